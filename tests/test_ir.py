import pytest
from hypothesis import given
from hypothesis import strategies as st

from schedules import (ACT, ALLREDUCE, COPY, GRAD, RECV, SEND, B, F, Op, ScheduleError, W, build, lower, message_key,
                       parse_op, validate)
from schedules.ir import make_schedule


@pytest.mark.parametrize("tok", ["F3.s2", "B0.s1.c1", "W12.s7.k1", "B3.s2.c1.k3", "SA3.s2>1", "SG3.s2.c1>0",
                                 "RA3.s3<0", "RG3.s1.k1<2", "CA3.s3", "CG3.s4.c1.k1", "AR.s2", "AR.s2.c1.k2", "OPT"])
def test_tokens_round_trip(tok):
    assert str(parse_op(tok)) == tok


@given(kind=st.sampled_from([F, B, W]), mb=st.integers(0, 999), stage=st.integers(0, 99), copy=st.integers(0, 1),
       chunk=st.integers(0, 7))
def test_compute_ops_round_trip(kind, mb, stage, copy, chunk):
    op = Op(kind, mb, stage, copy, chunk)
    assert parse_op(str(op)) == op


@given(kind=st.sampled_from([SEND, RECV, COPY]), payload=st.sampled_from([ACT, GRAD]), mb=st.integers(0, 999),
       stage=st.integers(0, 99), copy=st.integers(0, 1), peer=st.integers(0, 63))
def test_comm_ops_round_trip(kind, payload, mb, stage, copy, peer):
    op = Op(kind, mb, stage, copy, 0, -1 if kind == COPY else peer, payload)
    assert parse_op(str(op)) == op


@pytest.mark.parametrize("bad", ["F3", "F3.s2 ", "X1.s1", "SA3.s2", "RA3.s2>1", "F3.s2>1", "OPT<1", "AR.s", "f3.s2",
                                 "F3.s2.k1.c1"])
def test_bad_tokens_fail(bad):
    if bad == "F3.s2 ":
        assert str(parse_op(bad)) == "F3.s2"  # surrounding whitespace is ignored
        return
    with pytest.raises(ScheduleError):
        parse_op(bad)


def test_message_key_matches_send_and_recv():
    assert message_key(parse_op("SA3.s2>1")) == message_key(parse_op("RA3.s3<0"))
    assert message_key(parse_op("SG3.s2>0")) == message_key(parse_op("RG3.s1<2"))
    assert message_key(parse_op("CA3.s3")) == (ACT, 0, 3, 3)


def test_structure_errors_are_clear():
    good = build("dapple", 2, 2)
    progs = [list(p) for p in good.programs]
    progs[0] = progs[0][1:]  # drop F0.s0
    with pytest.raises(ScheduleError, match="missing F0.s0"):
        validate(good.with_programs(progs))
    progs = [list(p) for p in good.programs]
    progs[0][0], progs[1][0] = progs[1][0], progs[0][0]
    with pytest.raises(ScheduleError, match="belongs on device"):
        validate(good.with_programs(progs))


def test_deadlock_names_devices_and_ops():
    # device 1 runs B0 before F1 while device 0 waits for a gradient first: a cyclic wait
    order = [[(F, 0, 0, 0), (B, 0, 0, 0), (F, 1, 0, 0), (B, 1, 0, 0)],
             [(F, 1, 0, 1), (B, 1, 0, 1), (F, 0, 0, 1), (B, 0, 0, 1)]]
    s = make_schedule("bad", 2, 2, [[0, 1]], order)
    with pytest.raises(ScheduleError) as e:
        validate(s)
    # device 1 sends its gradients in the order B1, B0, so FIFO lowering puts RG1 first on device 0,
    # which device 1 can only send after F1, whose activation device 0 sends after B0: a cycle
    assert str(e.value) == ("deadlock: rank 0 waits at RG1.s0<1 for rank 1; "
                            "rank 1 waits at RA1.s1<0 for rank 0")


def test_fifo_order_and_pairing():
    """SEND/RECV pairs match one to one and in FIFO order for each device pair."""
    for name in ["gpipe", "dapple", "interleaved", "chimera", "bitpipe"]:
        for R in (1, 2):
            low = lower(build(name, 4, 8), replicas=R)
            sends, recvs = {}, {}
            for r in range(low.num_ranks):
                for op in low.program(r):
                    if op.kind == SEND:
                        sends.setdefault((r, op.peer), []).append(message_key(op))
                    elif op.kind == RECV:
                        recvs.setdefault((op.peer, r), []).append(message_key(op))
            assert sends == recvs, name
            # one activation and one gradient per micro-batch and stage boundary between two devices
            # (the copies of Chimera and BitPipe take half the micro-batches each)
            place = build(name, 4, 8).placement
            want = 2 * R * sum(8 // len(place) * sum(a != b for a, b in zip(p, p[1:])) for p in place)
            assert sum(map(len, sends.values())) == want, name


def test_lowering_inserts_copy_allreduce_and_optim():
    low = lower(build("bitpipe", 4, 4))
    p0 = [str(o) for o in low.programs[0]]
    assert p0[-1] == "OPT"
    assert "CA2.s3.c1.k2" in p0          # the up copy's V turn on device 0 is local
    ars = [o for o in low.programs[0] if o.kind == ALLREDUCE]
    assert sorted(o.stage for o in ars) == [0, 3, 4, 7]   # the four stages device 0 holds
    assert all(o.kind != ALLREDUCE for o in lower(build("dapple", 4, 4)).programs[0])
    assert sum(o.kind == ALLREDUCE for o in lower(build("dapple", 4, 4), replicas=2).programs[0]) == 1


def test_eager_allreduce_sits_in_bubbles_not_at_end():
    eager = [str(o) for o in lower(build("bitpipe", 4, 4), eager=True).programs[0]]
    late = [str(o) for o in lower(build("bitpipe", 4, 4), eager=False).programs[0]]
    assert eager.index("AR.s7.k1") < eager.index("B0.s0")
    assert late[-5:-1] == [t for t in late if t.startswith("AR")] and late[-1] == "OPT"
