"""The notebooks run top to bottom (small sizes): each code cell executed in order, one namespace."""
import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    nb = json.loads(path.read_text())
    ns = {"__name__": "__main__"}
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert cells
    for i, cell in enumerate(cells):
        src = "".join(cell["source"])
        exec(compile(src, f"{path.name}[cell {i}]", "exec"), ns)
    assert (tmp_path / "out" / "notebook_overlay.png").exists() or "crossval" not in path.name
