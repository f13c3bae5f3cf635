"""schedules.overlap: the overlapped F&B pairs of any schedule (``--overlap-fb``)."""
import pytest

from schedules import build, lower
from schedules.ir import ScheduleError
from schedules.overlap import forward_backward_pairs, pair_forward_backward


def test_1f1b_d2_n4_pairs_by_hand():
    # device 0: F0 F1 B0 F2 B1 F3 B2 B3 -> F1&B0, F2&B1, F3&B2
    # device 1: F0 B0 F1 B1 F2 B2 F3 B3 -> every F is followed by the B of its own micro-batch: none
    s = pair_forward_backward(build("dapple", 2, 4))
    assert s.meta["overlapped"] == [(("F", 0, 1), ("B", 0, 0)), (("F", 0, 2), ("B", 0, 1)),
                                    (("F", 0, 3), ("B", 0, 2))]
    assert s.programs == build("dapple", 2, 4).programs


def test_lowered_schedule_gives_the_same_pairs():
    # communication ops between F and B are ignored
    assert pair_forward_backward(lower(build("dapple", 2, 4))).meta["overlapped"] == \
        pair_forward_backward(build("dapple", 2, 4)).meta["overlapped"]


def test_dualpipe_v_keeps_its_pairs_and_gains_the_last_devices_first():
    s = build("dualpipe-v", 2, 4)
    own = s.meta["overlapped"]
    p = pair_forward_backward(s)
    # device 1's first F c0 & B c1 (F2.s1 then B0.s2), which DualPipe-V leaves serial, is the only new one
    assert p.meta["overlapped"] == list(own) + [(("F", 1, 2), ("B", 2, 0))]


def test_gpipe_pairs_that_would_wait_for_themselves_stay_serial():
    # every device runs F0..F7 then B0..B7: F7&B0 back to back on each. On device d < 3 the pair's
    # B0 needs the gradient of device d+1's B0, after device d+1's F7, which needs this pair's F7
    # output, sent only at the block's end: only the last device's pair (B0 needs no gradient) stays
    s = build("gpipe", 4, 8)
    assert forward_backward_pairs(s) == [(("F", d, 7), ("B", d, 0)) for d in range(4)]
    assert pair_forward_backward(s).meta["overlapped"] == [(("F", 3, 7), ("B", 3, 0))]


def test_a_schedule_that_deadlocks_alone_is_refused():
    s = build("dapple", 2, 2)
    progs = [list(p) for p in s.programs]
    progs[1].reverse()          # device 1: B1 F1 B0 F0: B1 before its F
    bad = s.with_programs(progs)
    with pytest.raises(ScheduleError, match=r"dapple: the compute orders deadlock without any overlapped pair "
                                            r"\(device 0 at B0.s0, device 1 at B1.s1\)"):
        pair_forward_backward(bad)


@pytest.mark.parametrize("D,N,v", [(2, 4, 2), (4, 8, 2), (4, 8, 1), (3, 9, 2), (4, 8, 3)])
def test_interleaved_a2a_overlap_variant(D, N, v):
    """Megatron-LM's combined 1F1B: one more warm-up chunk-forward per device, every steady F paired
    with the B right after it; without phases the step takes as long as Megatron's order; one more
    chunk-activation on every device: min(Nv, 2(D-1-d) + (v-1)D + 2)/v Ma."""
    from cost_models import UnitCostModel
    from sim import run

    base = build("interleaved", D, N, chunks=v)
    s = build("interleaved", D, N, chunks=v, variant="a2a-overlap")
    assert "overlapped" not in base.meta
    warm = [2 * (D - 1 - d) + (v - 1) * D + 1 for d in range(D)]
    # the steady phase: N v - warm-up pairs per device, each F followed at once by its B
    assert len(s.meta["overlapped"]) == sum(N * v - w for w in warm)
    for d, prog in enumerate(s.compute_programs()):
        first = next(i for i, o in enumerate(prog) if o.kind == "B")
        assert first == warm[d] + 1          # warm-up forwards, then the first pair's F
        assert all(((a.kind, a.stage, a.mb), (b.kind, b.stage, b.mb)) in s.meta["overlapped"]
                   for a, b in zip(prog[first - 1::2], prog[first::2]) if a.kind == "F" and b.kind == "B")
    lb, ls = lower(base), lower(s)
    rb, rs = run(lb, UnitCostModel().bind(lb)), run(ls, UnitCostModel().bind(ls))
    assert rs.iteration_time == pytest.approx(rb.iteration_time)
    assert rs.peak_activation == pytest.approx([min(N * v, w + 1) / v for w in warm])
    assert rb.peak_activation == pytest.approx([min(N * v, w) / v for w in warm])


def test_interleaved_variant_is_checked():
    with pytest.raises(ScheduleError, match=r"interleaved has no variant 'a2a'; choose one of megatron, a2a-overlap"):
        build("interleaved", 2, 4, variant="a2a")
