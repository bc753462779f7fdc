"""Built notebooks open in JupyterLab unmodified (no unsaved-changes dot before anything runs).

Measured with JupyterLab 4.6 in a browser: opening a notebook whose ``language_info`` is only
``{"name": "python"}`` marks it modified as soon as the kernel connects, because JupyterLab stores the
kernel's whole ``language_info`` (saving then writes codemirror_mode, file_extension, mimetype,
nbconvert_exporter, pygments_lexer and the Python version; nothing else changed); a notebook that
already holds the kernel's ``language_info`` stayed clean, one with another Python patch version
got the dot. So the build writes exactly what the kit's kernel (ipykernel on this Python) sends.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from course_lib.kit import notebooks

ROOT = Path(__file__).resolve().parents[1]
SOURCE = '''# %% [markdown]
# # Lab 99

# %% tags=["parameters"]
SMOKE = False

# %%
print("hi")
'''


def _built(tmp_path: Path) -> dict:
    (tmp_path / "labs").mkdir()
    src = tmp_path / "labs" / "99_probe.py"
    src.write_text(SOURCE)
    [item] = notebooks.build_one(src, tmp_path)
    return json.loads(item.text)


def test_language_info_is_what_the_kernel_sends(tmp_path):
    from ipykernel.ipkernel import IPythonKernel

    nb = _built(tmp_path)
    assert nb["metadata"]["language_info"] == IPythonKernel.language_info
    assert (nb["nbformat"], nb["nbformat_minor"]) == (4, 5)
    assert all(re.fullmatch(r"cell-\d{3}", c["id"]) for c in nb["cells"])


def test_kernelspec_is_the_one_kit_installs(tmp_path):
    """JupyterLab also writes the kernelspec (name, display_name, language) of the kernel it
    started: the notebook must hold the name and display name ``./kit setup`` registers."""
    nb = _built(tmp_path)
    kit = (ROOT / "kit").read_text()
    name = re.search(r'^KERNEL_NAME="([^"]+)"', kit, re.M).group(1)
    display = re.search(r'--display-name "([^"]+)"', kit).group(1)
    assert nb["metadata"]["kernelspec"] == {"name": name, "display_name": display, "language": "python"}


def test_another_python_patch_release_is_not_stale(tmp_path):
    """Only ``language_info.version`` may differ between machines: such a file is not reported stale
    or rewritten; any other difference still is."""
    text = json.dumps(_built(tmp_path))
    nb = json.loads(text)
    nb["metadata"]["language_info"]["version"] = "3.10.0"
    assert notebooks.same_notebook(text, json.dumps(nb))
    nb["metadata"]["language_info"]["mimetype"] = "text/plain"
    assert not notebooks.same_notebook(text, json.dumps(nb))
    assert not notebooks.same_notebook(text, text.replace("hi", "ho"))
