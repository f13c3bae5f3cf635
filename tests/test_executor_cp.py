"""Context parallelism in the executor (gloo on the CPU) against the single-process reference.

Three spawns of 4 processes run the matrix (processes reused across jobs): C = 2 x D = 2 (GPT and
Llama, ring and all-gather, dapple, the split backward of zb-v and zb-h1, full and selective
recomputation), T = 2 x C = 2 x D = 1 (with and without sequence parallelism) and C = 2 x R = 2 x
D = 1 (ZeRO-1 sharded over the R x C ranks that hold a stage). A small GPT (4 blocks, 4 heads,
16 tokens: 4 chunks of 4) trains 2 SGD steps: every per-step loss equals the reference's within
1e-5 (relative), every final parameter within 1e-5 of the reference's, the CP ranks of a pipeline
rank end with bit-identical weights, the trace of each pipeline rank is its lowered program op by
op, and a stage boundary carries b x s/C x h (/T with sequence parallelism).

Memory (``mem-`` cases, a wider model, Adam, one step): the measured peak activation bytes per
rank within 1% of the simulator's ledger at C = 2 (:func:`cost_models.transformer.context_parallel_layers`:
the formulas at s/C), with ring and all-gather, recomputation and the split backward; weights,
gradients and optimizer state per rank equal to the ledger's. The attention core itself is
checked at C = 3 against scaled_dot_product_attention on the whole sequence, in fp64, forward and
backward, and for what it keeps (its closed form below).
"""
import os
from dataclasses import replace

import pytest
import torch

from cost_models import load_model
from cost_models.job import Job
from executor.config import RunConfig, lowered_schedule
from executor.context_parallel import ContextParallel
from executor.launch import launch, run
from executor.mesh import Mesh, placement
from executor.reference import run_reference
from tests.helpers import assert_losses_equal, assert_params_equal_reference, reference_cache

SPEC = load_model("tiny").replace(layers=4, hidden=32, heads=4, seq_len=16, vocab=64)
LLAMA = SPEC.replace(name="tiny-llama", kind="llama", kv_heads=2, ffn_hidden=48)
BASE = dict(steps=2, optimizer="sgd", lr=0.05, collect_params=True, timeout=60.0, model=SPEC, cp=2)


def _c2d2():
    cases = {}
    for model in (SPEC, LLAMA):
        for comm in ("ring", "allgather"):
            for sched in ("dapple", "zb-v")[:2 if model is SPEC or comm == "allgather" else 1]:
                cases[f"{model.kind}-{sched}-{comm}-C2D2"] = RunConfig.of(
                    schedule=sched, devices=2, microbatches=4, cp_comm=comm, **dict(BASE, model=model))
    for sched, rc, comm in (("dapple", "full", "ring"), ("dapple", "selective", "allgather"),
                            ("zb-v", "full", "allgather"), ("zb-v", "selective", "ring"), ("zb-h1", "full", "ring")):
        cases[f"gpt-{sched}-{comm}-recompute-{rc}-C2D2"] = RunConfig.of(
            schedule=sched, devices=2, microbatches=4, cp_comm=comm, recompute=rc, **BASE)
    cases["llama-zb-v-ring-recompute-full-C2D2"] = RunConfig.of(
        schedule="zb-v", devices=2, microbatches=4, recompute="full", **dict(BASE, model=LLAMA))
    return cases


CASES = {"C2D2": _c2d2(),
         "T2C2": {f"{m.kind}-{comm}-{'sp' if sp else 'tp'}-T2C2": RunConfig.of(
             schedule="dapple", devices=1, microbatches=2, tp=2, cp_comm=comm, sequence_parallel=sp,
             **dict(BASE, model=m)) for m in (SPEC, LLAMA) for comm in ("ring", "allgather") for sp in (False, True)},
         "C2R2": {f"{s}-zero{z}{'-reshard' if r else ''}-C2R2": RunConfig.of(
             schedule=s, devices=1, microbatches=2, replicas=2, zero=z, reshard_after_forward=r, **BASE)
             # ZeRO 2 and 3 shard over the R x C = 4 ranks that hold a stage, as ZeRO-1 does
             for s, z, r in (("dapple", 0, False), ("dapple", 1, False), ("dapple", 2, False),
                             ("zb-v", 3, True))}}
