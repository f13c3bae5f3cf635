"""A calibration profile's process-group sizes (``tp``, ``ep``) and the fitted collective each needs
beyond 1 are checked by one pair of helpers (:func:`cost_models.profile._check_group_size`,
``_check_group_link``) for both groups, in the record and in the file; the lines are word for word
what the two copies said before."""
from __future__ import annotations

import dataclasses

import pytest

from cost_models import load_model, load_profile, save_profile
from cost_models._spec import SpecError
from cost_models.profile import CalibrationProfile, LayerTiming, LinkSpec

LINK = LinkSpec("calibrated-p2p", 1e9, 1e-5)


def _profile(model: str) -> CalibrationProfile:
    spec = load_model(model)
    return CalibrationProfile("toy", spec, (LayerTiming(1e-4, 1e-4, 1e-4),) * (spec.layers + 2), LINK, LINK)


@pytest.mark.parametrize("model,change,line", [
    ("tiny", dict(tp=0), "profile toy: field 'tp' must be an integer >= 1; got 0"),
    ("tiny", dict(tp=True), "profile toy: field 'tp' must be an integer >= 1; got True"),
    ("tiny", dict(tp=2), "profile toy: tp 2 needs field 'tp_allreduce' (the group's all-reduce); calibrate with "
                         "--tp 2"),
    ("tiny-mixtral", dict(ep=1.5), "profile toy: field 'ep' must be an integer >= 1; got 1.5"),
    ("tiny-mixtral", dict(ep=2), "profile toy: ep 2 needs field 'all_to_all' (the EP group's all-to-all); "
                                 "calibrate with --ep 2"),
])
def test_record_lines(model, change, line):
    with pytest.raises(SpecError) as e:
        dataclasses.replace(_profile(model), **change)
    assert str(e.value) == line


@pytest.mark.parametrize("extra,line", [
    ("tp: 0\n", "field 'tp' must be an integer >= 1; got 0"),
    ("tp: 2\n", "fields 'tp' > 1 and 'tp_allreduce' go together (calibrate --tp T writes both); got tp 2 without "
                "tp_allreduce"),
    ("tp_allreduce: {latency: 30 us, bandwidth: 1 GB/s}\n",
     "fields 'tp' > 1 and 'tp_allreduce' go together (calibrate --tp T writes both); got tp 1 with tp_allreduce"),
    ("ep: x\n", "field 'ep' must be an integer >= 1; got 'x'"),
    ("ep: 2\n", "fields 'ep' > 1 and 'all_to_all' go together (calibrate --ep E writes both); got ep 2 without "
                "all_to_all"),
    ("all_to_all: {latency: 1 ms, bandwidth: 1 GB/s}\n",
     "fields 'ep' > 1 and 'all_to_all' go together (calibrate --ep E writes both); got ep 1 with all_to_all"),
])
def test_file_lines(tmp_path, extra, line):
    path = save_profile(_profile("tiny-mixtral"), tmp_path / "p.yaml")
    path.write_text(path.read_text() + extra)
    with pytest.raises(SpecError) as e:
        load_profile(path)
    assert str(e.value) == f"{path}: {line}"
