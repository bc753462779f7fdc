"""`./kit`'s JupyterLab settings take effect: the server's default kernel is course-kit.

The function ``jupyter_settings`` of ``kit`` runs against a scratch "venv" folder, then Jupyter
Server's own config loader reads that folder the way ``jupyter lab`` does. (A setting under
``jupyter_server_config.d/`` is not read for this: the server reported python3 as its default.)
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _kit_function(name: str) -> str:
    text = (ROOT / "kit").read_text()
    start = text.index(f"{name}() {{")
    return text[start:text.index("\n}\n\n", start) + 3]


def _server_default_kernel(config_dir: Path) -> str | None:
    code = ("from jupyter_server.serverapp import ServerApp\n"
            "app = ServerApp(); app.load_config_file()\n"
            "print(app.config.MappingKernelManager.get('default_kernel_name'))\n")
    env = {**os.environ, "JUPYTER_CONFIG_PATH": str(config_dir), "JUPYTER_CONFIG_DIR": str(config_dir / "user"),
           "JUPYTER_NO_CONFIG": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                         check=True)
    return out.stdout.strip()


def test_kit_makes_course_kit_the_servers_default_kernel(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    # an older set-up's file and someone's own server setting: the first goes, the second stays
    old = venv / "etc" / "jupyter" / "jupyter_server_config.d" / "course-kit.json"
    old.parent.mkdir(parents=True)
    old.write_text('{"MappingKernelManager": {"default_kernel_name": "course-kit"}}')
    (venv / "etc" / "jupyter" / "jupyter_server_config.json").write_text('{"ServerApp": {"port": 8899}}')
    script = _kit_function("jupyter_settings") + "\njupyter_settings\n"
    subprocess.run(["bash", "-euo", "pipefail", "-c", script], check=True, timeout=60,
                   env={**os.environ, "venv": str(venv), "KERNEL_NAME": "course-kit"})
    assert _server_default_kernel(venv / "etc" / "jupyter") == "course-kit"
    assert not old.exists()
    assert '"port": 8899' in (venv / "etc" / "jupyter" / "jupyter_server_config.json").read_text()
    assert (venv / "share" / "jupyter" / "lab" / "settings" / "overrides.json").is_file()


def test_kit_lab_allows_root():
    """In a container the learner is root; JupyterLab exits at once there unless allowed."""
    lab = (ROOT / "kit").read_text().split("\n  lab)\n", 1)[1].split(";;", 1)[0]
    assert 'if [ "$(id -u)" = 0 ]' in lab and "--ServerApp.allow_root=True" in lab


def test_the_file_browser_lists_notebooks_not_their_py_twins(tmp_path):
    """Every lab is a jupytext source ``labs/NN_topic.py`` beside its notebook; JupyterLab listed
    both, and a learner opened the source. The kit's server setting hides the sources from the
    listing (they still open by path); a learner's own module (``exercises/ring.py``) still shows."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    script = _kit_function("jupyter_settings") + "\njupyter_settings\n"
    subprocess.run(["bash", "-euo", "pipefail", "-c", script], check=True, timeout=60,
                   env={**os.environ, "venv": str(venv), "KERNEL_NAME": "course-kit"})
    served = tmp_path / "served"
    (served / "labs").mkdir(parents=True)
    for name in ("00_orientation.py", "00_orientation.ipynb", "ring.py"):
        (served / "labs" / name).write_text("{}" if name.endswith(".ipynb") else "x = 1\n")
    code = ("import json, sys\n"
            "from jupyter_server.serverapp import ServerApp\n"
            "from jupyter_server.services.contents.filemanager import FileContentsManager\n"
            "app = ServerApp(); app.load_config_file()\n"
            "cm = FileContentsManager(config=app.config, root_dir=sys.argv[1])\n"
            "listed = [c['name'] for c in cm.get('labs', content=True)['content']]\n"
            "print(json.dumps({'listed': sorted(listed), 'opens': cm.get('labs/00_orientation.py')['name']}))\n")
    config_dir = venv / "etc" / "jupyter"
    env = {**os.environ, "JUPYTER_CONFIG_PATH": str(config_dir), "JUPYTER_CONFIG_DIR": str(config_dir / "user"),
           "JUPYTER_NO_CONFIG": ""}
    out = subprocess.run([sys.executable, "-c", code, str(served)], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    import json

    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["listed"] == ["00_orientation.ipynb", "ring.py"], seen
    assert seen["opens"] == "00_orientation.py"