# memory against the simulator's ledger: the wider model of tests/test_executor_tp.py (flash
# attention, no dropout, as the executor's model), Adam (16 bytes per fp32 parameter), one step
MEM_SPEC = SPEC.replace(hidden=256, dropout=False, attention="flash")
MEM_LLAMA = MEM_SPEC.replace(name="mem-llama", kind="llama", kv_heads=2, ffn_hidden=384)
MEM = dict(BASE, model=MEM_SPEC, optimizer="adam", lr=1e-3, steps=1, collect_params=False)
for _s, _rc, _c, _m in (("dapple", "none", "ring", MEM_SPEC), ("dapple", "full", "allgather", MEM_SPEC),
                        ("dapple", "selective", "ring", MEM_SPEC), ("zb-v", "none", "allgather", MEM_SPEC),
                        ("zb-v", "full", "ring", MEM_SPEC), ("dapple", "none", "ring", MEM_LLAMA),
                        ("zb-h1", "none", "allgather", MEM_LLAMA)):
    CASES["C2D2"][f"mem-adam-{_m.kind}-{_s}-{_c}-{_rc}-C2D2"] = RunConfig.of(
        schedule=_s, devices=2, microbatches=4, recompute=_rc, cp_comm=_c, **dict(MEM, model=_m))
IDS = [(w, k) for w, cases in CASES.items() for k in cases if "mem-" not in k]
MEMORY_IDS = [("C2D2", k) for k in CASES["C2D2"] if k.startswith("mem-")]


@pytest.fixture(scope="module")
def references():
    return reference_cache()


@pytest.mark.slow
@pytest.mark.parametrize("world,case", IDS, ids=[k for _, k in IDS])
def test_losses_and_parameters_equal_reference(runs, references, world, case):
    cfg, sched, res = runs(world)[case]
    ref = references(cfg)
    assert_losses_equal(res, ref)
    assert res.losses[-1] < res.losses[0]
    by_name = assert_params_equal_reference(res, ref, sched)
    # the C ranks of a pipeline rank start from the same weights and sum the same gradients
    assert res.extra["cp_replica_drift"] == 0.0
    assert cfg.parallel.tp == 1 or res.extra["tp_replica_drift"] == 0.0
    if cfg.parallel.zero:    # ZeRO over R x C: every replica ends with the same weights
        assert all(torch.equal(t, ts[0]) for ts in by_name.values() for t in ts)


@pytest.mark.slow
@pytest.mark.parametrize("world,case", IDS + MEMORY_IDS, ids=[k for _, k in IDS + MEMORY_IDS])
def test_trace_is_the_lowered_program_and_boundaries_carry_s_over_c(runs, world, case):
    """Process (CP 0, TP 0) stands for its pipeline rank (as one simulated rank does): its trace
    rows, step by step, are the ops of the rank's lowered program in order; every SEND/RECV
    carries b x (s/C) x h fp32 numbers (/T with sequence parallelism)."""
    cfg, sched, res = runs(world)[case]
    t = res.trace
    for rank in range(sched.num_ranks):
        mine = t[t["device"] == rank].sort_values(["step", "seq"])
        want = [str(op) for op in sched.program(rank)] * cfg.steps
        assert list(mine["token"]) == want
    spec = cfg.spec()
    tokens = spec.seq_len // cfg.parallel.cp // (cfg.parallel.tp if cfg.parallel.sequence_parallel else 1)
    p2p = t[t["kind"].isin(["SEND", "RECV"])]["bytes"]
    assert (p2p == spec.micro_batch * tokens * spec.hidden * 4).all()
    assert len(p2p) == sum(op.kind in ("SEND", "RECV") for prog in sched.programs for op in prog) * cfg.steps


