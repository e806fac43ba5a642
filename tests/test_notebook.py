"""notebooks/quickstart.ipynb runs green against the installed package (its Colab install cell,
tagged `install`, is left out: the package under test is already installed)."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_runs(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code"), "stored with outputs"
    nb.cells = [c for c in nb.cells if "install" not in c.metadata.get("tags", [])]
    # Raises CellExecutionError, naming the cell and its traceback, on any error.
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert any(o.get("output_type") == "display_data" for c in nb.cells for o in c.get("outputs", []))  # the plot
