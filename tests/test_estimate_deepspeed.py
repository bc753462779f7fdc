"""Our re-derivation of DeepSpeed's memory estimator against its published output and its code."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from course_lib.estimate import DeepSpeedEstimate, deepspeed_zero2_estimate, deepspeed_zero3_estimate

GIB = 2**30
T5_3B = 2_851_598_336  # t5-3b total parameters (tied embeddings counted once)
T5_3B_LARGEST = 32_128 * 1024  # its shared embedding: 32128 x 1024 ("32M largest layer params")


def _gib(x: int) -> str:
    # DeepSpeed prints f"{x/2**30:.2f}GB": its "GB" is GiB.
    return f"{x / GIB:.2f}"


# DeepSpeed docs, docs/code-docs/source/memory.rst and Hugging Face's DeepSpeed guide:
# estimate_zero3_model_states_mem_needs_all_live(t5-3b, num_gpus_per_node=8, num_nodes=1):
#   per CPU | per GPU | options (offload_param, offload_optimizer, zero_init)
ZERO3_T5_3B = [
    ("71.71", "0.12", True, True, True),
    ("127.48", "0.12", True, True, False),
    ("63.74", "0.79", False, True, True),
    ("127.48", "0.79", False, True, False),
    ("1.47", "6.10", False, False, True),
    ("127.48", "6.10", False, False, False),
]


@pytest.mark.parametrize("cpu, gpu, offload_param, offload_optimizer, zero_init", ZERO3_T5_3B)
def test_zero3_reproduces_published_t5_3b_table(cpu, gpu, offload_param, offload_optimizer, zero_init):
    est = deepspeed_zero3_estimate(T5_3B, T5_3B_LARGEST, num_gpus_per_node=8, offload_param=offload_param,
                                   offload_optimizer=offload_optimizer, zero_init=zero_init)
    assert (_gib(est.cpu_bytes_per_node), _gib(est.gpu_bytes_per_gpu)) == (cpu, gpu)


def test_zero2_reproduces_published_t5_3b_rows_and_shows_the_stale_one():
    # DeepSpeed docs (memory.rst), estimate_zero2_model_states_mem_needs_all_live(t5-3b, 8 GPUs):
    #   127.48GB | 5.31GB | offload_optimizer=cpu
    #   127.48GB | 15.93GB | offload_optimizer=none   <- printed by an older formula
    off = deepspeed_zero2_estimate(T5_3B, num_gpus_per_node=8, offload_optimizer=True)
    on = deepspeed_zero2_estimate(T5_3B, num_gpus_per_node=8, offload_optimizer=False)
    assert (_gib(off.cpu_bytes_per_node), _gib(off.gpu_bytes_per_gpu)) == ("127.48", "5.31")
    assert _gib(on.cpu_bytes_per_node) == "127.48"
    # Current stage_1_and_2.py: 2 + 18/n_gpus B/param -> 11.29; the docs' 15.93 is 4 + 16/n_gpus.
    assert _gib(on.gpu_bytes_per_gpu) == "11.29"
    assert _gib(4 * T5_3B + 16 * T5_3B / 8) == "15.93"


def test_result_is_a_named_tuple_in_bytes():
    est = deepspeed_zero2_estimate(1_000_000, num_gpus_per_node=2, num_nodes=2)
    assert isinstance(est, DeepSpeedEstimate)
    gpu, cpu = est  # the contract's order: (gpu_bytes_per_gpu, cpu_bytes_per_node)
    assert gpu == 2_000_000 + 18_000_000 // 4 and cpu == int(1_000_000 * 4 * 2 * 1.5)


def test_offload_and_zero_init_lower_gpu_or_cpu_memory():
    kw = dict(num_gpus_per_node=8, num_nodes=4)
    none = deepspeed_zero3_estimate(7e9, 4e8, **kw)
    opt = deepspeed_zero3_estimate(7e9, 4e8, offload_optimizer=True, **kw)
    both = deepspeed_zero3_estimate(7e9, 4e8, offload_optimizer=True, offload_param=True, **kw)
    assert both.gpu_bytes_per_gpu < opt.gpu_bytes_per_gpu < none.gpu_bytes_per_gpu
    cold = deepspeed_zero3_estimate(7e9, 4e8, zero_init=False, **kw)
    assert none.cpu_bytes_per_node < cold.cpu_bytes_per_node


@pytest.mark.parametrize("call, exc, words", [
    (lambda: deepspeed_zero3_estimate(1e9, 1e8, offload_param=True), ValueError,
     ["offload_param", "offload_optimizer"]),
    (lambda: deepspeed_zero3_estimate(1e9, 2e9), ValueError, ["largest_layer_params", "total_params"]),
    (lambda: deepspeed_zero2_estimate(-5), ValueError, ["total_params", ">= 0"]),
    (lambda: deepspeed_zero2_estimate(1e9, num_gpus_per_node=0), ValueError, ["num_gpus_per_node", ">= 1"]),
    (lambda: deepspeed_zero2_estimate(1e9, num_nodes=1.5), TypeError, ["num_nodes", "int"]),
    (lambda: deepspeed_zero2_estimate(1e9, additional_buffer_factor=0), ValueError,
     ["additional_buffer_factor", "> 0"]),
    (lambda: deepspeed_zero2_estimate(1e9, offload_optimizer="cpu"), TypeError, ["offload_optimizer", "bool"]),
])
def test_invalid_arguments_name_the_argument(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for word in words:
        assert word in str(info.value)


_GRID = [(p, g, n) for p in (1, 60_506_624, 7e9, 2_851_598_336, 405_853_388_800) for g in (1, 3, 8) for n in (1, 2, 5)]

_DS_SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as z2
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as z3
    out = []
    for p, g, n in json.loads(sys.argv[1]):
        largest = max(1, int(p) // 50)
        row = {"z2": [z2(p, g, n, off) for off in (True, False)], "z3": []}
        for off_opt, off_par in ((True, True), (True, False), (False, False)):
            for zi in (True, False):
                row["z3"].append(z3(p, largest, g, n, off_opt, off_par, zi))
        out.append(row)
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_agrees_with_installed_deepspeed_to_the_byte():
    # In a subprocess: DS_ACCELERATOR=cpu must be set before deepspeed is imported on a CPU-only
    # machine, and it must not leak into other tests that import deepspeed on a GPU.
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _DS_SCRIPT, json.dumps(_GRID)], env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        pytest.skip(f"deepspeed did not import: {proc.stderr.strip().splitlines()[-1:]}")
    results = json.loads(lines[-1][len("RESULT "):])
    assert len(results) == len(_GRID) and all(len(r["z3"]) == 6 for r in results)
    for (p, g, n), row in zip(_GRID, results):
        for off, (cpu, gpu) in zip((True, False), row["z2"]):
            assert deepspeed_zero2_estimate(p, num_gpus_per_node=g, num_nodes=n, offload_optimizer=off) == (gpu, cpu)
        largest = max(1, int(p) // 50)
        combos = [(o, q, z) for o, q in ((True, True), (True, False), (False, False)) for z in (True, False)]
        for (off_opt, off_par, zi), (cpu, gpu, _largest_mem) in zip(combos, row["z3"]):
            ours = deepspeed_zero3_estimate(p, largest, num_gpus_per_node=g, num_nodes=n, offload_param=off_par,
                                            offload_optimizer=off_opt, zero_init=zi)
            assert ours == (gpu, cpu), (p, g, n, off_opt, off_par, zi)
