"""What every model-parallel trainer test checks the same way, in one place: the config of a run,
its metrics rows, and the comparison with one process on the same global batch (per-step losses
and gradient norms, clipping decisions, final weights) and with itself after a resume.

Used by tests/test_train_model_parallel.py and the composed-layout tests (context parallel,
recompute under tp, ZeRO and FSDP under tp/pp/cp, pipeline splits)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from course_lib.trainer import config as train_config

TINY = Path(__file__).resolve().parents[1] / "labs" / "configs" / "tiny-cpu.toml"
FP32_REL = 1e-4  # fp32, the same global batch: equal up to summation order (measured 1e-7 to 3e-7)


def toml_value(v) -> str:
    """A Python value as the right-hand side of a ``--set`` override (strings quoted, lists TOML)."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (str, list)):
        return json.dumps(v)
    return str(v)


def tiny_cfg(grad_accum: int, extra: tuple[str, ...] = (), **sets) -> dict:
    """tiny-cpu.toml for a test run: no progress bar, fixed peak FLOP/s (no CPU measurement),
    synchronous saves, ``grad_accum`` micro-batches; ``sets`` as ``section__key=value``."""
    overrides = ["train.progress=false", "schedule.warmup_steps=3", "train.peak_flops=1e12",
                 f"train.grad_accum={grad_accum}", "checkpoint.async_save=false", *extra]
    overrides += [f"{k.replace('__', '.')}={toml_value(v)}" for k, v in sets.items()]
    return train_config.load(TINY, overrides)


RESUME_TAIL = 4  # steps a layout test resumes: its run saves at max_steps - RESUME_TAIL and at the end


def resume_save_every(steps: int) -> int:
    """Checkpoint interval (steps) of a layout run whose resume starts from the checkpoint before
    the last one, RESUME_TAIL steps before the end."""
    return steps - RESUME_TAIL


def one_read_per_step(steps: int) -> dict[int, int]:
    """The host reads per step a synchronously saving layout run of ``steps`` steps must show
    (model_parallel_rank_fns.train_counting_reads): one, the stabilizer's, at every step from 2 on
    but the one after the save at resume_save_every(steps)."""
    return {s: 1 for s in range(2, steps + 1) if s != resume_save_every(steps) + 1}


def micro_batch(sequences: int, accum: int, grad_accum: int) -> int:
    """Micro-batch (sequences) that keeps a step's batch when a step of ``accum`` micro-batches of
    ``sequences`` is taken as ``grad_accum`` micro-batches instead."""
    if (sequences * accum) % grad_accum:
        raise ValueError(f"{sequences} x {accum} sequences do not split into {grad_accum} micro-batches")
    return sequences * accum // grad_accum


def micro_batches_per_step(steps: int, accum: int) -> int:
    """Micro-batches per optimizer step of a layout run: the 30-step run (issue 20's loss match)
    takes its global batch as ONE micro-batch (accumulation is not its point, and a micro-batch
    costs a forward, a backward and their collectives); the shorter layouts keep ``accum``."""
    return 1 if steps == 30 else accum


def rows(out) -> list[dict]:
    """The run's metrics.jsonl rows."""
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def max_rel(a, b) -> float:
    """Largest relative difference of two equally long sequences (``b`` the reference)."""
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def rel_l2(weights: dict, want: dict) -> float:
    """Relative L2 distance of two state dicts over all of ``want``'s tensors."""
    diff = torch.cat([(weights[k].float() - want[k].float()).reshape(-1) for k in want]).norm()
    return (diff / torch.cat([want[k].float().reshape(-1) for k in want]).norm()).item()


def assert_matches_one_process(name: str, got: list[dict], ref: list[dict], weights: dict | None = None,
                               single_model=None, rel: float = FP32_REL) -> None:
    """Per-step losses and gradient norms within ``rel`` of one process, the same clipping
    decisions, and (given) final weights within ``rel`` relative L2 under the dense names."""
    r = max_rel([x["loss"] for x in got], [x["loss"] for x in ref])
    assert r <= rel, f"{name}: per-step losses differ from one process by up to {r:.2e} (relative)"
    # The stabilizer's norm counts each logical parameter once (shards summed, replicas once).
    g = max_rel([x["grad_norm"] for x in got], [x["grad_norm"] for x in ref])
    assert g <= rel, f"{name}: gradient norms differ from one process by up to {g:.2e}"
    assert [x["clipped"] for x in got] == [x["clipped"] for x in ref], f"{name}: other clipping decisions"
    if weights is not None:
        want = {k: v.float() for k, v in single_model.state_dict().items()}
        assert set(weights) == set(want), f"{name}: gathered weights have other names than the dense model"
        w = rel_l2(weights, want)
        assert w <= rel, f"{name}: final weights differ from one process by {w:.2e} (relative L2)"


def assert_resumed_bit_exact(name: str, first: dict, second: dict, start: int, steps: int, root) -> None:
    """The run resumed at ``start`` from ``root/cut`` ends with the weights of the uninterrupted
    run ``root/full`` (torch.equal) and logs the same losses after ``start``."""
    assert second["resumed_from"] == start and second["steps"] == steps, (name, second["resumed_from"])
    for k, v in first["weights"].items():
        assert torch.equal(second["weights"][k], v), f"{name}: {k} differs after the resume"
    cut, full = ([x["loss"] for x in rows(Path(root) / d)][start:] for d in ("cut", "full"))
    assert cut == full, f"{name}: losses after the resume differ"
