from fractions import Fraction

import pytest

from cost_models import UnitCostModel
from schedules import ScheduleError, build, lower, validate
from schedules.analysis import unit_summary
from schedules.timing import time_programs, unit_duration
from schedules.trace import step_metrics
from sim import simulate
from tests.helpers import admissible

PAPER = ["gpipe", "dapple", "interleaved", "chimera", "bitpipe"]


def sim_unit(name, D, N, **kw):
    low = lower(build(name, D, N, **kw))
    return step_metrics(simulate(low, UnitCostModel().bind(low)))


@pytest.mark.parametrize("name,expected", [("gpipe", Fraction(3, 7)), ("dapple", Fraction(3, 7)),
                                           ("interleaved", Fraction(3, 11)), ("chimera", Fraction(4, 16)),
                                           ("bitpipe", Fraction(2, 14))])
def test_bubble_closed_forms_d4_n4(name, expected):
    m = sim_unit(name, 4, 4)
    assert abs(m.bubble_ratio - float(expected)) < 1e-9
    for p in m.per_device:   # every device has the same busy time, so each has that bubble
        assert abs(p.bubble_ratio - float(expected)) < 1e-9


@pytest.mark.parametrize("D,N", [(2, 4), (4, 8), (8, 8), (8, 32), (3, 5)])
def test_gpipe_dapple_general_closed_form(D, N):
    for name in ("gpipe", "dapple"):
        m = sim_unit(name, D, N)
        assert m.iteration_time == pytest.approx(3 * (N + D - 1))
        assert m.bubble_ratio == pytest.approx((D - 1) / (N + D - 1), abs=1e-12)


@pytest.mark.parametrize("D,N,v", [(4, 8, 2), (4, 4, 3), (8, 16, 2), (2, 6, 4)])
def test_interleaved_closed_form(D, N, v):
    m = sim_unit("interleaved", D, N, chunks=v)
    assert m.bubble_ratio == pytest.approx((D - 1) / (v * N + D - 1), abs=1e-12)


@pytest.mark.parametrize("D", [4, 6, 8])
def test_chimera_closed_form(D):
    m = sim_unit("chimera", D, D)
    assert m.bubble_ratio == pytest.approx((D - 2) / (3 * D / 2 + D - 2), abs=1e-12)


@pytest.mark.parametrize("D", [2, 4, 6])
def test_bitpipe_closed_form(D):
    m = sim_unit("bitpipe", D, D)
    assert m.bubble_ratio == pytest.approx((D - 2) / (3 * D + D - 2), abs=1e-12)


def test_bitpipe_d8_released_meets_paper_greedy_does_not():
    """The released order meets the paper at D = 8 (3N + D - 2 = 30); the greedy variant's unit is
    0.5 F longer, its documented gap."""
    assert sim_unit("bitpipe", 8, 8).iteration_time == pytest.approx(30)
    assert sim_unit("bitpipe", 8, 8, variant="greedy").iteration_time == pytest.approx(30.5)


def test_peak_activation_memory_d4_n4():
    def peaks(name, D=4, N=4):
        return [p.peak_activation for p in sim_unit(name, D, N).per_device]
    assert peaks("gpipe") == [4, 4, 4, 4]
    assert peaks("gpipe", N=8) == [8] * 4
    assert peaks("dapple") == [4, 3, 2, 1]
    assert peaks("dapple", N=8) == [4, 3, 2, 1]
    for D in (4, 8):
        for p in peaks("bitpipe", D, D):
            assert (3 * D + 2) / 4 <= p <= D


def test_static_memory_counts_both_copies():
    for name, want in [("dapple", 1.0), ("chimera", 2.0), ("bitpipe", 2.0), ("interleaved", 1.0)]:
        low = lower(build(name, 4, 4))
        assert UnitCostModel().bind(low).static_mem == (want,) * 4, name


def test_bitpipe_beats_others_at_n_equals_d():
    ratios = {n: sim_unit(n, 8, 8).bubble_ratio for n in PAPER}
    assert min(ratios, key=ratios.get) == "bitpipe"


@pytest.mark.parametrize("name,D,N,msg", [
    ("bitpipe", 5, 10, "even number of devices; got 5"),
    ("chimera", 3, 6, "even number of devices"),
    ("bitpipe", 4, 6, "multiple of the number of devices"),
    ("interleaved", 4, 6, "multiple of the number of devices"),
    ("gpipe", 0, 4, "at least 1 device"),
    ("dapple", 2, 0, "at least 1 micro-batch"),
])
def test_requirements_fail_fast(name, D, N, msg):
    with pytest.raises(ScheduleError, match=msg):
        build(name, D, N)


def test_unknown_schedule():
    with pytest.raises(ScheduleError, match="unknown schedule 'nope'; choose one of"):
        build("nope", 2, 2)


@pytest.mark.parametrize("name", PAPER)
def test_every_admissible_config_validates_and_simulates(name):
    """Every config validates, and the simulator (unit costs, no network) reproduces the
    dependency timing of schedules.analysis exactly: the makespan and each device's busy time,
    for every replica."""
    count = 0
    for D in (2, 4, 6, 8, 16):
        for N, s in admissible(name, D):
            want = unit_summary(s)
            for R in (1, 2) if D <= 4 else (1,):
                low = lower(s, replicas=R)
                validate(low)
                if D <= 8 or N == D:
                    m = step_metrics(simulate(low, UnitCostModel().bind(low)))
                    assert m.iteration_time == pytest.approx(want["makespan"], abs=1e-9), (D, N, R)
                    assert [p.busy for p in m.per_device] == pytest.approx(want["busy"] * R, abs=1e-9)
                count += 1
    # every N in 1..4D for GPipe and 1F1B, the multiples of D for the others; two replica counts up to D = 4
    per_d = {D: (4 * D if name in ("gpipe", "dapple") else 4) * (2 if D <= 4 else 1) for D in (2, 4, 6, 8, 16)}
    assert count == sum(per_d.values())


def test_timing_matches_simulator_under_unit_costs():
    for name in PAPER:
        s = build(name, 4, 8)
        t = time_programs(s.programs, s.num_stages, unit_duration(4, s.num_stages, False))
        assert max(e for _, _, e in t.values()) == pytest.approx(sim_unit(name, 4, 8).iteration_time)


@pytest.mark.parametrize("D,N,v", [(2, 2, 2), (2, 8, 3), (4, 4, 2), (4, 8, 2), (4, 16, 3), (8, 8, 2), (8, 32, 4)])
def test_interleaved_activation_closed_form(D, N, v):
    """Device d keeps min(Nv, 2(D-1-d) + (v-1)D + 1) chunk-activations between F and B, 1/v Ma each
    (the module docstring); device 0 with N > D: D + (D-1)/v Ma."""
    from schedules.analysis import activation_peaks
    peaks = activation_peaks(build("interleaved", D, N, chunks=v))
    want = [Fraction(min(N * v, 2 * (D - 1 - d) + (v - 1) * D + 1), v) for d in range(D)]
    assert list(peaks["fb_chunks"]) == [w * v for w in want]
    assert list(peaks["fb_ma"]) == pytest.approx([float(w) for w in want])
    if N > D:
        assert peaks["fb_ma"][0] == pytest.approx(D + (D - 1) / v)
