"""The memory calculator of lab 01: sliders in, bytes per rank out.

The logic is one pure function, `memory_per_rank`, built on `course_lib.estimate` (torch-free) and
tested without a browser; `MemoryCalculator` only wires ipywidgets to it:

    from course_lib.labs.widgets import MemoryCalculator
    MemoryCalculator()            # in a notebook: model, recipe, micro-batch, seq, ZeRO stage, dp, recompute

Everything is **per rank** (one GPU): model state sharded by ZeRO over `dp` data-parallel ranks
(the ZeRO paper), activations of one micro-batch (Korthikanti et al. 2022; no tensor or pipeline
parallelism here - `course estimate` has those).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field

from course_lib.estimate import (
    ACCELERATORS, PRESETS, RECIPES, ModelShape, first_stage_activation_breakdown, format_bytes,
    model_state_bytes, resolve_recipe,
)

RECOMPUTE = ("none", "selective", "full")
SEQ_CHOICES = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
DP_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
COMPONENTS = ("params", "grads", "optimizer", "activations")


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes **per rank** of each component (`parts`: params, grads, optimizer, activations)."""

    parts: dict
    settings: dict
    num_params: int
    device: str
    device_bytes: float
    unit: str = "bytes per rank"
    notes: list = field(default_factory=list)

    @property
    def total(self) -> float:
        """Sum of the parts, bytes per rank."""
        return float(sum(self.parts.values()))

    @property
    def fits(self) -> bool:
        """True when the total is at most the device's memory (before CUDA context, buffers, fragmentation)."""
        return self.total <= self.device_bytes

    @property
    def largest(self) -> str:
        """Name of the largest component."""
        return max(self.parts, key=self.parts.get)

    def rows(self, unit: str = "GiB") -> list[tuple[str, str, str]]:
        """(component, bytes in `unit`, share of total) rows, then the total and the device."""
        total = self.total
        out = [(name, format_bytes(v, unit), f"{v / total:.0%}") for name, v in self.parts.items()]
        out.append(("total", format_bytes(total, unit), "100%"))
        verdict = "fits" if self.fits else "does NOT fit"
        out.append((self.device, format_bytes(self.device_bytes, unit), verdict))
        return out

    def text(self, unit: str = "GiB") -> str:
        """The table as aligned text (what a test or a terminal sees)."""
        return "\n".join(f"{a:<26}{b:>14}  {c}" for a, b, c in self.rows(unit))

    def html(self, unit: str = "GiB") -> str:
        """The table as HTML, with the settings and notes underneath."""
        cells = "".join(
            f"<tr><td>{a}</td><td style='text-align:right'>{b}</td><td style='text-align:right'>{c}</td></tr>"
            for a, b, c in self.rows(unit))
        s = self.settings
        caption = (f"{s['model']} ({self.num_params / 1e9:.2f} B params), recipe {s['recipe']}, "
                   f"ZeRO-{s['zero_stage']} over dp={s['dp']}, micro-batch {s['micro_batch']} x seq "
                   f"{s['seq']}, recompute {s['recompute']}, {s['attention']} attention")
        notes = "".join(f"<li>{n}</li>" for n in self.notes)
        return (f"<b>Memory per rank ({unit} = {'2**30' if unit == 'GiB' else '10**9'} bytes)</b>"
                f"<table><tr><th>component</th><th>{unit}</th><th>share</th></tr>{cells}</table>"
                f"<small>{caption}<ul>{notes}</ul></small>")


def memory_per_rank(model: str = "llama2-7b", *, micro_batch: int = 1, seq: int | None = None,
                    zero_stage: int = 0, dp: int = 1, recompute: str = "none", recipe: str = "mixed-adam",
                    attention: str = "eager", dropout: bool = True,
                    device: str = "h100-sxm5-80gb") -> MemoryBudget:
    """Bytes per rank of parameters, gradients, optimizer state and activations.

    `model`: a preset of `estimate.PRESETS` (or a ModelShape); `seq` defaults to its context.
    Model state: `estimate.model_state_bytes(num_params, recipe, zero_stage, dp)` (ZeRO paper).
    Activations: one micro-batch through every layer plus the output layer
    (`estimate.first_stage_activation_breakdown`, pp = tp = 1), 2-byte activations for 2-byte
    recipes and 4 otherwise, Korthikanti's assumptions unless `attention="flash"` / `dropout=False`.
    Invalid values raise ValueError naming the argument. Returns MemoryBudget (bytes).
    """
    shape = model if isinstance(model, ModelShape) else ModelShape.preset(model)
    name = "custom shape" if isinstance(model, ModelShape) else model
    seq = shape.seq_len if seq is None else seq
    r = resolve_recipe(recipe)
    if device not in ACCELERATORS:
        raise ValueError(f"device must be one of {', '.join(ACCELERATORS)}; got {device!r}")
    states = model_state_bytes(shape.num_params(), recipe=r, zero_stage=zero_stage, dp=dp)
    e = 2 if r.param_bytes <= 2 else 4
    acts = first_stage_activation_breakdown(
        n_layers=shape.n_layers, vocab_size=shape.vocab_size, seq_len=seq, micro_batch=micro_batch,
        d_model=shape.d_model, n_heads=shape.n_heads, n_kv_heads=shape.kv_heads, mlp=shape.mlp,
        d_ff=shape.ffn_dim, recompute=recompute, attention=attention, dropout=dropout, bytes_per_element=e)
    parts = {"params": states.params, "grads": states.grads, "optimizer": states.optimizer,
             "activations": acts.total}
    dev = ACCELERATORS[device]
    notes = [f"optimizer = fp32 master weights {format_bytes(states.master_weights, 'GiB')} + moments "
             f"{format_bytes(states.optimizer_states, 'GiB')} ({r.name}: {r.param_bytes:g}+{r.grad_bytes:g}"
             f"+{r.master_bytes:g}+{r.optimizer_bytes:g} B/param)",
             f"activations: {format_bytes(acts.per_layer, 'MiB')} per layer x {shape.n_layers} layers + "
             f"output layer {format_bytes(acts.output, 'MiB')}, {e} B per element"]
    if seq > shape.seq_len:
        notes.append(f"seq {seq} is longer than the model's context {shape.seq_len}")
    settings = dict(model=name, micro_batch=micro_batch, seq=seq, zero_stage=zero_stage, dp=dp,
                    recompute=recompute, recipe=r.name, attention=attention, dropout=dropout)
    return MemoryBudget(parts, settings, shape.num_params(), dev.name, dev.memory_bytes, notes=notes)


