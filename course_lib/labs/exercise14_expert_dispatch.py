"""Exercise 14 (expert-parallel dispatch): the learner's routing helpers, checked in one process, and
their ``dispatch`` / ``combine`` run on gloo ranks, checked against one process.

Expert parallelism deals ``E`` experts over the ``N`` ranks of an EP group in contiguous blocks: rank
``r`` holds global experts ``r*E/N ... (r+1)*E/N - 1`` (its *local* experts ``0 ... E/N - 1``). Each
rank starts with its own *rows* ``x`` [n, d] (one row per token and chosen expert) and the global
expert of each row. ``dispatch`` sends every row to the rank holding its expert and hands back the
received rows grouped by local expert; ``combine`` sends the experts' outputs back to where the rows
came from, in the order of that rank's ``x``.

Like exercises 08-11 (:mod:`course_lib.labs.exercise_harness`) the learner's cell is written to
``ex14_expert_dispatch.py``; the check sends ranks a ``"module:name"`` reference and each rank imports
it fresh. The reference never exchanges anything: every rank builds the inputs of every rank of its
group from the same seeds and picks out, by boolean masks, the rows that must arrive. The experts are
small seeded linear maps (a different one per global expert), so a row that reaches the wrong expert,
or comes back to the wrong place, shows up as a wrong number.

Checks raise :class:`course_lib.kit.checks.CheckFailed` with a sentence that says what came out and
what was expected (``NotImplementedError`` while the learner's code still raises it), and otherwise
return the rows the notebook prints and the raw outputs the grader records.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.kit.checks import CheckFailed
from course_lib.labs.exercise_harness import _first_problem, _guard, _launch, impl_ref, load_impl

D_OUT_EXTRA = 1  # the experts map width d to d + 1: combine must not assume the output width is x's
EXCHANGES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce",
             "broadcast", "send", "recv", "isend", "irecv", "scatter", "gather", "reduce_scatter_tensor")
DEADLOCK_HINT = ("Every rank of the EP group must call the same collectives in the same order, even a rank "
                 "that sends or receives no row, and the split sizes on both sides of an exchange must agree")


# ============================================================= inputs and the one-process reference
def routing(kind: str, n_rows: int, num_experts: int, ep: int, seed: int) -> torch.Tensor:
    """The global expert (int64 [n_rows]) of each row of one rank, seeded.

    ``kind``: ``"even"`` (every expert as often as possible, shuffled), ``"uneven"`` (expert e drawn
    with weight 2**-e: expert 0 gets about half), ``"empty"`` (like uneven, but expert 1 and every
    expert of the group's last rank receive nothing: that rank gets no row at all)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "even":
        return (torch.arange(n_rows) % num_experts)[torch.randperm(n_rows, generator=g)]
    weights = torch.tensor([2.0 ** -e for e in range(num_experts)])
    if kind == "empty":
        if num_experts < 2 or ep < 2 and num_experts < 3:
            raise ValueError(f"kind 'empty' needs room for an empty expert, got num_experts={num_experts}, ep={ep}")
        weights[1] = 0.0
        if ep > 1:
            weights[num_experts - num_experts // ep:] = 0.0
    elif kind != "uneven":
        raise ValueError(f"kind must be 'even', 'uneven' or 'empty', got {kind!r}")
    if n_rows == 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.multinomial(weights, n_rows, replacement=True, generator=g)


def rank_inputs(scenario: dict, source: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x [n, d] fp32, expert [n] int64)`` of group rank ``source`` in ``scenario``: the same on every
    process that asks (seeded by the scenario's seed and the source)."""
    n = scenario["rows"][source]
    seed = scenario["seed"] * 1000 + source
    x = torch.randn(n, scenario["d"], generator=torch.Generator().manual_seed(seed))
    return x, routing(scenario["kind"], n, scenario["experts"], scenario["ep"], seed + 7)


def expert_weights(num_experts: int, d: int, seed: int = 5) -> torch.Tensor:
    """The experts of every scenario: ``[E, d, d + 1]`` fp32, a different seeded linear map per expert."""
    return torch.randn(num_experts, d, d + D_OUT_EXTRA, generator=torch.Generator().manual_seed(seed)) / d ** 0.5


def run_experts(rows: torch.Tensor, counts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Apply local expert j to its block of ``rows`` (``counts[j]`` rows each, in order), with
    ``weights`` [E_local, d, d_out]; returns [m, d_out]."""
    blocks = rows.split([int(c) for c in counts])
    outs = [b @ weights[j] for j, b in enumerate(blocks)]
    return torch.cat(outs) if outs else rows.new_zeros(0, weights.shape[-1])


def reference_received(scenario: dict, me: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What group rank ``me`` must hold after dispatch, computed without any exchange: ``(rows [m, d],
    counts [E/N], arrival [m, d])``; rows grouped by local expert, then by source rank, then in the
    source's order; ``arrival``: the same rows in the order an all-to-all delivers them (source rank
    first), which a dispatch without the final permute would hand back."""
    ep, e = scenario["ep"], scenario["experts"]
    e_local = e // ep
    inputs = [rank_inputs(scenario, s) for s in range(ep)]
    blocks = [[x[expert == me * e_local + j] for j in range(e_local)] for x, expert in inputs]
    rows = torch.cat([blocks[s][j] for j in range(e_local) for s in range(ep)])
    arrival = torch.cat([blocks[s][j] for s in range(ep) for j in range(e_local)])
    counts = torch.tensor([sum(blocks[s][j].shape[0] for s in range(ep)) for j in range(e_local)])
    return rows, counts, arrival


def reference_outputs(scenario: dict, me: int, weights: torch.Tensor) -> torch.Tensor:
    """Each of rank ``me``'s rows through its own expert, in one process: ``[n, d + 1]``."""
    x, expert = rank_inputs(scenario, me)
    return torch.einsum("nd,nde->ne", x, weights[expert]) if x.shape[0] else x.new_zeros(0, weights.shape[-1])


def wire_rows(scenario: dict) -> list[list[int]]:
    """``[source][destination]``: the rows each group rank sends each other one (diagonal: kept)."""
    ep, e_local = scenario["ep"], scenario["experts"] // scenario["ep"]
    out = []
    for s in range(ep):
        _, expert = rank_inputs(scenario, s)
        out.append(torch.bincount(expert // e_local, minlength=ep).tolist())
    return out


# ============================================================= Part 1: in one process
def _same_rows(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The same rows, in any order (rows are random floats: a row identifies itself)."""
    if got.shape != want.shape:
        return False
    if got.shape[0] == 0:
        return True
    key = lambda t: t[torch.argsort(t[:, 0], stable=True)]  # noqa: E731
    return torch.equal(key(got), key(want))


def check_sort_by_expert(sort_by_expert, cases: list[tuple[list[int], int]]) -> list[dict]:
    """The learner's ``sort_by_expert(expert, num_experts) -> (order, counts)`` on each case
    ``(experts, num_experts)``: ``expert[order]`` ascending with ties in their original order (the
    stable sort), ``counts[e]`` the rows of expert e (zeros included). Returns one row per case with
    what came back."""
    rows = []
    for experts, num_experts in cases:
        expert = torch.tensor(experts, dtype=torch.long)
        given = expert.clone()
        got = sort_by_expert(expert, num_experts)
        what = f"sort_by_expert({experts}, {num_experts})"
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
            raise CheckFailed(f"{what} returned {type(got).__name__}, expected a pair of tensors (order, counts)")
        order, counts = got
        if not torch.equal(expert, given):
            raise CheckFailed(f"{what} changed the expert tensor it was given: the caller still needs it")
        want_counts = torch.tensor([experts.count(e) for e in range(num_experts)], dtype=torch.long)
        if counts.shape != want_counts.shape or not torch.equal(counts.long(), want_counts):
            why = ""
            if counts.numel() < num_experts:
                why = (f" An expert no row chose still needs its 0: the exchange that follows sends exactly "
                       f"num_experts counts")
            raise CheckFailed(f"{what}: counts {counts.tolist()}, expected {want_counts.tolist()} (the rows of each "
                              f"expert 0..{num_experts - 1}).{why}")
        want_order = sorted(range(len(experts)), key=lambda i: (experts[i], i))
        if order.dtype not in (torch.int64, torch.int32) or order.tolist() != want_order:
            sorted_ok = order.dtype in (torch.int64, torch.int32) and sorted(order.tolist()) == list(range(len(experts))) \
                and [experts[i] for i in order.tolist()] == sorted(experts)
            why = ("it groups the rows by expert, but rows of one expert are not in their original order: "
                   "the permute after the exchange, and the combine back, rely on that order" if sorted_ok else
                   "expert[order] should list the experts in ascending order, each row once")
            raise CheckFailed(f"{what}: order {order.tolist()}, expected {want_order}: {why}")
        rows.append({"experts": experts, "num_experts": num_experts, "order": order.clone(), "counts": counts.clone()})
    return rows


def check_group_by_local_expert(group_by_local_expert, cases: list[list[list[int]]], d: int = 3,
                                seed: int = 0) -> list[dict]:
    """The learner's ``group_by_local_expert(rows, counts) -> (grouped, perm)`` on each case
    ``counts`` ([N sources][E_local], rows from source s for local expert j, as an all-to-all hands
    them over: source 0's first, within one source by local expert). ``grouped`` must equal
    ``rows[perm]``: one block per local expert, within it by source. Returns a row per case."""
    out = []
    for k, counts_list in enumerate(cases):
        counts = torch.tensor(counts_list, dtype=torch.long)
        n_src, e_local = counts.shape
        m = int(counts.sum())
        rows = torch.randn(m, d, generator=torch.Generator().manual_seed(seed + k))
        blocks = rows.split(counts.flatten().tolist())
        want = torch.cat([blocks[s * e_local + j] for j in range(e_local) for s in range(n_src)]) if m else rows
        given_rows, given_counts = rows.clone(), counts.clone()
        got = group_by_local_expert(rows, counts)
        what = f"group_by_local_expert(rows, counts={counts_list})"
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
            raise CheckFailed(f"{what} returned {type(got).__name__}, expected a pair of tensors (grouped, perm)")
        grouped, perm = got
        if not (torch.equal(rows, given_rows) and torch.equal(counts, given_counts)):
            raise CheckFailed(f"{what} changed the rows or counts it was given")
        if grouped.shape != want.shape:
            raise CheckFailed(f"{what}: grouped has shape {tuple(grouped.shape)}, expected {tuple(want.shape)} "
                              "(every received row, once)")
        if not torch.equal(grouped, want):
            why = ("these are the rows in the order they arrived (source 0's block first): the experts need one "
                   "block per local expert" if torch.equal(grouped, rows) else
                   "the same rows, in another order: local expert 0's rows first (from source 0, then 1, ...), "
                   "then local expert 1's" if _same_rows(grouped, want) else
                   "rows are missing, repeated or changed")
            raise CheckFailed(f"{what}: {why}")
        if perm.shape != (m,) or perm.dtype not in (torch.int64, torch.int32) or \
                (m and not torch.equal(rows[perm.long()], grouped)):
            raise CheckFailed(f"{what}: perm should be the index with grouped == rows[perm] ({m} indices), "
                              "so that combine can put the outputs back where the rows arrived")
        out.append({"counts": counts_list, "grouped": grouped.clone(), "perm": perm.clone()})
    return out


# ============================================================= Part 2 and 3: on ranks
class _Calls:
    """Wraps the exchanges of ``torch.distributed`` in a rank (before the learner's module is
    imported) to count them per phase and sum the bytes ``all_to_all_single`` sends to *other*
    ranks (its input minus the split kept by the sender), in bytes."""

    def __init__(self):
        self.phase, self.counts, self.bytes_out = None, {}, {}
        for name in EXCHANGES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name, real):
        def counted(*args, **kwargs):
            per = self.counts.setdefault(self.phase, {})
            per[name] = per.get(name, 0) + 1
            if name == "all_to_all_single":
                self.bytes_out[self.phase] = self.bytes_out.get(self.phase, 0) + _sent_off_rank(*args, **kwargs)
            return real(*args, **kwargs)
        return counted

    def take(self, phase: str) -> tuple[dict, int]:
        return self.counts.pop(phase, {}), self.bytes_out.pop(phase, 0)


def _sent_off_rank(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **_) -> int:
    """Bytes of ``input`` that an ``all_to_all_single`` call sends to other ranks (not to itself)."""
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    row = input[0].numel() * input.element_size() if input.dim() and input.shape[0] else 0
    splits = list(input_split_sizes) if input_split_sizes else [input.shape[0] // n] * n
    return sum(int(s) for k, s in enumerate(splits) if k != me) * row


def _ep_group(world_size: int, ep: int, groups: dict):
    """(group or None, this rank's index in it): groups of ``ep`` consecutive ranks, made once per size
    (every rank creates every group, in the same order)."""
    if ep == world_size:
        return None, dist.get_rank()
    if ep not in groups:
        groups[ep] = [dist.new_group(list(range(s, s + ep))) for s in range(0, world_size, ep)]
    return groups[ep][dist.get_rank() // ep], dist.get_rank() % ep


def _raw(t):
    """A detached copy of what the learner's code produced, for the grader (None if not a tensor)."""
    return t.detach().clone() if isinstance(t, torch.Tensor) else None


def _dispatch_problems(got, sc: dict, me: int, d: int) -> tuple[list, dict]:
    """Problems (stage, sentence) of one dispatch result against the one-process reference."""
    rows_want, counts_want, arrival = reference_received(sc, me)
    e_local = sc["experts"] // sc["ep"]
    first = me * e_local
    if not (isinstance(got, (tuple, list)) and len(got) == 3):
        return [(1, f"dispatch returned {type(got).__name__}, expected (rows, counts, state)")], {}
    rows, counts, _ = got
    raw = {"rows": _raw(rows), "counts": _raw(counts)}
    if not isinstance(rows, torch.Tensor) or not isinstance(counts, torch.Tensor):
        return [(1, "dispatch should return rows and counts as tensors")], raw
    problems = []
    mine = f"experts {first}-{first + e_local - 1}" if e_local > 1 else f"expert {first}"
    if counts.shape != counts_want.shape or not torch.equal(counts.long(), counts_want):
        own_x, own_e = rank_inputs(sc, me)
        sent_here = torch.bincount(own_e, minlength=sc["experts"])[first:first + e_local]
        why = (" These are only the rows this rank routed to its own experts: the others' rows count too."
               if torch.equal(counts.long().flatten()[:e_local], sent_here) and not torch.equal(sent_here, counts_want)
               else "")
        problems.append((2, f"counts {counts.tolist()}, expected {counts_want.tolist()}: the rows that all "
                            f"{sc['ep']} ranks of the group routed to this rank's {mine}, one number per local "
                            f"expert.{why}"))
    if rows.shape[0] != rows_want.shape[0] or (rows.dim() == 2 and rows.shape[1] != d) or rows.dim() != 2:
        problems.append((3, f"received {tuple(rows.shape)}, expected {tuple(rows_want.shape)}: every row routed "
                            f"to this rank's {mine} by any rank of the group, and nothing else. Each side of the "
                            "row exchange must know how many rows go to, and come from, every rank"))
    elif not torch.equal(rows, rows_want):
        if torch.equal(rows, arrival):
            why = ("they are in the order they arrived (source rank 0's rows first): the experts need one "
                   "block per local expert, local expert 0's first")
        elif _same_rows(rows, rows_want):
            why = ("the right rows, in another order: one block per local expert; inside a block source rank "
                   "0's rows first, each source's rows in the order of its x")
        else:
            why = (f"some rows are not ones routed to this rank's {mine}, or came through changed: does the "
                   "exchange send each rank the block of rows sorted for it?")
        problems.append((3, f"the received rows differ from the expected ones: {why}"))
    return problems, raw


def _combine_problems(out, sc: dict, me: int, weights: torch.Tensor) -> list:
    want = reference_outputs(sc, me, weights)
    if not isinstance(out, torch.Tensor) or out.shape != want.shape:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return [(5, f"combine returned {shape}, expected {tuple(want.shape)}: one output per row of this "
                    "rank's x, as wide as the experts' outputs")]
    if torch.allclose(out, want, rtol=1e-5, atol=1e-6):
        return []
    x, expert = rank_inputs(sc, me)
    order = torch.argsort(expert, stable=True)
    if want.shape[0] and torch.allclose(out, want[order], rtol=1e-5, atol=1e-6):
        why = "they are in the order of the rows sorted by expert: put each back at its row of x"
    elif _same_rows(out, want):
        why = "every output is there, but some sit at another row's place: undo each reordering, the last one first"
    else:
        why = "some outputs are not the output of this rank's rows: do they travel back along the very splits they came?"
    return [(5, f"combine's outputs differ from each row of x through its expert (one process): {why}")]


def _scenario(fns: dict, sc: dict, group, me: int, calls: _Calls) -> dict:
    d, e = sc["d"], sc["experts"]
    e_local = e // sc["ep"]
    x, expert = rank_inputs(sc, me)
    x_in, expert_in = x.clone(), expert.clone()
    calls.phase = "dispatch"
    got = fns["dispatch"](x_in, expert_in, e, group)
    dispatch_calls, dispatch_bytes = calls.take("dispatch")
    problems, raw = _dispatch_problems(got, sc, me, d)
    if not (torch.equal(x_in, x) and torch.equal(expert_in, expert)):
        problems.append((1, "dispatch changed the x or expert tensor it was given: the caller still needs them"))
    a2a = dispatch_calls.get("all_to_all_single", 0)
    if a2a != 2 or sum(dispatch_calls.values()) != 2:
        problems.append((4, f"dispatch issued {dispatch_calls or 'no exchange'}; it should issue exactly two "
                            "all_to_all_single calls (the counts, then the rows) and nothing else"))
    row = {"rows in": int(x.shape[0]), "rows out": int(got[0].shape[0]) if not problems else None,
           "counts": got[1].tolist() if not problems else None, "dispatch bytes": dispatch_bytes}
    if "combine" in fns and not problems:
        rows, counts, state = got
        w = expert_weights(e, d)[me * e_local:(me + 1) * e_local]
        y = run_experts(rows, counts, w)
        calls.phase = "combine"
        out = fns["combine"](y.clone(), state, group)
        combine_calls, combine_bytes = calls.take("combine")
        raw["combined"] = _raw(out)
        problems += _combine_problems(out, sc, me, expert_weights(e, d))
        if combine_calls.get("all_to_all_single", 0) != 1 or sum(combine_calls.values()) != 1:
            problems.append((6, f"combine issued {combine_calls or 'no exchange'}; it should issue exactly one "
                                "all_to_all_single (the rows back) and nothing else: dispatch's state already "
                                "knows every split"))
        row["combine bytes"] = combine_bytes
    return {"problems": problems, "row": row, "raw": raw}


def ep_rank(rank: int, world_size: int, refs: dict, folder: str, scenarios: list) -> dict:
    """Rank function: every scenario with the learner's functions (``refs``: name -> ``module:name``)."""
    calls = _Calls()  # before the learner's module is imported
    fns = {name: load_impl(ref, folder) for name, ref in refs.items()}
    groups, out = {}, {}
    for sc in scenarios:
        group, me = _ep_group(world_size, sc["ep"], groups)
        out[sc["name"]] = _guard(sc["name"], _scenario, fns, sc, group, me, calls)
    dist.barrier()
    return out


def scenario(name: str, ep: int, experts: int, rows: list[int], kind: str, *, d: int = 4, seed: int = 1) -> dict:
    """One case: ``ep`` ranks per EP group, ``experts`` in all (a multiple of ``ep``), ``rows[s]`` rows on
    group rank s, routed ``kind`` (see :func:`routing`), width ``d``."""
    if ep < 1 or experts % ep:
        raise ValueError(f"experts ({experts}) must be a positive multiple of ep ({ep})")
    if len(rows) != ep:
        raise ValueError(f"rows must give one count per rank of the EP group ({ep}), got {rows}")
    return {"name": name, "ep": ep, "experts": experts, "rows": list(rows), "kind": kind, "d": d, "seed": seed}


def check_expert_parallel(dispatch, world_size: int, scenarios: list[dict], combine=None, *,
                          timeout: float = 180.0) -> list[dict]:
    """Run the learner's ``dispatch`` (and ``combine`` when given) on ``world_size`` gloo ranks in every
    scenario (EP groups of ``scenario["ep"]`` consecutive ranks); raise the first problem, else one row
    per scenario and group rank: rows in and out, counts per local expert, the bytes its all-to-alls sent
    to other ranks, and ``raw`` (what the learner's code returned: received rows, counts, combined
    outputs) for the grader."""
    for fn in (dispatch, combine):
        if fn is not None and fn.__module__.startswith("course_lib"):
            raise CheckFailed(f"{fn.__name__} is the library's own function ({fn.__module__}): check yours")
    for sc in scenarios:
        if world_size % sc["ep"]:
            raise ValueError(f"scenario {sc['name']!r}: ep {sc['ep']} does not divide world_size {world_size}")
    refs = {"dispatch": impl_ref(dispatch)}
    if combine is not None:
        refs["combine"] = impl_ref(combine)
    folder = refs["dispatch"][1]
    what = "your dispatch" + (" and combine" if combine is not None else "")
    per_rank = _launch(ep_rank, world_size, what, timeout, {k: v[0] for k, v in refs.items()}, folder, scenarios,
                       deadlock_hint=DEADLOCK_HINT)
    _first_problem(per_rank, world_size)
    rows = []
    for sc in scenarios:
        for rank in range(world_size):
            got = per_rank[rank][sc["name"]]
            rows.append({"scenario": sc["name"], "ep": sc["ep"], "rank": rank % sc["ep"], "global rank": rank,
                         "kind": sc["kind"], **got["row"], "raw": got["raw"]})
    return rows
