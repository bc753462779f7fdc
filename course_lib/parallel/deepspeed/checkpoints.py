"""Checkpoints of the ``deepspeed`` strategy: DeepSpeed's own shards, committed the kit's way.

A checkpoint is a directory ``step_000000120`` (the kit's names, :func:`course_lib.checkpoint.io.fresh_name`)
holding

* what ``engine.save_checkpoint`` writes: ``mp_rank_00_model_states.pt`` (rank 0: module weights,
  and the optimizer state at ZeRO-0; at ZeRO-3 one ``zero_pp_rank_R_mp_rank_00_model_states.pt`` per
  rank instead) and one ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank (its partition of
  the fp32 master weights and Adam moments; ZeRO >= 1 or bf16);
* ``rank{R}.pt`` per rank, written by the kit next to them (``torch.load(weights_only=True)``): that
  rank's RNG streams and data position, and on rank 0 the state shared by every rank (scheduler,
  precision policy, stabilizer). DeepSpeed's ``client_state`` is not used: it is rank 0's only, and
  every rank has its own RNG and data position;
* ``manifest.json`` (format ``course_lib.checkpoint.deepspeed/1``): step, save sequence, world size,
  ZeRO stage, metrics, and the sha256 and size of every file.

Atomicity, agreement and retention are those of :mod:`course_lib.checkpoint.dcp`, reusing its
helpers: rank 0 picks a fresh name and a ``.tmp-*`` directory and broadcasts them; every rank
serializes its ``rank{R}.pt`` (errors exchanged), DeepSpeed writes its shards with the temp
directory as the *tag* (``save_latest=False``: no ``latest`` file), the ranks exchange errors, and
rank 0 seals the directory with :func:`course_lib.checkpoint.io.commit_dir` (hash and fsync every
file, manifest, rename, fsync), re-reads it and only then prunes to ``keep_last``.

Loading: rank 0 verifies candidates newest first (checksums; every ``rank{R}.pt`` parses with
``weights_only=True``; DeepSpeed's files present for the saved world size), falling back past a
corrupt one with a warning, and broadcasts the name; every rank then calls ``engine.load_checkpoint``
on exactly that one and restores its own ``rank{R}.pt``. A ZeRO checkpoint is tied to the world size
it was saved with: another world size is refused (CheckpointLoadError), never silently resharded.
DeepSpeed's engine reads its own ``.pt`` files with ``torch.load(weights_only=False)`` when the
trainer resumes: the checksums catch damage, not a forged file (see ``docs/CHECKPOINTS.md``, "What
is trusted").

:func:`deepspeed_to_state_dict` turns a checkpoint into a plain ``{name: fp32 tensor}`` state dict
(DeepSpeed's ``zero_to_fp32``) that loads into a single-process model. It is what ``course ckpt``
runs on folders from anywhere, so it never unpickles code: every ``.pt`` file is read with
``torch.load(weights_only=True)``, admitting only :data:`SAFE_GLOBALS` (the three plain data classes
DeepSpeed pickles into its optimizer files); a file that names anything else is refused
(:class:`UntrustedPickleError`) unless the caller passes ``trust_pickles=True``.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from course_lib.checkpoint import io as cio
from course_lib.checkpoint.collective import agreed_choice, choose_newest, collective_save, newest_first
from course_lib.checkpoint.collective import describe as _describe
from course_lib.checkpoint.io import CheckpointCorruptError, CheckpointLoadError
from course_lib.checkpoint.state import LoadResult, capture_rng, restore_rng_state
from course_lib.validate import check_int

DS_FORMAT = "course_lib.checkpoint.deepspeed/1"
#: The only non-tensor classes DeepSpeed's own ``.pt`` files pickle (ZeRO 0-3, fp32 and bf16,
#: DeepSpeed 0.19; every file listed with ``torch.serialization.get_unsafe_globals_in_checkpoint``):
#: an IntEnum, a loss-scale holder and a two-int dataclass. Rebuilding them sets attributes only.
SAFE_GLOBALS = ("deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                "deepspeed.utils.tensor_fragment.fragment_address")
TRUST_HINT = ("pass trust_pickles=True (course ckpt: --trust-pickles) only for a checkpoint you wrote yourself: "
              "it unpickles DeepSpeed's files as DeepSpeed does, which runs any code a forged file names")


class UntrustedPickleError(CheckpointLoadError):
    """A DeepSpeed ``.pt`` file names a class or function outside :data:`SAFE_GLOBALS`: refused
    without ``trust_pickles`` (the message names the file and the global)."""
MODEL_STATES = "mp_rank_00_model_states.pt"


def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def _zero_files(rank: int) -> tuple[str, str]:
    """The names DeepSpeed gives rank ``rank``'s optimizer shard: ``bf16_``-prefixed when the engine
    runs bf16 (its BF16_Optimizer), plain otherwise; either one is that rank's shard."""
    plain = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    return plain, "bf16_" + plain


