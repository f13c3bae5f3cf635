"""Overlapped F&B pairs in the executor (:mod:`executor.overlap`), dense models: segments = blocks.

In process: a stage's F cut at its blocks and interleaved with another micro-batch's B gives the
gradients of the unsegmented forward and backward (full, and split into B then W), the phases
alternating F, B, F, B, ... (F first); the order a rank runs a DualPipe-V program in, pairs as
blocks, is the simulator's (RECVs first, then the pair, then F's SEND).

Spawned (one spawn, world 2, D = 2, N = 4, a GPT of 8 blocks: 2 per stage of a V or interleaved
schedule, 4 per stage of dapple): dualpipe-v (its own pairs, split backward), zb-v (split backward)
interleaved and dapple with ``--overlap-fb``, each with recompute none, selective and full: every
step's loss within 1e-5 of the single-process reference's, every final parameter within 1e-5;
the trace records each pair as the simulator does (F spans the block, B zero-length at its end,
right after it), and the sub-phases alternate the two ops' segments exactly.

Mixtures of experts (a second spawn, world 4: D = 2 x R = 2 at EP 2, the tiny Mixtral and the tiny
DeepSeek: MLA, a shared expert, a dense first block): each MoE block cut at its dispatch and combine
(three segments, two asynchronous all-to-alls), dualpipe-v and zb-v with ``--overlap-fb``, recompute
none / selective / full, ZeRO-1: losses and parameters within 1e-5 of the reference's; each pair's
F has 3 compute phases per MoE block (1 per dense block) and 2 comm phases per MoE block. In the
same spawn the dense GPT with ZeRO-3 (zb-v, D 2 x R 2), to the same bounds.
"""
import pytest
import torch

from cost_models import load_model
from executor.backward import SplitBackward, full_backward, weight_backward
from executor.config import RunConfig, lowered_schedule
from executor.launch import run_many
from executor.model import stage_module
from executor.overlap import COMPUTE, backward_segments, forward_segments, interleave, run_alone, steps_of
from executor.runtime import execution_order
from tests.helpers import assert_losses_equal, assert_params_equal_reference, reference_cache

SPEC = load_model("tiny").replace(layers=8, hidden=32, heads=4, seq_len=16, vocab=64)
BASE = dict(steps=2, optimizer="sgd", lr=0.05, collect_params=True, timeout=30.0, model=SPEC, devices=2,
            microbatches=4, overlap_fb=True)
CASES = {f"{s}-{rc}": RunConfig.of(schedule=s, recompute=rc, **BASE)
         for s in ("dualpipe-v", "zb-v", "interleaved", "dapple") for rc in ("none", "selective", "full")}


def _nothing():
    import contextlib
    return contextlib.nullcontext()


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("split", [False, True])
def test_interleaved_pair_gives_the_unsegmented_gradients(split):
    """Stage 1 of 3 (3 blocks: 3 segments): F of micro-batch a interleaved with B of micro-batch b
    (whose F ran segmented before) equals F(a), then B(b) unsegmented: same output, same input and
    parameter gradients (W after B when split)."""
    torch.manual_seed(0)
    spec = SPEC.replace(layers=9)
    xa, xb = torch.randn(2, 16, 32), torch.randn(2, 16, 32)
    gb = torch.randn(2, 16, 32)
    ref = stage_module(spec, 3, 1)
    ya = ref(xa)
    xb_ref = xb.clone().requires_grad_(True)
    full_backward(ref(xb_ref), gb)
    want, want_gx = _grads(ref), xb_ref.grad

    mod = stage_module(spec, 3, 1)
    assert len(steps_of(mod)) == 3
    xb_leaf = xb.clone().requires_grad_(True)
    segs_b = run_alone(forward_segments(steps_of(mod), xb_leaf, _nothing))
    splits = [SplitBackward(mod.parameters()) for _ in segs_b]
    pend = []

    def run(i, seg, g):
        if split:
            gx, p = splits[i].input(seg.out, seg.inp, g)
            pend.append(p)
            return gx
        full_backward(seg.out, g)
        return seg.inp.grad

    segs_a, gx, phases = interleave(forward_segments(steps_of(mod), xa.clone().requires_grad_(True), _nothing),
                                    backward_segments(segs_b, gb, run), "F", "B", lambda: 0.0)
    for p in pend:
        weight_backward(p)
    assert [(p.token, p.segment, p.kind) for p in phases] == \
        [(t, k, COMPUTE) for k in range(3) for t in ("F", "B")]
    assert torch.equal(segs_a[-1].out, ya)
    assert torch.allclose(gx, want_gx, rtol=1e-5, atol=1e-7)
    for n, g in _grads(mod).items():
        assert torch.allclose(g, want[n], rtol=1e-5, atol=1e-7), n


