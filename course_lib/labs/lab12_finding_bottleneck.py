"""Lab 12 ("Finding the bottleneck"): the rank function that trains several profiled
configurations in one launch, and the tables and plots that read their profile summaries.

Spawned ranks can only run importable code, hence this module. Every number comes from the
trainer's own files: ``OUT/profile/summary.json`` (:func:`course_lib.trainer.profiling.load_summary`) and
``OUT/metrics.jsonl``.
"""
from __future__ import annotations

from pathlib import Path

from course_lib.trainer.profiling import load_summary

PARTS = (("compute_s", "compute", "tab:blue"), ("comm_s", "communication (exposed)", "tab:red"),
         ("idle_s", "idle", "tab:gray"))


def train_jobs(rank: int, world_size: int, jobs: list[tuple[dict, str]]) -> list[dict]:
    """Run the trainer once per ``(cfg, out_dir)`` job, one after the other, on this rank (the
    process group is already up). Returns per job: optimizer ``steps`` done and ``final_loss``."""
    from course_lib.train import train

    out = []
    for cfg, out_dir in jobs:
        result = train(cfg, out_dir)
        out.append({"steps": result.steps, "final_loss": result.final_loss})
    return out


def breakdown_rows(out_dir: str | Path, label: str) -> list[dict]:
    """One row per rank of a profiled run: ``label``, ``rank`` and the mean per profiled step of
    ``wall_ms``, ``compute_ms``, ``comm_ms`` (exposed), ``idle_ms``, ``overlapped_ms`` (collective
    time hidden behind compute), all milliseconds on that rank; ``comm_share`` (exposed
    communication / wall) and ``mfu`` (the metrics rows', a fraction)."""
    rows = []
    for r in load_summary(out_dir)["ranks"]:
        m = r["mean"]
        rows.append({"label": label, "rank": r["rank"], "wall_ms": m["wall_s"] * 1e3,
                     "compute_ms": m["compute_s"] * 1e3, "comm_ms": m["comm_s"] * 1e3,
                     "idle_ms": m["idle_s"] * 1e3, "overlapped_ms": m["comm_overlapped_s"] * 1e3,
                     "comm_total_ms": m["comm_total_s"] * 1e3, "comm_share": m["comm_share"], "mfu": m["mfu"]})
    return rows


def print_breakdown(rows: list[dict]) -> None:
    """The rows of :func:`breakdown_rows` as an aligned table."""
    print(f"{'run':<28} {'rank':>4} {'step ms':>8} {'compute':>8} {'comm':>8} {'idle':>8} {'hidden':>8} "
          f"{'comm %':>7} {'MFU':>7}")
    for r in rows:
        mfu = "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}"
        print(f"{r['label']:<28} {r['rank']:>4} {r['wall_ms']:>8.1f} {r['compute_ms']:>8.1f} {r['comm_ms']:>8.1f} "
              f"{r['idle_ms']:>8.1f} {r['overlapped_ms']:>8.1f} {r['comm_share']:>7.1%} {mfu:>7}")
    print("(ms per step, mean over the profiled steps; comm = exposed communication, hidden = collective time "
          "overlapped with compute)")


def plot_breakdown(ax, rows: list[dict], *, shares: bool = True) -> None:
    """Horizontal stacked bars, one per (run, rank): compute / exposed communication / idle, as
    shares of the step (``shares=True``) or in milliseconds."""
    labels = [f"{r['label']}, rank {r['rank']}" for r in rows]
    left = [0.0] * len(rows)
    for key, name, color in PARTS:
        ms_key = key.replace("_s", "_ms")
        widths = [r[ms_key] / r["wall_ms"] if shares else r[ms_key] for r in rows]
        ax.barh(labels, widths, left=left, color=color, label=name)
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("share of the step's wall time" if shares else "ms per step")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8, frameon=False)


def top_ops(out_dir: str | Path, n: int = 8, rank: int = 0) -> list[dict]:
    """The ``n`` operators with the most self CPU time on ``rank`` (name, calls, self_s, share)."""
    ranks = {r["rank"]: r for r in load_summary(out_dir)["ranks"]}
    return ranks[rank]["top_ops"]["cpu"][:n]


def main_thread_tail(stack_text: str, frames: int = 3) -> str:
    """The innermost ``frames`` frames (file line + source line) of the main thread in a watchdog
    stack dump (``OUT/hang/rank{R}.txt``, its "formatted (oldest call first)" part); "" when the
    dump has no such thread."""
    lines = stack_text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Thread MainThread")), None)
    if start is None:
        return ""
    block = []
    for ln in lines[start + 1:]:
        if ln.startswith("Thread ") or ln.startswith("=="):
            break
        if ln.strip():
            block.append(ln)
    heads = [i for i, ln in enumerate(block) if ln.strip().startswith("File ")]
    return "\n".join(block[heads[-frames]:]) if len(heads) >= frames else "\n".join(block)