def _expert_optim_file(ep_rank: int) -> str:
    """The optimizer file DeepSpeed writes per EP rank at ZeRO-0 with experts (no ZeRO shards)."""
    return f"expp_rank_{ep_rank}_mp_rank_00_optim_states.pt"


def _ds_dirs(root: Path) -> tuple[list[tuple[int, str, dict]], dict[str, str]]:
    """``([(seq, name, manifest)] newest first, {name: why unreadable})`` under ``root``."""
    return newest_first(root, DS_FORMAT)


# ----------------------------------------------------------------------------- save

def save_deepspeed(root: str | Path, step: int, engine: Any, *, shared: dict[str, Any] | None = None,
                   per_rank: dict[str, Any] | None = None, metrics: dict | None = None,
                   keep_last: int = 3, ep: int = 1) -> Path:
    """Collective: save ``engine`` (every rank's shards) plus the kit's per-rank and shared state
    as checkpoint ``step`` under ``root``; keep the ``keep_last`` newest. Returns the final path.
    ``ep``: the run's parallel.ep, recorded in the manifest (a resume at another ep is refused).
    A failure on any rank raises CheckpointError on every rank and commits nothing."""
    check_int("step", step, 0)
    check_int("keep_last", keep_last, 1)
    rank = dist.get_rank()

    def prepare() -> bytes:  # local only: this rank's RNG and data position, rank 0's shared state
        buf = io.BytesIO()
        torch.save({"rng": capture_rng(),
                    "per_rank": {k: v.state_dict() for k, v in (per_rank or {}).items()},
                    "shared": {k: v.state_dict() for k, v in (shared or {}).items()} if rank == 0 else {}}, buf)
        return buf.getvalue()

    def write(tmp: Path, mine: bytes) -> None:
        # Collective inside (barriers); the temp directory is DeepSpeed's tag, so its files land
        # directly in it. save_latest=False: the kit's manifest, not a 'latest' file, says what exists.
        engine.save_checkpoint(str(tmp.parent), tag=tmp.name, client_state={}, save_latest=False)
        cio.write_durable(tmp / _rank_file(rank), mine)

    return collective_save(root, step, what="deepspeed", format=DS_FORMAT, prepare=prepare, write=write,
                           manifest={"zero_stage": int(engine.zero_optimization_stage()), "ep": int(ep),
                                     "metrics": dict(metrics or {})}, keep_last=keep_last)


# ----------------------------------------------------------------------------- load

