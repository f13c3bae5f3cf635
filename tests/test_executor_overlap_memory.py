"""Activation memory of overlapped F&B pairs (``--overlap-fb``, DualPipe-V's own pairs): the runtime's
sampled metering (one metered forward per stage, segment and segmentation; the others accounted
segment by segment, released as B and W free them, :class:`executor.runtime.PipelineRuntime`)
equals metering every forward, and the peaks against the non-overlapped runs and the simulator's
ledger (:func:`cost_models.memory.peak_activation`, overlapped pairs booked per segment), and the
simulator's pair memory from :mod:`cost_models.segments` against the measured peaks."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from cost_models import load_model
from cost_models.bind import bind
from cost_models.job import Job
from cost_models.memory import peak_activation
from executor.config import RunConfig

DENSE = load_model("tiny").replace(layers=8, hidden=32, heads=4, seq_len=16, vocab=64)
# routing balanced by construction (top-k = E), as tests/test_executor_ep.py's ledger test
BALANCED = load_model("tiny-mixtral").replace(name="mem-mixtral", hidden=256, ffn_hidden=384, experts=4, top_k=4,
                                              dropout=False, attention="flash")
BASE = dict(steps=1, optimizer="sgd", lr=0.05, timeout=60.0, devices=2, microbatches=4, replicas=2)
RUNS = [("dense", DENSE, {}), ("moe", BALANCED, {"ep": 2})]
CASES = {4: {f"{name}-{s}-ov{int(ov)}-ev{int(ev)}": RunConfig.of(schedule=s, model=m, overlap_fb=ov,
                                                                 meter_every_forward=ev, **dict(BASE, **kw))
             for name, m, kw in RUNS for s in ("dapple", "zb-v", "dualpipe-v") for ov in (False, True)
             for ev in (False, True) if not (ev and not ov)}}


def _peaks(runs, case) -> list[int]:
    return [d["peak_activation_bytes"] for d in runs(4)[case][2].per_device]


def _ledger(cfg) -> list[int]:
    par = cfg.parallel if cfg.spec().is_moe else dataclasses.replace(cfg.parallel, overlap_fb=False)
    b = bind(Job(layout=cfg.layout, parallel=par, model=cfg.spec(), cluster="dgx-a100-1x8"))
    return [int(x) for x in peak_activation(b.lowered, b.costs)]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(k for k in CASES[4] if k.endswith("-ov1-ev0")))
def test_sampled_metering_of_overlapped_pairs_equals_metering_every_forward(runs, case):
    """Per rank, the peak with one metered forward per stage and segmentation (the others accounted
    per segment: F adds a segment's bytes as it ends, B releases them as it frees the segment's
    graph, W what a split B kept: a tuple segment's retained graph) equals the peak with every
    forward metered, to the byte, and so do the bytes alive after every op. Before, an overlapped F
    was accounted whole at the pair's end, after its B's release, and B released a retained graph
    at B: dapple's stage 0 read half its peak."""
    assert _peaks(runs, case) == _peaks(runs, case.replace("-ev0", "-ev1"))
    cols = ["device", "step", "seq", "act_mem"]
    a, b = (runs(4)[k][2].trace[cols].sort_values(cols[:3]).reset_index(drop=True)
            for k in (case, case.replace("-ev0", "-ev1")))
    assert a.equals(b)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_overlapped_peaks_against_non_overlapped_and_the_ledger(runs, name):
    """Closed forms per rank (D 2, N 4, R 2; ranks d and d + 2 alike; S = one micro-batch's stage-0
    activations, half of dapple's non-overlapped peak 2 S on device 0).

    - Non-overlapped runs (dapple, zb-v) and dualpipe-v (its own pairs) within 1 % of the ledger.
    - dapple with overlap: device 0 runs F0, then the pairs (F1 & B0), (F2 & B1), (F3 & B2): F's
      first segment (the first block with the embedding) runs before B0's last; B frees a block's
      graph per segment as F keeps one, so the peak is S + s1 (s1: the first segment's bytes), not
      2 S (what the simulator booked before it booked pairs per segment,
      :func:`cost_models.memory.pair_memory`; test_simulated_pair_memory_equals_measured). Device 1
      (the last stage: F and B of one micro-batch, unpaired) equals the non-overlapped run.
    - zb-v with overlap: dense, device 0 equals the non-overlapped peak; with MoE blocks every
      paired B walks its F's segments (an F whose B is paired is cut even alone) and a tuple
      segment's split B keeps its graph until W (B takes the input gradients with
      ``retain_graph``, :class:`executor.overlap.RetainedWeightGrad`), so device 0 keeps more than
      the non-overlapped run (4,682,308 B against 4,427,972): within 1 % of the simulator's pair
      booking (:func:`cost_models.memory.pair_memory`, 4,705,796 B)."""
    cases = runs(4)
    led = {s: _ledger(cases[f"{name}-{s}-ov0-ev0"][0]) for s in ("dapple", "zb-v", "dualpipe-v")}
    for s in ("dapple", "zb-v", "dualpipe-v"):
        for ov in ((0, 1) if s == "dualpipe-v" else (0,)):
            for got, want in zip(_peaks(runs, f"{name}-{s}-ov{ov}-ev0"), led[s]):
                assert abs(got - want) <= 0.01 * want, (s, ov, got, want)
    plain, ov = _peaks(runs, f"{name}-dapple-ov0-ev0"), _peaks(runs, f"{name}-dapple-ov1-ev0")
    assert ov[1] == plain[1] and ov[3] == plain[3]
    assert plain[0] % 2 == 0
    seg = _segment_bytes(cases[f"{name}-dapple-ov1-ev0"][0])
    want = plain[0] // 2 + _pair_peak(seg)
    if name == "dense":
        assert sum(seg) == plain[0] // 2
        assert ov[0] == ov[2] == want, (ov, plain, seg)
    else:     # EP 2 adds the experts' row regrouping indices (tests/test_executor_ep.py)
        assert abs(sum(seg) - plain[0] // 2) <= 0.01 * sum(seg)
        assert ov[0] == ov[2] and abs(ov[0] - want) <= 0.01 * want, (ov, plain, seg)
    zp, zo = _peaks(runs, f"{name}-zb-v-ov0-ev0"), _peaks(runs, f"{name}-zb-v-ov1-ev0")
    if name == "dense":
        assert zo[0] == zp[0] and zo[2] == zp[2]
    led_ov = _ledger(cases[f"{name}-zb-v-ov1-ev0"][0])     # dense: booked without the pairs
    for got, want in zip(zo, led_ov):
        assert abs(got - want) <= 0.01 * want, (zo, led_ov)



def _segment_bytes(cfg) -> list[int]:
    """Bytes each segment of stage 0's paired forward keeps for backward (block 0 with the
    embedding first; a MoE block's three: up to the dispatch, the experts, the combine's rest; at EP
    1, with balanced routing the same rows per rank as at EP 2), metered in this process by the
    runtime's meter, segment by segment as the runtime runs them."""
    import contextlib

    from executor.device import SavedTensorMeter
    from executor.model import stage_module
    from executor.overlap import forward_segments, run_alone, steps_of
    spec = cfg.spec()
    module = stage_module(spec, 2, 0)
    meter = SavedTensorMeter(list(module.parameters()))
    kept = []

    @contextlib.contextmanager
    def enter():
        before = meter.current()
        with meter.capture():
            yield
        kept.append(meter.current() - before)

    x = torch.randint(0, spec.vocab, (spec.micro_batch, spec.seq_len))
    segs = run_alone(forward_segments(steps_of(module), x, enter))
    assert len(segs) == len(kept)
    return kept


def _pair_peak(s: list[int]) -> int:
    """The most a pair (F & B of a micro-batch whose F kept the same ``s``) adds over what was alive
    before it: F's segment k runs after B's segments n .. n - k + 2 freed theirs,
    max_k (s_1 + .. + s_k - s_{n-k+2} - .. - s_n)."""
    n = len(s)
    return max(sum(s[:k]) - sum(s[n - k + 1:]) for k in range(1, n + 1))


# ---------------------------------------------------------------------------- simulated and measured sub-phases
CASES[4]["tiny-mixtral-dualpipe-v"] = RunConfig.of(schedule="dualpipe-v", model="tiny-mixtral", overlap_fb=True,
                                                   **dict(BASE, ep=2))


def _runs_of(seq: list[str]) -> list[str]:
    """The kinds with consecutive repeats merged: the executor cuts a stage's forward at every block,
    the simulator's phases only at its all-to-alls (two compute segments with no exchange between
    them are one compute phase there)."""
    return [k for i, k in enumerate(seq) if i == 0 or k != seq[i - 1]]


@pytest.mark.slow
def test_simulated_pair_sub_phases_equal_the_executors(runs):
    """For every overlapped pair of a tiny-mixtral dualpipe-v run at EP 2 (D 2, N 4, R 2), on every
    rank, the simulator's sub-phases of the pair (:func:`sim.overlap.overlapped_pair` on the bound
    costs' phases of the pair's F and B stages) have, per op, the executor's measured kinds in the
    executor's order: F and B each compute, comm (the dispatch, then the combine of each MoE block
    of the stage), ..., compute; and both list the F's phases from the pair's first one. One
    difference, the cost model's: a MoE block's F phases end at its combine
    (``TransformerCostModel.layer_segments`` counts the weighted sum and the residual in the
    compute before the dispatch), so where no layer follows the stage's last combine the
    simulator's F ends on comm and the executor's with that compute. A paired B whose own F ran
    unpaired (D 2, N 4: every paired B's F ran in the warm-up) walks its F's segments too: an F
    whose B is paired is cut even alone, so the B overlaps its all-to-alls as the simulator's does."""
    from sim.overlap import overlapped_pair
    cfg, sched, res = runs(4)["tiny-mixtral-dualpipe-v"]
    b = bind(Job(layout=cfg.layout, parallel=cfg.parallel, model=cfg.spec(), cluster="dgx-a100-1x8"))
    costs = b.costs
    spec = cfg.spec()
    phases = [p for p in res.extra["phases"] if p["step"] == 0]
    tr = res.trace
    tr = tr[tr.step == 0]
    checked = 0
    for (fk, fs, fm), (bk, bs, bm) in sched.meta["overlapped"]:
        for dev in sorted(set(tr[(tr.kind == fk) & (tr.stage == fs) & (tr.microbatch == fm)].device)):
            rows = tr[tr.device == dev]
            f_tok = rows[(rows.kind == fk) & (rows.stage == fs) & (rows.microbatch == fm)]
            b_tok = rows[(rows.kind == bk) & (rows.stage == bs) & (rows.microbatch == bm)]
            f_row, b_row = f_tok.iloc[0], b_tok.iloc[0]
            mine = [p for p in phases if p["device"] == dev and p["token"] in (f_row.token, b_row.token)]
            pt = overlapped_pair(costs.phases_f[int(f_row["copy"])][fs], costs.phases_b[int(b_row["copy"])][bs],
                                 costs.comm_sm_share)
            for op, tok in (("F", f_row.token), ("B", b_row.token)):
                measured = _runs_of([p["kind"] for p in mine if p["token"] == tok])
                simulated = _runs_of([p.kind for p in pt.phases if p.op == op])
                blocks = sum(1 for i in range(spec.layers) if i >= spec.dense_layers) // sched.num_stages
                assert measured == ["compute", "comm"] * (2 * blocks) + ["compute"]
                if op == "F" and simulated[-1] == "comm":    # no layer after the stage's last combine
                    simulated = simulated + ["compute"]
                assert measured == simulated, (dev, op, tok, measured, simulated)
            assert mine[0]["token"] == f_row.token and pt.phases[0].op == "F"
            checked += 1
    assert checked == len(sched.meta["overlapped"]) * sched.replicas


# ---------------------------------------------------------------------------- the simulator's pair memory
def test_pair_peak_closed_form():
    """:func:`cost_models.memory.pair_peak` by hand. F's segments (3, 5, 2) with B's (4, 1, 6),
    a full backward: F1 +3 (3, the peak), B frees 6 (-3), F2 +5 (2), B frees 1 (1), F3 +2 (3), B
    frees 4: the pair peaks 3 over what was alive and leaves 10 - 11 = -1. A split B keeping
    (1, 0, 2) until W frees (4, 1, 3) in that order: 3, -1, 4, 3, 5, 2: peak 5, leaves 10 - 8 = 2."""
    from cost_models.memory import pair_peak
    assert pair_peak((3, 5, 2), (4, 1, 6)) == (3, -1)
    assert pair_peak((3, 5, 2), (4, 1, 6), (1, 0, 2)) == (5, 2)
    # B longer than F: its remaining segments free after F's last; a one-segment B frees all at once
    assert pair_peak((3,), (4, 1, 6)) == (3, -8)
    assert pair_peak((3, 5, 2), (11,)) == (3, -1)


def test_block_segments_closed_forms_and_metered():
    """The segments of BALANCED's MoE block (b 2, s 16: n = 32 tokens, h 256, a 4, k_v 2, e 64, E 4,
    k 4: pairs = 128, f_e 384, d 4, flash attention, no dropout), by hand:
    (1) R = 4 sbh d = 131,072; S = sb (4 + 2 + 2 + 4) e d = 98,304; A = 4 a s b = 512; scores 4 n E =
    512; indices 8 n k = 1,024 and 16 pairs = 2,048: 233,472;
    (2) pairs (h + 3 f_e) d = 720,896; (3) pairs (h + 1) d = 131,584; summing to the ledger's block.
    A split B keeps each whole with its output gradients: (1) 2 n h d + pairs (h + 1) d + d =
    197,124, (2) pairs h d = 131,072, (3) n h d = 32,768 more. tiny (gpt: b 2, s 32, h 64, a 4, e 16,
    f 256, d 4, flash, no dropout; sbh = 4,096) at T = 2 with SP, cut at the attention's
    reduce-scatter: (1) 2 sbh d / 2 + 4 sb a e d / 2 + 4 a s b / 2 = 16,384 + 32,768 + 512 = 49,664,
    (2) 2 sbh d / 2 + 2 sb f d / 2 = 81,920; W keeps (1) 2 sbh d / 2 + (sbh + sb 3 a e) d / 2 = 49,152,
    (2) 2 sbh d / 2 + 2 sb f d / 2 = 81,920 (summing to the ledger's 131,072). Metered by the runtime's meter on stage
    0 of 2 (two blocks, the embedding's int64 ids, 8 b s = 256, folded into the first segment):
    segments 2 and 3 to the byte, segment 1 272 B over (the experts' regrouping indices the ledger
    leaves out, 0.12 %)."""
    from cost_models.segments import block_segments, segment_weight_grads, stage_segments
    from cost_models.transformer import block_activation_bytes
    spec = BALANCED
    segs = block_segments(spec, 0)
    assert segs == (233472.0, 720896.0, 131584.0)
    assert sum(segs) == block_activation_bytes(spec, moe=True)
    assert segment_weight_grads(spec, 0) == (233472.0 + 197124, 720896.0 + 131072, 131584.0 + 32768)
    cfg = CASES[4]["moe-dapple-ov1-ev0"]
    acts, _ = stage_segments(spec, range(2), first=True, last=False)
    assert acts == (233472.0 + 256, 720896.0, 131584.0, 233472.0, 720896.0, 131584.0)
    got = _segment_bytes(cfg)
    assert [g - a for g, a in zip(got, acts)] == [272, 0, 0, 272, 0, 0]
    dense = load_model("tiny")
    assert block_segments(dense, 0) == (block_activation_bytes(dense),)      # T = 1: one segment
    assert block_segments(dense, 0, tp=2, sp=True) == (49664.0, 81920.0)
    assert segment_weight_grads(dense, 0, tp=2, sp=True) == (49152.0, 81920.0)
    assert block_activation_bytes(dense, tp=2, sp=True) == 49664 + 81920


@pytest.mark.slow
@pytest.mark.parametrize("case", ["moe-dapple-ov1-ev0", "moe-zb-v-ov1-ev0", "moe-dualpipe-v-ov1-ev0"])
def test_simulated_pair_memory_equals_measured(runs, case):
    """Per rank, the simulator's peak activation bytes (pairs booked segment by segment,
    :func:`cost_models.memory.pair_memory`) within 1 % of the executor's measured peak (D 2, N 4,
    R 2, EP 2, balanced routing). Measured / simulated, rank 0 and 1: dapple --overlap-fb
    3,002,160 / 3,001,344 and 2,250,660 / 2,249,728 (before: 4,344,320 on rank 0, +45 %); zb-v with
    overlap 4,682,308 / 4,713,988 and 4,681,284 / 4,712,964 (before: -7.2 % on rank 1: a tuple
    segment's split B keeps its graph and output gradients until W); dualpipe-v 5,844,700 /
    5,875,716 and 5,769,556 / 5,800,964."""
    from sim.engine import run
    cfg = CASES[4][case][0] if isinstance(CASES[4][case], tuple) else CASES[4][case]
    b = bind(Job(layout=cfg.layout, parallel=cfg.parallel, model=cfg.spec(), cluster="dgx-a100-1x8"))
    sim = run(b.lowered, b.costs, b.network).peak_activation
    got = _peaks(runs, case)
    assert len(sim) == len(got)
    for g, s in zip(got, sim):
        assert abs(s - g) <= 0.01 * g, (case, got, sim)


def test_simulated_pair_rows_hold_the_pair_peak():
    """The simulator's trace of dapple --overlap-fb on BALANCED (D 2, N 4, EP 2), device 0, stage 0:
    S = 2,176,256 (the stage's ledger bytes: two blocks of (233,472, 722,944, 131,584), the experts'
    720,896 B and EP 2's regrouping orders' 2,048; the embedding's 256 in the first segment).
    F0 runs alone, cut (its B is paired): S. Pair (F1 & B0):
    B0 walks F0's segments, freeing 131,584 after F1's first (233,728):
    S + 233,728 - 131,584 + 722,944 = 3,001,344 (the peak) in the F1 row, then S in the B0 row;
    F2 & B1 and F3 & B2 alike; B3 (alone) frees all: 0."""
    from sim.engine import simulate
    cfg = CASES[4]["moe-dapple-ov1-ev0"]
    b = bind(Job(layout=cfg.layout, parallel=cfg.parallel, model=cfg.spec(), cluster="dgx-a100-1x8"))
    S = 2 * (233472 + 722944 + 131584) + 256
    assert b.costs.act[0][0] == S
    tr = simulate(b.lowered, b.costs, b.network)
    rows = tr[(tr.device == 0) & tr.kind.isin(["F", "B"])].sort_values("seq")
    got = [(k, int(m), int(a)) for k, m, a in zip(rows.kind, rows.microbatch, rows.act_mem)]
    assert got == [("F", 0, S), ("F", 1, 3001344), ("B", 0, S), ("F", 2, 3001344), ("B", 1, S),
                   ("F", 3, 3001344), ("B", 2, S), ("B", 3, 0)]
