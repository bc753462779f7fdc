"""Execute notebooks headless with papermill: the engine behind ``course labs run`` and the tests."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

# The notebook kernel is a child of this process. The inline backend is headless *and* puts
# figures into the notebook (Agg would drop them); the rest keep runs quiet.
_KERNEL_ENV = {"MPLBACKEND": "module://matplotlib_inline.backend_inline",
               "PYDEVD_DISABLE_FILE_VALIDATION": "1", "TQDM_MININTERVAL": "5"}


@dataclass
class RunResult:
    """Outcome of one notebook run: ``status`` is ``ok`` or ``failed``; ``seconds`` is wall time;
    ``error`` is ``"ExceptionName: message"`` of the failing cell; ``failed_cell_id`` its id."""

    notebook: Path
    output: Path
    status: str
    seconds: float
    error: str = ""
    error_name: str = ""
    failed_cell_id: str = ""


def execute(notebook: Path, output: Path, *, smoke: bool, timeout_s: float = 600.0,
            kernel_name: str = "python3", cwd: Path | None = None) -> RunResult:
    """Run ``notebook`` top to bottom with papermill, writing the executed copy to ``output``.

    ``smoke=True`` injects ``SMOKE = True`` after the parameters cell and sets ``COURSE_SMOKE=1``.
    ``timeout_s`` bounds each cell (seconds), so a deadlock fails instead of hanging CI.
    ``kernel_name="python3"`` means the interpreter running this code; the committed notebooks
    name the ``course-kit`` kernel for JupyterLab. Never raises for a failing notebook: the
    result says what failed; the executed copy shows where."""
    import papermill as pm

    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    notebook, output = Path(notebook), Path(output)
    if not notebook.exists():
        raise FileNotFoundError(f"notebook not found: {notebook}")
    output.parent.mkdir(parents=True, exist_ok=True)
    saved = {k: os.environ.get(k) for k in [*_KERNEL_ENV, "COURSE_SMOKE"]}
    os.environ.update(_KERNEL_ENV)
    if smoke:
        os.environ["COURSE_SMOKE"] = "1"
    t0 = time.perf_counter()
    try:
        pm.execute_notebook(str(notebook), str(output), parameters={"SMOKE": bool(smoke)},
                            kernel_name=kernel_name, cwd=str(cwd or notebook.parent),
                            execution_timeout=timeout_s, progress_bar=False,
                            request_save_on_cell_execute=False)
        return RunResult(notebook, output, "ok", time.perf_counter() - t0)
    except pm.PapermillExecutionError as exc:
        return RunResult(notebook, output, "failed", time.perf_counter() - t0,
                         error=f"{exc.ename}: {exc.evalue}", error_name=exc.ename,
                         failed_cell_id=_failed_cell_id(output, exc.exec_count))
    except Exception as exc:  # noqa: BLE001 - kernel death, timeout: report, don't crash the batch
        return RunResult(notebook, output, "failed", time.perf_counter() - t0,
                         error=f"{type(exc).__name__}: {exc}", error_name=type(exc).__name__)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _failed_cell_id(output: Path, exec_count) -> str:
    """The id of the cell that raised, read back from the executed copy."""
    import nbformat

    try:
        nb = nbformat.read(output, as_version=4)
    except Exception:  # noqa: BLE001
        return ""
    for cell in nb.cells:
        if cell.cell_type == "code" and any(o.get("output_type") == "error" for o in cell.outputs):
            return cell.get("id", "")
    return ""
