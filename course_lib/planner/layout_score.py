"""Score a layout someone names (``course plan ... --layout tp8,pp16,dp128``) against the search.

    from course_lib.planner import make_spec, score_layout
    s = score_layout(make_spec(model="llama3-405b", gpu="h100", gpus=16384, tokens="15T",
                               global_batch_tokens=2048 * 8192), "tp8,pp16,dp128,v4,zero1,recompute=full")
    s.candidate.fits, s.rank, s.slower_than_best    # fits?  1-based place among fitting layouts, +x%
    print(s.text())                                 # the breakdown `course plan --layout` prints

The text is comma-separated fields, any order, each at most once:

* ``tp8`` ``pp16`` ``dp128`` ``cp2`` - degrees (tp, pp, cp default 1; dp defaults to what is left
  of --gpus; tp x pp x dp x cp must equal --gpus);
* ``v4`` - virtual stages per pipeline rank (interleaved 1F1B);
* ``ep64`` ``etp1`` - expert-parallel and expert tensor-parallel degrees (mixture-of-experts
  models only; etp is 1 or tp);
* ``zero1`` (or ``z1``), ``recompute=full`` (or ``rc=full``; none | selective | full), ``mb2``
  (micro-batch, sequences per rank);
* ``split=5:6*10:5`` blocks per stage (``N*k`` repeats N k times; or ``even`` / ``balanced``).

A field left out is chosen by the scorer: the fastest fitting value the search's rules allow (the
text says which). Input that breaks a rule raises :class:`PlanError` starting ``--layout:``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from course_lib.estimate import format_bytes
from course_lib.estimate.stage_split import check_counts
from course_lib.planner.costs import RECOMPUTE, Candidate, Layout, evaluate
from course_lib.planner.search import (MICRO_BATCHES, VIRTUAL_STAGES, Plan, expert_parallel_sizes, rank, search,
                                      stage_splits, why_lost, why_not_fit)
from course_lib.planner.spec import JobSpec, PlanError
from course_lib.planner.stages import balanced_counts, compact_counts

_INT_FIELD = re.compile(r"^(tp|pp|dp|cp|v|mb|zero|z|ep|etp)(\d+)$")
_KEYED = re.compile(r"^(recompute|rc|split)[=:]?(.+)$")
_NAMES = {"z": "zero"}


def _fail(msg: str) -> PlanError:
    return PlanError(f"--layout: {msg}")


def _split_counts(text: str) -> tuple[int, ...] | str:
    if text in ("even", "balanced"):
        return text
    out = []
    for part in re.split(r"[:/+]", text):
        m = re.fullmatch(r"(\d+)(?:\*(\d+))?", part)
        if not m:
            raise _fail(f"split={text!r}: give blocks per stage as N:N:... (N*k repeats N k times), or even / balanced")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return tuple(out)


def parse_layout(text: str) -> dict:
    """The fields of a layout text (see module) as a dict: tp, pp, dp, cp, v, mb, zero (ints),
    recompute (str), split (tuple of ints, "even" or "balanced"); absent fields are absent."""
    if not isinstance(text, str) or not text.strip():
        raise _fail("empty; e.g. tp8,pp16,dp128[,cp2,v4,zero1,recompute=full,mb1,split=7:8*14:7]")
    fields: dict = {}
    for raw in text.replace(" ", "").lower().split(","):
        if not raw:
            continue
        m = _INT_FIELD.match(raw)
        if m:
            name, value = _NAMES.get(m.group(1), m.group(1)), int(m.group(2))
            if name == "zero" and value > 3 or name != "zero" and value < 1:
                raise _fail(f"{raw!r}: {'ZeRO stage must be 0-3' if name == 'zero' else name + ' must be >= 1'}")
        else:
            k = _KEYED.match(raw)
            if not k:
                raise _fail(f"unknown field {raw!r}; fields: tpN ppN dpN cpN vN mbN zeroN epN etpN "
                            "recompute=none|selective|full "
                            f"split=N:N:...|even|balanced")
            name = "recompute" if k.group(1) in ("recompute", "rc") else "split"
            value = k.group(2).lstrip("=")
            if name == "recompute" and value not in RECOMPUTE:
                raise _fail(f"{raw!r}: recompute must be one of {', '.join(RECOMPUTE)}")
            if name == "split":
                value = _split_counts(value)
        if name in fields:
            raise _fail(f"{name} given twice")
        fields[name] = value
    return fields


def _check_degrees(spec: JobSpec, f: dict) -> tuple[int, int, int, int]:
    sh, gpn = spec.shape, spec.gpus_per_node
    tp, pp, cp = f.get("tp", 1), f.get("pp", 1), f.get("cp", 1)
    if spec.gpus % (tp * pp * cp):
        raise _fail(f"tp x pp x cp = {tp * pp * cp} does not divide --gpus {spec.gpus}")
    dp = f.get("dp", spec.gpus // (tp * pp * cp))
    if tp * pp * dp * cp != spec.gpus:
        raise _fail(f"tp x pp x dp x cp = {tp} x {pp} x {dp} x {cp} = {tp * pp * dp * cp}, not --gpus {spec.gpus}")
    for name, width in (("attention heads", sh.n_heads), ("KV heads", sh.kv_heads), ("MLP width", sh.ffn_dim)):
        if width % tp:
            raise _fail(f"tp{tp} must divide the {name} ({width})")
    if tp * cp > gpn:
        raise _fail(f"tp x cp = {tp * cp} > --gpus-per-node {gpn}: tensor and context parallelism stay inside a node")
    if spec.seq % cp:
        raise _fail(f"cp{cp} must divide the sequence length {spec.seq}")
    if pp > sh.n_layers:
        raise _fail(f"pp{pp} > {sh.n_layers} layers: every stage needs a block")
    return tp, pp, dp, cp


def candidate_layouts(spec: JobSpec, fields: dict) -> list[Layout]:
    """Every layout the fields allow, with the search's rules (PlanError ``--layout:`` naming the
    rule when none does)."""
    sh = spec.shape
    tp, pp, dp, cp = _check_degrees(spec, fields)
    mbs = [fields["mb"]] if "mb" in fields else list(MICRO_BATCHES)
    mbs = [b for b in mbs if spec.global_batch % (dp * b) == 0]
    if not mbs:
        what = f"dp{dp} x mb{fields['mb']}" if "mb" in fields else f"dp{dp} x every micro-batch in {MICRO_BATCHES}"
        raise _fail(f"{what} does not divide the global batch of {spec.global_batch} sequences")
    vs = [fields["v"]] if "v" in fields else list(VIRTUAL_STAGES)
    if fields.get("v", 1) > 1 and pp == 1:
        raise _fail(f"v{fields['v']} needs a pipeline (pp > 1): virtual stages interleave pipeline ranks")
    zero_ok = (0, 1) if pp > 1 else (0, 1, 2, 3)
    zeros = [fields["zero"]] if "zero" in fields else list(zero_ok)
    if zeros[0] not in zero_ok:
        raise _fail(f"zero{zeros[0]} with pp{pp}: pipeline parallelism composes with ZeRO-0/1 only here "
                    f"(Megatron's distributed optimizer and DeepSpeed's pipeline engine shard optimizer state)")
    if dp * cp == 1:
        if fields.get("zero", 0) > 0:
            raise _fail(f"zero{fields['zero']} with dp x cp = 1: nothing to shard over")
        zeros = [0]
    rcs = [fields["recompute"]] if "recompute" in fields else list(RECOMPUTE)
    experts = expert_parallel_sizes(spec, tp, cp, dp)
    if ("ep" in fields or "etp" in fields) and spec.moe is None:
        raise _fail("ep/etp: only for a mixture-of-experts --model")
    if "ep" in fields or "etp" in fields:
        want = [(e, t) for e, t in experts if e == fields.get("ep", e) and t == fields.get("etp", t)]
        if not want:
            raise _fail(f"ep{fields.get('ep', '?')} etp{fields.get('etp', '?')}: the rules allow (ep, etp) in "
                        f"{experts} here (ep divides the {spec.moe.n_experts} experts, etp is 1 or tp, ep x etp "
                        f"divides tp x cp x dp = {tp * cp * dp}, ep a multiple of cp, or of tp x cp when etp = 1)")
        experts = want
    out, why = [], []
    for v in vs:
        stages = pp * v
        if stages > sh.n_layers:
            why.append(f"pp x v = {stages} stages > {sh.n_layers} layers")
            continue
        split = fields.get("split")
        if split is None:
            splits = stage_splits(spec, pp, v)
        elif split == "even":
            if sh.n_layers % stages:
                raise _fail(f"split=even: {stages} stages do not divide {sh.n_layers} layers (give the blocks per "
                            f"stage, or split=balanced)")
            splits = [()]
        elif split == "balanced":
            splits = [balanced_counts(sh, stages, spec.seq)]
        else:
            try:
                splits = [tuple(check_counts(list(split), sh.n_layers, stages))]
            except ValueError as exc:
                raise _fail(str(exc)) from None
        for mb in mbs:
            m = spec.global_batch // (dp * mb)
            if v > 1 and m % pp:
                why.append(f"v{v} needs the micro-batches per step ({m} at mb{mb}) to be a multiple of pp{pp}")
                continue
            for s in splits:
                for z in zeros:
                    for rc in rcs:
                        for ep, etp in experts:
                            out.append(Layout(tp, pp, dp, cp, z, rc, mb, m, v, s, ep, etp))
    if not out:
        raise _fail("; ".join(dict.fromkeys(why)) or "no layout matches")
    return out


@dataclass
class LayoutScore:
    """A named layout scored against the plan's search."""

    spec: JobSpec
    text: str
    candidate: Candidate                 # the scored layout (free fields filled in)
    chosen: dict = field(default_factory=dict)  # field -> value the scorer chose
    plan: Plan | None = None
    tried: int = 0

    @property
    def best(self) -> Candidate | None:
        """The search's best plan (None when nothing fits)."""
        return self.plan.best if self.plan else None

    @property
    def rank(self) -> int | None:
        """1-based place among the fitting layouts by modelled step time (1 = as fast as the best
        or faster); None when it does not fit."""
        if not self.candidate.fits:
            return None
        return 1 + sum(1 for c in self.plan.ranked if c.step_s < self.candidate.step_s * (1 - 1e-9))

    @property
    def best_is_not_slower(self) -> bool:
        """The search's best is modelled at least as fast as this layout (within the ranking's
        0.5% tie band), or this layout does not fit."""
        return not self.candidate.fits or (self.best is not None and self.best.step_s <= self.candidate.step_s * 1.005)

    @property
    def slower_than_best(self) -> float | None:
        """Modelled step time over the best's minus 1 (negative: faster); None when nothing fits."""
        return None if self.best is None else self.candidate.step_s / self.best.step_s - 1

    def text_lines(self) -> list[str]:
        """The breakdown ``course plan --layout`` prints (see ``report.breakdown``)."""
        from course_lib.planner.report import breakdown

        c, spec = self.candidate, self.spec
        lines = [f"layout {self.text!r} scored as {c.layout.label()}"
                 + (f" (chosen by the scorer: {', '.join(f'{k}={v}' for k, v in self.chosen.items())}; "
                    f"fastest fitting of {self.tried})" if self.chosen else "")]
        lines += breakdown(spec, c)
        if c.fits:
            lines.append(f"fits: yes, {format_bytes(c.memory_total)} of {format_bytes(c.usable_bytes)} usable per GPU")
        else:
            lines.append(f"fits: no, {why_not_fit(c)}")
        if self.best is None:
            lines.append("rank: nothing the search tries fits")
        elif c.fits:
            n = len(self.plan.ranked)
            verdict = ("the best" if c.layout == self.best.layout else
                       why_lost(c, self.best) if self.slower_than_best >= 0 else
                       f"{-self.slower_than_best:.1%} faster than the search's best (outside the searched values)")
            lines.append(f"rank: {self.rank} of {n} fitting layouts; {verdict}")
            lines.append(f"best: {self.best.layout.label()}: {self.best.step_s:.2f} s per step, "
                         f"{self.best.tokens_per_s:,.0f} tokens/s, modelled MFU {self.best.mfu(spec):.1%}")
        else:
            lines.append(f"rank: does not fit; the best that does: {self.best.layout.label()}")
        return lines

    def __str__(self) -> str:
        return "\n".join(self.text_lines())


