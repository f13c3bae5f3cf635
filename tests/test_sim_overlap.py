"""Overlapped forward/backward pairs: the two-stream pair timing (sim.overlap), the phases contract of
StageCosts, and the engine running a schedule's ``meta["overlapped"]`` pairs as blocks."""
from dataclasses import replace

import pytest

from cost_models import UnitCostModel
from cost_models.base import OpPhases
from schedules import build, lower
from schedules.analysis import fused_overlap_timing
from schedules.trace import op_orders, step_metrics
from sim import SimOptions, run
from sim.engine import SimulationError
from sim.overlap import PairTime, overlapped_pair

# F of one micro-batch: attention+MLP-in (2), dispatch (1), experts (2), combine (1)
PF = OpPhases((2.0, 2.0), (1.0, 1.0))
# B of another: combine's backward all-to-all first (compute[0] = 0), experts (2), dispatch (1), attention (2)
PB = OpPhases((0.0, 2.0, 2.0), (1.0, 1.0))


def test_op_phases_rules():
    assert PF.total == 6.0 and PF.comm_total == 2.0 and PB.total == 6.0
    assert OpPhases((1.0,), ()).total == 1.0
    with pytest.raises(ValueError, match=r"len\(compute\) == len\(comm\) or len\(comm\) \+ 1"):
        OpPhases((1.0,), (1.0, 1.0))
    with pytest.raises(ValueError, match="finite numbers >= 0; got -1"):
        OpPhases((1.0, -1), (1.0,))
    with pytest.raises(ValueError, match="finite numbers >= 0; got nan"):
        OpPhases((float("nan"),), ())


def test_op_phases_from_segments():
    # a stage of two MoE blocks: zero segments dropped, neighbours of one kind merged
    seg = [("compute", 2), ("comm", 1), ("compute", 0), ("comm", 1), ("compute", 3), ("compute", 1)]
    assert OpPhases.from_segments(seg) == OpPhases((2.0, 4.0), (2.0,))
    # a backward starting with the combine's gradient
    assert OpPhases.from_segments([("comm", 1), ("compute", 2), ("comm", 1), ("compute", 2)]) == PB
    assert OpPhases.from_segments([]) == OpPhases((0.0,), ())
    with pytest.raises(ValueError, match="an op segment is 'compute' or 'comm'; got 'a2a'"):
        OpPhases.from_segments([("a2a", 1.0)])


def test_pair_worked_by_hand_without_sm_share():
    # s = 0. Zero-length segments take no stream, so B starts with its all-to-all at once.
    # t=0: F.c 2 on compute [0,2], B.x 1 on comm [0,1]          both busy 1
    # t=2: B.c 2 (ready since 1) on compute [2,4], F.x [2,3]     both busy 1
    # t=4: F.c (ready since 3) [4,6], B.x [4,5]                  both busy 1
    # t=6: B.c (ready since 5) [6,8], F.x [6,7]                  both busy 1
    # time 8 = serial 12 - hidden 4
    assert overlapped_pair(PF, PB, 0.0) == PairTime(time=8.0, serial=12.0, comm=4.0, hidden=4.0)


def test_pair_worked_by_hand_with_sm_share():
    # s = 0.15: compute under a comm segment of 1 s does 0.85 of work, so each compute segment of 2
    # that starts with a comm segment ends after 2 + 0.15 * 1 = 2.15 = max(x, c + s x).
    # t=0: F.c ends 2.15; B.x [0,1]. t=2.15: B.c ends 4.30; F.x [2.15,3.15].
    # t=4.30: F.c ends 6.45; B.x [4.30,5.30]. t=6.45: B.c ends 8.60; F.x [6.45,7.45].
    # time 8.60 = serial 12 - (1 - 0.15) * hidden 4
    p = overlapped_pair(PF, PB, 0.15)
    assert (p.time, p.serial, p.comm, p.hidden) == (pytest.approx(8.6), 12.0, 4.0, pytest.approx(4.0))
    assert p.time == pytest.approx(p.serial - (1 - 0.15) * p.hidden)


