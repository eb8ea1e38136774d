"""examples/quickstart.ipynb runs top to bottom on the CPU (as on Colab, minus the install)."""

from __future__ import annotations

import os
import pathlib

import nbclient
import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def _outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def test_quickstart_notebook_runs(monkeypatch):
    # The kernel is a subprocess: it imports this checkout's jpaged (cwd and PYTHONPATH).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    text = _outputs_text(nb)
    assert "auto tries 'xla' first: cpu backend" in text
    assert "max |paged - dense|" in text
    assert "no Hopper-class GPU here" in text
    for prompt, answer in (("123+456=", "579"), ("999+1=", "1000"), ("500+500=", "1000")):
        assert any(line.split()[:3] == [prompt, answer, "right"] for line in text.splitlines())
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the page pool and its use over the run
