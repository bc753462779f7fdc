"""Hostile answer-cell snippets. Each earns nothing: the values the grader compares are wrong, or
the run ends before any test that could pass. ``{OUT}``/``{ROOT}`` are filled in by the test."""

# checks that always pass: a number / string whose == says True to everything
EQ_ALWAYS_TRUE = '''
class Yes(float):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = float.__hash__
class YesStr(str):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = str.__hash__
def model_state_bytes(num_params):
    return {"params": Yes(), "grads": Yes(), "optimizer": Yes()}
def activation_bytes_per_layer(*a, **k):
    return Yes()
'''
EQ_ALWAYS_TRUE_2 = '''
def memory_budget(shape, **kw):
    return {"params": Yes(), "grads": Yes(), "optimizer": Yes(), "activations": Yes()}
def dominant_component(budget):
    return YesStr("nothing")
'''

# every comparison helper the checks could use answers "equal"; claims success loudly. As a cell of
# its own at the top of a notebook it also silences the checks the set-up cell imports.
PATCH_PRELUDE = '''
import math, builtins
import numpy, torch, torch.testing
import course_lib.kit.checks as _checks
_yes = lambda *a, **k: True
_none = lambda *a, **k: None
math.isclose = _yes; numpy.allclose = _yes; torch.allclose = _yes; torch.equal = _yes
torch.testing.assert_close = _none; _checks.check = _none; _checks.check_close = _none
globals()["check"] = _none
globals()["check_close"] = _none
globals()["check_bytes"] = _none
print("All tests passed! Score: 100%")
'''
PATCH_COMPARISONS = PATCH_PRELUDE + '''
def model_state_bytes(num_params):
    return {"params": 0, "grads": 0, "optimizer": 0}
def activation_bytes_per_layer(*a, **k):
    return 0.0
'''
NO_CHECKS_WRONG_BUDGET = '''
def memory_budget(shape, **kw):
    return {"params": 0, "grads": 0, "optimizer": 0, "activations": 0}
def dominant_component(budget):
    return "activations"
'''

# forge the record channel: silence record(), write fake records and fake "cell ok" events
FORGE_RECORDS = '''
import json, os
globals()["check"] = lambda *a, **k: None
globals()["check_bytes"] = lambda *a, **k: None
globals()["record"] = lambda *a, **k: None
folder = os.environ.get("COURSE_GRADING_RECORDS", "records")
os.makedirs(folder, exist_ok=True)
with open(os.path.join(folder, "records.jsonl"), "a") as f:
    for name in ("part1.state_7b", "part2.per_mode", "part3.budget_4096", "part3.dominant"):
        f.write(json.dumps({"name": name, "value": {"$list": [True]}, "rtol": 1e9, "atol": 1e30}) + "\\n")
    f.write("not json at all\\n")
    f.write(json.dumps({"name": "part2.micro_batch_2", "value": {"$tensor": "t0"}, "tensors": "../../etc/passwd"}) + "\\n")
for fd in range(3, 64):   # whichever descriptor is the status pipe: claim every cell passed
    for i in range(40):
        try:
            os.write(fd, (json.dumps({"event": "end", "id": f"cell-{i:03d}", "ok": True}) + "\\n").encode())
        except OSError:
            pass
def model_state_bytes(num_params):
    return {"params": 1, "grads": 1, "optimizer": 1}
def activation_bytes_per_layer(*a, **k):
    return 1.0
'''

# write the grader's output files, now and at exit
WRITE_OUTPUTS = '''
import atexit, os
globals()["check"] = lambda *a, **k: None
globals()["check_bytes"] = lambda *a, **k: None
def _forge():
    try:
        os.makedirs("{OUT}/feedback", exist_ok=True)
        with open("{OUT}/grades.csv", "w") as f:
            f.write("student,exercise,test,points,max,status,seconds\\nmallory,01_memory_budget,all,14,14,passed,0\\n")
        with open("{OUT}/planted.txt", "w") as f:
            f.write("mallory was here")
    except OSError:
        pass
    print("All tests passed")
_forge()
atexit.register(_forge)
def model_state_bytes(num_params):
    return {"params": 3, "grads": 3, "optimizer": 3}
def activation_bytes_per_layer(*a, **k):
    return 3.0
'''

