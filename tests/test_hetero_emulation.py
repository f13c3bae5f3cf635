"""A mixed cluster emulated in a real run (:func:`cost_models.bind.pool_slowdowns`): where the ranks
sit, what ratio slows them and which partition they run, worked in closed form on a small cluster
of two device kinds of speeds 1 and 3; the slowed run trains exactly as the reference."""
from dataclasses import replace

import pytest

from cost_models import Job, Layout
from cost_models.bind import pool_slowdowns
from cost_models.cluster import by_pool_map, megatron_map, DeviceGrid
from executor.config import RunConfig
from executor.launch import run
from executor.reference import run_reference
from schedules import build
from tests.helpers import assert_losses_equal

# two pools of 2 devices: "slow" and "fast", every peak and the memory bandwidth 3x apart, one
# efficiency, no kernel constants (so the linear model prices both: every op 3x on the slow kind)
MIX = """name: two-speeds
pools:
  - nodes: 1
    devices_per_node: 2
    intra: pcie4
    inter: eth-10g
    device: {name: slow, peak_flops: {fp32: 10 TFLOP/s, tf32: 10 TFLOP/s, bf16: 20 TFLOP/s}, memory: 16 GiB,
             memory_bandwidth: 500 GB/s, efficiency: 0.5}
  - nodes: 1
    devices_per_node: 2
    intra: pcie4
    inter: eth-10g
    device: {name: fast, peak_flops: {fp32: 30 TFLOP/s, tf32: 30 TFLOP/s, bf16: 60 TFLOP/s}, memory: 16 GiB,
             memory_bandwidth: 1500 GB/s, efficiency: 0.5}
between: eth-10g
"""


@pytest.fixture
def mix(tmp_path):
    p = tmp_path / "two-speeds.yaml"
    p.write_text(MIX)
    return str(p)


def _job(mix, D, R=1, **kw):
    return Job(layout=Layout(schedule="1f1b", devices=D, microbatches=8, replicas=R), model="tiny", cluster=mix, **kw)


def test_placement_factors_and_typed_split_in_closed_form(mix):
    """The tiny GPT's layers: embedding (0 s in the linear model), 8 blocks of c each, a head of h
    (~0.31 c) on the slow kind; a third of that on the fast one (every F, B and W 3x: k = 3).

    D = 4: pipeline device d on pool 4 d // ... = d * 2 // 4: ranks 0, 1 slow, 2, 3 fast. Each slow
    stage needs a block (a stage of the embedding alone leaves 2 blocks, 2 c, on the next), so the
    least slowest stage is c + h / 3: (emb + 1, 1, 3, 3 + head) = (2, 1, 3, 4) (4 blocks on a fast
    stage would be 4 c / 3 > c + h / 3). Ranks 0 and 1 slowed 3x.

    D = 2, R = 2: device 0 (slow) takes GPUs 0, 1, device 1 (fast) GPUs 2, 3; rank r = replica
    r // 2 of device r % 2, so ranks 0, 2 slow, 1, 3 fast. n blocks on the slow stage: max(n c,
    (8 - n) c / 3 + h / 3) is 2 c + h / 3 at n = 2 and 3 c at n = 3: (emb + 2, 6 + head) = (3, 7)."""
    e = pool_slowdowns(_job(mix, 4))
    assert (e.mapping, e.cost_model, e.latency_bound, e.typed) == ("by-pool", "linear", False, True)
    assert e.pools == (0, 0, 1, 1)
    assert e.partition == (2, 1, 3, 4)
    assert [r for r, _ in e.slowdown] == [0, 1]
    assert [k for _, k in e.slowdown] == pytest.approx([3.0, 3.0], rel=1e-12)
    e = pool_slowdowns(_job(mix, 2, 2))
    assert e.pools == (0, 1, 0, 1)
    assert e.partition == (3, 7)
    assert [r for r, _ in e.slowdown] == [0, 2]
    assert [k for _, k in e.slowdown] == pytest.approx([3.0, 3.0], rel=1e-12)
    # a partition given is the run's (and prices the factors): still 3x, every op alike
    e = pool_slowdowns(_job(mix, 2, partition=(5, 5)))
    assert (e.partition, e.typed, [r for r, _ in e.slowdown]) == ((5, 5), False, [0])


def test_by_pool_map_on_one_pool_is_megatrons_order():
    """On a device grid (one pool) every pipeline device is on pool 0 and its R replicas on the next
    R GPUs: rank (replica j, device d) on GPU d R + j, Megatron's [DP, PP] order."""
    sched = replace(build("1f1b", 2, 4), replicas=2)
    grid = DeviceGrid(1, 4, "grid")
    assert by_pool_map(sched, grid) == megatron_map(sched, grid) == (0, 2, 1, 3)


def test_a_tiny_model_on_a100_h100_is_priced_by_the_linear_model():
    """The kernel model prices the tiny GPT's ops latency-bound (its layers' F + B + W within 1 % on
    an A100 and an H100), so the ratios come from the linear model; D = 2 spans both pools, and the
    A100 rank's factor is the ratio of the fp32 peaks at each preset's efficiency,
    (66.9 x 0.5945) / (19.5 x 0.5) = 4.079 (its stage, the embedding and a block, is all GEMM FLOPs in
    the linear model)."""
    e = pool_slowdowns(Job(layout=Layout(schedule="1f1b", devices=2, microbatches=4), model="tiny",
                           cluster="a100-h100"))
    assert (e.cost_model, e.latency_bound, e.pools, [r for r, _ in e.slowdown]) == ("linear", True, (0, 1), [0])
    assert e.slowdown[0][1] == pytest.approx(66.9 * 0.5945 / (19.5 * 0.5), rel=1e-9)
    assert "linear cost model (the kernel model prices this model's ops latency-bound" in e.line()


