"""``course ckpt list RUN``: every checkpoint of a run, and which one ``--resume auto`` would take.

One row per checkpoint folder: name, step, format, the world size and layout that saved it, bytes
on disk (the manifest's file sizes), whether it verifies (every file's sha256 re-read plus what its
loader parses: the same check a resume makes). Then the resume verdict for the run's own
``config.json``: the newest checkpoint of the format that configuration saves, passing over ones
that do not verify, or why the resume would refuse (``parallel/resume_guard.py``).
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

from course_lib.ckpt.runs import DEEPSPEED, Found, checkpoint_root, find_all, format_name, run_config, verify
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
    """``(one dict per checkpoint, oldest first; the resume verdict as a sentence)``."""
    root = checkpoint_root(run)
    try:
        cfg = run_config(root)
    except ValueError:
        cfg = None
    out, checked = [], {}
    for f in find_all(root):
        why = verify(f)
        checked[f.name] = why
        files = (f.manifest or {}).get("files", {})
        out.append({"name": f.name, "step": f.step, "format": format_name(f.format) if f.manifest else "unreadable",
                    "layout": layout(f, cfg) if f.manifest else "", "bytes": sum(int(v.get("bytes", 0))
                                                                                 for v in files.values()),
                    "verifies": why is None, "why": why or ""})
    return out, resume_choice(root, cfg, find_all(root), checked)


def resume_choice(root: Path, cfg: dict | None, found: list[Found], checked: dict[str, str | None]) -> str:
    """Which checkpoint ``--resume auto`` with the run's config.json would load, and why."""
    if cfg is None:
        return "--resume auto: unknown (no config.json beside the checkpoints says which format the run saves)"
    fmt = saving_format(cfg)
    mine = [f for f in found if f.format == fmt]
    # Newest by save sequence among this format (the loaders' order), first one that verifies.
    mine.sort(key=lambda f: (f.manifest or {}).get("seq", 0), reverse=True)
    skipped = [f.name for f in mine if checked.get(f.name)]
    chosen = next((f for f in mine if not checked.get(f.name)), None)
    if fmt == DEEPSPEED and chosen is not None:
        chosen_world = chosen.manifest.get("world_size")
        note = f" (DeepSpeed: only on {chosen_world} ranks, ZeRO-{chosen.manifest.get('zero_stage')})"
    else:
        note = ""
    loaded = None if chosen is None else SimpleNamespace(
        manifest=chosen.manifest, path=chosen.path, step=chosen.step)
    judged = verdict(root, "full" if fmt == MANIFEST_FORMAT["full"] else
                     "sharded" if fmt == MANIFEST_FORMAT["sharded"] else "deepspeed", cfg["train"]["strategy"], loaded)
    if judged is not None and judged[0] == "refuse":
        return "--resume auto would refuse: " + judged[1].splitlines()[0]
    if chosen is None:
        return (f"--resume auto would start from step 0: no {format_name(fmt)} checkpoint "
                f"(train.strategy = {cfg['train']['strategy']!r} saves that format)")
    why = f"the newest {format_name(fmt)} checkpoint (save #{chosen.manifest.get('seq', 0)}) that verifies, the format " \
          f"train.strategy = {cfg['train']['strategy']!r} in config.json saves"
    if skipped:
        why += f"; newer ones that do not verify are passed over: {', '.join(skipped)}"
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
