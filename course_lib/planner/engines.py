"""What the engines people run at scale share in a plan: their versions, the schedule's length,
the blocks of each pipeline stage, and the torchrun line that starts them on the plan's nodes.

The files themselves: :mod:`course_lib.planner.torchtitan_job` (``torchtitan.toml`` and the model
module it imports) and :mod:`course_lib.planner.megatron_job` (``megatron_args.txt``). Both engines
are held to their own code by the tests: torchtitan 0.2.0 is installed there (its ConfigManager,
ParallelDims and Llama model read the files); Megatron-LM's ``validate_args`` is not on PyPI, so
``tests/test_planner_megatron.py`` holds the files to each of its assertions, by source line.
"""
from __future__ import annotations

from course_lib.launchers.commands import shell_join
from course_lib.planner.costs import Candidate
from course_lib.planner.spec import JobSpec

TORCHTITAN_VERSION = "0.2.0"
MEGATRON_VERSION = "core_v0.14.0"
MEGATRON_COMMIT = "23e00ed0963c35382dfe8a5a94fb3cda4d21e133"
RDZV_PORT = 29500


def train_steps(spec: JobSpec) -> int:
    """Optimizer steps: the plan's tokens / tokens per step (at least 1)."""
    return max(1, int(round(spec.tokens / spec.global_batch_tokens)))


def warmup_steps(spec: JobSpec) -> int:
    """Warm-up steps, as the trainer TOML: 1% of the steps, at most 2000."""
    return min(2000, max(1, train_steps(spec) // 100))


def stage_blocks(spec: JobSpec, c: Candidate) -> tuple:
    """Blocks on each of the pp x v stages, in depth order (stage i on pipeline rank i mod pp)."""
    return tuple(c.layout.blocks_per_stage(spec.shape.n_layers))


def torchrun_head(spec: JobSpec) -> list[str]:
    """torchrun's options for the plan's nodes, before the program: ``--standalone`` on one node
    (a free port, no host to name); on several, a c10d rendezvous at ``$HEAD_NODE`` with the job's
    id ``$JOB_ID`` (both set by the user, or by SLURM: see plan.md), so no node needs its rank.
    Only options every torch 2.x torchrun has."""
    head = ["torchrun", "--nnodes", str(spec.nodes), "--nproc-per-node", str(spec.gpus_per_node)]
    if spec.nodes == 1:
        return head[:1] + ["--standalone"] + head[1:]
    return head + ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"${{HEAD_NODE}}:{RDZV_PORT}", "--rdzv-id", "$JOB_ID"]


def command_line(env: dict[str, str], argv: list[str], tail: str = "") -> str:
    """One shell line: ``VAR=value ...`` assignments, the quoted argv, then ``tail`` verbatim (a
    ``$(...)`` expansion or placeholders the user fills in)."""
    words = [f"{k}={v}" for k, v in env.items()] + [shell_join(argv)]
    return " ".join(words + ([tail] if tail else []))
