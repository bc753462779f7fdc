"""Plot helpers the labs share: loss curves, learning-rate schedules, number formats, magnitudes.

Every helper draws on a matplotlib Axes you pass in and returns it; none calls `plt.show()` or
creates a window, so they run headless (tests, papermill, `MPLBACKEND=Agg`) and compose into any
subplot layout:

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    plot_curves(ax1, {"fp32": losses32, "bf16": losses16}, smooth=5, refs={"floor": 1.25})
    plot_schedules(ax2, {"cosine": sched})

Importing this module does not import torch (the torch-free estimators may plot too); the helpers
that need torch import it when called.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from course_lib.validate import check_int

# One colour per series, stable across plots: "fp32" is the same colour in every figure of a lab.
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
          "tab:gray", "tab:olive", "tab:cyan")


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start), same length as `values`.

    Trailing, not centred: the smoothed value at step s uses only steps <= s, so a smoothed curve
    never shows a drop before it happened."""
    check_int("window", window, 1)
    out, total = [], 0.0
    vals = [float(v) for v in values]
    for i, v in enumerate(vals):
        total += v
        if i >= window:
            total -= vals[i - window]
        out.append(total / min(i + 1, window))
    return out


def _xy(series) -> tuple[list[float], list[float]]:
    """A series is either y values (x = 0, 1, ...) or a pair (xs, ys) of equal length."""
    if isinstance(series, tuple) and len(series) == 2:
        xs, ys = list(series[0]), list(series[1])
        if len(xs) != len(ys):
            raise ValueError(f"a (xs, ys) series needs equal lengths, got {len(xs)} and {len(ys)}")
        return [float(x) for x in xs], [float(y) for y in ys]
    ys = [float(y) for y in series]
    return list(range(len(ys))), ys


def plot_curves(ax, curves: Mapping[str, object], *, smooth: int = 1, raw_alpha: float = 0.25,
                refs: Mapping[str, float] | None = None, xlabel: str = "step", ylabel: str = "loss",
                title: str | None = None, logy: bool = False, styles: Mapping[str, str] | None = None):
    """One line per named series (loss curves, scales, norms). A series is a list of y values or
    an (xs, ys) pair. With `smooth` > 1 the raw values are drawn faint and their trailing moving
    average on top. `refs` draws labelled horizontal reference lines (e.g. a loss floor).
    `styles` maps a series name to a matplotlib format string such as "--"."""
    if not curves:
        raise ValueError("curves is empty: nothing to plot")
    for i, (name, series) in enumerate(curves.items()):
        xs, ys = _xy(series)
        color = COLORS[i % len(COLORS)]
        fmt = (styles or {}).get(name, "-")
        if smooth > 1:
            ax.plot(xs, ys, fmt, color=color, alpha=raw_alpha, linewidth=0.8)
            ax.plot(xs, moving_average(ys, smooth), fmt, color=color, label=f"{name} (mean of {smooth})")
        else:
            ax.plot(xs, ys, fmt, color=color, label=name)
    for j, (name, value) in enumerate((refs or {}).items()):
        ax.axhline(value, color="black", linestyle=(":", "-.", "--")[j % 3], linewidth=1,
                   label=f"{name} = {value:.3g}")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_schedules(ax, schedules: Mapping[str, object], steps: int | None = None, *, markers: bool = False,
                   styles: Mapping[str, str] | None = None, title: str | None = None):
    """Learning rate against optimizer step for each named schedule.

    A value is a `course_lib.schedules.Schedule` (drawn for `steps` steps, default its
    total_steps + 1 so the floor at step T shows) or a list of lrs. `markers=True` draws one
    point per step (for zoomed views of warmup, where the indexing convention matters)."""
    if not schedules:
        raise ValueError("schedules is empty: nothing to plot")
    for i, (name, sched) in enumerate(schedules.items()):
        if callable(sched) and hasattr(sched, "total_steps"):
            n = sched.total_steps + 1 if steps is None else steps
            values = [sched(s) for s in range(n)]
        else:
            values = [float(v) for v in sched][: steps if steps is not None else None]
        fmt = (styles or {}).get(name, "-")
        ax.plot(range(len(values)), values, fmt, color=COLORS[i % len(COLORS)], label=name,
                marker="o" if markers else None, markersize=4)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_number_formats(ax, dtypes=None):
    """Range and precision of floating formats in one picture: for each dtype, the gap between
    neighbouring representable numbers relative to the magnitude (ulp(x) / x, taken at powers of
    two x = 2^k, where it is largest), from the smallest subnormal to the largest finite value.
    Width = range; height = imprecision (eps across the normal range); the rising left end is the
    subnormal range, where precision drains away until the gap equals the value itself."""
    import torch

    from course_lib.precision import dtype_ranges, ulp

    dtypes = (torch.float32, torch.bfloat16, torch.float16) if dtypes is None else dtypes
    for i, (dt, row) in enumerate(zip(dtypes, dtype_ranges(dtypes))):
        k_lo, k_hi = round(math.log2(row["min_subnormal"])), math.floor(math.log2(row["max"]))
        xs = [2.0**k for k in range(k_lo, k_hi + 1)]
        ys = [ulp(x, dt) / x for x in xs]
        xs.append(row["max"])  # max lies in the top binade: same gap as 2^k_hi
        ys.append(ys[-1])
        ax.loglog(xs, ys, color=COLORS[i % len(COLORS)],
                  label=f"{row['dtype']}: {row['min_subnormal']:.1e} .. {row['max']:.1e}, eps {row['eps']:.1e}")
    ax.set_xlabel("magnitude |x|")
    ax.set_ylabel("relative gap to the next number")
    ax.grid(alpha=0.3, which="major")
    ax.legend(fontsize=8)
    return ax


def plot_magnitude_histogram(ax, values: Mapping[str, object], *, lines: Mapping[str, float] | None = None,
                             bins: int = 80, title: str | None = None):
    """Histogram of log10 |v| for each named set of values (tensors or sequences; zeros are
    skipped and counted in the legend), with labelled vertical lines at magnitudes such as a
    format's smallest normal / subnormal number."""
    import torch

    if not values:
        raise ValueError("values is empty: nothing to plot")
    logs = {}
    for name, v in values.items():
        t = torch.as_tensor(v).detach().double().flatten()
        nonzero = t[(t != 0) & torch.isfinite(t)]
        logs[name] = (nonzero.abs().log10(), int(t.numel() - nonzero.numel()))
    lo = min(float(v.min()) for v, _ in logs.values() if v.numel())
    hi = max(float(v.max()) for v, _ in logs.values() if v.numel())
    edges = torch.linspace(math.floor(lo), math.ceil(hi), bins + 1).tolist()
    for i, (name, (lg, zeros)) in enumerate(logs.items()):
        label = name + (f" ({zeros} exact zero{'s' if zeros > 1 else ''} not shown)" if zeros else "")
        ax.hist(lg.tolist(), bins=edges, histtype="step", linewidth=1.5, color=COLORS[i % len(COLORS)], label=label)
    for j, (name, x) in enumerate((lines or {}).items()):
        ax.axvline(math.log10(x), color="black", linestyle=("--", ":", "-.")[j % 3], linewidth=1,
                   label=f"{name} = {x:.2g}")
    ax.set_xlabel("log10 |value|")
    ax.set_ylabel("count")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax
