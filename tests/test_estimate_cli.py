"""`course estimate`: table with units, --json, errors, and wiring into a parent parser."""

import argparse
import json
import subprocess
import sys

import pytest

from course_lib.estimate import (
    ModelShape, activation_bytes_first_stage, bubble_fraction, model_state_bytes,
)
from course_lib.estimate.cli import add_arguments, main, run


def _json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_numbers_are_the_library_numbers(capsys):
    r = _json(capsys, ["--model", "llama2-7b", "--zero-stage", "3", "--dp", "8", "--seq", "2048",
                       "--recompute", "selective", "--attention", "flash", "--no-dropout"])
    shape = ModelShape.preset("llama2-7b")
    states = model_state_bytes(shape.num_params(), recipe="mixed-adam", zero_stage=3, dp=8)
    acts = activation_bytes_first_stage(
        n_layers=32, vocab_size=32000, seq_len=2048, micro_batch=1, d_model=4096, n_heads=32, d_ff=11008,
        mlp="swiglu", recompute="selective", attention="flash", dropout=False)
    b = r["per_rank_bytes"]
    assert b["params"] == states.params and b["optimizer"] == states.optimizer
    assert b["activations"] == pytest.approx(acts)
    assert b["total"] == pytest.approx(states.total + acts)
    assert r["model"]["num_params"] == 6_738_415_616
    assert r["assumptions"]["recipe"]["name"] == "mixed-adam" and "bytes" in r["units"]


def test_shape_flags_and_overrides(capsys):
    custom = _json(capsys, ["--n-layers", "2", "--d-model", "64", "--n-heads", "4", "--vocab-size", "256",
                            "--seq-len", "64", "--mlp", "swiglu", "--norm", "rmsnorm", "--no-bias",
                            "--untied-embeddings", "--no-pos-emb", "--n-kv-heads", "2"])
    expected = ModelShape(2, 64, 4, 256, 64, n_kv_heads=2, tied_embeddings=False, learned_pos_emb=False,
                          bias=False, mlp="swiglu", norm="rmsnorm")
    assert custom["model"]["num_params"] == expected.num_params()
    deeper = _json(capsys, ["--model", "gpt2-small", "--n-layers", "24"])
    assert deeper["model"]["num_params"] == ModelShape.preset("gpt2-small", n_layers=24).num_params()


def test_pipeline_layout(capsys):
    r = _json(capsys, ["--model", "gpt2-small", "--tp", "2", "--sp", "--pp", "4", "--micro-batches", "8",
                       "--virtual-stages", "3"])
    assert r["layout"]["schedule"] == "interleaved"
    assert r["bubble_fraction_of_ideal"] == bubble_fraction(4, 8, schedule="interleaved", virtual_stages=3)
    assert r["model"]["params_on_busiest_rank"] == ModelShape.preset("gpt2-small").params_on_busiest_rank(tp=2, pp=4)


def test_table_says_its_units(capsys):
    assert main(["--model", "gpt2-small", "--units", "GB", "--device", "a100-sxm4-80gb"]) == 0
    out = capsys.readouterr().out
    assert "GB = 10**9 bytes" in out and " GiB" not in out
    for label in ("parameters", "gradients", "optimizer", "activations", "total", "fits"):
        assert label in out
    assert main(["--model", "gpt2-small"]) == 0
    assert "GiB = 2**30 bytes" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--n-layers", "2", "--d-model", "64"], ["--n-heads", "--vocab-size", "--seq-len"]),
    (["--model", "gpt2-small", "--tp", "5"], ["tp (5)", "n_heads (12)"]),
    (["--model", "gpt2-small", "--zero-stage", "4"], ["zero_stage", "[0, 3]"]),
    (["--model", "gpt2-small", "--dp", "-2"], ["dp", ">= 1"]),
    (["--model", "llama2-7b", "--n-kv-heads", "3"], ["n_kv_heads (3)", "n_heads (32)"]),
])
def test_errors_exit_2_and_name_the_argument(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("course estimate: error:")
    for word in words:
        assert word in err


def test_unknown_recipe_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--model", "gpt2-small", "--recipe", "bf16-lion"])
    assert info.value.code == 2
    assert "--recipe" in capsys.readouterr().err


def test_wires_into_a_parent_cli(capsys):
    parser = argparse.ArgumentParser(prog="course")
    sub = parser.add_subparsers(dest="command", required=True)
    add_arguments(sub.add_parser("estimate"))
    args = parser.parse_args(["estimate", "--model", "gpt2-medium", "--json"])
    assert run(args) == 0
    assert json.loads(capsys.readouterr().out)["model"]["num_params"] == 354_823_168


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "course_lib.estimate.cli", "--model", "llama3-8b", "--units", "GB"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "8,030,261,248 parameters" in proc.stdout


def test_the_table_says_why_the_step_peak_differs_from_the_total(capsys):
    """32.52 GiB of step peak under a 32.87 GiB total read as an error; the table says what each is."""
    assert main(["--model", "llama2-7b", "--zero-stage", "3", "--dp", "8", "--recompute", "selective"]) == 0
    out = capsys.readouterr().out
    assert "total = the four rows above summed, as if all were live at once" in out
    assert "step peak = what is live at the start of backward" in out and "no gradients yet" in out
    assert main(["--model", "gpt2-small", "--pp", "2", "--micro-batches", "4"]) == 0
    assert "the gradients summed so far" in capsys.readouterr().out


def test_moe_model_rows_are_the_moe_estimators(capsys):
    from course_lib.estimate import (alltoall_bytes_per_layer, expected_tokens_off_rank, moe_flops_per_token,
                                     moe_model_state_bytes, moe_preset)

    r = _json(capsys, ["--moe-model", "mixtral-8x7b", "--tp", "2", "--ep", "4", "--etp", "1", "--dp", "4",
                       "--zero-stage", "1", "--seq", "4096", "--imbalance", "2"])
    mx = moe_preset("mixtral-8x7b", seq_len=4096)
    states = moe_model_state_bytes(mx, zero_stage=1, dp=4, tp=2, ep=4, etp=1)
    b = r["per_rank_bytes"]
    assert b["params"] == states.params and b["optimizer"] == states.optimizer and r["layout"]["edp"] == 2
    assert r["model"]["moe"]["active_params"] == mx.active_params() and r["model"]["num_params"] == mx.num_params()
    assert r["flops"]["per_token_moe"] == moe_flops_per_token(mx)
    a2a = alltoall_bytes_per_layer(tokens_off_rank=expected_tokens_off_rank(4096, 2, 4), d_model=4096, ep=4,
                                   n_experts=8)
    assert r["moe"]["alltoall"]["per_layer_bytes"] == a2a.total
    assert r["moe"]["spike"]["busiest_tokens"] > r["moe"]["spike"]["mean_tokens"]
    assert main(["--moe-model", "deepseek-v3", "--pp", "16", "--dp", "128", "--ep", "64", "--zero-stage", "1"]) == 0
    out = capsys.readouterr().out
    assert "37,552,282,624 active per token" in out and "expert-data-parallel=2" in out
    for argv, words in ((["--moe-model", "mixtral-8x7b", "--ep", "3", "--dp", "3"], "must divide n_experts"),
                        (["--model", "gpt2-small", "--ep", "2"], "--ep and --etp need --moe-model"),
                        (["--moe-model", "mixtral-8x7b", "--tp", "4", "--etp", "2", "--dp", "2"], "--etp must be 1 or --tp")):
        assert main(argv) == 2
        assert words in capsys.readouterr().err