def test_pair_single_segments_closed_form():
    # a compute segment c under a comm segment x, starting together: max(x, c + s x)
    for c, x, s in [(1.0, 2.0, 0.3), (3.0, 1.0, 0.3), (1.0, 1.0, 0.0), (0.7, 1.0, 0.3)]:
        p = overlapped_pair(OpPhases((0.0,), (x,)), OpPhases((c,), ()), s)
        assert p.time == pytest.approx(max(x, c + s * x))
        assert p.hidden == pytest.approx(min(x, c / (1 - s)))
    # no communication: the pair is serial, whatever the share
    assert overlapped_pair(OpPhases((3.0,), ()), OpPhases((1.0,), ()), 0.5) == PairTime(4.0, 4.0, 0.0, 0.0)
    # ties on a stream go to F: both start with compute, F's runs first, B's comm waits for B's compute
    p = overlapped_pair(OpPhases((1.0,), (2.0,)), OpPhases((1.0,), (2.0,)), 0.0)
    # F.c [0,1], F.x [1,3], B.c [1,2], B.x [3,5]
    assert p == PairTime(time=5.0, serial=6.0, comm=4.0, hidden=1.0)
    with pytest.raises(ValueError, match=r"sm_share must be a number in \[0, 1\); got 1"):
        overlapped_pair(PF, PB, 1)


def uniform(costs, pf, pb, share, w=None):
    C, S = len(costs.f), len(costs.f[0])
    tab = lambda v: tuple(tuple([v] * S) for _ in range(C))  # noqa: E731
    kw = {} if w is None else {"w": tab(w)}
    return replace(costs, phases_f=tab(pf), phases_b=tab(pb), comm_sm_share=share, **kw)


def test_stage_costs_phases_contract():
    low = lower(build("dualpipe-v", 2, 4))
    c = UnitCostModel().bind(low)          # F = B = W = 1/2 per chunk
    with pytest.raises(ValueError, match=r"phases_f\[0\]\[0\] sums to 0.6, not f\[0\]\[0\] = 0.5"):
        uniform(c, OpPhases((0.3,), (0.3,)), None, 0.0)
    with pytest.raises(ValueError, match=r"comm_sm_share must be a number in \[0, 1\); got 1.5"):
        replace(c, comm_sm_share=1.5)
    with pytest.raises(ValueError, match="phases_b must be a .copy..stage. table shaped like b"):
        replace(c, phases_b=((None,),))


def phases(f):
    """F and B of one chunk of time f, 40 % of it all-to-alls (two of 0.2 f each)."""
    return OpPhases((0.3 * f, 0.3 * f), (0.2 * f, 0.2 * f)), OpPhases((0.0, 0.3 * f, 0.3 * f), (0.2 * f, 0.2 * f))


def test_engine_runs_dualpipe_v_pairs_as_blocks():
    s = build("dualpipe-v", 2, 4)
    low = lower(s)
    c = UnitCostModel().bind(low)
    pf, pb = phases(0.5)
    serial = run(low, c)
    share = 20 / 132
    r = run(low, uniform(c, pf, pb, share), trace=True)
    pt = overlapped_pair(pf, pb, share)
    # each device runs 3 of the 6 pairs (hand count of meta["overlapped"]); a pair of F = B = 1/2
    # with 0.4 all-to-all, hidden whole, takes 1 - (1 - share) 0.4
    assert pt.hidden == pytest.approx(0.4) and pt.time == pytest.approx(1 - (1 - share) * 0.4)
    saving = 3 * (1.0 - pt.time)
    assert r.busy == pytest.approx([b - saving for b in serial.busy])
    # and no wait changes here: the step is the serial one (3N + (D-1)/2 = 12.5) less one device's savings
    assert serial.iteration_time == 12.5
    assert r.iteration_time == pytest.approx(12.5 - saving)
    # all-to-all seconds: 8 F and 8 B per device, 0.2 each; hidden: 3 pairs x 0.4
    assert r.a2a_time == pytest.approx([3.2, 3.2]) and r.a2a_hidden == pytest.approx([1.2, 1.2])
    # the metrics of the trace agree (the block counted once: B's row is zero-length at its end)
    m = step_metrics(r.trace())
    assert m.iteration_time == pytest.approx(r.iteration_time)
    assert [d.busy for d in m.per_device] == pytest.approx(r.busy)
    t = r.trace()
    fr = t[t.token == "F3.s0"].iloc[0]
    br = t[t.token == "B1.s3.k1"].iloc[0]
    assert fr.end - fr.start == pytest.approx(pt.time) and br.start == br.end == fr.end
    # the RECV of a pair's B goes before the block, the F's SEND after it (DualPipe's F&B chunk)
    order = op_orders(t)
    assert order[0][order[0].index("F3.s0"):][:3] == ["F3.s0", "B1.s3.k1", "SA3.s0>1"]
    assert order[0][order[0].index("F2.s3.k1") - 2:][:4] == ["RA2.s3.k1<1", "RG0.s0<1", "F2.s3.k1", "B0.s0"]
    assert order[1][order[1].index("F3.s1") - 2:][:5] == ["RA3.s1<0", "RG1.s2.k1<0", "F3.s1", "B1.s2.k1", "CA3.s1"]
    # F's activation is allocated and B's freed at the block's end: the peak is the serial run's
    assert r.peak_activation == serial.peak_activation


