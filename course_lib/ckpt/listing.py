"""``course ckpt list RUN``: every checkpoint of a run, and which one ``--resume auto`` would take.

One row per checkpoint folder: name, step, format, the world size and layout that saved it, bytes
on disk (the manifest's file sizes), whether it verifies (every file's sha256 re-read plus what its
loader parses: the same check a resume makes). Then what ``--resume auto`` with the run's own
``config.json`` would do, by the loaders' own rules: the newest checkpoint (by save sequence) of
the format that configuration saves, passing over damaged ones; or that it would refuse, with the
exit code (3: nothing loadable, or a checkpoint the storage cannot read; 2: checkpoints of another
format, ``parallel/resume_guard.py``); step 0 only for a folder that holds nothing.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

from course_lib.checkpoint.io import quarantined
from course_lib.ckpt.runs import DEEPSPEED, Found, check, checkpoint_root, find_all, format_name, run_config
from course_lib.parallel import registry
from course_lib.parallel.resume_guard import MANIFEST_FORMAT, verdict


def saving_format(cfg: dict) -> str:
    """The manifest format the run's configuration saves and resumes (the strategy's own, or
    ``checkpoint.format``), without building the strategy."""
    name = cfg["train"]["strategy"]
    par = cfg.get("parallel", {})
    module, cls, _ = registry.STRATEGIES[name]
    if par.get("tp", 1) * par.get("pp", 1) * par.get("cp", 1) > 1:
        module, cls, _ = registry.FSDP_MODEL_PARALLEL if name == "fsdp" else registry.MODEL_PARALLEL
    own = getattr(importlib.import_module(module), cls).checkpoint_format
    chosen = cfg.get("checkpoint", {}).get("format", "auto")
    return MANIFEST_FORMAT[own if chosen == "auto" else chosen]


def layout(found: Found, cfg: dict | None) -> str:
    """"N ranks" plus, when the run's config saves this format, its strategy and tp/pp/cp/dp degrees
    (the manifest records only the world size; config.json is the last run's, so it is shown only
    for checkpoints of the format that config writes)."""
    m = found.manifest or {}
    world = m.get("world_size")
    parts = [f"{world} ranks" if world else "rank 0 wrote"]  # full checkpoints: gathered to one writer
    if m.get("zero_stage") is not None:
        parts.append(f"ZeRO-{m['zero_stage']}")
    if cfg is not None and saving_format(cfg) == found.format:
        par = cfg.get("parallel", {})
        degrees = "".join(f" {k}{par[k]}" for k in ("tp", "pp", "cp") if par.get(k, 1) > 1)
        parts.append(f"{cfg['train']['strategy']}{degrees}")
    return ", ".join(parts)


def rows(run: str | Path) -> tuple[list[dict], str]:
    """``(one dict per checkpoint, oldest first by save sequence; the resume verdict as a sentence)``."""
    root = checkpoint_root(run)
    try:
        cfg = run_config(root)
    except ValueError:
        cfg = None
    out, checked = [], {}
    found = find_all(root)
    for f in found:
        kind, why = check(f)
        checked[f.name] = (kind, why)
        files = (f.manifest or {}).get("files", {})
        out.append({"name": f.name, "step": f.step, "format": format_name(f.format) if f.manifest else "unreadable",
                    "layout": layout(f, cfg) if f.manifest else "", "bytes": sum(int(v.get("bytes", 0))
                                                                                 for v in files.values()),
                    "verifies": kind is None, "why": ("cannot be read: " if kind == "unreadable" else "") + why})
    return out, resume_choice(root, cfg, found, checked)


def _own_kind(fmt: str) -> str:
    return "full" if fmt == MANIFEST_FORMAT["full"] else "sharded" if fmt == MANIFEST_FORMAT["sharded"] else "deepspeed"


def resume_choice(root: Path, cfg: dict | None, found: list[Found],
                  checked: dict[str, tuple[str | None, str]]) -> str:
    """What ``--resume auto`` with the run's config.json would do with this folder, by the loaders'
    rules (``checkpoint/tiers.py`` ``choose``, then ``parallel/resume_guard.py``): a manifest the
    storage cannot read stops it (exit 3); damaged checkpoints, of any format, are moved aside as
    ``.corrupt-*`` and passed over; of this run's format the newest by save sequence that verifies
    is loaded, one the storage cannot read stops it (exit 3); checkpoints (or quarantined ones) but
    none that loads: a refusal (exit 3); checkpoints of another format only, or saved after the one
    it would load: a refusal (exit 2); step 0 only when the folder holds nothing at all.
    ``checked``: :func:`course_lib.ckpt.runs.check` of each checkpoint by name."""
    if cfg is None:
        return "--resume auto: unknown (no config.json beside the checkpoints says which format the run saves)"
    fmt, strategy = saving_format(cfg), cfg["train"]["strategy"]
    refuse3 = "--resume auto would refuse (exit 3, cannot resume): "
    torn = [f for f in found if f.io_error]  # the loaders' scan of the folder stops at these
    if torn:
        return refuse3 + (f"{torn[0].name}: {torn[0].io_error}. A read error is not damage: no older checkpoint is "
                          f"used until it is fixed")
    damaged = [f.name for f in found if f.manifest is None]  # any format: a resume moves these aside
    mine = sorted((f for f in found if f.manifest is not None and f.format == fmt), key=lambda f: f.order,
                  reverse=True)  # newest first by save sequence: the loaders' order
    chosen, passed = None, []
    for f in mine:
        kind, why = checked[f.name]
        if kind is None:
            chosen = f
            break
        if kind == "unreadable":
            return refuse3 + (f"{f.name} cannot be read ({why}); a read error is not damage, so no older checkpoint "
                              f"is used until it is fixed")
        passed.append(f.name)
    aside = damaged + passed
    if chosen is None and (aside or quarantined(root)):
        what = (f"every checkpoint it could load is damaged ({', '.join(aside)}; the attempt moves them aside as "
                f".corrupt-*)" if aside else
                f"only checkpoints quarantined as corrupt by an earlier attempt are left ({', '.join(quarantined(root))})")
        return refuse3 + (f"{what}; it never starts from step 0 beside them. Restore a good copy to resume, or use a "
                          f"new --out to start over")
    loaded = None if chosen is None else SimpleNamespace(
        manifest=chosen.manifest, path=chosen.path, step=chosen.step, seq=chosen.manifest.get("seq", 0))
    judged = verdict(root, _own_kind(fmt), strategy, loaded)
    if judged is not None and judged[0] == "refuse":
        return "--resume auto would refuse (exit 2, config error): " + judged[1].splitlines()[0]
    if chosen is None:
        return (f"--resume auto would start from step 0: the folder holds no checkpoint at all "
                f"(train.strategy = {strategy!r} saves {format_name(fmt)} checkpoints)")
    note = ""
    if fmt == DEEPSPEED:
        note = (f" (DeepSpeed: only on {chosen.manifest.get('world_size')} ranks, "
                f"ZeRO-{chosen.manifest.get('zero_stage')})")
    why = (f"the newest {format_name(fmt)} checkpoint (save #{chosen.manifest.get('seq', 0)}) that verifies, the "
           f"format train.strategy = {strategy!r} in config.json saves")
    if aside:
        why += f"; damaged ones are moved aside as .corrupt-* and passed over: {', '.join(aside)}"
    return f"--resume auto would load {chosen.name} (step {chosen.step}){note}: {why}"


def table(listed: list[dict]) -> str:
    """The rows as a fixed-width text table."""
    head = ("checkpoint", "step", "format", "saved by", "size", "verifies")
    lines = [(r["name"], str(r["step"]), r["format"], r["layout"], _size(r["bytes"]),
              "yes" if r["verifies"] else f"NO: {r['why'][:120]}") for r in listed]
    widths = [max(len(x) for x in col) for col in zip(head, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths[:-1]) + "  {}"
    return "\n".join(fmt.format(*row) for row in [head, *lines])


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