@pytest.mark.slow
@pytest.mark.parametrize("world,case", MEMORY_IDS, ids=[k for _, k in MEMORY_IDS])
def test_memory_per_rank_equals_the_simulators_ledger(runs, world, case):
    """Measured peak activation bytes per rank (the saved-tensor meter of process (CP 0, TP 0))
    within 1% of the simulator's ledger at C = 2: the formulas at s/C, the flash row statistics
    included (:func:`cost_models.transformer.context_parallel_layers`). The attention keeps what
    Transformer Engine's CP attention keeps, for the ring and the all-gather alike: this rank's
    Q, K, V, the output and the fp32 log-sum-exp; the other ranks' K/V are received again in the
    backward, not kept (so no term grows with C). Weights, gradients and Adam's state per rank
    equal the ledger's exactly (CP splits no weight)."""
    from cost_models.bind import bind
    from cost_models.memory import peak_activation
    cfg, sched, res = runs(world)[case]
    ledger = bind(Job(layout=cfg.layout, parallel=cfg.parallel, model=cfg.spec(), cluster="dgx-a100-1x8"))
    assert [op for prog in ledger.lowered.programs for op in prog] == [op for prog in sched.programs for op in prog]
    act = peak_activation(ledger.lowered, ledger.costs)
    measured = [d["peak_activation_bytes"] for d in res.per_device]
    assert len(measured) == len(act) == sched.num_ranks
    for m, want in zip(measured, act):
        assert abs(m - want) <= 0.01 * want, (measured, act)
    assert [d["static_bytes"] for d in res.per_device] == [int(x) for x in ledger.costs.static_mem]


@pytest.mark.slow
def test_context_parallelism_halves_the_measured_activations(runs):
    """What the ledger's s/C says, measured: at C = 2 a rank keeps about half of what the whole
    sequence keeps (the same model at T = 1, the ledger's number at C = 1, within 1%)."""
    from cost_models.bind import bind
    from cost_models.memory import peak_activation
    for key in ("mem-adam-gpt-dapple-ring-none-C2D2", "mem-adam-llama-dapple-ring-none-C2D2"):
        cfg, _, res = runs("C2D2")[key]
        ledger = bind(Job(layout=cfg.layout, parallel=replace(cfg.parallel, cp=1), model=cfg.spec(),
                          cluster="dgx-a100-1x8"))
        whole = peak_activation(ledger.lowered, ledger.costs)
        for d, w in zip(res.per_device, whole):
            assert 0.49 * w <= d["peak_activation_bytes"] <= 0.51 * w, (d, w)


