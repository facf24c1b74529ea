"""The data scientists' notebook (docs/notebooks/quickstart.ipynb) runs, top to bottom, in a
Jupyter kernel of this interpreter on this checkout's code, so it cannot rot; and it is committed
without outputs, so its diffs stay code."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "docs" / "notebooks" / "quickstart.ipynb"
TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_first60.jsonl"
KERNEL_NAME = "kvprefetch-test"
CELL_TIMEOUT_SECONDS = 240
# What the probe cell, appended to the notebook here, prints: the kernel's interpreter and the
# checkout its `training` came from.
PROBE = "import sys, training\nprint(sys.executable)\nprint(training.__file__)"


def _kernelspec(jupyter_dir: Path) -> None:
    """A kernel of this interpreter (the venv's python), not whatever `python3` Jupyter finds."""
    spec = jupyter_dir / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": KERNEL_NAME, "language": "python"})
    )


def test_the_notebook_is_committed_without_outputs() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert len(code) >= 5
    for cell in code:
        assert cell.outputs == [], cell.source[:80]
        assert cell.execution_count is None, cell.source[:80]
    assert "widgets" not in notebook.metadata


@pytest.mark.slow  # a kernel process and a minute of replays: scheduled first under xdist
def test_the_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not TRACE.is_file():
        pytest.fail(f"the notebook reads {TRACE}, which is missing")
    _kernelspec(tmp_path / "jupyter")
    # The kernel finds the spec above first, imports this checkout (a worktree beside the
    # editable install) and writes its IPython profile under tmp_path, not the home directory.
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    pythonpath = [str(REPO), str(REPO / "client"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in pythonpath if p))

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(PROBE))
    client = NotebookClient(
        notebook,
        kernel_name=KERNEL_NAME,
        timeout=CELL_TIMEOUT_SECONDS,
        # As Jupyter opens it: from its own folder (the notebook finds the checkout's root).
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    )
    started = time.perf_counter()
    client.execute()  # a cell that raises (its own asserts included) fails here, naming it
    elapsed_seconds = time.perf_counter() - started
    print(f"\nthe notebook executed in {elapsed_seconds:.1f} s")

    def text(cell: nbformat.NotebookNode) -> str:
        return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")

    executable, training_file = text(notebook.cells[-1]).split()
    assert Path(executable) == Path(sys.executable)
    assert Path(training_file).is_relative_to(REPO)
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    # Two inline plots (importance, calibration) and the replay's table.
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == 2
    assert any("byte_hit_rate" in o.get("data", {}).get("text/html", "") for o in outputs)
    assert "the notebook ran in" in text(notebook.cells[-2])
