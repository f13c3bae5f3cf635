"""Overlapped F&B pairs with tensor parallelism (``--overlap-fb --tp 2``, with and without sequence
parallelism): each dense block cut at its attention's row-parallel reduction and at its MLP's
(:func:`executor.overlap.tp_block_steps`; the stage's last block keeps its MLP's reduction), the
reductions (all-reduce, or SP's reduce-scatter) started asynchronously at their cuts and waited for
after the other op's next segment, SP's backward all-gather alike.

One spawn at world 4 (D 2 x T 2, N 4): dapple and zb-v, SP off and on, recompute selective and full
(and none), a GPT of 4 blocks and a Llama: every step's loss within 1e-5 of the single-process
reference's, every final parameter too; each pair's sub-phases are exactly the turns of the
interleaving: with n blocks per stage, F has 2n segments and 2n - 1 cuts, each exchanging (F's
turn k > 0 = the wait, then segment k), B walks the same 2n segments back (its F was cut, paired or
not), waiting at a cut only with SP (the gradient's all-gather; without SP a reduction's backward is
the identity), and the two alternate turn by turn, F first:

    F c0, B c0, F (m1 c1), B ([m1] c1), ..., F (m_{2n-1} c_{2n-1}), B ([m_{2n-1}] c_{2n-1}).

Memory (a GPT of 4 blocks, h = 256, no dropout, flash attention; dapple, steps 1): the bytes each
segment of a cut forward keeps equal :func:`cost_models.segments.block_segments`, to the byte, plus
what the ledger leaves out: each LayerNorm's mean and 1/std (fp32, 2 x 4 sb / t' bytes; t' = T with
SP, else 1), one LayerNorm per segment (ln1 in segment 1, ln2 in segment 2), none under full
recomputation (a segment keeps its input only); the first segment of stage 0 (the embedding folded
in) within 1 % of the simulator's ``act_segments``. The peak per rank within 1 % of the simulator's
(:func:`cost_models.memory.peak_activation` with its per-segment pair booking,
:func:`cost_models.memory.pair_memory`, on the executor's lowered schedule: the cost model refuses
``--overlap-fb`` on a dense model, so the binding is made without it and the pairs are the run's).
"""
from __future__ import annotations

import dataclasses

import pytest

from cost_models import load_model
from cost_models.bind import bind
from cost_models.job import Job
from cost_models.memory import peak_activation
from cost_models.segments import block_segments
from executor.config import RunConfig
from executor.overlap import COMM, COMPUTE
from tests.helpers import assert_losses_equal, assert_params_equal_reference, reference_cache

SPEC = load_model("tiny").replace(layers=4, hidden=32, heads=4, seq_len=16, vocab=64)
LLAMA = SPEC.replace(name="tiny-llama", kind="llama", kv_heads=2, ffn_hidden=48)
BASE = dict(steps=2, optimizer="sgd", lr=0.05, collect_params=True, timeout=60.0, model=SPEC, tp=2,
            device_map="megatron", devices=2, microbatches=4, overlap_fb=True)
MEM_SPEC = SPEC.replace(hidden=256, dropout=False, attention="flash")
MEM = dict(BASE, model=MEM_SPEC, optimizer="adam", lr=1e-3, steps=1, collect_params=False)

LOSS = {f"{s}-sp{int(sp)}-{rc}": RunConfig.of(schedule=s, sequence_parallel=sp, recompute=rc, **BASE)
        for s in ("dapple", "zb-v") for sp in (False, True) for rc in ("selective", "full")}
LOSS["zb-v-sp0-none"] = RunConfig.of(schedule="zb-v", **BASE)
LOSS["llama-dapple-sp1-none"] = RunConfig.of(schedule="dapple", sequence_parallel=True, **dict(BASE, model=LLAMA))
LOSS["llama-zb-v-sp0-full"] = RunConfig.of(schedule="zb-v", recompute="full", **dict(BASE, model=LLAMA))
MEMORY = {f"mem-dapple-sp{int(sp)}-{rc}": RunConfig.of(schedule="dapple", sequence_parallel=sp, recompute=rc, **MEM)
          for sp, rc in ((False, "none"), (True, "none"), (False, "selective"), (True, "full"))}
CASES = {4: {**LOSS, **MEMORY}}