def score_layout(spec: JobSpec, layout, plan: Plan | None = None) -> LayoutScore:
    """Score ``layout`` (text, see module; or a :class:`Layout`) for ``spec``: its memory and step
    time, whether it fits, its place among the search's fitting layouts (``plan``, searched when
    not given). Fields left out of the text: the fastest fitting choice (or the leanest if none
    fits). PlanError ``--layout: ...`` for input that breaks a rule."""
    if isinstance(layout, Layout):
        text, cands, fields = layout.label(), [evaluate(spec, layout)], None
    else:
        text = str(layout)
        fields = parse_layout(text)
        cands = [evaluate(spec, lay) for lay in candidate_layouts(spec, fields)]
    fitting = [c for c in cands if c.fits]
    pick = rank(fitting)[0] if fitting else min(cands, key=lambda c: c.memory_total)  # the search's tie-breaks
    chosen = {}
    if fields is not None:
        lay = pick.layout
        for name, value in (("mb", lay.micro_batch), ("zero", lay.zero_stage), ("recompute", lay.recompute),
                            ("v", lay.virtual_stages)) + ((("ep", lay.ep), ("etp", lay.etp)) if spec.moe else ()):
            if name not in fields and len(cands) > 1:
                chosen[name] = value
        if "split" not in fields and lay.pp > 1 and lay.split:
            chosen["split"] = compact_counts(lay.split)
    return LayoutScore(spec, text, pick, chosen, plan if plan is not None else search(spec), len(cands))