@pytest.mark.parametrize("D,N", [(1, 2), (2, 4), (3, 6), (4, 8)])
@pytest.mark.parametrize("share", [0.0, 0.15])
def test_engine_matches_fused_overlap_timing(D, N, share):
    """With W = 0 (so a pair's block is all that is fused), the engine's iteration time and idle
    times equal schedules.analysis.fused_overlap_timing's with F&B = the pair's time: two
    independent timings of the same fused schedule."""
    s = build("dualpipe-v", D, N)
    low = lower(s)
    c = UnitCostModel().bind(low)
    f = c.f[0][0]
    pf, pb = phases(f)
    r = run(low, uniform(c, pf, pb, share, w=0.0))
    fz = fused_overlap_timing(s, f, f, 0.0, overlapped_pair(pf, pb, share).time)
    assert r.iteration_time == pytest.approx(fz["makespan"], rel=1e-12)
    assert [r.iteration_time - b for b in r.busy] == pytest.approx(fz["idle"], rel=1e-9, abs=1e-12)


def test_single_device_saving_is_the_sum_of_pair_savings():
    # D = 1: nothing ever waits, so the step is the device's busy time, and the overlapped step is
    # the serial one less each pair's saving (N = 4: the steady phase runs 3 times, its first
    # F c0 & B c1 not overlapped on the last device: 2 x 3 - 1 = 5 pairs)
    s = build("dualpipe-v", 1, 4)
    low = lower(s)
    c = UnitCostModel().bind(low)
    pf, pb = phases(0.5)
    pt = overlapped_pair(pf, pb, 0.15)
    assert len(s.meta["overlapped"]) == 5
    serial = run(low, c)
    r = run(low, uniform(c, pf, pb, 0.15))
    assert serial.iteration_time == 12.0
    assert r.iteration_time == pytest.approx(12.0 - 5 * (1.0 - pt.time))
    assert r.a2a_hidden == pytest.approx([5 * 0.4])


def test_no_communication_and_no_share_is_the_serial_run():
    low = lower(build("dualpipe-v", 2, 4))
    c = UnitCostModel().bind(low)
    serial = run(low, c, trace=True)
    r = run(low, uniform(c, OpPhases((0.5,), ()), OpPhases((0.5,), ()), 0.0), trace=True)
    assert r.iteration_time == serial.iteration_time == 12.5
    assert r.busy == serial.busy and r.peak_activation == serial.peak_activation
    assert r.a2a_time == [0.0, 0.0] and r.a2a_hidden == [0.0, 0.0]


def test_without_pairs_or_phases_nothing_changes():
    # phases on a schedule without pairs: serial, the all-to-alls counted, none hidden
    low = lower(build("dapple", 2, 4))
    c = UnitCostModel().bind(low)          # F = 1, B = 2
    pf, pb = OpPhases((0.6,), (0.4,)), OpPhases((1.2,), (0.8,))
    base = run(low, c, trace=True)
    r = run(low, replace(c, phases_f=((pf, pf),), phases_b=((pb, pb),), comm_sm_share=0.15), trace=True)
    assert r.iteration_time == base.iteration_time and r.busy == base.busy
    assert op_orders(r.trace()) == op_orders(base.trace())
    assert r.a2a_time == pytest.approx([4 * 0.4 + 4 * 0.8] * 2) and r.a2a_hidden == [0.0, 0.0]
    # no phases: zero all-to-all
    assert base.a2a_time == [0.0, 0.0] and base.a2a_hidden == [0.0, 0.0]


