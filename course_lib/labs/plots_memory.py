"""Memory plots for lab 01 and the memory calculator: stacked bars of bytes per rank.

Bars take **bytes** and convert to the unit on the axis ("GiB" = 2**30 bytes, "GB" = 1e9), so a
plot can never be ambiguous about its unit. The same component always has the same colour.
"""

from __future__ import annotations

from course_lib.estimate import format_bytes
from course_lib.estimate.units import BYTE_UNITS

#: Component -> colour (parameters, gradients, optimizer state, activations, anything else).
COLORS = {
    "params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52",
    "master weights": "#8172B3", "moments": "#55A868",
}
LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state (master + moments)",
          "activations": "activations"}


def stacked_memory_bars(ax, labels: list[str], parts: dict[str, list[float]], *, unit: str = "GiB",
                        title: str | None = None, limit_bytes: float | None = None,
                        limit_label: str | None = None, annotate: bool = True):
    """Draw one stacked bar per label on `ax`; `parts` maps component -> bytes per bar.

    `limit_bytes` draws a dashed line (a device's memory, say) labelled `limit_label`. `annotate`
    writes each bar's total above it. Returns `ax`.
    """
    if unit not in BYTE_UNITS:
        raise ValueError(f"unit must be one of {', '.join(BYTE_UNITS)}; got {unit!r}")
    for name, values in parts.items():
        if len(values) != len(labels):
            raise ValueError(f"parts[{name!r}] has {len(values)} values for {len(labels)} labels")
    scale = BYTE_UNITS[unit]
    xs = list(range(len(labels)))
    bottom = [0.0] * len(labels)
    for name, values in parts.items():
        heights = [v / scale for v in values]
        ax.bar(xs, heights, bottom=bottom, label=LABELS.get(name, name), color=COLORS.get(name),
               edgecolor="white", linewidth=0.5)
        bottom = [b + h for b, h in zip(bottom, heights)]
    if annotate:
        for x, top in zip(xs, bottom):
            ax.annotate(format_bytes(top * scale, unit, 1), (x, top), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
    if limit_bytes is not None:
        ax.axhline(limit_bytes / scale, color="black", linestyle="--", linewidth=1,
                   label=limit_label or f"{format_bytes(limit_bytes, unit, 0)}")
    ax.set_xticks(xs, labels)
    ax.set_ylabel(f"bytes per rank ({unit})")
    ax.set_ylim(0, max(bottom + [limit_bytes / scale if limit_bytes else 0]) * 1.15 or 1)
    if title:
        ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return ax
