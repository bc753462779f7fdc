"""A learner's first minutes, in a real browser: JupyterLab started the way ``./kit lab`` starts it,
driven by headless Chromium through playwright.

It opens on ``labs/`` with no "Jupyter news" pop-up and the ``course-kit`` kernel, runs lab 01 top
to bottom, moves the memory calculator's ZeRO-stage slider and sees the table change, then opens
exercise 01, sees the ``NotImplementedError`` of an untouched gap, types a wrong answer and reads
the check's message. Screenshots go to ``test-artifacts/browser/`` (or ``$COURSE_TEST_ARTIFACTS``).

Needs Debian's ``chromium`` (or ``COURSE_CHROMIUM=/path``) and the ``playwright`` package
(``./kit setup --browser`` installs both where it can); skipped with the reason otherwise.
Playwright's own browser download is never used.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("COURSE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(os.environ.get("COURSE_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "browser"
TOKEN = "course-kit-browser-test"
NEWS_DELAY_S = 3.0  # seconds after a page opens by which JupyterLab's news question would show

try:
    import playwright.sync_api as pw
except ImportError:  # pragma: no cover - depends on the machine
    pw = None

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on this machine (Debian: apt-get install chromium; "
                                                "or set COURSE_CHROMIUM); ./kit setup --browser"),
    pytest.mark.skipif(pw is None, reason="playwright is not installed (./kit setup --browser)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _installed_by_kit() -> bool:
    """True when this venv was set up by ./kit for this checkout (so `kit lab` will not reinstall)."""
    import hashlib

    stamp = Path(sys.prefix) / ".course-kit-installed"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (ROOT / "kit").read_bytes()).hexdigest()
    return stamp.is_file() and stamp.read_text().strip() == want


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory):
    """`kit lab` on a copy of the notebooks (running cells must never touch the committed ones)."""
    if not _installed_by_kit():
        pytest.skip("this environment was not set up by ./kit (its stamp does not match); run ./kit setup")
    work = tmp_path_factory.mktemp("kit-lab")
    for name in ("kit", "pyproject.toml"):
        shutil.copy2(ROOT / name, work / name)
    for folder in ("labs", "exercises"):
        shutil.copytree(ROOT / folder, work / folder, ignore=shutil.ignore_patterns("*.py", "configs"))
    shutil.copytree(ROOT / "labs" / "configs", work / "labs" / "configs")
    # Windowing off: every cell stays in the page, so the test can read all prompts. User-level
    # settings in a scratch folder; the kit's own overrides (no news, default kernel) still apply.
    user_settings = work / "user-settings" / "@jupyterlab" / "notebook-extension"
    user_settings.mkdir(parents=True)
    (user_settings / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    port = _free_port()
    env = {**os.environ, "COURSE_VENV": sys.prefix, "COURSE_SMOKE": "1",
           "JUPYTERLAB_SETTINGS_DIR": str(work / "user-settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(work / "workspaces"),
           "JUPYTER_RUNTIME_DIR": str(work / "runtime"), "JUPYTER_CONFIG_DIR": str(work / "config")}
    log = open(work / "jupyter.log", "w")
    proc = subprocess.Popen([str(work / "kit"), "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
                             f"--IdentityProvider.token={TOKEN}"],  # as root, kit adds --allow-root itself
                            cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={TOKEN}", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"`kit lab` did not start: {(work / 'jupyter.log').read_text()[-2000:]}")
            time.sleep(0.5)
    yield base, work
    os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
    log.close()


@pytest.fixture(scope="module")
def browser():
    with pw.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(60_000)
    yield pg
    context.close()


def _shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=False)


def _open_notebook(page, base: str, path: str) -> None:
    page.goto(f"{base}/lab/tree/{path}?reset&token={TOKEN}")  # reset: only this notebook, no restored tabs
    page.locator(".jp-Notebook .jp-Cell").first.wait_for()
    # the kernel is the course kit's, preselected from the notebook's metadata and the server default
    page.locator(".jp-NotebookPanel-toolbar:visible", has_text="Python (course kit)").first.wait_for()
    _wait_idle(page)


def _wait_idle(page, timeout_s: float = 300) -> None:
    """Wait until the kernel is idle and no cell shows the busy prompt [*]."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = [t for t in page.locator(".jp-InputPrompt").all_inner_texts() if "*" in t]
        status = page.locator(".jp-Notebook-ExecutionIndicator").first
        idle = status.count() == 0 or (status.get_attribute("data-status") or "idle") == "idle"
        if not busy and idle:
            return
        time.sleep(0.5)
    raise AssertionError("the kernel was still busy after %.0f s" % timeout_s)