def verify_deepspeed(path: Path, manifest: dict | None = None) -> dict:
    """Rank 0's check before the ranks load ``path``: every file's size and sha256, every
    ``rank{R}.pt`` through ``torch.load(weights_only=True)``, DeepSpeed's model file and (ZeRO)
    one optimizer shard per saved rank. Returns the manifest; CheckpointCorruptError otherwise."""
    manifest, blobs = cio.read_verified(path, manifest)
    del blobs
    files, world = manifest["files"], manifest.get("world_size")
    if not isinstance(world, int) or world < 1:
        raise CheckpointCorruptError(f"{path}: the manifest names no world size")
    needed = [_rank_file(r) for r in range(world)]
    stage = manifest.get("zero_stage", 0)
    # ZeRO-3 writes each rank's module partition, the others rank 0's whole module.
    needed += [f"zero_pp_rank_{r}_{MODEL_STATES}" for r in range(world)] if stage == 3 else [MODEL_STATES]
    missing = [f for f in needed if f not in files]
    ep = manifest.get("ep", 1)
    if stage == 0 and ep > 1:  # ZeRO-0 with experts: DeepSpeed writes one optimizer file per EP rank
        missing += [_expert_optim_file(r) for r in range(ep) if _expert_optim_file(r) not in files]
    elif any(f.endswith("_optim_states.pt") for f in files) or stage >= 1:
        missing += [_zero_files(r)[0] for r in range(world) if not any(f in files for f in _zero_files(r))]
    if missing:
        raise CheckpointCorruptError(f"{path}: the manifest lacks {', '.join(missing)}")
    for r in range(world):
        try:
            state = torch.load(path / _rank_file(r), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            raise CheckpointCorruptError(f"{path}: {_rank_file(r)} does not load with weights_only=True ({e})") from e
        if not isinstance(state, dict) or "rng" not in state:
            raise CheckpointCorruptError(f"{path}: {_rank_file(r)} is not a per-rank state")
    return manifest


#: ZeRO stages whose checkpoints DeepSpeed loads into each other (one optimizer class, partitions
#: of the same flat fp32 groups): resumed 1 -> 2 and 2 -> 1, every loss equals the uninterrupted run's
#: (fp32, 2 ranks). Every
#: other change of stage fails inside DeepSpeed (an AssertionError with no text for 2 <-> 3, a
#: missing file for 0 -> 2, an AttributeError for 2 -> 0), so it is refused before DeepSpeed reads.
COMPATIBLE_STAGES = ({1, 2},)


def stage_mismatch(saved: int, asked: int) -> str | None:
    """Why a checkpoint saved at ZeRO stage ``saved`` cannot resume at stage ``asked`` (None: it can)."""
    if saved == asked or any({saved, asked} <= group for group in COMPATIBLE_STAGES):
        return None
    return (f"saved with ZeRO stage {saved} (parallel.zero_stage = {saved}), this run asks for stage {asked}: "
            f"DeepSpeed's stage-{saved} checkpoint holds its optimizer state in another layout than stage "
            f"{asked} reads (only stages 1 and 2 load each other). Resume with parallel.zero_stage = {saved}, "
            f"or convert the weights with course_lib.parallel.deepspeed.checkpoints.deepspeed_to_state_dict(path) "
            f"and start a new run from them (the optimizer state does not convert)")


def ep_mismatch(saved: int, asked: int) -> str | None:
    """Why a checkpoint saved at ``parallel.ep = saved`` cannot resume at ``asked`` (None: it can)."""
    if saved == asked:
        return None
    return (f"saved with parallel.ep = {saved}, this run asks for parallel.ep = {asked}: DeepSpeed partitions the "
            f"optimizer state of the expert slices over the expert-data-parallel groups of that ep, and each rank's "
            f"file holds its own slices, so another ep would read other experts' state. Resume with "
            f"parallel.ep = {saved}, or convert the weights with course_lib.parallel.deepspeed.checkpoints."
            f"deepspeed_to_state_dict(path) (experts joined into the one-process layout) and start a new run from "
            f"them with model.init_from (the optimizer state does not convert)")


def _choose(root: Path, world_size: int, stage: int | None = None, ep: int = 1) -> tuple:
    """Rank 0's choice (see :func:`course_lib.checkpoint.collective.choose_newest`); a checkpoint of
    another world size, or of a ZeRO ``stage`` DeepSpeed cannot load into this one, stops the choice
    rather than falling back past it."""
    def verify(path: Path, manifest: dict) -> dict:
        manifest = verify_deepspeed(path, manifest)
        if manifest["world_size"] != world_size:
            raise CheckpointLoadError(
                f"saved by {manifest['world_size']} ranks, this run has {world_size}; a ZeRO checkpoint is "
                f"partitioned per rank: resume with the same number of ranks, or convert it with "
                f"deepspeed_to_state_dict and start a new run from the weights")
        why = None if stage is None else stage_mismatch(int(manifest.get("zero_stage", 0)), stage)
        why = why or ep_mismatch(int(manifest.get("ep", 1)), ep)
        if why:
            raise CheckpointLoadError(why)
        return manifest

    return choose_newest(root, DS_FORMAT, verify, "deepspeed checkpoint")


def load_deepspeed(root: str | Path, engine: Any, *, shared: dict[str, Any] | None = None,
                   per_rank: dict[str, Any] | None = None, restore_rng: bool = True,
                   ep: int = 1) -> LoadResult | None:
    """Collective: restore the newest deepspeed checkpoint under ``root`` that verifies (rank 0
    picks, every rank loads that one). None on every rank when there is none at all;
    CheckpointLoadError on every rank when checkpoints exist but none can be loaded (or were saved
    at another ZeRO stage or ``parallel.ep`` than ``ep``). ``per_rank`` entries are restored after
    DeepSpeed's own files, so they win over what those hold (the expert slices)."""
    root, rank = Path(root), dist.get_rank()
    chosen = agreed_choice(lambda: _choose(root, dist.get_world_size(), int(engine.zero_optimization_stage()), ep),
                           "deepspeed", root)
    if chosen is None:
        return None
    kind, name, manifest, _ = chosen
    path = root / name
    try:
        loaded, _ = engine.load_checkpoint(str(root), tag=name, load_optimizer_states=True,
                                           load_lr_scheduler_states=False, load_module_strict=True)
        if loaded is None:
            raise CheckpointLoadError(f"DeepSpeed found nothing to load in {path}")
        extra_shared = torch.load(path / _rank_file(0), map_location="cpu", weights_only=True)["shared"]
        mine = torch.load(path / _rank_file(rank), map_location="cpu", weights_only=True)
        for key, obj in (shared or {}).items():
            obj.load_state_dict(extra_shared[key])
        for key, obj in (per_rank or {}).items():
            obj.load_state_dict(mine["per_rank"][key])
        if restore_rng:
            restore_rng_state(mine["rng"])
    except CheckpointLoadError:
        raise
    except Exception as e:
        raise CheckpointLoadError(f"cannot load deepspeed checkpoint {name} on rank {rank}: {_engine_error(e)}",
                                  [(name, _engine_error(e))]) from e
    return LoadResult(manifest["step"], path, "local", manifest.get("metrics", {}), manifest.get("seq", 0), manifest)


def _engine_error(e: BaseException) -> str:
    """``"TypeName: message"``; for an error DeepSpeed raised without a message (a bare ``assert``),
    where it was raised and the failing line, so the report says something."""
    text = _describe(e)
    if str(e).strip():
        return text
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return text
    last = frames[-1]
    return f"{text.rstrip(': ')} with no message, at {last.filename}:{last.lineno} ({(last.line or '').strip()})"


# ----------------------------------------------------------------------------- the trainer's object

class DeepSpeedCheckpoints:
    """The trainer's checkpoint object for ``train.strategy = "deepspeed"`` (the interface of
    :class:`~course_lib.parallel.checkpointing.FullCheckpoints`). Saves are synchronous and local:
    ``async_save`` is ignored (DeepSpeed writes from the training thread), ``mirror`` is refused."""

    format = "deepspeed"

    def __init__(self, strategy: Any, root: str | Path, *, every_steps: int | None, keep_last: int,
                 async_save: bool, mirror: str | None):
        if mirror:
            from course_lib.validate import ConfigError

            raise ConfigError("checkpoint.mirror is not supported with train.strategy = 'deepspeed'; copy the "
                              "checkpoint folder with your storage tools")
        self.strategy, self.root = strategy, Path(root)
        self.every_steps, self.keep_last = every_steps, keep_last

    def should_save(self, step: int) -> bool:
        """Whether the step policy saves after ``step`` optimizer steps."""
        return self.every_steps is not None and step > 0 and step % self.every_steps == 0

    @staticmethod
    def _shared(state: Any) -> dict[str, Any]:
        shared = {"scheduler": state.scheduler, "precision": state.scaler, **state.stateful}
        return {k: v for k, v in shared.items() if v is not None}

    def _rank_state(self) -> dict[str, Any]:
        """The strategy's own per-rank entries (expert parallelism: this rank's expert slices)."""
        return getattr(self.strategy, "rank_state", dict)()

    def _ep(self) -> int:
        return int(self.strategy.cfg["parallel"].get("ep", 1))

    def save(self, step: int, state: Any, metrics: dict) -> None:
        """Collective: every rank writes its shards, RNG and data position."""
        per_rank = {**({"data": state.data} if state.data is not None else {}), **self._rank_state()}
        save_deepspeed(self.root, step, self.strategy.engine, shared=self._shared(state), per_rank=per_rank,
                       metrics=metrics, keep_last=self.keep_last, ep=self._ep())

    def load(self, state: Any, *, restore_data: bool = True) -> LoadResult | None:
        """Collective: every rank restores the checkpoint rank 0 picks; ``restore_data=False``
        keeps the data position (a roll-back must not replay the batches that caused it)."""
        per_rank = {**({"data": state.data} if restore_data and state.data is not None else {}), **self._rank_state()}
        return load_deepspeed(self.root, self.strategy.engine, shared=self._shared(state), per_rank=per_rank,
                              ep=self._ep())

    def flush(self) -> None:
        """Nothing in flight: saves are synchronous."""

    def close(self) -> None:
        """Nothing to finish."""


# ----------------------------------------------------------------------------- conversion

def _safe_globals() -> list:
    """The classes of :data:`SAFE_GLOBALS`, imported (DeepSpeed is installed when its files are read)."""
    import importlib

    out = []
    for dotted in SAFE_GLOBALS:
        module, name = dotted.rsplit(".", 1)
        out.append(getattr(importlib.import_module(module), name))
    return out


def load_ds_file(path: str | Path, *, trust_pickles: bool = False, **kwargs: Any) -> Any:
    """``torch.load`` of one of DeepSpeed's ``.pt`` files: ``weights_only=True`` with
    :data:`SAFE_GLOBALS` admitted (UntrustedPickleError naming the file and what it asked for
    otherwise), or, with ``trust_pickles``, full unpickling as DeepSpeed itself does.
    ``kwargs``: ``map_location``, ``mmap``."""
    import pickle

    if trust_pickles:
        return torch.load(path, weights_only=False, **kwargs)
    with torch.serialization.safe_globals(_safe_globals()):
        try:
            return torch.load(path, weights_only=True, **kwargs)
        except pickle.UnpicklingError as e:
            lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]  # torch's names the global
            first = next((ln for ln in lines if "Unsupported" in ln or "WeightsUnpickler" in ln),
                         lines[0] if lines else type(e).__name__)
            raise UntrustedPickleError(f"{path}: refused to unpickle it ({first}). DeepSpeed's own files pickle only "
                                       f"{', '.join(SAFE_GLOBALS)} besides tensors; this one asks for more, so it "
                                       f"may be forged or from another DeepSpeed version. To load it anyway, "
                                       f"{TRUST_HINT}", [(Path(path).name, first)]) from None