def turns(f_token: str, b_token: str, segments: int, b_waits: bool) -> list[tuple]:
    """The sub-phases (token, segment, kind) of a pair whose F and B have ``segments`` segments each,
    every F cut exchanging and B's only where ``b_waits`` (module docstring)."""
    out = []
    for k in range(segments):
        out += [(f_token, k, COMM)] if k else []
        out += [(f_token, k, COMPUTE)]
        out += [(b_token, k, COMM)] if k and b_waits else []
        out += [(b_token, k, COMPUTE)]
    return out


def test_turns_closed_form():
    """Two blocks per stage (4 segments), SP off: F waits at each of its 3 cuts, B at none."""
    assert turns("F", "B", 4, False) == [
        ("F", 0, COMPUTE), ("B", 0, COMPUTE), ("F", 1, COMM), ("F", 1, COMPUTE), ("B", 1, COMPUTE),
        ("F", 2, COMM), ("F", 2, COMPUTE), ("B", 2, COMPUTE), ("F", 3, COMM), ("F", 3, COMPUTE), ("B", 3, COMPUTE)]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LOSS) + list(MEMORY))
def test_overlapped_tp_runs_equal_the_reference_and_run_the_interleaving(runs, case):
    cfg, sched, res = runs(4)[case]
    if cfg.collect_params:
        ref = reference_cache()(cfg)
        assert_losses_equal(res, ref)
        assert_params_equal_reference(res, ref, sched)
    pairs = [(tuple(a), tuple(b)) for a, b in sched.meta["overlapped"]]
    assert len(pairs) == {"zb-v": 6, "dapple": 3}[cfg.layout.schedule]
    blocks = cfg.spec().layers // sched.num_stages
    tr = res.trace
    seen = 0
    for step in range(cfg.steps):
        for (fk, fs, fm), (bk, bs, bm) in pairs:
            f = tr[(tr.step == step) & (tr.kind == fk) & (tr.stage == fs) & (tr.microbatch == fm)].iloc[0]
            b = tr[(tr.step == step) & (tr.kind == bk) & (tr.stage == bs) & (tr.microbatch == bm)].iloc[0]
            mine = [(p["token"], p["segment"], p["kind"]) for p in res.extra["phases"]
                    if p["step"] == step and p["device"] == f.device and p["token"] in (f.token, b.token)]
            assert mine == turns(f.token, b.token, 2 * blocks, cfg.parallel.sequence_parallel), (f.token, b.token)
            seen += 1
    assert seen == len(pairs) * cfg.steps


def _ln_stats(spec, sp: bool) -> int:
    """A LayerNorm's saved mean and 1/std: fp32, per token of the rank's sequence."""
    return 2 * 4 * spec.micro_batch * spec.seq_len // (2 if sp else 1)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MEMORY))
def test_segment_bytes_and_peaks_equal_the_simulators(runs, case):
    cfg, sched, res = runs(4)[case]
    spec, par = cfg.spec(), cfg.parallel
    sp, rc = par.sequence_parallel, par.recompute
    b = bind(Job(layout=cfg.layout, parallel=dataclasses.replace(par, overlap_fb=False), model=spec,
                 cluster="dgx-a100-1x8"))
    per_stage = spec.layers // sched.num_stages
    rows = res.extra["segment_bytes"]
    assert {(r["device"], r["stage"]) for r in rows} == {(0, 0)}    # dapple's pairs: stage 0's F and B
    for r in rows:
        st = r["stage"]
        want = [x for i in range(st * per_stage, (st + 1) * per_stage)
                for x in block_segments(spec, i, tp=2, sp=sp, recompute=rc, dropout=False)]
        extra = 0 if rc == "full" else _ln_stats(spec, sp)
        assert len(r["bytes"]) == len(want) == 2 * per_stage
        assert r["bytes"][1:] == [int(w) + extra for w in want[1:]], (r["bytes"], want)
        sim = b.costs.act_segments[r["copy"]][st]
        assert abs(r["bytes"][0] - sim[0]) <= 0.01 * sim[0], (r["bytes"][0], sim[0])
    measured = [d["peak_activation_bytes"] for d in res.per_device]
    simulated = peak_activation(sched, b.costs)
    for m, s in zip(measured, simulated):
        assert abs(m - s) <= 0.01 * s, (measured, simulated)