@pytest.mark.slow
def test_zero1_shards_the_optimizer_state_over_r_x_c(runs):
    """ZeRO-1 with CP: a stage's optimizer state is sharded over the R x C = 4 ranks that hold
    its weights (Megatron's distributed optimizer over DP x CP): SGD's momentum of n / 4 per rank
    against n unsharded, the same losses."""
    _, _, plain = runs("C2R2")["dapple-zero0-C2R2"]
    cfg, sched, zero = runs("C2R2")["dapple-zero1-C2R2"]
    for a, b in zip(zero.losses, plain.losses):
        assert abs(a - b) <= 1e-6 * abs(b)
    n = sum(v.numel() for k, v in zero.params.items() if k.startswith("r0."))
    for zd, pd in zip(zero.per_device, plain.per_device):
        assert pd["static_bytes"] == 3 * 4 * n                   # weights, gradients, momentum
        assert zd["static_bytes"] == 2 * 4 * n + 4 * -(-n // 4)  # the momentum of this rank's quarter


@pytest.mark.slow
def test_placement_is_tp_then_cp_then_pipeline(runs):
    """Process-group rank (p C + c) T + t runs on device (slot(p) C + c) T + t: a pipeline rank's
    T x C processes are consecutive devices, TP fastest (Llama 3's [TP, CP, PP, DP])."""
    _, _, res = runs("T2C2")["gpt-ring-tp-T2C2"]
    assert sorted((p["rank"], p["cp"], p["tp"], p["device"]) for p in res.extra["placement"]) == \
        [(0, c, t, c * 2 + t) for c in range(2) for t in range(2)]
    _, _, res = runs("C2D2")["gpt-dapple-ring-C2D2"]
    assert sorted((p["rank"], p["cp"], p["device"]) for p in res.extra["placement"]) == \
        [(d, c, d * 2 + c) for d in range(2) for c in range(2)]


def test_mesh_ranks_with_cp():
    mesh = Mesh(2, 3, cp=2)      # T = 2, C = 2, 3 pipeline ranks
    assert mesh.world == 12 and mesh.rank(1, 1, 1) == 7
    assert mesh.coords(7) == (1, 1) and mesh.cp_rank(7) == 1
    assert mesh.tp_group(2, 1) == (10, 11) and mesh.cp_group(2, 1) == (9, 11)
    assert mesh.lift((0, 2), 1, 1) == (3, 11)
    assert mesh.stage_group((0, 2), 0) == (0, 2, 8, 10)     # the R x C ranks that sum a stage's gradients
    sched = lowered_schedule(RunConfig.of(schedule="dapple", devices=2, microbatches=4, model=SPEC, tp=2, cp=2))
    assert [placement("sequential", sched, 2, 0, local, 1, 8, 2) for local in (0, 3, 5)] == [(0, 0), (3, 3), (5, 5)]
    with pytest.raises(ValueError, match=r"--tp 2 x --cp 2 = 4 does not divide the 6 processes per node"):
        placement("sequential", sched, 2, 0, 0, 2, 6, 2)


def test_chunks_and_positions_are_causally_balanced():
    """CP rank i of C holds chunks i and 2C-1-i of m = s/2C tokens: at s = 16, C = 2, rank 0 the
    positions 0-3 and 12-15, rank 1 4-11."""
    cps = [ContextParallel(2, i) for i in range(2)]
    assert [c.chunks() for c in cps] == [(0, 3), (1, 2)]
    assert cps[0].positions(16).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cps[1].positions(16).tolist() == list(range(4, 12))
    tokens = torch.arange(32).reshape(2, 16)
    assert cps[1].local(tokens)[1].tolist() == list(range(20, 28))


def _attention_rank(payload, rank, world, local_rank, local_world):
    """One CP rank of ``world``: the context-parallel attention of its tokens against
    scaled_dot_product_attention of the whole sequence (fp64: the largest differences of the
    output and of the three input gradients), and the bytes it keeps (fp32)."""
    import torch.distributed as dist
    import torch.nn.functional as Fn

    import executor.context_parallel as cpm
    from executor.context_parallel import attention
    from executor.worker import init_world
    init_world("cpu", rank, world, local_rank, local_world, timeout=60.0)    # the runs' own rendezvous
    sent, shift, gather = [0], cpm._shift, cpm._all_gather

    def counted_shift(cp, tensors):      # bytes this rank sends to the next one
        sent[0] += sum(t.numel() * t.element_size() for t in tensors)
        return shift(cp, tensors)

    def counted_gather(t, cp):           # an all-gather's ring sends C-1 blocks of each rank
        sent[0] += (cp.size - 1) * t.numel() * t.element_size()
        return gather(t, cp)
    cpm._shift, cpm._all_gather = counted_shift, counted_gather
    try:
        out = {}
        for comm in ("ring", "allgather"):
            cp = ContextParallel(world, rank, dist.new_group(list(range(world))), tuple(range(world)), comm)
            b, a, k, s, e = payload
            g = torch.Generator().manual_seed(7)
            q, kk, v, gy = (torch.randn(b, n, s, e, generator=g, dtype=torch.float64) for n in (a, k, k, a))
            whole = [t.clone().requires_grad_() for t in (q, kk, v)]
            y = Fn.scaled_dot_product_attention(whole[0], *(t.repeat_interleave(a // k, 1) for t in whole[1:]),
                                                is_causal=True)
            y.backward(gy)
            pos = cp.positions(s)
            mine = [t[:, :, pos].clone().requires_grad_() for t in (q, kk, v)]
            sent[0] = 0
            ym = attention(*mine, cp)
            out[comm + "-f-bytes"] = sent[0]
            ym.backward(gy[:, :, pos])
            out[comm + "-b-bytes"] = sent[0] - out[comm + "-f-bytes"]
            out[comm] = [float((ym - y[:, :, pos]).abs().max())] + \
                [float((m.grad - w.grad[:, :, pos]).abs().max()) for m, w in zip(mine, whole)]
            kept = {}

            def pack(t, kept=kept):
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t
            small = [t[:, :, pos].float().clone().requires_grad_() for t in (q, kk, v)]
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y32 = attention(*small, cp)
            out[comm + "-kept"] = sum(kept.values())
            out[comm + "-view"] = y32.transpose(1, 2).is_contiguous()
        return out
    finally:
        cpm._shift, cpm._all_gather = shift, gather
        dist.destroy_process_group()


@pytest.mark.slow
def test_attention_over_three_ranks_equals_the_whole_sequences():
    """C = 3 (6 chunks; GQA 4:2): both exchanges give the whole sequence's causal attention at each
    rank's positions, forward and backward, to fp64 rounding; each keeps exactly Q, K, V, the
    output and the fp32 log-sum-exp of its s/C tokens: 4 x (b a n e + 2 b k n e + b a n e) + 4 b a n
    bytes (n = s/C), whatever C. Bytes a rank sends per block, X = 2 b n k e d (its K and V): (C-1) X
    in the forward and 2 (C-1) X in the backward, for the ring (its P2P steps; dK/dV sums in C-1
    hops) and the all-gather (counted as a ring all-gather; the reduce-scatter of dK, dV is not
    counted here, it sends as much again), the cost model's closed forms."""
    b, a, k, s, e = 2, 4, 2, 24, 8
    got = launch("tests.test_executor_cp:_attention_rank", (b, a, k, s, e), 3)
    n = s // 3
    for comm in ("ring", "allgather"):
        assert max(got[comm]) < 1e-12, got[comm]
        assert got[comm + "-kept"] == 4 * (b * a * n * e + 2 * b * k * n * e + b * a * n * e) + 4 * b * a * n
        assert got[comm + "-view"]      # the output projection's input is a view of the kept output
    X = 2 * b * n * k * e * 8
    assert (got["ring-f-bytes"], got["ring-b-bytes"]) == (2 * X, 4 * X)             # (C-1) X, 2 (C-1) X
    assert (got["allgather-f-bytes"], got["allgather-b-bytes"]) == (2 * X, 2 * X)   # + the reduce-scatter's 2 X


def test_context_parallel_refusals():
    with pytest.raises(ValueError, match=r"--cp 3 needs the sequence length \(16\) divisible by 2 x 3 = 6"):
        lowered_schedule(RunConfig.of(schedule="dapple", devices=2, microbatches=4, model=SPEC, cp=3))
    with pytest.raises(ValueError, match=r"--cp 2 with --sequence-parallel needs each GPU's 12 tokens divisible by "
                                         r"--tp 8"):
        lowered_schedule(RunConfig.of(schedule="dapple", devices=1, microbatches=2, model=SPEC.replace(
            seq_len=24, heads=8, hidden=64), cp=2, tp=8, sequence_parallel=True))
    with pytest.raises(ValueError, match=r"--cp 2 splits the built-in GPT's sequence"):
        RunConfig.of(schedule="dapple", devices=2, microbatches=4, cp=2,
                     model=os.path.join(os.path.dirname(__file__), "..", "notebooks", "models", "tied_lm.py:build"))
    with pytest.raises(ValueError, match=r"--cp 2: the executor's context-parallel attention takes one head width for "
                                         r"Q, K and V; model tiny-deepseek's latent attention has 12-wide"):
        lowered_schedule(RunConfig.of(schedule="dapple", devices=2, microbatches=4, model="tiny-deepseek", cp=2))


def test_world_not_t_x_c_x_d_x_r_is_refused(monkeypatch):
    """Under torchrun the world must be T x C x D x R: refused before any process group starts."""
    for var, value in dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="29500", TORCHELASTIC_RUN_ID="test").items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("PIPETWIN_WORKDIR", raising=False)
    cfg = RunConfig.of(schedule="dapple", devices=2, microbatches=4, model=SPEC, tp=2, cp=2)
    with pytest.raises(ValueError, match=r"torchrun started 4 processes but the run needs T x C x D x R = "
                                         r"2 x 2 x 2 x 1 = 8"):
        run(cfg)


@pytest.mark.slow
def test_torchrun_runs_the_cp_mesh_placed_by_the_device_map():
    """Under torchrun (its environment variables, 2 nodes x 2 processes, gloo) C = 2 x D = 2: each
    node holds one pipeline rank's two CP ranks (local rank = CP rank); losses equal the reference's."""
    import json

    from tests.helpers import torchrun_cli
    outs = torchrun_cli(["-s", "dapple", "-D", "2", "-N", "2", "--cp", "2", "--cp-comm", "allgather", "--steps", "2",
                         "--device", "cpu", "--optimizer", "sgd", "--lr", "0.05", "--timeout", "60", "--json"],
                        timeout=180)
    assert [i for i, o in enumerate(outs) if o.strip()] == [0]
    res = json.loads(outs[0])
    assert res["cp"] == 2 and res["cp_comm"] == "allgather"
    assert [(p["rank"], p["cp"], p["node"], p["local_rank"]) for p in res["placement"]] == \
        [(0, 0, 0, 0), (0, 1, 0, 1), (1, 0, 1, 0), (1, 1, 1, 1)]
    ref = run_reference(RunConfig.of(schedule="dapple", devices=2, microbatches=2, steps=2, optimizer="sgd", lr=0.05))
    for a, b in zip(res["losses"], ref.losses):
        assert abs(a - b) <= 1e-5 * abs(b)