class _SafeTorch:
    """``torch`` as DeepSpeed's ``zero_to_fp32`` module sees it while :func:`deepspeed_to_state_dict`
    runs it: every attribute is torch's own except ``load``, which is :func:`load_ds_file`
    (``zero_to_fp32`` asks for ``weights_only=False`` itself; that argument is replaced)."""

    def __init__(self, trust_pickles: bool):
        self._trust = trust_pickles

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def load(self, f: Any, map_location: Any = None, weights_only: Any = None, **kwargs: Any) -> Any:
        return load_ds_file(f, trust_pickles=self._trust, map_location=map_location, **kwargs)


def deepspeed_to_state_dict(checkpoint_path: str | Path, *, trust_pickles: bool = False) -> dict[str, torch.Tensor]:
    """A plain ``{name: fp32 CPU tensor}`` state dict from a deepspeed checkpoint directory
    (verified first), for ``model.load_state_dict(..., strict=True)`` in one process. ZeRO >= 1:
    DeepSpeed's ``zero_to_fp32`` merges the fp32 master partitions of every rank; ZeRO-0: the
    module weights rank 0 saved. Every ``.pt`` file is read with ``weights_only=True`` and
    :data:`SAFE_GLOBALS` (UntrustedPickleError for anything else), or with full unpickling when
    ``trust_pickles`` (only for checkpoints you wrote: a forged file would run code).

    With ``parallel.ep > 1`` (:mod:`course_lib.parallel.deepspeed.experts`) rank 0's module weights
    with every EP rank's expert slices (its ``rank{R}.pt``) joined along the expert dimension: the
    one-process layout. Only for an fp32 run, whose module weights are the trained fp32 values; a
    bf16 run's fp32 masters lie in ZeRO's partitions of the expert groups, which ``zero_to_fp32``
    does not merge (CheckpointLoadError)."""
    path = Path(checkpoint_path)
    manifest = verify_deepspeed(path)
    if manifest.get("ep", 1) > 1:
        return _expert_parallel_state_dict(path, int(manifest["ep"]), trust_pickles)
    if manifest.get("zero_stage", 0) >= 1 or any(f.startswith("zero_pp_rank_") for f in manifest["files"]):
        from deepspeed.utils import zero_to_fp32

        # zero_to_fp32 calls torch.load(..., weights_only=False) on every file it reads: for the
        # duration of this call its module sees a torch whose load is load_ds_file.
        real = zero_to_fp32.torch
        zero_to_fp32.torch = _SafeTorch(trust_pickles)
        try:
            state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)
        finally:
            zero_to_fp32.torch = real
    else:
        state = load_ds_file(path / MODEL_STATES, trust_pickles=trust_pickles, map_location="cpu")["module"]
    return {k: v.detach().to("cpu", torch.float32).clone() if v.is_floating_point() else v.detach().cpu().clone()
            for k, v in state.items()}


