"""Plot helpers: draw on a given Axes, headless (no pyplot figure is created), right data drawn."""

import matplotlib

matplotlib.use("Agg")

import pytest
import torch
from matplotlib.figure import Figure

from course_lib.labs import plots
from course_lib.schedules import Schedule


def axes(n=1):
    fig = Figure()
    return fig.subplots(1, n) if n > 1 else fig.subplots()


def test_moving_average_is_trailing_and_keeps_length():
    assert plots.moving_average([1, 2, 3, 4], 2) == [1.0, 1.5, 2.5, 3.5]
    assert plots.moving_average([5, 1], 1) == [5.0, 1.0]
    assert plots.moving_average([], 3) == []
    with pytest.raises(ValueError, match="window"):
        plots.moving_average([1, 2], 0)


def test_plot_curves_draws_raw_and_smoothed_lines_and_references():
    ax = axes()
    out = plots.plot_curves(ax, {"a": [3, 2, 1], "b": ([0, 10, 20], [1, 1, 1])}, smooth=2, refs={"floor": 0.5})
    assert out is ax
    lines = ax.get_lines()
    assert len(lines) == 2 * 2 + 1  # raw + smoothed per series, one reference line
    assert list(lines[1].get_ydata()) == [3.0, 2.5, 1.5]
    assert list(lines[2].get_xdata()) == [0.0, 10.0, 20.0]
    assert "floor = 0.5" in [t.get_text() for t in ax.get_legend().get_texts()]
    with pytest.raises(ValueError, match="empty"):
        plots.plot_curves(axes(), {})
    with pytest.raises(ValueError, match="equal lengths"):
        plots.plot_curves(axes(), {"bad": ([0, 1], [1])})


def test_plot_schedules_samples_the_schedule_through_its_floor():
    s = Schedule(max_lr=1e-3, total_steps=20, warmup_steps=5, kind="linear", min_lr=1e-4)
    ax = axes()
    plots.plot_schedules(ax, {"linear": s, "list": [1e-3, 5e-4]}, markers=True)
    first, second = ax.get_lines()
    assert len(first.get_ydata()) == 21 and first.get_ydata()[-1] == pytest.approx(1e-4)
    assert list(first.get_ydata()[:5]) == pytest.approx([s(i) for i in range(5)])
    assert list(second.get_ydata()) == [1e-3, 5e-4]
    plots.plot_schedules(ax2 := axes(), {"short": s}, steps=7)
    assert len(ax2.get_lines()[0].get_ydata()) == 7


def test_plot_number_formats_spans_each_dtype_range():
    ax = axes()
    plots.plot_number_formats(ax)
    fp32, bf16, fp16 = ax.get_lines()
    assert fp16.get_xdata()[-1] == 65504.0 and fp16.get_xdata()[0] == 2.0**-24
    assert fp32.get_xdata()[0] == 2.0**-149 and bf16.get_xdata()[0] == 2.0**-133
    # in the normal range the relative gap is eps; below it, it grows to 1 at the smallest subnormal
    for line, eps, min_normal in ((fp32, 2.0**-23, 2.0**-126), (bf16, 2.0**-7, 2.0**-126), (fp16, 2.0**-10, 2.0**-14)):
        normal = [y for x, y in zip(line.get_xdata(), line.get_ydata()) if x >= min_normal]
        assert normal and all(y == eps for y in normal)
        assert line.get_ydata()[0] == 1.0


def test_plot_magnitude_histogram_skips_zeros_and_draws_lines():
    ax = axes()
    v = torch.tensor([1e-3, 1e-5, 0.0, -1e-7])
    plots.plot_magnitude_histogram(ax, {"g": v}, lines={"fp16 min normal": 6.1e-5}, bins=10)
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "g (1 exact zero not shown)" in texts and any("fp16 min normal" in t for t in texts)
    (patch,) = ax.patches
    assert ax.get_lines()[0].get_xdata()[0] == pytest.approx(torch.log10(torch.tensor(6.1e-5)).item())
    with pytest.raises(ValueError, match="empty"):
        plots.plot_magnitude_histogram(axes(), {})


def test_importing_plots_does_not_import_pyplot_figures():
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    plots.plot_curves(axes(), {"a": [1, 2]})
    assert plt.get_fignums() == before  # nothing opened a pyplot figure (headless-safe)