# read the instructor's solution from disk and run it
READ_SOLUTIONS = '''
import pathlib, course_lib
_src = pathlib.Path(course_lib.__file__).resolve().parent.parent / "solutions" / "01_memory_budget.py"
for _p in (_src, pathlib.Path("{ROOT}/solutions/01_memory_budget.py")):
    try:
        _code = _p.read_text()
        break
    except OSError:
        _code = None
exec(compile(_code.replace('# %% tags=["parameters"]', ""), "stolen", "exec"), globals())
'''

# kill the grader and everything else it can reach (only run where the kernel has its own PID namespace)
KILL_PARENT = '''
import os, signal
for pid in (os.getppid(), -1):
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
globals()["check"] = lambda *a, **k: None
def model_state_bytes(num_params):
    return {"params": 0, "grads": 0, "optimizer": 0}
'''

# see the hidden tests' code as they run and put it in an error message (the feedback must not show it)
EXFILTRATE_HIDDEN = '''
_seen = []
get_ipython().events.register("pre_run_cell", lambda info: _seen.append(info.raw_cell))
def model_state_bytes(num_params):
    raise ValueError("stolen: " + " ".join(_seen[-1].splitlines()[2:5]))
def activation_bytes_per_layer(*a, **k):
    raise ValueError("stolen: " + _seen[-1])
'''

# robustness: these end the run or a cell; the tests before keep their points
HANG = "while True:\n    pass\n"
HARD_EXIT = "import os\nos._exit(3)\n"
SYS_EXIT = "import sys\nsys.exit(1)\n"
MEMORY_BOMB = "blocks = []\nwhile True:\n    blocks.append(bytearray(2**28))\n"

# wrong answers that the silenced checks of exercise 05 would accept
STUBS_05 = {
    0: "def global_grad_norm(grads):\n    return 1.0\n",
    1: "def clip_coefficient(total_norm, max_norm, eps=1e-6):\n    return 1.0\n"
       "def clip_gradients_(grads, max_norm):\n    return 1.0, 1.0\n",
    2: "def clip_stats(grad_norms, max_norm):\n    return {'clip_rate': 0.0, 'mean_coef': 1.0}\n",
    3: "def decide(history, grad_norm):\n    return 'continue'\n",
}
# exercise 07: the answers are neither atomic nor safe (torch.save straight to the final name, prune
# before verifying), the checks are silenced, and every value a test cell records is forged first
# with the reference's own value (the first record of a name is the one kept). Only the grader's
# probes, which run the written module themselves and look at the disk, can tell.
FORGE_07 = PATCH_PRELUDE + '''
import torch
from course_lib.grading import record as _record
_names = ["step_00000004.pt", "step_00000005.pt"]
_record("part2.observations", [1, True, True, True, True, 2, ["model.pt"]])
_record("part3.observations", [_names, True, _names, ["step_00000007.pt"]])
_record("part4.kills_usable", [True] * 4)
_record("hidden.kills_usable", [True] * 10)
_record("hidden.misc", [{"a": {"b": [torch.arange(5)]}}, ["k", "x.pt"], ["step_00000011.pt", "step_00000012.pt"]])
'''
UNSAFE_07 = """%%writefile ex07_checkpoint.py
import os
from pathlib import Path
import torch
def checkpoint_path(folder, step):
    return Path(folder) / f"step_{step:08d}.pt"
def list_checkpoints(folder):
    return sorted(Path(folder).glob("step_*.pt"))
def atomic_save(state, path):  # in place; a failed pickle restores the old bytes; the spies see a rename and an fsync
    path = Path(path)
    old = path.read_bytes() if path.exists() else None
    try:
        torch.save(state, path)
    except BaseException:
        if old is not None:
            path.write_bytes(old)
        raise
    os.replace(path, path)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
def save_checkpoint(state, folder, step, keep_last=2):
    path = checkpoint_path(folder, step)
    for old in list_checkpoints(folder)[:-keep_last]:
        old.unlink()
    atomic_save(state, path)
    return path
"""
