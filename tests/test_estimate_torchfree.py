"""course_lib.estimate imports and works with torch (and every non-stdlib package) unavailable."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    # A None entry makes `import X` raise ImportError: torch, numpy and deepspeed are "absent".
    for name in ("torch", "numpy", "deepspeed", "hypothesis", "pytest"):
        sys.modules[name] = None
    import course_lib.estimate as E
    import course_lib.estimate.cli as cli
    assert E.ModelShape.preset("llama3-8b").num_params() == 8_030_261_248
    assert E.model_state_bytes(7.5e9, zero_stage=3, dp=64).total == 1.875e9
    assert cli.main(["--model", "gpt2-small", "--json"]) == 0
    loaded = sorted(m for m in sys.modules if m.split(".")[0] not in sys.stdlib_module_names
                    and sys.modules[m] is not None and not m.startswith(("course_lib", "_")))
    print("NON_STDLIB", loaded)
""")


def test_estimate_is_torch_free_and_stdlib_only():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "NON_STDLIB []" in proc.stdout, proc.stdout.splitlines()[-1]
