"""Exchange with torch.distributed.pipelining: exported pipetwin schedules pass PyTorch's own
lowering (``_add_send_recv``, the runtime's CSV loader) and step simulator
(``_simulate_comms_compute``); PyTorch's built-in schedules import, validate and time without
deadlock. PyTorch schedules are built without a process group from lightweight fake stages."""
import types
from collections import Counter

import pytest

pytest.importorskip("torch.distributed.pipelining")
from torch.distributed.pipelining import schedules as S  # noqa: E402
from torch.distributed.pipelining.schedules import (  # noqa: E402
    _Action,
    _add_send_recv,
    _PipelineScheduleRuntime,
    _simulate_comms_compute,
    _validate_schedule,
)

from schedules import ScheduleError, build, lower, validate  # noqa: E402
from schedules.analysis import unit_summary  # noqa: E402
from schedules.torch_interop import from_torch_order, from_torch_text, to_torch_actions, to_torch_text  # noqa: E402

SINGLE_COPY = ["gpipe", "dapple", "interleaved", "zb-h1", "zb-v", "dualpipe-v"]


def fake_stages(D, num_stages, per_rank, rank=0):
    """What PyTorch's schedule constructors read from a stage (no process group, no module)."""
    return [types.SimpleNamespace(num_stages=num_stages, group_size=D, group_rank=rank, stage_index=i,
                                  submod=None, stage_index_to_group_rank=None, is_first=i == 0,
                                  is_last=i == num_stages - 1)
            for i in range(per_rank)]


def torch_order(cls, D, N, per_rank):
    stages = fake_stages(D, D * per_rank, per_rank)
    if issubclass(cls, S.PipelineScheduleSingle):
        return cls(stages[0], N)._get_pipeline_order()
    return cls(stages, N).pipeline_order


def torch_compute_actions(sched, **kw):
    return {r: [_Action.from_str(t) for t in row] for r, row in enumerate(to_torch_actions(sched, **kw))}


def admissible(name, D, Ns):
    for N in Ns:
        try:
            yield N, build(name, D, N)
        except ScheduleError:
            continue


# ---------------------------------------------------------------------------------- export
def test_export_tokens_exact():
    assert to_torch_text(build("dapple", 2, 2)) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1"
    assert to_torch_text(build("zb-h1", 2, 2)) == "0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1F1,1I1,1W0,1W1"
    assert to_torch_text(build("zb-h1", 2, 2), merge_backward=True, sep=" ").splitlines()[0] == "0F0 0F1 0B0 0B1"
    # V placement: rank 0 holds stages 0 and 3, the V turn 1 -> 2 stays on rank 1
    zbv = to_torch_actions(build("zb-v", 2, 3))
    assert zbv[0][:5] == ["0F0", "0F1", "0F2", "3F0", "3I0"]
    assert {t[0] for t in zbv[1]} == {"1", "2"}


def test_export_refuses_two_copies():
    with pytest.raises(ScheduleError, match="2 model copies"):
        to_torch_text(build("bitpipe", 4, 4))


@pytest.mark.parametrize("name", SINGLE_COPY)
def test_exported_schedules_pass_torch_lowering_and_simulator(name):
    checked = 0
    for D in (2, 4):
        for N, s in admissible(name, D, (D, 2 * D, 3 * D + 1, 4 * D)):
            actions = torch_compute_actions(s)
            stage_to_rank = _validate_schedule(actions, D, s.num_stages, N)
            assert stage_to_rank == {st: s.placement[0][st] for st in range(s.num_stages)}
            with_comms = _add_send_recv({r: list(a) for r, a in actions.items()},
                                        stage_to_rank=stage_to_rank.__getitem__, num_stages=s.num_stages)
            steps = _simulate_comms_compute(with_comms, stage_to_rank.__getitem__, s.num_stages)
            ran = Counter(str(a) for row in steps.values() for a in row if a is not None)
            want = Counter(str(a) for row in with_comms.values() for a in row)
            assert ran == want                        # every compute and comm action ran once
            # one SEND per cross-rank hop, matched by one RECV
            sends = sum(1 for row in with_comms.values() for a in row if a.computation_type.value.startswith("SEND"))
            recvs = sum(1 for row in with_comms.values() for a in row if a.computation_type.value.startswith("RECV"))
            hops = sum(1 for st in range(s.num_stages - 1) if s.placement[0][st] != s.placement[0][st + 1])
            assert sends == recvs == 2 * hops * N
            checked += 1
    assert checked >= 4


