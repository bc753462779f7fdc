"""Five published runs (course_lib/planner/published_runs.py) held against the planner: each layout
is expressible with --layout, fits the memory model, is modelled within 1.5x of the throughput the
paper published, and the planner's best is never modelled slower. Pure Python, ~1 s a run."""
from __future__ import annotations

import pytest

from course_lib.planner import make_spec, score_layout
from course_lib.planner.layout_score import parse_layout
from course_lib.planner.published_runs import RUNS, published_tokens_per_s


@pytest.mark.parametrize("key", sorted(RUNS))
def test_published_layout_fits_matches_throughput_and_is_not_beaten_silently(key):
    run = RUNS[key]
    spec = make_spec(**run.plan_kwargs())
    assert spec.global_batch == run.global_batch and spec.batch_note == ""  # the batch as published
    assert spec.gpu_peak_flops > run.tflops_per_gpu * 1e12                  # a sane published number
    score = score_layout(spec, run.layout)
    c, given = score.candidate, parse_layout(run.layout)
    for name in ("tp", "pp", "dp", "cp", "zero", "mb", "v"):  # the published fields are kept as given
        if name in given:
            attr = {"zero": "zero_stage", "mb": "micro_batch", "v": "virtual_stages"}.get(name, name)
            assert getattr(c.layout, attr) == given[name], name
    if isinstance(given.get("split"), tuple):
        assert c.layout.split == given["split"]
    assert c.fits, f"{run.name}: {c.memory_total / 2**30:.1f} GiB per GPU"
    ratio = published_tokens_per_s(run) / c.tokens_per_s
    assert 1 / 1.5 <= ratio <= 1.5, f"{run.name}: published / modelled tokens/s = {ratio:.2f}"
    assert score.best is not None and score.best_is_not_slower, \
        f"{run.name}: the search's best {score.best.layout.label()} is modelled slower than the published layout"


def test_published_throughput_conversion_matches_the_papers_own_numbers():
    # MT-NLG: 1920 x 2048 tokens per 60.1 s iteration on 280 nodes (Smith et al. 2022) = 126 TFLOP/s per GPU
    assert published_tokens_per_s(RUNS["mt-nlg-530b"]) == pytest.approx(1920 * 2048 / 60.1, rel=0.01)
    # Megatron GPT-3 175B: 300B tokens in 34 days on 1024 GPUs at 140 TFLOP/s (Narayanan et al. 2021, Sec. 5.1)
    days = 300e9 / published_tokens_per_s(RUNS["megatron-gpt3-175b"]) / 86400
    assert days == pytest.approx(34, rel=0.05)


def test_published_runs_doc_lists_every_run_with_its_source():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "published-runs.md").read_text()
    for run in RUNS.values():
        arxiv = run.source.split("arXiv ")[1].split(",")[0]
        assert arxiv in doc and run.layout in doc, run.name


@pytest.mark.parametrize("key", sorted(__import__("course_lib.planner.published_runs", fromlist=["MOE_RUNS"]).MOE_RUNS))
def test_published_moe_layout_fits_matches_throughput_and_is_not_beaten_silently(key):
    from course_lib.planner.published_runs import MOE_RUNS, published_moe_tokens_per_s

    run = MOE_RUNS[key]
    spec = make_spec(**run.plan_kwargs())
    assert spec.moe is not None and spec.global_batch == run.global_batch and spec.batch_note == ""
    score = score_layout(spec, run.layout)
    c, given = score.candidate, parse_layout(run.layout)
    for name in ("tp", "pp", "dp", "cp", "zero", "ep", "etp"):
        if name in given:
            assert getattr(c.layout, {"zero": "zero_stage"}.get(name, name)) == given[name], name
    assert c.fits, f"{run.name}: {c.memory_total / 2**30:.1f} GiB per GPU"
    ratio = published_moe_tokens_per_s(run) / c.tokens_per_s
    assert 1 / 1.5 <= ratio <= 1.5, f"{run.name}: published / modelled tokens/s = {ratio:.2f}"
    assert score.best is not None and score.best_is_not_slower, run.name


def test_deepseek_v3_row_is_the_papers_arithmetic():
    from course_lib.planner.published_runs import MOE_RUNS, published_moe_tokens_per_s

    ds = MOE_RUNS["deepseek-v3"]
    # Table 1: 180K H800-hours per trillion tokens x 14.8T = 2,664K pre-training hours; + 119K + 5K = 2.788M
    hours = ds.tokens / published_moe_tokens_per_s(ds) * ds.gpus / 3600
    assert hours == pytest.approx(2664e3) and hours + 119e3 + 5e3 == pytest.approx(2.788e6)
    # under two months on 2,048 GPUs (the paper: 3.7 days per trillion tokens)
    assert 1e12 / published_moe_tokens_per_s(ds) / 86400 == pytest.approx(3.66, abs=0.01)
    spec = make_spec(**ds.plan_kwargs())
    assert spec.gpu_peak_flops == 989.5e12 and spec.intra_node_bytes_per_s == 200e9   # H800: H100 math, less NVLink
    mx = MOE_RUNS["mixtral-8x22b-megatron"]
    from course_lib.estimate import moe_flops_per_token, moe_preset
    per_gpu = published_moe_tokens_per_s(mx) / mx.gpus * moe_flops_per_token(moe_preset("mixtral-8x22b"), seq_len=4096)
    assert per_gpu == pytest.approx(0.493 * 989.5e12)  # 49.3% of the dense bf16 peak, on active FLOPs