def zero_stage_chart_png(budget_args: dict, *, unit: str = "GiB", width: float = 7.0, height: float = 3.4) -> bytes:
    """PNG of stacked bars for ZeRO stages 0-3 at `budget_args` (memory_per_rank's keywords);
    the chosen stage is marked. Rendered with Agg, off-screen, so it works headless."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from course_lib.labs.plots_memory import stacked_memory_bars

    budgets = [memory_per_rank(**{**budget_args, "zero_stage": z}) for z in range(4)]
    chosen = budget_args.get("zero_stage", 0)
    labels = [("> " if z == chosen else "") + f"ZeRO-{z}" for z in range(4)]
    parts = {c: [b.parts[c] for b in budgets] for c in COMPONENTS}
    fig = Figure(figsize=(width, height), dpi=90)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    stacked_memory_bars(ax, labels, parts, unit=unit, limit_bytes=budgets[0].device_bytes,
                        limit_label=budgets[0].device,
                        title=f"{budgets[0].settings['model']}, dp={budget_args.get('dp', 1)}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


class MemoryCalculator:
    """ipywidgets front end of `memory_per_rank`: `controls` (name -> widget), `table` (HTML),
    `chart` (PNG Image of all ZeRO stages), `widget` (the whole box). Display the object itself."""

    def __init__(self, *, model: str = "llama2-7b", unit: str = "GiB", **initial):
        import ipywidgets as w

        self.unit = unit
        start = dict(micro_batch=1, seq=4096, zero_stage=0, dp=8, recompute="none", recipe="mixed-adam",
                     attention="eager")
        unknown = sorted(set(initial) - set(start))
        if unknown:
            raise ValueError(f"unknown setting(s) {unknown}; choose from {sorted(start)}")
        start.update(initial)
        wide = {"description_width": "initial"}
        self.controls = {
            "model": w.Dropdown(options=sorted(PRESETS), value=model, description="model", style=wide),
            "recipe": w.Dropdown(options=sorted(RECIPES), value=start["recipe"], description="recipe", style=wide),
            "micro_batch": w.IntSlider(value=start["micro_batch"], min=1, max=64, description="micro-batch",
                                       style=wide),
            "seq": w.SelectionSlider(options=sorted({*SEQ_CHOICES, start["seq"]}), value=start["seq"],
                                     description="seq", style=wide),
            "zero_stage": w.IntSlider(value=start["zero_stage"], min=0, max=3, description="ZeRO stage",
                                      style=wide),
            "dp": w.SelectionSlider(options=sorted({*DP_CHOICES, start["dp"]}), value=start["dp"],
                                    description="dp", style=wide),
            "recompute": w.ToggleButtons(options=RECOMPUTE, value=start["recompute"], description="recompute"),
            "attention": w.ToggleButtons(options=("eager", "flash"), value=start["attention"],
                                         description="attention"),
        }
        self.table = w.HTML()
        self.chart = w.Image(format="png")
        self.error = w.HTML()
        for control in self.controls.values():
            control.observe(self._update, names="value")
        self.widget = w.VBox([w.HBox([w.VBox(list(self.controls.values())[:6]),
                                      w.VBox(list(self.controls.values())[6:])]),
                              self.error, w.HBox([self.table, self.chart])])
        self.budget: MemoryBudget | None = None
        self._update()

    def values(self) -> dict:
        """The current settings, as memory_per_rank keywords."""
        return {name: control.value for name, control in self.controls.items()}

    def _update(self, _change=None) -> None:
        try:
            self.budget = memory_per_rank(**self.values())
        except ValueError as exc:  # e.g. a shape the recipe cannot take: say so, keep the last table
            self.error.value = f"<span style='color:#b00'>{exc}</span>"
            return
        self.error.value = ""
        self.table.value = self.budget.html(self.unit)
        self.chart.value = zero_stage_chart_png(self.values(), unit=self.unit)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
