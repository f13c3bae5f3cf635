"""Calibration and validation with tensor parallelism: the profile of a TP rank (its layers at 1/T
and the group's all-reduce), how the simulator prices it (collectives on F and B, a rank = a TP
group on T cores), and a short calibrate --tp / validate --tp sitting."""
from dataclasses import replace

import pytest

from cost_models import SpecError, load_profile, save_profile
from cost_models.profile import CalibrationProfile, LayerTiming
from cost_models.cluster import LinkSpec
from cost_models.comm import ring_allreduce_time
from cost_models.model_spec import load_model
from cost_models.transformer import block_params

SPEC = load_model("tiny")
OUT = SPEC.micro_batch * SPEC.seq_len * SPEC.hidden * 4.0       # bsh fp32: 16 KiB
STATS = 3 * SPEC.micro_batch * SPEC.seq_len * 4.0                 # the loss's three fp32 statistics per token
TP_AR = LinkSpec("calibrated-tp-allreduce", 0.5e9, 40e-6)


def _tp_profile(tp=2, cores=2, **kw) -> CalibrationProfile:
    """A tiny profile whose layers are a TP rank's, no runtime overheads, free point-to-point."""
    layers = (LayerTiming(1e-4, 0.0, 1.5e-4, 1.5e-4),) + (LayerTiming(4e-4, 3.5e-4, 4.5e-4, 6e-4),) * SPEC.layers \
        + (LayerTiming(2e-4, 1.5e-4, 1.5e-4, 2.5e-4),)
    return CalibrationProfile("toy-tp", SPEC, layers, LinkSpec("calibrated-p2p", 1e15, 0.0),
                              LinkSpec("calibrated-allreduce", 1e9, 3e-4),
                              cores=cores, tp=tp, tp_allreduce=TP_AR if tp > 1 else None, **kw)


def test_tp_profile_prices_each_layers_collectives_on_the_groups_allreduce(tmp_path):
    prof = _tp_profile()
    ring = lambda n: ring_allreduce_time(n, 2, TP_AR.bandwidth, TP_AR.latency)   # noqa: E731
    c = prof.layer_costs()
    # embedding: its output all-reduced in F; a block: two all-reduces in F, two in B (the input
    # gradients of the column-parallel layers); the head: the loss's statistics in F, its input
    # gradient in B
    assert c.f[0] == pytest.approx(1e-4 + ring(OUT), rel=1e-12) and c.b_input[0] == pytest.approx(0.0)
    assert c.f[1] == pytest.approx(4e-4 + 2 * ring(OUT), rel=1e-12)
    assert c.b_input[1] == pytest.approx(3.5e-4 + 2 * ring(OUT), rel=1e-12)
    assert c.b_full[1] == pytest.approx(6e-4 + 2 * ring(OUT), rel=1e-12) and c.w[1] == 4.5e-4
    assert c.f[-1] == pytest.approx(2e-4 + 3 * ring(STATS), rel=1e-12)
    assert c.b_input[-1] == pytest.approx(1.5e-4 + ring(OUT), rel=1e-12)
    # a TP rank's parameters: its shards, (12h^2 + 7h) / 2 of the split matrices and biases, the
    # row-parallel biases (2h) and the norms (4h) whole
    assert c.params[1] == block_params(SPEC, 2) == (12 * 64 ** 2 + 7 * 64) // 2 + 2 * 64 + 4 * 64
    # a rank is a group of T processes: 2 cores hold one
    assert prof.host_cores()["cores"] == 1 and _tp_profile(cores=4).host_cores()["cores"] == 2
    back = load_profile(save_profile(prof, tmp_path / "tp.yaml"))
    assert back == prof and back.tp == 2 and back.tp_allreduce == TP_AR
    # a profile of T = 1 (no 'tp' field) prices no collectives and keeps its cores
    one = _tp_profile(tp=1)
    assert "tp" not in one.to_dict() and "tp_allreduce" not in one.to_dict()
    assert one.collective_times() == [(0.0, 0.0)] * (SPEC.layers + 2) and one.host_cores()["cores"] == 2
    assert load_profile(save_profile(one, tmp_path / "one.yaml")).tp == 1