def test_a_rank_runs_each_pair_as_one_block_as_the_simulator_orders_it():
    low = lowered_schedule(RunConfig.of(schedule="dualpipe-v", devices=2, microbatches=4))
    prog = low.program(0)
    got = ["&".join(str(prog[i]) for i in item) for item in execution_order(prog, low.meta["overlapped"], 0)]
    assert got == ['F0.s0', 'SA0.s0>1', 'F1.s0', 'SA1.s0>1', 'F2.s0', 'SA2.s0>1', 'RA0.s3.k1<1', 'F0.s3.k1',
                   'B0.s3.k1', 'SG0.s3.k1>1', 'W0.s3.k1', 'RA1.s3.k1<1', 'F1.s3.k1', 'F3.s0&B1.s3.k1', 'SA3.s0>1',
                   'SG1.s3.k1>1', 'W1.s3.k1', 'RA2.s3.k1<1', 'RG0.s0<1', 'F2.s3.k1&B0.s0', 'W0.s0', 'B2.s3.k1',
                   'SG2.s3.k1>1', 'W2.s3.k1', 'RA3.s3.k1<1', 'RG1.s0<1', 'F3.s3.k1&B1.s0', 'W1.s0', 'B3.s3.k1',
                   'SG3.s3.k1>1', 'W3.s3.k1', 'RG2.s0<1', 'B2.s0', 'W2.s0', 'RG3.s0<1', 'B3.s0', 'W3.s0', 'OPT']


def test_a_pair_that_is_not_back_to_back_is_refused():
    low = lowered_schedule(RunConfig.of(schedule="dapple", devices=2, microbatches=4))
    with pytest.raises(ValueError, match="overlapped pair F0.s0 & B3.s1 is not back to back"):
        execution_order(low.program(0), [(("F", 0, 0), ("B", 1, 3))], 0)


@pytest.fixture(scope="module")
def results():
    return dict(zip(CASES, run_many(list(CASES.values()))))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_overlapped_runs_equal_the_reference(results, case):
    res = results[case]
    cfg = CASES[case]
    sched = lowered_schedule(cfg)
    ref = reference_cache()(cfg)
    assert_losses_equal(res, ref)
    assert_params_equal_reference(res, ref, sched)
    pairs = [(tuple(a), tuple(b)) for a, b in sched.meta["overlapped"]]
    assert len(pairs) == {"dualpipe-v": 6, "zb-v": 6, "interleaved": 6, "dapple": 3}[cfg.layout.schedule]
    # each pair as the simulator records it: F spans the block, B zero-length at its end, right after F
    tr = res.trace
    blocks = SPEC.layers // sched.num_stages
    phases = res.extra["phases"]
    for step in range(cfg.steps):
        for (fk, fs, fm), (bk, bs, bm) in pairs:
            f = tr[(tr.step == step) & (tr.kind == fk) & (tr.stage == fs) & (tr.microbatch == fm)].iloc[0]
            b = tr[(tr.step == step) & (tr.kind == bk) & (tr.stage == bs) & (tr.microbatch == bm)].iloc[0]
            assert (b.device, b.seq, b.start, b.end) == (f.device, f.seq + 1, f.end, f.end)
            # sub-phases: F's segments (one per block) and B's (its F's: cut even where that F ran alone)
            mine = [(p["token"], p["segment"]) for p in phases
                    if p["step"] == step and p["device"] == f.device and p["token"] in (f.token, b.token)]
            assert mine == [(t, k) for k in range(blocks) for t in (f.token, b.token)]


MOE_BASE = dict(steps=2, optimizer="sgd", lr=0.05, collect_params=True, timeout=60.0, devices=2, microbatches=4,
                replicas=2, ep=2, overlap_fb=True)
MOE = {f"{m}-{s}-{rc}": RunConfig.of(schedule=s, recompute=rc, model=m, **MOE_BASE)
       for m, s, rc in (("tiny-mixtral", "dualpipe-v", "none"), ("tiny-mixtral", "dualpipe-v", "selective"),
                        ("tiny-mixtral", "dualpipe-v", "full"), ("tiny-mixtral", "zb-v", "none"),
                        ("tiny-mixtral", "zb-v", "selective"), ("tiny-mixtral", "zb-v", "full"),
                        ("tiny-deepseek", "dualpipe-v", "full"), ("tiny-deepseek", "zb-v", "selective"))}
MOE["tiny-mixtral-dualpipe-v-zero1"] = MOE["tiny-mixtral-dualpipe-v-none"].with_(zero=1)
# dense at world 4 in the same spawn: ZeRO-3 (weights gathered around each op of a pair)
MOE["dense-zb-v-zero3"] = RunConfig.of(schedule="zb-v", zero=3, **dict(BASE, replicas=2))


@pytest.fixture(scope="module")
def moe_results():
    return dict(zip(MOE, run_many(list(MOE.values()))))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MOE))
def test_overlapped_moe_runs_equal_the_reference(moe_results, case):
    res = moe_results[case]
    cfg = MOE[case]
    sched = lowered_schedule(cfg)
    ref = reference_cache()(cfg.with_(ep=1))
    assert_losses_equal(res, ref)
    assert_params_equal_reference(res, ref, sched)
    spec = cfg.spec()
    per_stage = spec.layers // sched.num_stages
    moe_blocks = {s: sum(1 for b in range(s * per_stage, (s + 1) * per_stage) if b >= spec.dense_layers)
                  for s in range(sched.num_stages)}
    phases = [p for p in res.extra["phases"] if p["step"] == 0]
    paired_f = {tuple(a) for a, _ in sched.meta["overlapped"]}
    assert paired_f
    tr = res.trace
    for kind, stage, mb in paired_f:
        row = tr[(tr.step == 0) & (tr.kind == kind) & (tr.stage == stage) & (tr.microbatch == mb)]
        for dev in row.device:
            mine = [p["kind"] for p in phases if p["device"] == dev and p["token"] == row.token.iloc[0]]
            m = moe_blocks[stage] if spec.is_moe else 0
            assert (mine.count(COMPUTE), mine.count("comm")) == (3 * m + per_stage - m, 2 * m)