@pytest.mark.parametrize("name,D,N", [("zb-h1", 4, 6), ("zb-v", 4, 8), ("dualpipe-v", 4, 8), ("interleaved", 4, 8)])
def test_torch_runtime_loads_exported_csv(tmp_path, name, D, N):
    s = build(name, D, N)
    path = tmp_path / f"{name}.csv"
    path.write_text(to_torch_text(s))
    rt = _PipelineScheduleRuntime(fake_stages(D, s.num_stages, len(s.stages_on(0))), N)
    rt._load_csv(str(path))          # PyTorch's validation + lowering (unshard, reduce_grad, send/recv)
    assert rt.stage_index_to_group_rank == {st: s.placement[0][st] for st in range(s.num_stages)}
    comm = {r: [a for a in row if a.computation_type.value not in ("UNSHARD", "RESHARD", "REDUCE_GRAD")]
            for r, row in rt.pipeline_order_with_comms.items()}
    _simulate_comms_compute(comm, rt.stage_index_to_group_rank.__getitem__, s.num_stages)
    reduce = [a for row in rt.pipeline_order_with_comms.values() for a in row
              if a.computation_type.value == "REDUCE_GRAD"]
    assert len(reduce) == s.num_stages    # one gradient reduction per stage, after its last W/B


def test_dualpipe_v_export_with_overlap_tokens():
    s = build("dualpipe-v", 4, 10)
    rows = to_torch_actions(s, overlap=True)
    acts = {r: [_Action.from_str(t) for t in row] for r, row in enumerate(rows)}
    n_overlap = sum(1 for row in acts.values() for a in row if a.computation_type.value == "OVERLAP_F_B")
    assert n_overlap == len(s.meta["overlapped"])
    stage_to_rank = _validate_schedule(acts, 4, 8, 10)
    _add_send_recv(acts, stage_to_rank.__getitem__, 8)
    back = from_torch_order(rows, name="dualpipe-v")
    assert back.programs == s.programs and back.meta["overlapped"] == list(map(tuple, s.meta["overlapped"]))


# ------------------------------------------------------------------------- same as PyTorch's
@pytest.mark.parametrize("D", [1, 2, 3, 4, 6, 8])
def test_zb_v_and_dualpipe_v_equal_pytorch_orders(D):
    for N in range(1, 4 * D + 1):
        ours = to_torch_actions(build("zb-v", D, N))
        theirs = torch_order(S.ScheduleZBVZeroBubble, D, N, 2)
        assert ours == [[str(a) for a in theirs[r] if a is not None] for r in range(D)], (D, N)
        if N >= 2 * D:
            ours = to_torch_actions(build("dualpipe-v", D, N), overlap=True)
            theirs = torch_order(S.ScheduleDualPipeV, D, N, 2)
            assert ours == [[str(a) for a in theirs[r] if a is not None] for r in range(D)], (D, N)