def _expert_parallel_state_dict(path: Path, ep: int, trust_pickles: bool) -> dict[str, torch.Tensor]:
    """:func:`deepspeed_to_state_dict` of a checkpoint saved at ``parallel.ep = ep``: rank 0's
    module with the expert slices of EP ranks 0..ep-1 (their ``rank{R}.pt``) concatenated."""
    module = load_ds_file(path / MODEL_STATES, trust_pickles=trust_pickles, map_location="cpu")["module"]
    low = sorted(k for k, v in module.items() if v.is_floating_point() and v.dtype != torch.float32)
    if low:
        raise CheckpointLoadError(f"{path}: saved at parallel.ep = {ep} with {module[low[0]].dtype} weights "
                                  f"({low[0]}, ...): "
                                  f"their fp32 masters are in ZeRO's partitions of the expert groups, which "
                                  f"zero_to_fp32 does not merge; only an fp32 run's checkpoint converts")
    slices = [torch.load(path / _rank_file(r), map_location="cpu", weights_only=True)["per_rank"]["experts"]
              for r in range(ep)]
    state = dict(module)
    for name in slices[0]:
        state[name] = torch.cat([s[name] for s in slices])
    return {k: v.detach().to("cpu", torch.float32).clone() if v.is_floating_point() else v.detach().cpu().clone()
            for k, v in state.items()}