def _run_all(page) -> None:
    page.locator(".jp-Notebook").first.click()
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Run All Cells")).first.click()
    time.sleep(1.0)  # let the first cells turn busy
    _wait_idle(page)


def _code_prompts(page) -> list[str]:
    return [t.strip() for t in page.locator(".jp-CodeCell .jp-InputPrompt").all_inner_texts()]


def test_lab_opens_on_labs_and_reaches_exercises(lab_server, page):
    base, _ = lab_server
    page.goto(f"{base}/?token={TOKEN}")  # the server root redirects to its default url
    assert "/lab/tree/labs" in page.url, f"`kit lab` should open on labs/, opened {page.url}"
    page.locator(".jp-DirListing-item", has_text="01_memory.ipynb").first.wait_for()
    breadcrumbs = page.locator(".jp-FileBrowser .jp-BreadCrumbs").first.inner_text()
    assert "labs" in breadcrumbs, f"the file browser should open on labs/, shows {breadcrumbs!r}"
    _shot(page, "01-start")
    # no "Jupyter news" question: checked in the next test, on a page open long enough for it to show
    # exercises/ and solutions/ live beside labs/ under the server root: reachable from the browser
    page.goto(f"{base}/lab/tree/exercises?token={TOKEN}")
    page.locator(".jp-DirListing-item", has_text="01_memory_budget.ipynb").first.wait_for()


def test_lab01_runs_without_news_popup_and_calculator_widgets_respond(lab_server, page):
    base, _ = lab_server
    opened = time.monotonic()
    _open_notebook(page, base, "labs/01_memory.ipynb")
    _run_all(page)
    # the news question, when enabled, appears a moment after start-up: by now the page has been
    # open for the whole run (at least NEWS_DELAY_S), so it would be showing
    time.sleep(max(0.0, NEWS_DELAY_S - (time.monotonic() - opened)))
    assert page.get_by_text(re.compile("notified about.*Jupyter news", re.I)).count() == 0, \
        "JupyterLab asks about Jupyter news: the kit's overrides.json is not applied"
    prompts = _code_prompts(page)
    assert prompts and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts), \
        f"every code cell should have run (a failing cell stops Run All): prompts {prompts}"
    assert page.locator(".jp-OutputArea-output", has_text="Traceback").count() == 0, "a cell raised"
    stage = page.locator(".widget-slider", has_text="ZeRO stage").first
    stage.scroll_into_view_if_needed()
    table = page.locator(".widget-html-content table").first
    before = table.inner_text()
    _shot(page, "02-calculator-before")
    handle = stage.locator(".noUi-handle").first
    handle.focus()
    for _ in range(3):  # ZeRO 0 -> 3: optimizer state, gradients and parameters sharded
        page.keyboard.press("ArrowRight")
    page.wait_for_function("([el, old]) => el.innerText !== old", arg=[table.element_handle(), before])
    after = table.inner_text()
    _shot(page, "03-calculator-after")
    assert stage.locator(".widget-readout").inner_text().strip() == "3"
    assert after != before, "moving the ZeRO-stage slider did not change the memory table"


def test_exercise_shows_gap_then_check_message(lab_server, page):
    base, _ = lab_server
    _open_notebook(page, base, "exercises/01_memory_budget.ipynb")
    _run_all(page)
    error = page.locator(".jp-OutputArea-output", has_text="NotImplementedError").first
    error.wait_for()
    _shot(page, "04-exercise-gap")
    # A learner's wrong first answer: Adam's two moments only (8 bytes), no fp32 master copy.
    gap = page.locator(".jp-CodeCell", has_text="def model_state_bytes").first
    gap.locator(".cm-content").click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text('def model_state_bytes(num_params):\n'
                              '    return {"params": 2 * num_params, "grads": 2 * num_params,'
                              ' "optimizer": 8 * num_params}\n')
    page.keyboard.press("Shift+Enter")  # runs it and moves to the check cell
    _wait_idle(page)
    page.keyboard.press("Shift+Enter")  # runs the check
    _wait_idle(page)
    message = page.locator(".jp-OutputArea-output", has_text="CheckFailed").first
    message.wait_for()
    text = message.inner_text()
    _shot(page, "05-exercise-check-message")
    assert "master copy" in text, f"the check should explain the missing fp32 master weights, said: {text[:500]}"
