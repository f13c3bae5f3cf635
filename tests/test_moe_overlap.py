"""The overlapped forward-backward of a MoE job through the whole chain: the cost model's phases
(cost_models/transformer.py ``layer_segments`` / ``_with_phases``), the schedule's pairs (DualPipe-V's
own, ``--overlap-fb`` on others) and the engine's blocks (sim/overlap.py), reported by simulate."""
from __future__ import annotations

import pytest

from cost_models.job import Job
from sim import simulate_job


def _run(ep: int, overlap: bool, schedule: str = "dualpipe-v", **kw):
    job = Job.of(schedule=schedule, devices=4, microbatches=8, replicas=32, ep=ep, overlap_fb=overlap,
                 model="qwen3-30b-a3b", cluster="dgx-h100-ib:16", **kw)
    return simulate_job(job)


def test_phases_split_each_op_exactly_and_pairs_are_dualpipes_own():
    sim = _run(32, True)
    costs, low = sim.bound.costs, sim.bound.lowered
    for c in range(low.num_copies):
        for s in range(low.num_stages):
            assert costs.phases_f[c][s].total == pytest.approx(costs.f[c][s], rel=1e-12)
            assert costs.phases_b[c][s].total == pytest.approx(costs.b[c][s], rel=1e-12)
    # each MoE layer of a stage: a dispatch and a combine in F, their gradients in B
    disp_comb = sim.bound.report["a2a_per_moe_layer"]
    layers = 48 // low.num_stages        # qwen3-30b-a3b: 48 MoE blocks, none dense
    assert costs.phases_f[0][1].comm_total == pytest.approx(layers * disp_comb, rel=1e-12)
    assert costs.phases_b[0][1].comm_total == pytest.approx(layers * disp_comb, rel=1e-12)
    assert costs.comm_sm_share == pytest.approx(20 / 132)
    assert low.meta["overlapped"] == sim.bound.lowered.meta["overlapped"]


def test_overlap_pays_across_nodes_and_less_inside_nvlink():
    gain = {}
    for ep in (8, 32):                       # one node's NVLink; four nodes' NICs
        serial, overlapped = _run(ep, False), _run(ep, True)
        assert overlapped.result.iteration_time < serial.result.iteration_time
        gain[ep] = 1 - overlapped.result.iteration_time / serial.result.iteration_time
        hidden = sum(overlapped.result.a2a_hidden)
        assert 0 < hidden < sum(overlapped.result.a2a_time)
        assert not any(serial.result.a2a_time)     # no phases without --overlap-fb: nothing to hide
    # across four nodes' NICs the overlap is worth 1.7x what it is inside one node's NVLink (6.7% of
    # the step against 3.9% at the h100 preset's fitted efficiency)
    assert gain[32] > 1.5 * gain[8]


def test_overlap_fb_pairs_other_schedules_and_combined_1f1b_overlaps_its_own():
    job = Job.of(schedule="1f1b", devices=2, microbatches=4, overlap_fb=True, ep=2, replicas=2,
                 model="qwen3-30b-a3b", cluster="dgx-h100-ib:1")
    pairs = job.build().meta["overlapped"]
    assert pairs and all(f[0] == "F" and b[0] == "B" and f[2] != b[2] for f, b in pairs)
    # Megatron's combined 1F1B: its own pairs, overlapped only with --overlap-fb (serial otherwise)
    comb = dict(schedule="interleaved", devices=2, microbatches=8, variant="a2a-overlap", ep=2, replicas=2,
                model="qwen3-30b-a3b", cluster="dgx-h100-ib:1")
    serial, overlapped = simulate_job(Job.of(**comb)), simulate_job(Job.of(**comb, overlap_fb=True))
    assert serial.bound.lowered.meta["overlapped"] == overlapped.bound.lowered.meta["overlapped"]
    assert overlapped.result.iteration_time < serial.result.iteration_time and sum(overlapped.result.a2a_hidden)


def test_simulate_prints_what_was_hidden(capsys):
    from experiments.cli import main
    assert main(["simulate", "-s", "dualpipe-v", "-D", "4", "-N", "8", "--dp", "32", "--ep", "32", "-m",
                 "qwen3-30b-a3b", "-c", "dgx-h100-ib:16", "--overlap-fb"]) == 0
    out = capsys.readouterr().out
    sim = _run(32, True)
    n = len(sim.result.a2a_time)             # every GPU of the 4 x 32
    assert n == 128
    a2a = sum(sim.result.a2a_time) / n
    hidden = sum(sim.result.a2a_hidden) / n
    assert f"all-to-all: {a2a:.6g} s per device in the step, {hidden:.6g} s ({hidden / a2a:.0%}) hidden" in out