def test_slowdown_stretches_the_block():
    low = lower(build("dualpipe-v", 1, 4))
    c = uniform(UnitCostModel().bind(low), *phases(0.5), 0.0)
    r = run(low, c, options=SimOptions(slowdown={0: 2.0}))
    one = run(low, c)
    assert r.iteration_time == pytest.approx(2 * one.iteration_time)
    assert r.a2a_time == pytest.approx([2 * x for x in one.a2a_time])
    assert r.a2a_hidden == pytest.approx([2 * x for x in one.a2a_hidden])


def test_pairs_not_back_to_back_fail_with_one_line():
    s = build("dapple", 2, 4)
    s.meta["overlapped"] = [(("F", 0, 3), ("B", 0, 0))]     # F3.s0 is followed by B2.s0 on device 0
    low = lower(s)
    c = UnitCostModel().bind(low)
    pf, pb = OpPhases((0.6,), (0.4,)), OpPhases((1.2,), (0.8,))
    with pytest.raises(ValueError, match=r"rank 0: overlapped pair F3.s0 & B0.s0 is not back to back in its "
                                         r"compute order \(next compute op: B2.s0\)"):
        run(low, replace(c, phases_f=((pf, pf),), phases_b=((pb, pb),)))


def test_a_pair_that_needs_its_own_output_deadlocks_with_ranks_named():
    # pair F3.s0 (device 0) with B3.s0: B3.s0 needs the gradient of B3.s1, which needs F3.s1,
    # which needs F3.s0's activation, sent only after the block: the engine names the stuck ranks
    s = build("dapple", 2, 4)
    progs = [list(p) for p in s.programs]
    f3 = next(i for i, o in enumerate(progs[0]) if str(o) == "F3.s0")
    b3 = next(i for i, o in enumerate(progs[0]) if str(o) == "B3.s0")
    op = progs[0].pop(b3)
    progs[0].insert(f3 + 1, op)
    s = s.with_programs(tuple(tuple(p) for p in progs))
    s.meta["overlapped"] = [(("F", 0, 3), ("B", 0, 3))]
    low = lower(s)
    c = UnitCostModel().bind(low)
    pf, pb = OpPhases((0.6,), (0.4,)), OpPhases((1.2,), (0.8,))
    with pytest.raises(SimulationError, match=r"simulation deadlocked: rank 0 at RG3.s0<1; rank 1 at RA3.s1<0"):
        run(low, replace(c, phases_f=((pf, pf),), phases_b=((pb, pb),)))


def test_overlap_fb_on_gpipe_hides_the_last_devices_pair():
    # --overlap-fb on GPipe D=4 N=8 keeps one pair, F7&B0 on the last device (schedules.overlap).
    # F = [c 0.6, x 0.4], B = [x 0.8, c 1.2] (unit costs F = 1, B = 2), share 0.15, by hand:
    # t=0: F.c under B.x: 0.6 / 0.85 = 0.70588 < 0.8, ends 0.70588; B.x ends 0.8
    # t=0.8: F.x [0.8, 1.2]; B.c under it for 0.4 s does 0.34, the remaining 0.86 alone: ends 2.06
    # pair 2.06 instead of 3; hidden 0.6 / 0.85 + 0.4. The last device is the critical path and no
    # wait changes (its pair's inputs are there): 33 - 0.94.
    from schedules.overlap import pair_forward_backward
    s = pair_forward_backward(build("gpipe", 4, 8))
    low = lower(s)
    c = UnitCostModel().bind(low)
    pf = tuple(tuple(OpPhases((0.6 * x,), (0.4 * x,)) for x in row) for row in c.f)
    pb = tuple(tuple(OpPhases((0.0, 0.6 * x), (0.4 * x,)) for x in row) for row in c.b)
    assert run(low, c).iteration_time == 33.0
    r = run(low, replace(c, phases_f=pf, phases_b=pb, comm_sm_share=0.15))
    assert r.iteration_time == pytest.approx(33.0 - 0.94)
    assert r.a2a_hidden == pytest.approx([0.0, 0.0, 0.0, 0.6 / 0.85 + 0.4])
    assert r.a2a_time == pytest.approx([8 * 0.4 + 8 * 0.8] * 4)


