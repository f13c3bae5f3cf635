"""The notebooks run top to bottom (small sizes): each code cell executed in order, one namespace,
and each writes what it must.

A notebook's first code cell is tagged ``parameters`` (papermill's convention): the values the
test gives are set right after it. Here that is ``CALIBRATED``, the profile the tests calibrated
for the same model (tests/conftest.py), so that no notebook calibrates again; the calibration
itself is tested there (the cross-validation and model-file tests).
"""
import json
from pathlib import Path

import pytest

from cost_models import load_profile

pytestmark = pytest.mark.slow      # the notebooks calibrate (shared fixtures), train and compare

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
PNG = b"\x89PNG\r\n\x1a\n"


def _figure(path: Path) -> None:
    assert path.is_file() and path.read_bytes()[:8] == PNG and path.stat().st_size > 10_000, path


def _crossval(ns: dict, out: Path) -> None:
    """Every schedule compared, run for the profile given, and the overlay drawn."""
    assert [c.schedule for c in ns["comps"]] == ns["SCHEDULES"]
    assert all(c.devices == ns["D"] and len(c.measured_iteration_times) == ns["STEPS"] for c in ns["comps"])
    _figure(out / "notebook_overlay.png")


def _your_model(ns: dict, out: Path) -> None:
    """The plan file written and trained (the model's six layers split over the ranks), the
    comparison drawn."""
    plan = json.loads((out / "plan.json").read_text())
    assert plan and ns["cfg"].model == ns["MODEL"] and sum(ns["cfg"].blocks) == 6
    assert [c.schedule for c in ns["comps"]] == ["dapple", "zb-v"]
    _figure(out / "your_model_overlay.png")


# per notebook: (the fixture whose profile it is given, what it must leave behind)
NOTEBOOK = {"crossval.ipynb": ("tiny_sitting", _crossval), "your_model.ipynb": ("tied_lm_profile", _your_model)}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch, request):
    fixture, check = NOTEBOOK[path.name]         # a new notebook needs its entry: what must it produce?
    given = {"CALIBRATED": str(request.getfixturevalue(fixture)[-1])}
    monkeypatch.chdir(tmp_path)
    nb = json.loads(path.read_text())
    ns = {"__name__": "__main__"}
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert cells and "parameters" in cells[0].get("metadata", {}).get("tags", [])
    for i, cell in enumerate(cells):
        src = "".join(cell["source"])
        exec(compile(src, f"{path.name}[cell {i}]", "exec"), ns)
        if i == 0:
            assert set(given) <= set(ns), f"{path.name}'s parameters cell does not define {set(given) - set(ns)}"
            ns.update(given)
    assert ns["profile"] == load_profile(given["CALIBRATED"])     # the notebook used the profile given
    check(ns, tmp_path / "out")
