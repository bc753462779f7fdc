"""train.precision = "fp8": the config's [fp8] section, a run in each backend next to bf16, and one
2-rank launch composing FP8 with DDP and FSDP2 (FP8 all-gather where torchao is installed)."""
import json
from pathlib import Path

import pytest
import torch

import rank_fns
from course_lib.parallel import run_ranks
from course_lib.precision import fp8_model
from course_lib.precision.fp8_linear import Fp8Linear
from course_lib.train import train
from course_lib.trainer import config as train_config

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "labs" / "configs" / "tiny-cpu.toml"
needs_torchao = pytest.mark.skipif(not fp8_model.torchao_available(), reason=f"needs {fp8_model.TORCHAO_PIN}")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def cfg(*sets):
    """tiny-cpu.toml, 12 steps, no progress bar, plus ``section.key=value`` overrides."""
    return train_config.load(TINY, ["train.progress=false", "train.max_steps=12", "schedule.warmup_steps=3",
                                    "checkpoint.async_save=false", *sets])


def losses(out):
    return [json.loads(line)["loss"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- the config
def test_fp8_config_accepts_the_recipes_and_refuses_what_cannot_run(monkeypatch):
    for recipe in ("tensorwise", "rowwise", "delayed", "blockwise", "mxfp8"):
        assert cfg("train.precision=fp8", f"fp8.recipe={recipe}", "fp8.backend=kit")["fp8"]["recipe"] == recipe
    assert cfg("train.precision=fp8")["fp8"]["keep"] == ["lm_head", "router"]
    # deepspeed runs FP8 at every ZeRO stage (tests/test_deepspeed_strategy.py)
    assert cfg("train.precision=fp8", "train.strategy=deepspeed", "parallel.zero_stage=3")["train"]["precision"] == "fp8"
    refusals = {
        # model-parallel layouts (pp, cp and tp with the kit run: tests/test_train_fp8_layouts.py)
        ("parallel.tp=2", "train.strategy=ddp", "fp8.backend=torchao"):
            r"torchao.*parallel.tp = 2.*Float8ColwiseParallel.*fp8.backend = 'kit'",
        ("parallel.tp=2", "train.strategy=fsdp", "fp8.backend=kit"): r"train.strategy = 'fsdp' and parallel.tp = 2",
        # an MoE model under tp (its router and shared experts read this rank's slice of the tokens) or pp
        ("model.preset=\"moe-tiny\"", "parallel.tp=2", "parallel.sequence_parallel=true", "train.strategy=ddp",
         "fp8.backend=kit"): r"model.moe_experts with parallel.tp = 2 does not run with train.precision = 'fp8'.*"
                             r"shared experts",
        ("model.preset=\"moe-tiny\"", "parallel.pp=2", "train.strategy=ddp", "fp8.backend=kit"):
            r"train.precision = 'fp8' \(not tried with the experts of a pipeline stage",
        ("parallel.pp=2", "train.strategy=ddp", "parallel.pp_schedule=\"interleaved\"", "parallel.virtual_stages=1",
         "fp8.backend=kit"): "pp_schedule = 'interleaved' is not built",
        ("parallel.pp=2", "train.strategy=ddp", "train.grad_accum=2", "fp8.recipe=delayed"):
            r"fp8.recipe = 'delayed' with parallel.pp = 2 and train.grad_accum = 2",
        ("parallel.cp=2", "train.strategy=ddp", "fp8.backend=torchao"):
            r"torchao.*parallel.cp = 2.*fp8.backend = 'kit'",
        ("parallel.cp=2", "train.strategy=fsdp", "fp8.backend=kit"): r"train.strategy = 'fsdp' and parallel.cp = 2",
        ("parallel.cp=2", "train.strategy=ddp", "fp8.recipe=mxfp8"): r"fp8.recipe = 'mxfp8' with parallel.cp = 2 needs "
                                                                    r"data.seq_len / \(2 x cp\) \(= 16 tokens",
        ("fp8.recipe=blockwise", "fp8.backend=torchao"): "kit's own",
        ("fp8.keep=\"lm_head\"",): "array of non-empty strings",
        ("fp8.fsdp_all_gather=true", "train.strategy=ddp"): "train.strategy = 'fsdp'",
    }
    for sets, words in refusals.items():
        with pytest.raises(train_config.ConfigError, match=words):
            cfg("train.precision=fp8", *sets)
    # ... and what composes: pp (kit or torchao, delayed with one micro-batch), cp and tp with the kit
    # (every recipe under tp: straddling tiles take the amax of both shards), and mxfp8 / blockwise
    # under cp where a zig-zag piece holds whole tiles
    for sets in (("parallel.tp=2", "fp8.recipe=blockwise", "fp8.backend=kit"),
                 ("parallel.tp=2", "parallel.sequence_parallel=true", "fp8.recipe=delayed", "fp8.backend=kit"),
                 ("parallel.pp=2", "fp8.recipe=rowwise"), ("parallel.pp=2", "fp8.recipe=delayed", "fp8.backend=kit"),
                 ("parallel.cp=2", "fp8.recipe=tensorwise", "fp8.backend=kit"),
                 ("parallel.cp=2", "fp8.recipe=mxfp8", "data.seq_len=128", "model.block_size=128")):
        assert cfg("train.precision=fp8", "train.strategy=ddp", *sets)["train"]["precision"] == "fp8"
    with pytest.raises(train_config.ConfigError, match="needs train.precision = 'fp8'"):
        cfg("fp8.fsdp_all_gather=true")
    # torchao asked for by name where it is not installed: the message names the package and its pin
    monkeypatch.setattr(fp8_model, "torchao_available", lambda: False)
    with pytest.raises(train_config.ConfigError, match=r"torchao package.*pip install torchao==0\.18\.0"):
        cfg("train.precision=fp8", "fp8.backend=torchao")
    assert fp8_model.resolve_backend("auto", "tensorwise") == "kit"  # auto falls back to the kit's own


# ----------------------------------------------------------------------------- one process
@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16")
    return train(cfg("train.precision=bf16", "train.peak_flops=1e11"), out), out


def _check_fp8_run(result, out, bf16_run, backend, layer_type):
    bf16, bf16_out = bf16_run
    report = json.loads((out / "fp8.json").read_text())
    assert report["backend"] == backend and report["emulated"] is True and report["kept"] == ["lm_head"]
    converted = [n for n, m in result.model.named_modules() if isinstance(m, layer_type)]
    assert sorted(converted) == sorted(report["converted"]) and len(converted) == 12  # 6 Linear per block
    assert type(result.model.lm_head) is torch.nn.Linear  # the head stays in high precision
    # FP8 trains the tiny model as bf16 does: every logged loss within 3% of the bf16 run's
    for ours, ref in zip(losses(out), losses(bf16_out), strict=True):
        assert abs(ours - ref) / ref < 0.03, (losses(out), losses(bf16_out))
    # same state-dict names as the bf16 run: checkpoints stay interchangeable
    assert sorted(result.model.state_dict()) == sorted(bf16.model.state_dict())


def test_fp8_kit_backend_trains_like_bf16_and_says_emulated(tmp_path, bf16_run, capsys):
    out = tmp_path / "fp8"
    result = train(cfg("train.precision=fp8", "fp8.recipe=blockwise", "train.peak_flops=1e11"), out)
    assert "emulated on CPU" in capsys.readouterr().out
    _check_fp8_run(result, out, bf16_run, "kit", Fp8Linear)


@needs_torchao
def test_fp8_torchao_backend_trains_like_bf16(tmp_path, bf16_run):
    from torchao.float8.float8_linear import Float8Linear

    out = tmp_path / "fp8"
    result = train(cfg("train.precision=fp8", "fp8.recipe=rowwise", "fp8.backend=torchao", "train.peak_flops=1e11"), out)
    _check_fp8_run(result, out, bf16_run, "torchao", Float8Linear)


# ----------------------------------------------------------------------------- two ranks
def test_fp8_composes_with_ddp_and_fsdp2_on_two_ranks(tmp_path, bf16_run):
    """One 2-rank launch: DDP and FSDP2 (with torchao's FP8 all-gather where torchao is installed),
    each training the global batch of 16 (8 per rank); both track one process's bf16 run on that
    batch as closely as one FP8 process does."""
    common = ("train.precision=fp8", "train.peak_flops=1e11", "train.micro_batch=8")
    runs = {"ddp": cfg(*common, "train.strategy=ddp", "fp8.backend=kit"),
            "fsdp": cfg(*common, "train.strategy=fsdp")}
    if fp8_model.torchao_available():
        runs["fsdp"] = cfg(*common, "train.strategy=fsdp", "fp8.backend=torchao", "fp8.fsdp_all_gather=true")
    calls = [(rank_fns.train_rank, (c, str(tmp_path / name))) for name, c in runs.items()]
    per_rank = run_ranks(rank_fns.several, 2, calls)
    bf16_losses = losses(bf16_run[1])
    for i, name in enumerate(runs):
        assert [r[i]["steps"] for r in per_rank] == [12, 12], name
        report = json.loads((tmp_path / name / "fp8.json").read_text())
        assert len(report["converted"]) == 12 and report["emulated"], (name, report)
        for ours, ref in zip(losses(tmp_path / name), bf16_losses, strict=True):
            assert abs(ours - ref) / ref < 0.03, (name, losses(tmp_path / name), bf16_losses)
    assert losses(tmp_path / "ddp")[-1] < losses(tmp_path / "ddp")[0] - 0.5  # it learns