@pytest.mark.parametrize("D,N,v", [(2, 4, 2), (4, 8, 2), (4, 8, 1), (4, 8, 3)])
def test_interleaved_a2a_overlap_matches_fused_timing(D, N, v):
    """Megatron's combined 1F1B (interleaved variant a2a-overlap) with phased costs: the engine's step
    equals fused_overlap_timing's with F&B = the pair's time (no W: a full backward)."""
    s = build("interleaved", D, N, chunks=v, variant="a2a-overlap")
    low = lower(s)
    c = UnitCostModel().bind(low)
    f, b = c.f[0][0], c.b[0][0]
    pf = OpPhases((0.3 * f, 0.3 * f), (0.2 * f, 0.2 * f))
    pb = OpPhases((0.0, 0.3 * b, 0.3 * b), (0.2 * b, 0.2 * b))
    r = run(low, uniform(c, pf, pb, 0.15))
    fz = fused_overlap_timing(s, f, b, 0.0, overlapped_pair(pf, pb, 0.15).time)
    assert r.iteration_time == pytest.approx(fz["makespan"], rel=1e-12)


def test_interleaved_a2a_overlap_d4_n8_v2_numbers():
    # F = 1/2 per chunk, B = 1: 40 % all-to-all; SM share 0.15. Megatron's order runs serially
    # (28.5 = (D - 1 + vN) x 3/2, its unit step); the combined 1F1B hides 17.69 s of 38.4 and takes 23.33
    low = lower(build("interleaved", 4, 8, chunks=2, variant="a2a-overlap"))
    c = UnitCostModel().bind(low)
    pf, pb = OpPhases((0.15, 0.15), (0.1, 0.1)), OpPhases((0.0, 0.3, 0.3), (0.2, 0.2))
    meg = lower(build("interleaved", 4, 8, chunks=2))
    cm = UnitCostModel().bind(meg)
    assert run(meg, uniform(cm, pf, pb, 0.15)).iteration_time == 28.5
    r = run(low, uniform(c, pf, pb, 0.15))
    assert r.iteration_time == pytest.approx(23.33)
    assert sum(r.a2a_time) == pytest.approx(4 * 16 * 0.6)
    # a pair by hand: F.c 0.15 under B.x 0.2 ends 0.15/0.85; B.c 0.3 from 0.2 under F.x [0.2, 0.3]
    # ends 0.3 + 0.215 = 0.515; F.c under B.x [0.515, 0.715] ends 0.515 + 0.15/0.85; B.c from 0.715
    # under F.x [0.715, 0.815] ends 1.03: hidden 2 (0.15/0.85 + 0.1), 1.5 - 0.85 hidden = 1.03
    pt = overlapped_pair(pf, pb, 0.15)
    assert pt.time == pytest.approx(1.03) and pt.hidden == pytest.approx(2 * (0.15 / 0.85 + 0.1))
    # 32 pairs (N v - warm-up on each device: 5 + 7 + 9 + 11)
    assert sum(r.a2a_hidden) == pytest.approx(32 * 2 * (0.15 / 0.85 + 0.1))


def test_an_all_to_all_wait_holds_no_core_of_a_shared_host():
    """Two replicas of D = 1, N = 1 (F = 1, B = 2) on one host of 1 core, each op 40 % all-to-all
    (F: 0.6 compute then 0.4 waiting; B: 1.2 then 0.8). The cores run the compute only: both ranks
    share the core for F's 0.6 each (1.2 s), wait 0.4 (the core idle: the ranks are in step), share
    it for B's 1.2 each (2.4 s), wait 0.8: 1.2 + 0.4 + 2.4 + 0.8 = 4.8 s, where the waits held the core
    it took 2 x 3 = 6; without a host (the GPU path) both are the serial 3."""
    low = lower(build("dapple", 1, 1), replicas=2)
    c = UnitCostModel().bind(low)
    ph = replace(c, phases_f=((OpPhases((0.6,), (0.4,)),),), phases_b=((OpPhases((1.2,), (0.8,)),),))
    host = SimOptions(hosts=[0, 0], cores=1.0)
    assert run(low, c, None, host).iteration_time == pytest.approx(6.0, rel=1e-12)
    r = run(low, ph, None, host)
    assert r.iteration_time == pytest.approx(4.8, rel=1e-12) and r.busy == pytest.approx([4.8, 4.8], rel=1e-12)
    assert run(low, ph).iteration_time == run(low, c).iteration_time == 3.0