def test_a_simulated_rank_is_a_tp_group_on_t_cores():
    """GPipe at D = 2, N = 4 with T = 2 on 2 cores: the two groups share one group's worth of
    cores, the core never idles (a rank always has a micro-batch to work on), so the step is all
    the work, N x (F + B) of every layer with its collectives. At T = 1 the same layers run on a
    core each: the step is shorter by the overlap."""
    from calibration import simulate_with_profile
    from executor.config import RunConfig, lowered_schedule
    from schedules.trace import step_metrics
    low = lowered_schedule(RunConfig.of(schedule="gpipe", devices=2, microbatches=4, steps=1, model="tiny", tp=2))
    prof = _tp_profile(time_slice=1e-3)
    c = prof.layer_costs()
    work = 4 * sum(f + b for f, b in zip(c.f, c.b_full))
    step = step_metrics(simulate_with_profile(low, prof, steps=1)).iteration_times[0]
    assert step == pytest.approx(work, rel=1e-9)
    alone = replace(prof, tp=1, tp_allreduce=None)
    c1 = alone.layer_costs()
    t1 = step_metrics(simulate_with_profile(low, alone, steps=1)).iteration_times[0]
    assert t1 < 0.75 * 4 * sum(f + b for f, b in zip(c1.f, c1.b_full))


def test_tp_profile_refusals():
    with pytest.raises(SpecError, match="tp 2 needs field 'tp_allreduce'"):
        CalibrationProfile("x", SPEC, _tp_profile().layers, TP_AR, TP_AR, tp=2)
    with pytest.raises(SpecError, match="tp 3 does not divide heads"):
        _tp_profile(tp=3)
    with pytest.raises(SpecError, match="'tp' must be an integer >= 1"):
        _tp_profile(tp=0)


def test_validate_refuses_a_tp_profile_at_another_tp():
    from cost_models.bind import check_profile_tp
    check_profile_tp(_tp_profile(), 2)
    with pytest.raises(ValueError, match=r"measured at --tp 2, not --tp 1; calibrate with --tp 1"):
        check_profile_tp(_tp_profile(), 1)


@pytest.fixture(scope="module")
def tp_sitting(tmp_path_factory):
    """The tiny GPT at T = 2 x D = 2 calibrated and validated in one short sitting (4 processes
    on this host's cores; GPipe a prediction, DAPPLE among the runs fitted on), its profile saved."""
    from calibration import SittingRules, calibrate_and_compare
    from cost_models.job import Job
    jobs = [Job.of(schedule=s, devices=2, microbatches=4, tp=2) for s in ("gpipe", "dapple")]
    # short runs on a shared host: the figures are what is checked, not whether the host was quiet
    rules = SittingRules(runs=1, max_runs=1, warmup=1, max_foreign=100.0, max_spread=10.0)
    prof, comps = calibrate_and_compare(jobs, steps=7, repeats=3, rules=rules)
    path = save_profile(prof, tmp_path_factory.mktemp("tp") / "calibration.yaml")
    return prof, load_profile(path), comps


@pytest.mark.slow
def test_calibrated_tp_profile_round_trips(tp_sitting):
    from calibration.measure import TP_SIZES
    measured, prof, _ = tp_sitting
    assert prof == measured and prof.tp == 2 and prof.name.endswith("-tiny-tp2")
    assert prof.tp_allreduce.latency > 0 and prof.tp_allreduce.bandwidth > 0
    assert [s for s, _ in prof.meta["tp_allreduce_samples"]] == list(TP_SIZES)
    assert prof.meta["runtime_fit_ranks"] == 2 and set(prof.meta["sitting"]) == {"2"}


