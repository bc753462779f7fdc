"""The README's course map: each lab, its exercise on the same row, and what its full size cost
where it was measured, from the records ``course doctor`` lists (each lab notebook's metadata
``course.full_size_seconds`` and ``measured_on``, written by ``course labs run NN --record-time``).

``python -m course_lib.kit.course_map`` prints the table; tests/test_readme.py holds the README to it,
so a re-timed lab shows up as a failing test with the row to paste.
"""
from __future__ import annotations

from pathlib import Path

from course_lib.kit import catalog, notebooks
from course_lib.kit.doctor import _split_stamps

#: lab stem -> (exercise stem in exercises/, what the exercise asks). Exercise numbers follow the
#: exercises' own order, so lab 13's exercise is 12, lab 15's is 13, lab 16's is 14, lab 03's is 15 (FP8,
#: added after them), and labs 06, 12 and 14 have none.
EXERCISES: dict[str, tuple[str, str]] = {
    "00_orientation": ("00_ring_allreduce", "ring all-reduce from send/recv"),
    "01_memory": ("01_memory_budget", "memory budget of a 7B model with AdamW"),
    "02_flops_mfu": ("02_zero_stages", "the ZeRO stage table (sharding, memory, communication)"),
    "03_mixed_precision": ("15_fp8_blockwise", "FP8 quantization in DeepSeek-V3's 1 x 128 tiles, scales and all"),
    "04_checkpointing_accumulation": ("04_custom_attention", "a custom attention pattern, checkpointed and benchmarked"),
    "05_stability": ("05_gradient_policy", "clipping analysis and a gradient-explosion policy"),
    "07_checkpoints": ("07_atomic_checkpoint", "atomic save and retention, killed mid-save"),
    "08_data_parallel": ("08_bucketed_ddp", "bucketed DDP"),
    "09_zero_fsdp_deepspeed": ("09_zero1_optimizer", "a ZeRO-1 sharded optimizer"),
    "10_tensor_parallel": ("10_tp_linear", "column- and row-parallel linear layers (f/g, Megatron MLP)"),
    "11_pipeline_parallel": ("11_one_f_one_b", "the 1F1B schedule (simulated, then on gloo ranks)"),
    "13_planning_launching": ("12_parallelism_selection", "parallelism selection (a layout for three jobs, "
                                                          "then `choose_layout` for any job)"),
    "15_context_parallel": ("13_online_softmax", "the online-softmax merge of two partial attention results, "
                                                 "then inside a simulated ring"),
    "16_experts": ("14_expert_dispatch", "expert-parallel dispatch and combine (counts, rows, permute) on "
                                         "1, 2 and 4 gloo ranks"),
}


def format_duration(seconds: float | None) -> str:
    """``12 s`` under a minute, ``11.8 min`` above; ``not timed`` for None."""
    if seconds is None:
        return "not timed"
    if seconds < 0:
        raise ValueError(f"seconds must be >= 0, got {seconds}")
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


def markdown_table(root: Path) -> str:
    """The course map as markdown: ``| lab | exercise | full size here |`` per lab in ``root/labs``,
    then one line naming the machine the times were measured on."""
    names = sorted(p.stem for p in (root / "labs").glob("[0-9][0-9]_*.py"))
    runs = [notebooks.recorded_run(root / "labs" / f"{n}.ipynb") for n in names]
    common, own = _split_stamps([r.get("measured_on", "") for r in runs])
    rows = ["| # | lab (`labs/`) | exercise (`exercises/`) | full size, laptop CPU |", "| --- | --- | --- | --- |"]
    for name, run, extra in zip(names, runs, own):
        info = catalog.LABS.get(name)
        title = info.title if info else name
        ex = EXERCISES.get(name)
        exercise = f"{ex[0][:2]}: {ex[1]}" if ex else ""
        took = format_duration(run.get("full_size_seconds")) + (f" ({extra})" if extra else "")
        rows.append(f"| {name[:2]} | {title} | {exercise} | {took} |")
    note = ("Times: each lab's full-size Run All as `course doctor` lists it (recorded by "
            "`course labs run NN --record-time`)" + (f", measured on {common}" if common else "")
            + "; load is the 1-minute load average when the run ended: above the core count, the lab shared "
              "the CPU with other work.")
    return "\n".join(rows) + "\n\n" + note


def main() -> int:
    """Print the table for the checkout this runs in."""
    from course_lib.kit.root import find_root

    print(markdown_table(find_root()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
