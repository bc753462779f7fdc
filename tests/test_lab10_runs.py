"""Lab 10's rank functions (course_lib.labs.lab10_tensor_parallel), fast: one 2-rank launch.

The notebook executes everything at smoke size; this pins the two claims the lab builds on without
a kernel: every TP / SP block equals the dense one with the counted collectives, and the measured
saved-activation bytes per rank equal Korthikanti's accounting (TinyGPT settings) exactly, except
under SP by the kept all-gathered inputs, 2 (1 - 1/N) B T C x 4 bytes."""
import pytest

from course_lib.estimate import activation_bytes_per_layer, tp_comm_bytes_per_layer
from course_lib.measure import tinygpt_activation_kwargs
from course_lib.parallel import run_ranks
from course_lib.labs import lab10_tensor_parallel as lab_runs

pytestmark = pytest.mark.usefixtures("one_thread")
B, T, C, N = 2, 8, 16, 2


@pytest.fixture(scope="module")
def blocks():
    return run_ranks(lab_runs.megatron_blocks, N, ("gpt", "llama"), B, T, C, timeout=240, show_output=False)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_blocks_equal_dense_and_count_the_estimated_bytes(blocks, kind, sp):
    est = tp_comm_bytes_per_layer(seq_len=T, micro_batch=B, d_model=C, tp=N, bytes_per_element=4,
                                  sequence_parallel=sp)
    for rank in blocks:
        row = rank[(kind, sp, "block")]
        assert max(row["y_diff"], row["x_grad_diff"], row["grad_diff"]) < 1e-5, row
        assert row["bytes"] == est.bytes_per_rank
        assert row["fwd"] == row["bwd"] == {k: n // 2 for k, n in est.collectives.items()}


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_saved_bytes_per_rank_match_the_estimator(blocks, kind):
    kw = tinygpt_activation_kwargs(lab_runs.block_config(kind, T, C), seq_len=T, micro_batch=B)
    kept_gathered = 2 * 4 * B * T * C * (1 - 1 / N)
    for rank in blocks:
        assert rank[(kind, False, "saved")]["dense"] == activation_bytes_per_layer(**kw)
        assert rank[(kind, False, "saved")]["tp"] == activation_bytes_per_layer(**kw, tp=N)
        sp = rank[(kind, True, "saved")]["tp"]
        assert sp - activation_bytes_per_layer(**kw, tp=N, sequence_parallel=True) == kept_gathered


def test_describe_style_names_the_layouts():
    from course_lib.model import TinyGPT
    from course_lib.parallel.tensor_parallel import tinygpt_tp_plan

    plan = tinygpt_tp_plan(TinyGPT(lab_runs.lab_model_config("llama")), sequence_parallel=True)
    lines = {path: lab_runs.describe_style(style) for path, style in plan.items()}
    assert lines["blocks.*.attn.out_proj"] == "RowwiseParallel: input Shard(dim=-1), output Shard(dim=1)"
    assert lines["blocks.*.mlp"] == "PrepareModuleInput: input Shard(dim=1) -> Replicate()"
    assert lines["norm_f"].startswith("SequenceParallel: input and output Shard(dim=1)")