@pytest.mark.slow
def test_short_validate_at_tp2_memory_exact_and_ops_in_program_order(tp_sitting):
    """Peak activation bytes of each TP rank 0 equal the simulator's from the measured shards and
    each rank ran its program's op order. (How close the predicted step time comes to the measured
    one is what ``pipetwin validate`` reports on a quiet host; a shared host moves the measured side,
    so no test bounds it.)"""
    _, prof, comps = tp_sitting
    g, d = comps
    assert (g.schedule, g.fitted, d.schedule, d.fitted) == ("gpipe", False, "dapple", True)
    for c in comps:
        assert c.order_identical, c.schedule
        assert c.measured_peak_activation_bytes == c.simulated_peak_activation_bytes, c.schedule


@pytest.mark.slow
def test_the_tp_model_is_what_makes_the_prediction(tp_sitting):
    """Each comparison's simulated step is the saved profile's simulation of that run (the
    noise-free step after the warm-up); the same runs simulated without the collectives and with a
    core per process (the profile read as one of T = 1) come out more than a third shorter: the TP
    model (a rank is a group of T processes on T cores, its layers' all-reduces on the group's
    ring) is what the prediction rests on. Both sides simulated: no host timing is compared."""
    from calibration import simulate_with_profile
    from executor.config import RunConfig, lowered_schedule
    from schedules.trace import noise_free, step_metrics
    _, prof, comps = tp_sitting
    bare = replace(prof, tp=1, tp_allreduce=None)
    assert bare.host_cores()["cores"] == 2 * prof.host_cores()["cores"]
    for c in comps:
        low = lowered_schedule(RunConfig.of(schedule=c.schedule, devices=2, microbatches=4, steps=1, model="tiny",
                                            tp=2))
        t_tp, t_bare = (noise_free(step_metrics(simulate_with_profile(low, p, steps=3)).iteration_times[1:])
                        for p in (prof, bare))
        assert t_tp == pytest.approx(c.simulated_iteration_time, rel=1e-9), c.schedule
        assert t_bare / t_tp - 1 < -1 / 3, (c.schedule, t_bare, t_tp)


@pytest.mark.slow
def test_calibrate_tp_on_the_command_line(tp_sitting, tmp_path, capsys, monkeypatch):
    """``pipetwin calibrate --tp 2`` in its quickest form (3 repeats per measurement, one round of
    4-step traced runs at T = 2): the options reach the calibration as given, and the profile it
    returns is written and said in its line: a profile of T = 2 whose layers are a TP rank's. The
    profile is the sitting's above, measured by the same steps (measure_host, the traced runs of
    the runtime schedules, fit_profile), shared instead of measured a second time."""
    import calibration
    from experiments.cli import main
    measured = tp_sitting[0]
    asked = []

    def calibrate(model, **kw):
        asked.append((model, {k: v for k, v in kw.items() if k != "progress"}))
        return measured
    monkeypatch.setattr(calibration, "calibrate", calibrate)
    out = tmp_path / "tp2.yaml"
    assert main(["calibrate", "--tp", "2", "--repeats", "3", "--runtime-steps", "4", "--runtime-repeats", "1",
                 "--out", str(out)]) == 0
    assert asked == [("tiny", {"ranks": 2, "repeats": 3, "micro_batch": None, "runtime_steps": 4,
                               "runtime_repeats": 1, "dtype": "fp32", "tp": 2, "ep": 1})]
    line = capsys.readouterr().out
    prof = load_profile(out)
    assert prof == measured
    assert prof.tp == 2 and prof.meta["runtime_schedules"] == ["dapple", "interleaved", "zb-v", "zb-h1", "bitpipe"]
    assert f"T=2: layers per TP rank, TP all-reduce step {prof.tp_allreduce.latency * 1e6:.0f} us" in line
    # the profile prices a block's four all-reduces of its 16 KiB activations on the fitted ring
    f_comm, b_comm = prof.collective_times()[1]
    ring = ring_allreduce_time(OUT, 2, prof.tp_allreduce.bandwidth, prof.tp_allreduce.latency)
    assert (f_comm, b_comm) == (pytest.approx(2 * ring, rel=1e-12), pytest.approx(2 * ring, rel=1e-12))
    assert prof.layer_costs().f[1] == pytest.approx(prof.layers[1].f + 2 * ring, rel=1e-12)
