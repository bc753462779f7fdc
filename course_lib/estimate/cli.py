"""`course estimate`: per-rank memory, FLOPs, communication and bubble for a model and a layout.

    course estimate --model llama2-7b --zero-stage 3 --dp 8 --micro-batch 1 --seq 4096
    course estimate --n-layers 12 --d-model 768 --n-heads 12 --vocab-size 50257 --seq-len 1024 --json
    course estimate --moe-model deepseek-v3 --pp 16 --dp 128 --ep 64 --zero-stage 1 --seq 4096
    python -m course_lib.estimate.cli --model gpt2-small --recompute selective --units GB

`add_arguments(parser)` and `run(args) -> int` plug into the `course` CLI; `main()` runs it alone.
Every number printed carries its unit; `--json` prints bytes (and FLOPs) as plain numbers, plus
the per-rank memory in the `--units` unit as ``per_rank_GiB`` (default) or ``per_rank_GB``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .activations import ATTENTION, NORM_SAVES, RECOMPUTE, first_stage_activation_breakdown
from .comm import comm_elements_per_step, tp_comm_bytes_per_layer
from .flops import flops_per_token, model_flops_per_iteration
from .hardware import ACCELERATORS, accelerator
from .activations import output_backward_transient_bytes
from .memory import (RECIPES, StepPeak, accumulated_grad_bytes, engine_accumulation, model_state_bytes, resolve_recipe,
                     training_step_peak_bytes)
from .moe import (MOE_PRESETS, alltoall_bytes_per_layer, expected_tokens_off_rank, moe_flops_per_token,
                  moe_model_state_bytes, moe_preset, routing_spike)
from .pipeline import bubble_fraction
from .shapes import MLPS, NORMS, PRESETS, ModelShape
from .units import format_bytes, format_si

_SHAPE_FLAGS = ("n_layers", "d_model", "n_heads", "vocab_size", "seq_len")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the `course estimate` options on `parser`."""
    m = parser.add_argument_group("model (a preset, or all of --n-layers/--d-model/--n-heads/--vocab-size/--seq-len)")
    m.add_argument("--model", choices=sorted(PRESETS), help="published model shape; shape flags override it")
    m.add_argument("--n-layers", type=int)
    m.add_argument("--d-model", type=int)
    m.add_argument("--n-heads", type=int)
    m.add_argument("--vocab-size", type=int)
    m.add_argument("--seq-len", type=int, help="model context length (sizes learned positions)")
    m.add_argument("--d-ff", type=int, help="MLP width (default 4*d_model for gelu, ~8/3*d_model for swiglu)")
    m.add_argument("--n-kv-heads", type=int, help="key/value heads (grouped-query attention)")
    m.add_argument("--mlp", choices=MLPS)
    m.add_argument("--norm", choices=NORMS)
    m.add_argument("--untied-embeddings", action="store_true", default=None, help="separate output matrix")
    m.add_argument("--no-pos-emb", action="store_true", default=None, help="no learned position table (RoPE)")
    m.add_argument("--no-bias", action="store_true", default=None, help="no biases in linears and norms")
    m.add_argument("--moe-model", choices=sorted(MOE_PRESETS),
                   help="a published mixture-of-experts shape (instead of --model): total vs active parameters, "
                        "expert-parallel memory and all-to-all bytes")

    e = parser.add_argument_group("experts (with --moe-model)")
    e.add_argument("--ep", type=int, default=1, help="expert-parallel degree (divides the experts)")
    e.add_argument("--etp", type=int, default=None, help="expert tensor-parallel degree (default: --tp; 1 or --tp)")
    e.add_argument("--imbalance", type=float, default=1.0,
                   help="busiest expert's tokens over the mean, for the activation spike (default 1: balanced)")

    t = parser.add_argument_group("training layout")
    t.add_argument("--recipe", default="mixed-adam", choices=sorted(RECIPES),
                   help="bytes per parameter (default mixed-adam: 2+2+4+8, the ZeRO paper)")
    t.add_argument("--zero-stage", type=int, default=0, help="ZeRO stage 0-3 (sharded over --dp)")
    t.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    t.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    t.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages")
    t.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    t.add_argument("--virtual-stages", type=int, default=1, help="model chunks per rank (interleaved 1F1B)")
    t.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    t.add_argument("--micro-batches", type=int, default=None,
                   help="micro-batches per step per pipeline (default: pp)")
    t.add_argument("--seq", type=int, default=None, help="training sequence length (default: the model's)")
    t.add_argument("--recompute", default="none", choices=RECOMPUTE)

    a = parser.add_argument_group("activation accounting (defaults: Korthikanti et al. 2022)")
    a.add_argument("--attention", default="eager", choices=ATTENTION, help="flash keeps no s x s scores")
    a.add_argument("--no-dropout", action="store_true", help="model without dropout (no masks)")
    a.add_argument("--activation-bytes", type=float, default=None,
                   help="bytes per activation element (default: the recipe's parameter bytes)")
    a.add_argument("--residual-bytes", type=float, default=None, help="bytes of the residual stream (4 under autocast)")
    a.add_argument("--norm-saves", default="input", choices=NORM_SAVES)
    a.add_argument("--kv-repeat", action="store_true", help="K/V repeated to every query head before attention")

    o = parser.add_argument_group("output")
    o.add_argument("--units", default="GiB", choices=("GB", "GiB"), help="GB = 1e9 bytes, GiB = 2**30 bytes")
    o.add_argument("--device", choices=sorted(ACCELERATORS), help="say whether the total fits its memory")
    o.add_argument("--json", action="store_true", help="machine-readable output (bytes, FLOPs; per-rank memory also in --units)")


