"""The whole-layout search of a mixture of experts: EP (and ETP) and the forward/backward overlap
as axes, the brute-force twin on a small MoE, EP winning where unsharded experts do not fit, the
bounds with experts, the plan file and the command line."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cost_models import ModelSpec
from cost_models.cluster import load_cluster, with_nodes
from cost_models.job import Job
from cost_models.moe import expert_params
from cost_models.transformer import model_params, transformer_layers
from planner.layout import (PAIRED_FAMILIES, LayoutSpace, NoPlanFits, _Bounds, candidates,
                            plan_layouts)
from planner.plan_io import LayoutPlan, layout_plan_record, load_plan
from sim import simulate_job
from experiments.cli import main
from tests.helpers import assert_search_is_the_brute_force

GiB = 2 ** 30
# 4 llama blocks whose MLP is 8 experts of width 1024, top-2: small enough to simulate every layout
MOE = ModelSpec(name="small-moe", kind="llama", layers=4, hidden=1024, heads=16, kv_heads=4, ffn_hidden=2816,
                seq_len=1024, vocab=32000, micro_batch=1, dtype_bytes=2, experts=8, top_k=2, expert_ffn=1024)
DENSE = replace(MOE, name="small-dense", experts=0, top_k=0, expert_ffn=None)
# ZeRO 0 and 1: the expert axes' counts and claims below (ZeRO-2/3 with experts: tests/test_fsdp_sim.py)
SPACE = LayoutSpace(schedules=("dapple", "dualpipe-v"), micro_batches=(1, 2), recompute=("none",), tp=(1, 2),
                    sequence_parallel=(True,), zero=(0, 1))


def _cluster():
    """2 H100 nodes of 4 GPUs (8 GPUs: EP up to 8 spans both nodes)."""
    return replace(with_nodes(load_cluster("dgx-h100-ib"), 2), devices_per_node=4, nics_per_node=4)


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def test_ep_takes_every_divisor_of_the_experts_that_folds_and_overlap_only_where_pairs_hide_all_to_alls():
    """EP: the divisors of the 8 experts that divide T x R (cost_models.moe's rule); overlap_fb True only
    on dualpipe-v with EP > 1; EP > 1 in Megatron's order, EP 1 in the sequential one."""
    jobs = candidates(MOE, _cluster(), 16, SPACE)
    assert len(jobs) == 182
    by_layout = {}
    for j in jobs:
        par, lay = j.parallel, j.layout
        by_layout.setdefault((par.tp, lay.replicas), set()).add(par.ep)
        assert j.device_map == ("megatron" if par.ep > 1 else "sequential")
        assert par.overlap_fb <= (lay.schedule in PAIRED_FAMILIES and par.ep > 1)
    assert by_layout == {(t, r): {e for e in _divisors(8) if (t * r) % e == 0} for t, r in by_layout}
    assert by_layout[(1, 8)] == {1, 2, 4, 8} and by_layout[(2, 1)] == {1, 2} and by_layout[(1, 2)] == {1, 2}
    paired = [j for j in jobs if j.layout.schedule == "dualpipe-v" and j.parallel.ep > 1]
    assert sum(j.parallel.overlap_fb for j in jobs) == len(paired) // 2 == 46
    # --overlap-fb: every schedule's pairs; no overlap asked at all: none
    every = candidates(MOE, _cluster(), 16, replace(SPACE, overlap_schedules=("dapple", "dualpipe-v")))
    assert sum(j.parallel.overlap_fb for j in every) == sum(j.parallel.ep > 1 for j in jobs
                                                            if not j.parallel.overlap_fb) == 92
    assert not any(j.parallel.overlap_fb for j in candidates(MOE, _cluster(), 16, replace(SPACE, overlap_fb=(False,))))


def test_a_dense_model_has_no_expert_axes():
    """A dense model's space is T x D x R x ... alone: EP 1, no overlap, the sequential order; an MoE
    option given for it is the check's line."""
    jobs = candidates(DENSE, _cluster(), 16, SPACE)
    moe1 = [j for j in candidates(MOE, _cluster(), 16, SPACE) if j.parallel.ep == 1]
    # at D = 1 a dense model's families are dapple's alone (planner.layout._one_stage): 8 DualPipe-V fewer
    assert len(moe1) == 44 and len(jobs) == 36 == \
        sum(not (j.layout.devices == 1 and j.layout.schedule == "dualpipe-v") for j in moe1)
    assert {(j.parallel.ep, j.parallel.etp, j.parallel.overlap_fb, j.device_map) for j in jobs} == \
        {(1, 1, False, "sequential")}
    with pytest.raises(ValueError, match="^--ep acts on a mixture of experts; model small-dense is dense"):
        candidates(DENSE, _cluster(), 16, replace(SPACE, ep=(2,)))
    with pytest.raises(ValueError, match="^--fp8-dispatch acts on a mixture of experts"):
        candidates(DENSE, _cluster(), 16, replace(SPACE, knobs=replace(SPACE.knobs, fp8_dispatch=True)))


def test_an_ep_that_folds_onto_no_layout_is_the_checks_line():
    with pytest.raises(ValueError, match=r"^--ep 3 fits no layout of the space: --ep 3 x --etp 1 must divide"):
        candidates(MOE, _cluster(), 16, replace(SPACE, ep=(3,)))
    with pytest.raises(ValueError, match=r"^--ep 16 fits no layout of the space: --ep 16 x --etp 1 must divide"):
        candidates(MOE, _cluster(), 16, replace(SPACE, ep=(4, 16)))
    with pytest.raises(ValueError, match="knobs: ep is an axis of the search"):
        LayoutSpace(knobs=replace(SPACE.knobs, ep=2))


def test_search_equals_brute_force_on_a_small_moe():
    """Every candidate bound, judged by the ledger and simulated: the search's top 3 are the brute
    force's best 3; every bound is below its truth; EP 4 wins (each GPU all-reduces the gradients of
    2 experts over EDP 1 instead of 8 over 8), with the overlap on (its all-to-alls behind the paired
    op's compute), ahead of the same layout without it."""
    cl = _cluster()
    brute, fits, res = assert_search_is_the_brute_force(MOE, cl, 16, SPACE)
    assert len(fits) == 140      # 42 refused: dualpipe-v needs 2D micro-batches
    assert res.simulated < len(fits) and res.candidates == len(brute) == 182
    best = res.best.job
    assert (best.layout.schedule, best.parallel.tp, best.layout.devices, best.layout.replicas,
            best.parallel.micro_batch, best.parallel.zero, best.parallel.ep, best.parallel.overlap_fb) == \
        ("dualpipe-v", 1, 2, 4, 1, 1, 4, True)
    ep1 = min(x.iteration_time for x in fits if x.job.parallel.ep == 1)
    serial = next(x for x in fits if x.job == best.with_(overlap_fb=False))
    assert res.best.iteration_time < serial.iteration_time < ep1


def test_memory_bound_holds_the_experts_as_the_cost_model_does():
    """Static bytes per GPU of T=1, D=2, R=4, ZeRO-1, EP 4 (16-bit weights, fp32 gradients, 12 bytes
    of Adam state a parameter): the dense parameters with their optimizer state over R = 4, the 2
    experts a GPU holds per block with theirs over EDP = T R / EP = 1; plus the transients (a send and
    a receive buffer of the boundary, b s h d each, and of the dispatch, b s k h d each) and the mean
    over the 2 devices of micro-batch 0's activations, which a device keeps from its forwards until its
    first backward (at EP 4 with the expert rank's regrouping orders)."""
    job = next(j for j in candidates(MOE, _cluster(), 16, SPACE)
               if (j.layout.schedule, j.layout.devices, j.layout.replicas, j.parallel.tp, j.parallel.zero,
                   j.parallel.ep, j.parallel.micro_batch) == ("dapple", 2, 4, 1, 1, 4, 1))
    experts = 4 * 8 * expert_params(MOE)
    assert expert_params(MOE) == 3 * 1024 * 1024
    dense = model_params(MOE) - experts
    static = dense * (2 + 4 + 12 / 4) + experts / 4 * (2 + 4 + 12 / 1)
    assert (dense, static) == (76_063_744, 1_137_558_528)
    transient = 2 * 1024 * 1024 * 2 + 2 * 1024 * 2 * 1024 * 2
    acts = sum(x.act_bytes for x in transformer_layers(MOE))      # one micro-batch through the model
    # the routing's int64 indices and gate weights: 1024 tokens x k 2 x (8 + 16 + 2) bytes in each of 4 blocks
    assert acts == 274_079_744 + 4 * 1024 * 2 * (8 + 16 + 2) == 274_292_736
    regroup = 4 * 1024 * 2 * 16     # at EP 4 each block's two int64 regrouping orders a pair (moe.regroup_bytes)
    assert _Bounds(MOE, _cluster()).memory(job) == pytest.approx((static + acts + regroup) / 2 + transient, rel=1e-12)


def test_ep_wins_where_unsharded_experts_do_not_fit():
    """Under 0.7 GiB a GPU, no layout with every expert on every GPU fits (the smallest needs 749 MiB:
    dapple T=2, D=2, R=2, ZeRO-1); the search finds an EP > 1 layout that does."""
    cl, lim = _cluster(), 0.7 * GiB
    with pytest.raises(NoPlanFits, match=r"no plan fits: the smallest needs 749 MiB per GPU"):
        plan_layouts(MOE, cl, 16, replace(SPACE, ep=(1,)), memory_limit=lim)
    res = plan_layouts(MOE, cl, 16, SPACE, memory_limit=lim)
    best = res.best
    assert best.memory_need <= lim
    assert (best.job.layout.schedule, best.job.parallel.tp, best.job.layout.devices, best.job.layout.replicas,
            best.job.parallel.zero, best.job.parallel.ep, best.job.parallel.overlap_fb) == \
        ("dapple", 2, 2, 2, 1, 4, False)     # at the h100 preset's fitted efficiency (Llama 3 Table 4)


def test_an_ep_plan_round_trips_and_simulates_to_the_planners_time(tmp_path):
    cl = _cluster()
    res = plan_layouts(MOE, cl, 16, replace(SPACE, schedules=("dualpipe-v",), ep=(4,), overlap_fb=(True,)))
    best = res.best
    assert (best.job.parallel.ep, best.job.parallel.overlap_fb, best.job.device_map) == (4, True, "megatron")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(layout_plan_record(best.job, cl, 16, simulated=res.records()[0])))
    loaded = load_plan(path)
    assert isinstance(loaded, LayoutPlan)
    job = loaded.job()
    assert (job.layout, job.parallel, job.device_map) == (best.job.layout, best.job.parallel, best.job.device_map)
    _, sim = simulate_job(Job(plan=loaded))
    assert sim.iteration_time == best.iteration_time
    assert json.loads(path.read_text())["job"]["parallel"]["ep"] == 4


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_cli_searches_ep_and_shows_it(tmp_path, capsys):
    """``plan --ep auto`` (the default) prints the ep and overlap columns; --json has ep, etp,
    overlap_fb; --ep 3 is one line."""
    model = tmp_path / "moe.yaml"
    model.write_text("\n".join(f"{k}: {v}" for k, v in MOE.__dict__.items() if v is not None and v is not False)
                     + "\n")
    args = ["plan", "--model", str(model), "--cluster", "dgx-h100-ib:1", "-G", "16", "--schedules",
            "dapple,dualpipe-v", "--micro-batch", "1", "--recompute", "none", "--tp", "1", "--no-progress"]
    rc, out, err = run_cli(capsys, *args, "--ep", "auto", "--json")
    assert rc == 0, err
    top = json.loads(out)["top"][0]
    assert (top["schedule"], top["devices"], top["dp"], top["ep"], top["etp"], top["device_map"]) == \
        ("dualpipe-v", 1, 8, 8, 1, "megatron")
    assert top["overlap_fb"] in (False, True)
    rc, out, err = run_cli(capsys, *args)
    assert rc == 0, err
    head = [line for line in out.splitlines() if line.lstrip().startswith("tp")][0].split()
    assert head[:11] == ["tp", "devices", "dp", "schedule", "chunks", "micro_batch", "recompute", "zero", "sp", "ep",
                         "overlap"]
    rc, out, err = run_cli(capsys, *args, "--overlap-fb", "--top", "40", "--json")     # every schedule's pairs
    recs = json.loads(out)["top"]
    assert rc == 0 and {(r["schedule"], r["overlap_fb"]) for r in recs if r["ep"] > 1} == \
        {("dapple", False), ("dapple", True), ("dualpipe-v", False), ("dualpipe-v", True)}
    assert not any(r["overlap_fb"] for r in recs if r["ep"] == 1)
    rc, out, err = run_cli(capsys, *args, "--ep", "3")
    assert rc == 2
    assert err.strip().splitlines()[-1].startswith("pipetwin: error: --ep 3 fits no layout of the space")


def test_overlapped_ops_take_at_least_their_all_to_alls_and_their_slowed_compute():
    """max(a2a, compute + share x a2a): 10 s of compute under 4 s of all-to-alls at share 1/4 take 11 s
    (3 s of compute hide, at 3/4 speed, behind the 4 s); 2 s of compute take the 4 s of all-to-alls."""
    from planner.layout import overlapped
    assert overlapped(10.0, 4.0, 0.25) == 11.0
    assert overlapped(2.0, 4.0, 0.25) == 4.0
    assert overlapped(7.0, 0.0, 0.25) == 7.0
