"""Activation memory of overlapped F&B pairs (``--overlap-fb``, DualPipe-V's own pairs): the runtime's
sampled metering (one metered forward per stage, segment and segmentation; the others accounted
segment by segment, released as B and W free them, :class:`executor.runtime.PipelineRuntime`)
equals metering every forward, and the peaks against the non-overlapped runs and the simulator's
ledger (:func:`cost_models.memory.peak_activation`)."""
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
      the ledger's 2 S (the simulator allocates a pair's F at its end, before B frees). Device 1
      (the last stage: F and B of one micro-batch, unpaired) equals the non-overlapped run.
    - zb-v with overlap: dense, device 0 equals the non-overlapped peak; with MoE blocks device 1
      keeps more than the ledger: a tuple segment's split B keeps its graph until W (B takes the
      input gradients with ``retain_graph``, :class:`executor.overlap.RetainedWeightGrad`), where
      the ledger keeps only ``act_w``."""
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
    assert zo[0] == zp[0] and zo[2] == zp[2]
    if name == "dense":
        for got, want in zip(zo, led["zb-v"]):
            assert abs(got - want) <= 0.01 * want, (zo, led["zb-v"])



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