def _shape(args) -> ModelShape:
    overrides = {k: getattr(args, k) for k in _SHAPE_FLAGS + ("d_ff", "n_kv_heads", "mlp", "norm")
                 if getattr(args, k) is not None}
    for flag, field in (("untied_embeddings", "tied_embeddings"), ("no_pos_emb", "learned_pos_emb"),
                        ("no_bias", "bias")):
        if getattr(args, flag):
            overrides[field] = False
    if args.model is not None:
        return ModelShape.preset(args.model, **overrides)
    missing = ["--" + k.replace("_", "-") for k in _SHAPE_FLAGS if getattr(args, k) is None]
    if missing:
        raise ValueError(f"give --model PRESET or all shape flags; missing: {' '.join(missing)}")
    return ModelShape(**overrides)


def _moe(args, out: dict, seq: int, m: int, e: float) -> None:
    """The MoE rows: parameters total vs active, model state with EP x expert-DP (replacing the
    dense rows), FLOPs on active parameters, all-to-all bytes and the routing spike."""
    moe = moe_preset(args.moe_model, seq_len=seq) if args.seq else moe_preset(args.moe_model)
    etp = args.tp if args.etp is None else args.etp
    if etp not in (1, args.tp):
        raise ValueError(f"--etp must be 1 or --tp ({args.tp}), got {etp}")
    blocks = None
    if moe.n_layers % args.pp:
        base, extra = divmod(moe.n_layers, args.pp)
        blocks = [base + (1 if i < extra else 0) for i in range(args.pp)]
    states = moe_model_state_bytes(moe, recipe=args.recipe, zero_stage=args.zero_stage, dp=args.dp, tp=args.tp,
                                   pp=args.pp, ep=args.ep, etp=etp, blocks=blocks)
    tokens = seq * args.micro_batch // (args.tp if args.sp else 1)
    off = expected_tokens_off_rank(tokens, moe.top_k, args.ep)
    a2a = alltoall_bytes_per_layer(tokens_off_rank=off, d_model=moe.d_model, ep=args.ep, n_experts=moe.n_experts,
                                   bytes_per_element=e, recompute=args.recompute)
    spike = routing_spike(moe, tokens=tokens, ep=args.ep, etp=etp, max_over_mean=args.imbalance, bytes_per_element=e)
    moe_layers_per_stage = -(-moe.n_moe_layers // args.pp)
    b = out["per_rank_bytes"]
    b.update(params=states.params, grads=states.grads, optimizer=states.optimizer,
             master_weights=states.dense.master_weights + states.experts.master_weights,
             optimizer_states=states.dense.optimizer_states + states.experts.optimizer_states)
    b["total"] = states.total + b["activations"]
    # the step peak as training_step_peak_bytes, both parts' live gradients under accumulation
    acc = engine_accumulation(args.zero_stage)
    live = (accumulated_grad_bytes(states.dense, acc) + accumulated_grad_bytes(states.experts, acc)) if m > 1 else 0.0
    peak = StepPeak(states.total - states.grads + live + b["activations"] + b["output_transient"], states.total)
    b.update(step_peak=peak.peak, step_peak_at=peak.where)
    strategy = out["comm"]["dp_strategy"]
    out["comm"]["dp_bytes_per_rank_per_step"] = (
        comm_elements_per_step(states.dense.num_params, strategy, world_size=args.dp).bytes_per_rank(2)
        + comm_elements_per_step(states.experts.num_params, strategy, world_size=states.edp).bytes_per_rank(2))
    out["model"]["moe"] = {"preset": args.moe_model, "num_params": moe.num_params(),
                           "active_params": moe.active_params(), "n_experts": moe.n_experts, "top_k": moe.top_k,
                           "expert_d_ff": moe.expert_d_ff, "n_moe_layers": moe.n_moe_layers}
    out["layout"].update(ep=args.ep, etp=etp, edp=states.edp)
    out["flops"]["per_token_moe"] = moe_flops_per_token(moe, seq_len=seq)
    out["moe"] = {
        "expert_params_per_rank": states.experts.num_params, "dense_params_per_rank": states.dense.num_params,
        "alltoall": {"tokens_per_micro_batch": tokens, "tokens_off_rank": off, "dispatch_bytes": a2a.dispatch,
                     "combine_bytes": a2a.combine, "counts_bytes": a2a.counts, "per_layer_bytes": a2a.total,
                     "bytes_per_rank_per_step": a2a.total * moe_layers_per_stage * m},
        "spike": {"imbalance": args.imbalance, "mean_tokens": spike.mean_tokens, "busiest_tokens": spike.busiest_tokens,
                  "mean_bytes": spike.mean_bytes, "busiest_bytes": spike.busiest_bytes}}


def estimate(args) -> dict:
    """All numbers for `args` as a JSON-ready dict (bytes, FLOPs); raises ValueError on bad input."""
    moe_model = getattr(args, "moe_model", None)
    if moe_model is not None and args.model is not None:
        raise ValueError("give --model or --moe-model, not both")
    if moe_model is None and (getattr(args, "ep", 1) != 1 or getattr(args, "etp", None) is not None):
        raise ValueError("--ep and --etp need --moe-model")
    shape = _shape(args) if moe_model is None else MOE_PRESETS[moe_model].active_equivalent()
    if moe_model is not None and shape.n_layers % args.pp:
        # activations of the busiest stage: stages of ceil(n_layers / pp) blocks (the first ones)
        shape = dataclasses.replace(shape, n_layers=-(-shape.n_layers // args.pp) * args.pp)
    recipe = resolve_recipe(args.recipe)
    seq = shape.seq_len if args.seq is None else args.seq
    m = args.pp if args.micro_batches is None else args.micro_batches
    e = args.activation_bytes if args.activation_bytes is not None else (2 if recipe.param_bytes <= 2 else 4)
    schedule = "interleaved" if args.virtual_stages > 1 else "1f1b"
    rank_params = shape.params_on_busiest_rank(tp=args.tp, pp=args.pp) if moe_model is None else 0
    states = model_state_bytes(rank_params, recipe=recipe, zero_stage=args.zero_stage, dp=args.dp)
    layer_kwargs = dict(
        seq_len=seq, micro_batch=args.micro_batch, d_model=shape.d_model, n_heads=shape.n_heads, tp=args.tp,
        sequence_parallel=args.sp, recompute=args.recompute, dropout=not args.no_dropout,
        attention=args.attention, mlp=shape.mlp, d_ff=shape.ffn_dim, n_kv_heads=shape.kv_heads,
        bytes_per_element=e, residual_bytes=args.residual_bytes, norm_saves=args.norm_saves,
        kv_repeat=args.kv_repeat)
    acts = first_stage_activation_breakdown(
        n_layers=shape.n_layers, pp=args.pp, virtual_stages=args.virtual_stages, schedule=schedule,
        micro_batches=m, vocab_size=shape.vocab_size, **layer_kwargs)
    strategy = "ddp" if args.zero_stage == 0 else f"zero{args.zero_stage}"
    dp_comm = comm_elements_per_step(rank_params, strategy, world_size=args.dp)
    tp_layer = tp_comm_bytes_per_layer(seq_len=seq, micro_batch=args.micro_batch, d_model=shape.d_model,
                                       tp=args.tp, bytes_per_element=e, sequence_parallel=args.sp,
                                       recompute=args.recompute)
    sequences = args.micro_batch * m * args.dp
    total = states.total + acts.total
    transient = output_backward_transient_bytes(seq_len=seq, micro_batch=args.micro_batch, vocab_size=shape.vocab_size,
                                                tp=args.tp, bytes_per_element=e)
    # the same rule as `course plan`: m micro-batches per step keep the gradient sum live from the second on
    peak = training_step_peak_bytes(states, acts.total, transient_bytes=transient, grad_accum=m,
                                    accumulation=engine_accumulation(args.zero_stage))
    out = {
        "units": "bytes (memory), FLOPs (work); per rank = the busiest rank (first pipeline stage)",
        "model": {**dataclasses.asdict(shape), "d_ff": shape.ffn_dim, "num_params": shape.num_params(),
                  "params_on_busiest_rank": rank_params, "preset": args.model},
        "layout": {"dp": args.dp, "tp": args.tp, "pp": args.pp, "sequence_parallel": args.sp,
                   "virtual_stages": args.virtual_stages, "schedule": schedule, "zero_stage": args.zero_stage,
                   "micro_batch": args.micro_batch, "micro_batches": m, "seq": seq,
                   "global_batch_sequences": sequences, "recompute": args.recompute},
        "assumptions": {"recipe": dataclasses.asdict(recipe), "activation_bytes_per_element": e,
                        "residual_bytes": args.residual_bytes or e, "attention": args.attention,
                        "dropout": not args.no_dropout, "norm_saves": args.norm_saves, "kv_repeat": args.kv_repeat},
        "per_rank_bytes": {"params": states.params, "grads": states.grads, "optimizer": states.optimizer,
                           "master_weights": states.master_weights, "optimizer_states": states.optimizer_states,
                           "activations": acts.total, "total": total, "output_transient": transient,
                           "step_peak": peak.peak, "step_peak_at": peak.where},
        "activations": {"per_layer_bytes": acts.per_layer, "layer_equivalents": acts.layer_equivalents,
                        "in_flight_micro_batches": acts.in_flight_micro_batches,
                        "embedding_bytes": acts.embedding, "output_layer_bytes": acts.output},
        "flops": {"per_token_6n": flops_per_token(shape), "per_token_palm": flops_per_token(shape, formula="palm"),
                  "model_flops_per_step": model_flops_per_iteration(shape, batch=sequences, seq_len=seq),
                  "hardware_flops_per_step": model_flops_per_iteration(
                      shape, batch=sequences, seq_len=seq, recompute=args.recompute)},
        "comm": {"dp_strategy": strategy, "dp_bytes_per_rank_per_step": dp_comm.bytes_per_rank(recipe.param_bytes),
                 "tp_bytes_per_rank_per_step": tp_layer.bytes_per_rank * (shape.n_layers // args.pp) * m},
        "bubble_fraction_of_ideal": bubble_fraction(args.pp, m, schedule=schedule, virtual_stages=args.virtual_stages),
    }
    if moe_model is not None:
        _moe(args, out, seq, m, e)
        total = out["per_rank_bytes"]["total"]
        out["model"]["preset"] = moe_model
        out["model"]["num_params"] = out["model"]["moe"]["num_params"]
        out["model"]["params_on_busiest_rank"] = out["moe"]["expert_params_per_rank"] + out["moe"]["dense_params_per_rank"]
    if args.device:
        dev = accelerator(args.device)
        out["device"] = {"name": dev.name, "memory_bytes": dev.memory_bytes, "fits": total <= dev.memory_bytes,
                         "source": dev.source}
    return out


def _peak_note(b: dict, micro_batches: int, unit: str) -> list[str]:
    """Why the step peak and the total differ: the total sums every part as if all were live at
    once; the step peak is what is live at its one moment (memory.training_step_peak_bytes)."""
    if b["step_peak_at"] == "backward start":
        grads = ("the gradients summed so far (micro-batches 2 and up)" if micro_batches > 1
                 else "no gradients yet (one micro-batch: they are created during backward)")
        when = (f"the start of backward: states with {grads}, all activations, and the output layer's "
                f"gradient ({format_bytes(b['output_transient'], unit)})")
    else:
        when = "the optimizer step: every model state, activations already freed"
    return ["  total = the four rows above summed, as if all were live at once;",
            f"  step peak = what is live at {when}. A device must hold the step peak."]


def _text(r: dict, unit: str) -> str:
    md, lay, asm, b = r["model"], r["layout"], r["assumptions"], r["per_rank_bytes"]
    rec = asm["recipe"]
    name = md["preset"] or "custom shape"
    rows = [("parameters", b["params"]), ("gradients", b["grads"]),
            ("optimizer (master + moments)", b["optimizer"]),
            ("activations (first stage, peak)", b["activations"]), ("total", b["total"]),
            (f"step peak (at {b['step_peak_at']})", b["step_peak"])]
    width = max(len(format_bytes(v, unit)) for _, v in rows)
    lines = [
        f"course estimate - {name}: {md['num_params']:,} parameters,"
        f" {md['params_on_busiest_rank']:,.0f} on the busiest rank",
        f"  layout: dp={lay['dp']} tp={lay['tp']} pp={lay['pp']} sp={'on' if lay['sequence_parallel'] else 'off'}"
        f" schedule={lay['schedule']}, ZeRO-{lay['zero_stage']}, recipe {rec['name']}"
        f" ({rec['param_bytes']:g} params + {rec['grad_bytes']:g} grads + {rec['master_bytes']:g} master"
        f" + {rec['optimizer_bytes']:g} optimizer B/param)",
        f"  activations: micro-batch {lay['micro_batch']} x seq {lay['seq']},"
        f" micro-batches per step {lay['micro_batches']},"
        f" recompute={lay['recompute']}, attention={asm['attention']}, dropout={'on' if asm['dropout'] else 'off'},"
        f" {asm['activation_bytes_per_element']:g} B/element",
        "",
        f"  {'per rank':<34}{'':>{width - len(unit)}}{unit}",
    ]
    lines += [f"  {label:<34}{format_bytes(v, unit):>{width}}" for label, v in rows]
    lines += _peak_note(b, lay["micro_batches"], unit)
    fl, cm = r["flops"], r["comm"]
    lines += [
        "",
        f"  {unit} = {'2**30' if unit == 'GiB' else '10**9'} bytes; model states per the ZeRO paper, activations per"
        " Korthikanti et al. 2022 (Sec. 4, Table 2).",
        f"  FLOPs per token: 6N = {format_si(fl['per_token_6n'], 'FLOP')}, PaLM 6N+12LHQT ="
        f" {format_si(fl['per_token_palm'], 'FLOP')}; per step (model) {format_si(fl['model_flops_per_step'], 'FLOP')}",
        f"  traffic per rank per step: data parallel ({cm['dp_strategy']})"
        f" {format_bytes(cm['dp_bytes_per_rank_per_step'], unit)},"
        f" tensor parallel {format_bytes(cm['tp_bytes_per_rank_per_step'], unit)}",
        f"  pipeline bubble: {r['bubble_fraction_of_ideal']:.1%} of the ideal step time",
    ]
    if "moe" in r:
        mo, mm, a, sp = r["moe"], md["moe"], r["moe"]["alltoall"], r["moe"]["spike"]
        lines += [
            "",
            f"  experts: {mm['n_experts']} per MoE block ({mm['n_moe_layers']} blocks), top-{mm['top_k']}, width"
            f" {mm['expert_d_ff']}; parameters {mm['num_params']:,} total, {mm['active_params']:,} active per token",
            f"  layout: ep={lay['ep']} etp={lay['etp']} expert-data-parallel={lay['edp']}; per rank"
            f" {mo['expert_params_per_rank']:,.0f} expert + {mo['dense_params_per_rank']:,.0f} other parameters",
            f"  FLOPs per token (6 x active + attention): {format_si(fl['per_token_moe'], 'FLOP')}",
            f"  all-to-all per MoE block and micro-batch ({a['tokens_per_micro_batch']:,} tokens,"
            f" {a['tokens_off_rank']:,.0f} copies off-rank): dispatch {format_bytes(a['dispatch_bytes'], 'auto')},"
            f" combine {format_bytes(a['combine_bytes'], 'auto')}, counts {a['counts_bytes']:,.0f} B;"
            f" forward + backward {format_bytes(a['per_layer_bytes'], 'auto')};"
            f" per step {format_bytes(a['bytes_per_rank_per_step'], unit)}",
            f"  routing spike at {sp['imbalance']:g}x the mean expert load: the busiest rank's experts save"
            f" {format_bytes(sp['busiest_bytes'], 'auto')} per block vs {format_bytes(sp['mean_bytes'], 'auto')}"
            f" balanced ({sp['busiest_tokens'] / sp['mean_tokens']:.2f}x)",
        ]
    if "device" in r:
        d = r["device"]
        verdict = "fits" if d["fits"] else "does NOT fit"
        lines.append(f"  {d['name']}: {format_bytes(d['memory_bytes'], unit)} - the total {verdict}"
                     " (before CUDA context, buffers and fragmentation)")
    return "\n".join(lines)


def run(args) -> int:
    """Run `course estimate` with parsed `args`; print the table (or JSON); return the exit code."""
    try:
        result = estimate(args)
    except (ValueError, TypeError) as exc:
        print(f"course estimate: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        result = with_display_units(result, args.units)
    print(json.dumps(result, indent=2) if args.json else _text(result, args.units))
    return 0


def with_display_units(result: dict, unit: str) -> dict:
    """``result`` plus ``per_rank_<unit>``: the per-rank memory rows of ``per_rank_bytes`` in
    ``unit`` (GB = 1e9 bytes, GiB = 2**30 bytes, 3 decimals). The byte counts stay as they are:
    they are what a program should read; ``--units`` chooses the unit of this extra block."""
    div = 1e9 if unit == "GB" else 2**30
    converted = {k: round(v / div, 3) for k, v in result["per_rank_bytes"].items() if isinstance(v, (int, float))}
    return {**result, f"per_rank_{unit}": converted}


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m course_lib.estimate.cli ...``."""
    parser = argparse.ArgumentParser(prog="course estimate", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
