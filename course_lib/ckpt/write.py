"""``course ckpt consolidate`` and ``course ckpt export-hf``: one checkpoint out of the kit.

* :func:`consolidate` writes ``FILE.safetensors`` (TinyGPT's names, full tensors, the tied head once
  as ``tok_emb.weight``; the ModelConfig in the file's metadata, key ``course_lib.model_config``)
  and ``FILE.json`` beside it (model config and provenance, for people). ``model.init_from = FILE``
  starts a run from it. With ``with_optimizer`` also ``FILE.optim.pt``: the AdamW state by name
  (:mod:`course_lib.ckpt.optimizer`), for resuming on one process outside the kit.
* :func:`export_hf` writes a folder ``transformers`` loads with ``from_pretrained``: ``config.json``
  from ``transformers``' own config class (``save_pretrained``) and ``model.safetensors`` in HF's
  names (:mod:`course_lib.model.hf_map`). Before anything is written the HF model is built on the
  meta device (no memory) and its state-dict names and shapes compared with ours.

Nothing is half-written: every output goes to a ``.tmp-*`` name in the output's folder and is
renamed into place last (the weights file after its ``.json``; the whole folder at once), and an
output that exists is refused.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from course_lib.checkpoint.io import fsync_dir
from course_lib.ckpt.runs import CkptError, checkpoint_root, format_name, full_weights, model_config, pick, run_config
from course_lib.model.init_source import CONFIG_KEY


def load_source(source: str | Path, step: int | None, *,
                with_optimizer: bool = False) -> tuple[dict, Any, dict, dict | None]:
    """``(TinyGPT state dict, ModelConfig, provenance, optimizer state)`` of a run folder's
    checkpoint (``step``, or the newest that verifies) or of a consolidated ``.safetensors`` file.
    The optimizer state (:mod:`course_lib.ckpt.optimizer`) only with ``with_optimizer`` (else None),
    from the same read of the checkpoint; a weights file has none (CkptError)."""
    p = Path(source)
    if p.is_file():
        from course_lib.model.init_source import load_init_state, source_config

        if with_optimizer:
            raise CkptError(f"--with-optimizer: {p} is a weights file; give the run folder, whose checkpoints "
                            f"hold the optimizer state")
        if step is not None:
            raise CkptError(f"--step {step}: {p} is one consolidated file (one step already); drop --step")
        try:
            mcfg = source_config(p)
            return load_init_state(p, mcfg), mcfg, {"source": str(p)}, None
        except ValueError as e:
            raise CkptError(str(e)) from None
    root = checkpoint_root(p)
    cfg = run_config(root)
    mcfg = model_config(cfg)
    found, decoded = pick(root, step)  # a full checkpoint comes back read: weights and optimizer, one read
    state = full_weights(found, mcfg, decoded)
    optim = None
    if with_optimizer:
        from course_lib.ckpt.optimizer import optimizer_state

        optim = optimizer_state(found, mcfg, cfg, decoded[1] if decoded else None)
    return state, mcfg, {"run": str(p), "checkpoint": found.name, "step": found.step,
                         "format": format_name(found.format), "world_size": found.manifest.get("world_size")}, optim


def _refuse_existing(*paths: Path) -> None:
    for path in paths:
        if path.exists() or path.is_symlink():
            raise CkptError(f"{path} exists; refusing to overwrite it (remove it or choose another --out)")
    parent = paths[0].parent
    if not parent.is_dir():
        raise CkptError(f"--out {paths[0]}: the folder {parent} does not exist")


def _temp(final: Path) -> Path:
    return final.with_name(f".tmp-{final.name}-{uuid.uuid4().hex[:8]}")


def consolidate(source: str | Path, out: str | Path, step: int | None = None, *,
                with_optimizer: bool = False) -> tuple[Path, Path, dict]:
    """Write ``out`` (a ``.safetensors`` file) and ``out`` with suffix ``.json`` (and, with
    ``with_optimizer``, ``FILE.optim.pt``); returns the weights and config paths and the provenance
    (``info["optimizer"]``: the optimizer file's path). CkptError for bad input; nothing is left
    behind on any error."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.suffix != ".safetensors":
        raise CkptError(f"--out {out}: name the file FILE.safetensors")
    side = out.with_suffix(".json")
    optim_path = out.with_suffix(".optim.pt")
    _refuse_existing(out, side, *([optim_path] if with_optimizer else []))
    state, mcfg, info, optim = load_source(source, step, with_optimizer=with_optimizer)
    tensors = {k: v.detach().contiguous() for k, v in state.items()
               if not (mcfg.tie_embeddings and k == "lm_head.weight")}  # safetensors stores a tensor once
    meta = {"format": "pt", CONFIG_KEY: json.dumps(mcfg.to_dict()), "course_lib.source": json.dumps(info)}
    tmp_w, tmp_j, tmp_o = _temp(out), _temp(side), _temp(optim_path)
    described = {"model": mcfg.to_dict(), "source": info, "tensors": len(tensors),
                 "tied_embeddings": mcfg.tie_embeddings}
    if optim is not None:
        described["optimizer"] = {"file": optim_path.name, "parameters": len(optim["state"]),
                                  "load_with": "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict"}
    try:
        save_file(tensors, str(tmp_w), metadata=meta)
        tmp_j.write_text(json.dumps(described, indent=2) + "\n")
        temps = [tmp_w, tmp_j]
        if optim is not None:
            import torch

            torch.save(optim, tmp_o)
            temps.append(tmp_o)
        for t in temps:
            os.chmod(t, 0o644)  # a file to hand on: readable like any other output
            with open(t, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp_j, side)  # the config first: a weights file never appears without it
        if optim is not None:
            os.replace(tmp_o, optim_path)
        os.replace(tmp_w, out)  # the weights last: their presence says the set is complete
        fsync_dir(out.parent)
    except BaseException:
        for t in (tmp_w, tmp_j, tmp_o):
            t.unlink(missing_ok=True)
        if not out.exists():  # the config (and optimizer) went in, the weights did not: take them back
            side.unlink(missing_ok=True)
            if optim is not None:
                optim_path.unlink(missing_ok=True)
        raise
    if optim is not None:
        info = {**info, "optimizer": str(optim_path)}
    return out, side, info


def export_hf(source: str | Path, out: str | Path, step: int | None = None) -> tuple[Path, str, dict]:
    """Write the HF folder ``out``; returns it, the HF class name and the provenance. CkptError for
    bad input or a TinyGPT no HF class expresses (naming the switch); ImportError (with the install
    command) when ``transformers`` is missing."""
    from safetensors.torch import save_file

    from course_lib.model.hf_map import HF_WEIGHTS
    from course_lib.model.hf_weights import hf_config, require_transformers, to_hf, to_runtime

    out = Path(out)
    _refuse_existing(out)
    require_transformers()  # before the (possibly long) read of the checkpoint
    state, mcfg, info, _ = load_source(source, step)
    try:
        cls, config = hf_config(mcfg)
    except ValueError as e:
        raise CkptError(f"cannot export {source}: {e}") from None
    hf_state = to_hf(state, mcfg)
    _check_against_hf(cls, config, to_runtime(hf_state, mcfg))  # Mixtral: fused as transformers holds it
    tmp = _temp(out)
    try:
        tmp.mkdir()
        config.save_pretrained(str(tmp))  # config.json, written by transformers itself
        save_file(hf_state, str(tmp / HF_WEIGHTS), metadata={"format": "pt"})
        (tmp / "course_lib_source.json").write_text(json.dumps({"model": mcfg.to_dict(), "source": info}, indent=2))
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, cls.__name__, info


def _check_against_hf(cls, config, hf_state: dict) -> None:
    """The HF model's own state dict (built on the meta device: shapes only) has exactly our names
    and shapes, the tied head aside; a mapping error is caught before any file is written."""
    import torch

    with torch.device("meta"):
        theirs = {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}
    if config.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    ours = {k: tuple(v.shape) for k, v in hf_state.items()}
    if ours != theirs:
        diff = sorted(set(ours.items()) ^ set(theirs.items()))[:6]
        raise CkptError(f"the HF model {cls.__name__} does not match the mapped tensors (ours vs theirs differ in: "
                        f"{diff}); nothing was written")