@pytest.mark.parametrize("D", [2, 4, 8])
def test_zb_h1_equals_pytorch_zero_bubble_with_one_stage_per_rank(D):
    for N in range(1, 4 * D + 1):
        if N % max(1, N // D):
            continue                     # PyTorch needs N to be a multiple of its round count
        theirs = from_torch_order(torch_order(S.ScheduleInterleavedZeroBubble, D, N, 1), num_microbatches=N)
        assert theirs.programs == build("zb-h1", D, N).programs


# ---------------------------------------------------------------------------------- import
def test_import_text_and_round_trip():
    for name in SINGLE_COPY:
        for D, N in [(2, 4), (4, 8)]:
            s = build(name, D, N)
            back = from_torch_text(to_torch_text(s), name=name)
            assert back.programs == s.programs and back.placement == s.placement
            assert back.split_backward == s.split_backward
    grid = "Rank 0: 0F0 0F1 0I0 0W0 0I1 0W1\nRank 1: 1F0 1I0 1F1 1I1 1W0 1W1"
    assert from_torch_text(grid).programs == build("zb-h1", 2, 2).programs


def test_import_mixed_full_and_split_backward():
    s = from_torch_text("0F0,0F1,0B0,0I1,0W1\n1F0,1B0,1F1,1B1")
    assert s.split_backward and sorted(s.meta["full_backward"]) == [(0, 0), (1, 0), (1, 1)]
    assert s.to_text().splitlines()[1] == "1: F0.s1 B0.s1 W0.s1 F1.s1 B1.s1 W1.s1"
    assert to_torch_text(s) == "0F0,0F1,0B0,0I1,0W1\n1F0,1B0,1F1,1B1"
    validate(lower(s))


@pytest.mark.parametrize("text,msg", [
    ("0F0,0X0", r"cannot parse PyTorch action '0X0'"),
    ("0F0,0B0\n0F0,0B0", "stage 0 runs on rank 0 and rank 1"),
    ("0F0,0B0,2F0,2B0", r"stages \[1\] never run"),
    ("0F", "has no micro-batch index"),
])
def test_import_errors(text, msg):
    with pytest.raises(ScheduleError, match=msg):
        from_torch_text(text)


def test_import_skips_comm_and_fsdp_actions():
    s = from_torch_text("0UNSHARD,0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD,0RESHARD\n1RECV_F0,1F0,1B0,1SEND_B0")
    assert s.programs == build("dapple", 2, 1).programs


def test_pytorch_1f1b_pipeline_order_is_rejected_with_a_clear_message():
    """PyTorch 2.13's Schedule1F1B._get_pipeline_order (a description; its step() runs its own
    loop) lists F1..FN on the last rank instead of F0..F(N-1)."""
    order = torch_order(S.Schedule1F1B, 4, 4, 1)
    assert [str(a) for a in order[3] if a is not None][:2] == ["3F1", "3B0"]
    with pytest.raises(ScheduleError, match=r"rank 3: action 3F4 names micro-batch 4, outside 0..3"):
        from_torch_order(order, num_microbatches=4)


BUILTINS = [  # class, chunks per rank, pipetwin family with the same order (or None), makespan
    (S.ScheduleGPipe, 1, "gpipe", lambda D, N, v: 3 * (N + D - 1)),
    (S.ScheduleInterleaved1F1B, 1, "interleaved", lambda D, N, v: 3 * N + 3 * (D - 1) / v),
    (S.ScheduleInterleaved1F1B, 2, "interleaved", lambda D, N, v: 3 * N + 3 * (D - 1) / v),
    (S.ScheduleInterleaved1F1B, 3, "interleaved", lambda D, N, v: 3 * N + 3 * (D - 1) / v),
    (S.ScheduleLoopedBFS, 2, None, lambda D, N, v: 3 * N + 3 * (D - 1) / v),
    (S.ScheduleLoopedBFS, 3, None, lambda D, N, v: 3 * N + 3 * (D - 1) / v),
    (S.ScheduleInterleavedZeroBubble, 1, "zb-h1", lambda D, N, v: 3 * N + (D - 1) / v),
    (S.ScheduleInterleavedZeroBubble, 2, None, lambda D, N, v: 3 * N + (D - 1) / v),
    (S.ScheduleInterleavedZeroBubble, 3, None, lambda D, N, v: 3 * N + (D - 1) / v),
    (S.ScheduleZBVZeroBubble, 2, "zb-v", lambda D, N, v: 3 * N + (D - 1) / 2),
    (S.ScheduleDualPipeV, 2, "dualpipe-v", lambda D, N, v: 3 * N + (D - 1) / 2),
]


@pytest.mark.parametrize("cls,v,family,makespan", BUILTINS, ids=lambda x: getattr(x, "__name__", str(x)))
def test_pytorch_builtins_import_validate_and_time(cls, v, family, makespan):
    for D in (2, 4, 8):
        for N in (2 * D, 4 * D):
            s = from_torch_order(torch_order(cls, D, N, v), name=cls.__name__, num_microbatches=N)
            assert s.num_stages == v * D and s.num_devices == D
            for R in (1, 2):
                validate(lower(s, replicas=R))
            u = unit_summary(s)                   # time_programs: raises on a deadlock
            assert u["makespan"] == pytest.approx(makespan(D, N, v)), (cls.__name__, D, N)
            if family is not None:
                kw = {"chunks": v} if family == "interleaved" else {}
                assert s.programs == build(family, D, N, **kw).programs