def test_a_slowed_mixed_run_trains_as_the_reference(mix):
    """run --cluster two-speeds, D = 2: rank 0 (slow pool) sleeps 2 x each op, the partition is
    (3, 7); the losses equal the single-process reference's over the same partition."""
    cfg = RunConfig.of(schedule="1f1b", devices=2, microbatches=4, steps=2, cluster=mix, timeout=30.0)
    assert cfg.job.cluster.name is None and cfg.job.partition == (3, 7)
    assert [r for r, _ in cfg.job.faults.slowdown] == [0]
    res = run(cfg)
    assert_losses_equal(res, run_reference(cfg))


def test_the_simulated_side_slows_the_same_ranks_by_the_same_factor():
    """validate's simulated side (simulate_with_profile, slowdown = the run's pairs): on a host of 4
    cores (every rank has one), rank 0's F, B and W of a toy profile take exactly 3x their unslowed
    time; rank 1's are unchanged."""
    from calibration import simulate_with_profile
    from executor.config import lowered_schedule
    from tests.test_crossval import _toy_profile
    prof = _toy_profile(cores=4)
    low = lowered_schedule(RunConfig.of(schedule="1f1b", devices=2, microbatches=4))
    plain = simulate_with_profile(low, prof, steps=1, partition=(3, 7))
    slow = simulate_with_profile(low, prof, steps=1, partition=(3, 7), slowdown=((0, 3.0),))

    def dur(tr, rank):
        t = tr[(tr.device == rank) & tr.kind.isin(["F", "B", "W"])]
        return list(t.end - t.start)

    assert dur(slow, 0) == pytest.approx([3 * d for d in dur(plain, 0)], rel=1e-9)
    assert dur(slow, 1) == pytest.approx(dur(plain, 1), rel=1e-9)


def test_validate_on_a_mixed_cluster_keeps_op_orders_exact(mix):
    """validate --cluster two-speeds at D = 2 (1F1B = dapple, ZB-H1): each schedule twice (the typed
    split (3, 7) and the uniform (5, 5)), rank 0 slowed 3x on both sides; every rank's op order is the schedule's in the
    executor and in the simulator, whatever the host's timing (one short run each)."""
    from calibration import run_and_compare
    from calibration.sitting import SittingRules
    from experiments.cmd_validate import mixed_jobs
    from tests.test_crossval import _toy_profile
    base = Job(layout=Layout(schedule="dapple", devices=2, microbatches=4), model="tiny", cluster=mix)
    jobs, lines = mixed_jobs([base, base.with_layout(schedule="zb-h1")], 8)
    assert [j.partition for j in jobs] == [None, (5, 5), None, (5, 5)]
    assert lines[0] == ("dapple: emulated two-speeds: ranks on pools [0, 1] (device map by-pool), slowdowns priced "
                        "with the linear cost model; layers per stage [3, 7] (typed split of the planner); slowed "
                        "rank 0 x3.000")
    comps = run_and_compare(jobs, _toy_profile(), steps=3,
                            rules=SittingRules(runs=1, max_runs=1, warmup=1, max_foreign=100.0, max_spread=10.0))
    assert [(c.schedule, c.partition) for c in comps] == [("dapple", (3, 7)), ("dapple", (5, 5)),
                                                         ("zb-h1", (3, 7)), ("zb-h1", (5, 5))]
    for c in comps:
        assert [r for r, _ in c.slowdown] == [0] and c.slowdown[0][1] == pytest.approx(3.0, rel=1e-12)
        assert c.order_identical, (c.schedule, c.partition)


def test_a_slowed_ranks_ops_are_judged_against_k_times_their_alone_time():
    """The sitting's host state (calibration.sitting.RunSeries.speeds) on a run with rank 1 slowed
    3x (its F and B rows include the sleep: 3 ms and 6 ms against a 1 ms and 2 ms yardstick): every
    step's speed is 1.0, the same as rank 0's, so the slowed run can meet the fast state."""
    from types import SimpleNamespace

    import pandas as pd

    from calibration.sitting import RunSeries, SittingRules
    from cost_models.job import Faults
    from tests.test_sitting import _Yard
    rows = []
    for step in range(4):
        for dev, k in ((0, 1.0), (1, 3.0)):
            clock = 0.0
            for kind, d in (("F", 1e-3 * k), ("B", 2e-3 * k)):
                rows.append({"device": dev, "step": step, "kind": kind, "copy": 0, "stage": dev, "start": clock,
                             "end": clock + d})
                clock += d
    cfg = RunConfig.of(schedule="dapple", faults=Faults(slowdown=((1, 3.0),)))
    run_ = SimpleNamespace(config=cfg, iteration_times=[1e-2] * 4, extra={}, trace=pd.DataFrame(rows))
    s = RunSeries(config=cfg, runs=[run_], rules=SittingRules(runs=1, warmup=1), yardstick=_Yard())
    assert s.speeds(0) == {1: pytest.approx(1.0), 2: pytest.approx(1.0), 3: pytest.approx(1.0)}
