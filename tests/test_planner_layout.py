"""The whole-layout planner (``pipetwin plan --tp``): equal to the brute force over the same space,
never worse than a grid simulated one by one, its bounds below the truth, memory verdicts equal to
the ledger's and to ``simulate``'s, plan files round-trip and simulate to the planner's time."""
from __future__ import annotations

import json

import pytest

from cost_models import load_cluster, with_nodes
from cost_models.job import Job, Layout
from cost_models.memory import fmt_bytes, memory_report, usable_memory
from cost_models.model_spec import ModelSpec, load_model
from cost_models.transformer import megatron_flops
from experiments.common import metrics_record
from planner.layout import (Confirmed, LayoutSpace, NoPlanFits, brute_force, candidates, layout_mfu,
                            plan_layouts)
from planner.plan_io import LayoutPlan, layout_plan_record, load_plan
from sim import simulate_job
from tests.helpers import assert_search_is_the_brute_force

GiB = 2 ** 30
SMALL = ModelSpec(name="small-llama", kind="llama", layers=8, hidden=1024, heads=16, kv_heads=4, ffn_hidden=2816,
                  seq_len=1024, vocab=32000, micro_batch=1, dtype_bytes=2)


def _h100(nodes):
    return with_nodes(load_cluster("dgx-h100-ib"), nodes)


def _small_h100(per_node):
    """H100 nodes of ``per_node`` GPUs (2 nodes): a small space."""
    from dataclasses import replace
    return replace(_h100(2), devices_per_node=per_node, nics_per_node=per_node)


# (cluster GPUs per node, global batch, memory limit in GiB or None, space)
CASES = [
    (4, 16, 3.2, LayoutSpace(schedules=("dapple", "interleaved", "zb-v"), micro_batches=(1, 2),
                             recompute=("none", "full"))),
    (2, 8, 2.4, LayoutSpace(schedules=("gpipe", "chimera", "zb-h1"), micro_batches=(1, 2, 4),
                            recompute=("none", "selective"), sequence_parallel=(False, True),
                            device_maps=("sequential", "megatron"))),
    (4, 32, None, LayoutSpace(schedules=("dapple", "bitpipe", "dualpipe-v"), micro_batches=(2, 4),
                              recompute=("none",))),
    # context parallelism: C = 1, 2, 4 beside T (a pipeline device T x C GPUs), ring and all-gather
    (4, 16, 2.0, LayoutSpace(schedules=("dapple", "zb-v"), micro_batches=(1, 2), recompute=("none", "full"),
                             cp=(1, 2, 4), sequence_parallel=(False, True))),
    (4, 8, 2.6, LayoutSpace(schedules=("interleaved", "zb-h1"), micro_batches=(1,), recompute=("none", "selective"),
                            tp=(1, 2), cp=(1, 2), cp_comm="allgather", device_maps=("sequential", "megatron"))),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_search_equals_brute_force(case):
    """Every candidate of a small space bound, judged by the ledger and simulated: the search's
    top 3 are the brute force's best 3 (same jobs, same times); every bound is below its truth
    (time: the simulated iteration; memory: the worst GPU's need by the ledger)."""
    per, G, limit, space = CASES[case]
    cl = _small_h100(per)
    lim = None if limit is None else limit * GiB
    brute, fits, res = assert_search_is_the_brute_force(SMALL, cl, G, space, memory_limit=lim)
    ooms = [(c, got) for c, got in brute if isinstance(got, tuple) and got[0] == "oom"]
    assert len(fits) >= 3 and (limit is None or ooms), (len(fits), len(ooms))
    # the ZeRO axis: 0 to 3 where R > 1, ZeRO-3 re-gathering per micro-batch (planner.layout.zero_record),
    # ZeRO-2 and 3 simulated among the layouts that fit
    assert {c.job.parallel.zero for c, _ in brute} == {0, 1, 2, 3}
    assert all(c.job.parallel.reshard_after_forward == (c.job.parallel.zero == 3) for c, _ in brute)
    assert {x.job.parallel.zero for x in fits} >= {2, 3}
    assert res.simulated < len(fits)     # the bounds spared simulations
    assert res.candidates == len(brute)


def test_memory_bound_and_verdicts_equal_the_ledger_and_simulate():
    """The memory bound never exceeds the ledger's need; a candidate the search calls out of memory
    is out of memory by ``simulate``'s verdict, one it confirms fits there, with the same peak."""
    per, G, limit, space = CASES[0]
    cl = _small_h100(per)
    from cost_models.bind import CostInputs, bind
    seen = {"oom": 0, "fits": 0}
    for i, (c, got) in enumerate(brute_force(SMALL, cl, G, space, memory_limit=limit * GiB)):
        if isinstance(got, tuple) and got[0] == "refused":
            continue
        if i % 7 and not isinstance(got, tuple):       # every 7th that fits, every one out of memory
            continue
        job = c.job
        inputs = CostInputs("transformer", model=SMALL.replace(micro_batch=job.parallel.micro_batch), cluster=cl)
        b = bind(job, inputs)
        rep = memory_report(b.lowered, b.costs, limit * GiB, 0.0)
        need = rep.max_peak + rep.transient
        assert c.memory_bound <= need * (1 + 1e-12)
        assert (need > limit * GiB) == isinstance(got, tuple)
        bound, res = simulate_job(job, inputs=inputs)
        rec = metrics_record(res, **{**bound.report, "memory_capacity": limit * GiB, "memory_reserve": 0.0})
        assert rec["out_of_memory"] == isinstance(got, tuple)
        if isinstance(got, Confirmed):
            assert got.peak_memory == max(p["peak_memory"] for p in rec["per_device"])
            assert got.iteration_time == res.iteration_time
            seen["fits"] += 1
        else:
            assert got[1] == pytest.approx(need, rel=1e-12)
            seen["oom"] += 1
    assert seen["oom"] and seen["fits"]


def test_never_worse_than_a_grid_simulated_one_by_one():
    """Llama 3 8B on 32 H100s: the search's best is no slower than the best point of a grid over
    (T, D, schedule, micro-batch), each simulated by ``simulate``'s path and kept when it fits."""
    model, cl, G = load_model("llama3-8b"), _h100(4), 64
    res = plan_layouts(model, cl, G, LayoutSpace(), top_k=1)
    grid = []
    for tp in (1, 2, 4, 8):
        for D in (1, 2, 4):
            for sched in ("dapple", "interleaved", "zb-v"):
                for mb in (1, 2):
                    R = 32 // (tp * D)
                    if G % (R * mb):
                        continue
                    job = Job.of(layout=Layout(schedule=sched, devices=D, microbatches=G // (R * mb), replicas=R),
                                 tp=tp, model="llama3-8b", cluster="dgx-h100-ib:4", micro_batch=mb)
                    try:
                        bound, r = simulate_job(job)
                    except ValueError:
                        continue
                    if not metrics_record(r, **bound.report)["out_of_memory"]:
                        grid.append(r.iteration_time)
    assert len(grid) >= 10
    assert res.best.iteration_time <= min(grid) * (1 + 1e-12)


def test_plan_file_round_trips_and_simulates_to_the_planners_time(tmp_path):
    """T, ZeRO, recompute and sequence parallelism survive the plan file; ``simulate --plan`` gives
    the planner's confirmed iteration time."""
    cl = _small_h100(4)
    res = plan_layouts(SMALL, cl, 16, LayoutSpace(tp=(2,), zero=(1,), recompute=("selective",),
                                                   sequence_parallel=(True,), schedules=("interleaved",)), top_k=1)
    best = res.best
    assert best.job.parallel.tp == 2 and best.job.parallel.zero == 1 and best.job.parallel.sequence_parallel
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(layout_plan_record(best.job, cl, 16, simulated=res.records()[0])))
    loaded = load_plan(path)
    assert isinstance(loaded, LayoutPlan)
    job = loaded.job()
    for f in ("layout", "parallel", "device_map", "cost_model", "memory_reserve"):
        assert getattr(job, f) == getattr(best.job, f), f
    assert loaded.model == SMALL.replace(micro_batch=best.job.parallel.micro_batch)
    _, sim = simulate_job(Job(plan=loaded))
    assert sim.iteration_time == best.iteration_time
    rec = json.loads(path.read_text())
    assert (rec["version"], rec["planner"], rec["job"]["parallel"]) == (2, "layout", best.job.parallel.record())
    # the same plan written as version 1 (flat: "kind", the layout with tp, the parallel fields beside it)
    j = rec["job"]
    v1 = {**{k: v for k, v in rec.items() if k not in ("job", "planner")}, "version": 1, "kind": "layout",
          "layout": {**{k: j["layout"][k] for k in ("schedule", "devices", "microbatches", "replicas", "chunks",
                                                    "variant")}, "tp": j["parallel"]["tp"]},
          **{k: j["parallel"][k] for k in ("micro_batch", "recompute", "zero", "sequence_parallel")},
          **{k: j[k] for k in ("device_map", "cost_model", "memory_reserve")}}
    (tmp_path / "v1.json").write_text(json.dumps(v1))
    assert load_plan(tmp_path / "v1.json").job() == job
    rec["job"]["parallel"]["tp"] = 3
    path.write_text(json.dumps(rec))
    with pytest.raises(ValueError, match="--tp 3 does not divide heads"):
        load_plan(path)
    rec["job"]["parallel"]["pp"] = 2
    path.write_text(json.dumps(rec))
    with pytest.raises(ValueError, match=r"plan.json: job.parallel: unknown field 'pp'"):
        load_plan(path)
    del rec["job"]["parallel"]["pp"]
    for change, msg in ((lambda r: r["job"].update(pp=2), "plan.json: unknown job field 'pp'"),
                        (lambda r: r["job"]["layout"].pop("devices"), "plan.json: the job's layout has no devices"),
                        (lambda r: r.pop("cluster"), "plan.json: missing field 'cluster'")):
        bad = json.loads(json.dumps(rec))
        change(bad)
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError) as e:
            load_plan(path)
        assert str(e.value).startswith(f"{path.parent}/{msg}"), str(e.value)


def test_mfu_is_megatrons_formula_and_candidates_respect_the_rules():
    """MFU = 72 B s l h^2 (1 + s/6h + V/12lh) / (time x GPUs x peak); the SC'21 Eq. (3) with
    recomputation is 96 ... V/16lh. T divides the node and the model's heads, KV heads and FFN;
    ZeRO only with R > 1, SP only with T > 1."""
    B, s, l, h, V = 8, 2048, 24, 2048, 51200
    assert megatron_flops(B, s, l, h, V) == 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert megatron_flops(B, s, l, h, V, recompute=False) == pytest.approx(
        (24 * B * s * l * h * h + 4 * B * s * s * l * h) * 3 + 6 * B * s * h * V, rel=1e-12)
    m = SMALL
    assert layout_mfu(m, 4, 2.0, 8, 1e15) == pytest.approx(
        megatron_flops(4, m.seq_len, m.layers, m.hidden, m.vocab, recompute=False) / (2.0 * 8 * 1e15))
    jobs = candidates(SMALL, _small_h100(4), 16, LayoutSpace(schedules=("dapple",)))
    assert {j.parallel.tp for j in jobs} == {1, 2, 4}
    assert all(j.gpus == 8 and 16 % (j.layout.replicas * j.parallel.micro_batch) == 0 for j in jobs)
    assert not [j for j in jobs if j.parallel.zero and j.layout.replicas == 1]
    assert not [j for j in jobs if j.parallel.sequence_parallel and j.parallel.tp == 1]
    assert {j.parallel.recompute for j in jobs} == {"none", "selective", "full"}


def test_no_plan_fits_says_by_how_much():
    """The smallest need of the space, exact, against the usable memory."""
    cl = _small_h100(2)
    space = LayoutSpace(schedules=("dapple",), micro_batches=(1,), recompute=("full",))
    needs = [got.memory_need if isinstance(got, Confirmed) else got[1]
             for _, got in brute_force(SMALL, cl, 4, space, memory_limit=64 * GiB)
             if isinstance(got, Confirmed) or got[0] != "refused"]
    least = min(needs)
    with pytest.raises(NoPlanFits) as e:
        plan_layouts(SMALL, cl, 4, space, memory_limit=least / 2)
    assert str(e.value) == (f"no plan fits: the smallest needs {fmt_bytes(least)} per GPU, {fmt_bytes(least / 2)} "
                            f"more than the {fmt_bytes(least / 2)} usable of {fmt_bytes(least / 2)}; use more GPUs "
                            f"(nodes), a smaller model or a device with more memory")
    assert usable_memory(64 * GiB, 0.0) == 64 * GiB


CLUSTER_YAML = """name: h100-2x4
nodes: 2
devices_per_node: 4
device: h100
intra: nvlink4
inter: ib-ndr
nics_per_node: 4
"""


def test_cli_top_json_out_plot_and_simulate_plan(tmp_path, capsys):
    """plan --tp: --json records with the documented keys, best first; --out simulates (simulate
    --plan --json) to the planner's time; --plot writes the figure; the table fits 120 columns."""
    from experiments.cli import main
    cl = tmp_path / "h100-2x4.yaml"
    cl.write_text(CLUSTER_YAML)
    model = tmp_path / "small.yaml"
    import yaml
    model.write_text(yaml.safe_dump(SMALL.to_dict()))
    base = ["plan", "-m", str(model), "-c", str(cl), "-G", "16", "--tp", "auto", "--schedules", "dapple,zb-v",
            "--micro-batches", "1,2", "--top", "4", "--no-progress"]
    assert main(base + ["--json", "--out", str(tmp_path / "p.json"), "--plot", str(tmp_path / "p.png")]) == 0
    out = json.loads(capsys.readouterr().out)
    top = out["top"]
    assert len(top) == 4
    for r in top:
        for k in ("tp", "devices", "dp", "schedule", "chunks", "micro_batch", "recompute", "zero", "iteration_time",
                  "mfu", "peak_memory", "tokens_per_s", "bubble_ratio"):
            assert k in r, k
        assert r["tp"] * r["devices"] * r["dp"] == 8
        assert 0 < r["mfu"] < 1 and r["peak_memory"] <= out["usable_memory"]
    assert [r["iteration_time"] for r in top] == sorted(r["iteration_time"] for r in top)
    assert (tmp_path / "p.png").stat().st_size > 10_000
    assert main(["simulate", "--plan", str(tmp_path / "p.json"), "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["iteration_time"] == top[0]["iteration_time"] and sim["tp"] == top[0]["tp"]
    assert sim["out_of_memory"] is False
    assert main(base) == 0
    text = capsys.readouterr().out
    assert max(map(len, text.splitlines())) <= 120
    assert "step_s" in text and "mfu" in text and "search:" in text


def test_simulate_plan_applies_what_ifs_as_the_same_layout_by_hand(tmp_path, capsys):
    """The what-ifs ``simulate --plan`` takes on the plan's layout (--tp-overlap, --fabric with
    --oversubscription and --nodes-per-leaf, --cost-model, --memory-reserve) give what the same
    layout given by hand with them gives, change the result, and show in --json."""
    from experiments.cli import main
    import yaml
    cl, model, path = tmp_path / "h100-2x4.yaml", tmp_path / "small.yaml", tmp_path / "p.json"
    cl.write_text(CLUSTER_YAML)
    model.write_text(yaml.safe_dump(SMALL.to_dict()))
    job = Job.of(layout=Layout(schedule="dapple", devices=2, microbatches=4, replicas=2), tp=2, model=SMALL,
                 micro_batch=1, zero=1, sequence_parallel=True, device_map="sequential")
    path.write_text(json.dumps(layout_plan_record(job, load_cluster(str(cl)), 8)))
    by_hand = ["-s", "dapple", "-D", "2", "-N", "4", "--dp", "2", "--tp", "2", "-m", str(model), "-c", str(cl),
               "--micro-batch", "1", "--zero", "1", "--sequence-parallel", "--device-map", "sequential"]

    def sim(argv):
        assert main(["simulate", *argv, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    base = sim(["--plan", str(path)])
    assert base["iteration_time"] == sim(by_hand)["iteration_time"]
    assert base["tp_overlap"] is False and "fabric" not in base
    for extra, shown in ((["--tp-overlap"], {"tp_overlap": True}),
                         (["--fabric", "fat-tree", "--oversubscription", "8", "--nodes-per-leaf", "1"],
                          {"fabric": "fat-tree", "oversubscription": 8.0, "nodes_per_leaf": 1}),
                         (["--cost-model", "linear"], {"cost_model": "linear"}),
                         (["--memory-reserve", "40 GiB"], {"memory_reserve": 40 * GiB})):
        got, want = sim(["--plan", str(path), *extra]), sim(by_hand + extra)
        assert (got["iteration_time"], got["memory_verdict"]) == (want["iteration_time"], want["memory_verdict"])
        assert {k: got[k] for k in shown} == shown, extra
        if extra[0] == "--memory-reserve":
            assert got["memory_verdict"] != base["memory_verdict"] and "40 GiB reserved" in got["memory_verdict"]
        else:
            assert got["iteration_time"] != base["iteration_time"], extra


@pytest.mark.slow
def test_run_plan_trains_tp2_plans_with_the_references_losses(tmp_path):
    """The planner's best T = 2 plan for the tiny GPT (ZeRO-1 where R > 1), and the same with
    sequence parallelism, run on gloo from their plan files with the reference's losses."""
    from executor.launch import run_many
    from executor.reference import run_reference
    from experiments.plan_files import config_from_plan
    from dataclasses import replace
    tiny = load_model("tiny")
    cl = replace(_small_h100(2), name="h100-2x2")
    res = plan_layouts(tiny, cl, 8, LayoutSpace(tp=(2,), schedules=("dapple",), micro_batches=(1, 2),
                                                 recompute=("none",), sequence_parallel=(False,)),
                       top_k=1, cost_model="linear")
    best = res.best.job
    assert best.parallel.tp == 2
    runs = []
    for name, job in (("tp2", best), ("tp2-sp", best.with_(sequence_parallel=True))):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(layout_plan_record(job, cl, 8)))
        cfg, low, info = config_from_plan(path, steps=3, optimizer="sgd", lr=0.05, timeout=30.0)
        assert cfg.parallel == job.parallel and cfg.parallel.tp == 2 and cfg.layout == job.layout
        assert cfg.global_microbatches * cfg.spec().micro_batch == 8
        runs.append((cfg, low))
    for (cfg, _), got in zip(runs, run_many(runs)):
        ref = run_reference(cfg)
        assert len(got.losses) == len(ref.losses) == 3
        for a, b in zip(got.losses, ref.losses):
            assert abs(a - b) <= 1e-5 * abs(b), (cfg.parallel.sequence_parallel, got.losses, ref.losses)


def test_the_footer_counts_in_english():
    from experiments.plan_layout import _ordinal
    assert [_ordinal(k) for k in (1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st", "111th"]


def test_plan_at_another_sequence_length(tmp_path, capsys):
    """--seq-len plans the model at that length: the plan file's model has it, tokens per second
    count it, and simulate --plan gives the planner's time; without --tp it is refused."""
    from experiments.cli import main as cli_main
    out = tmp_path / "p.json"
    argv = ["plan", "-m", "llama3-8b", "-c", "dgx-h100-ib:2", "-G", "64", "--tp", "2", "--top", "1",
            "--no-progress", "--json", "--out", str(out)]
    assert cli_main(argv + ["--seq-len", "2048"]) == 0
    best = json.loads(capsys.readouterr().out)["top"][0]
    assert best["tokens_per_s"] == pytest.approx(64 * 2048 / best["iteration_time"], rel=1e-12)
    rec = json.loads(out.read_text())
    assert rec["model"]["spec"]["seq_len"] == 2048
    assert cli_main(["simulate", "--plan", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_time"] == pytest.approx(best["iteration_time"], rel=1e-9)
    assert cli_main(["plan", "-m", "llama3-8b", "-c", "dgx-h100-ib:2", "-G", "64", "--seq-len", "2048",
                     "--search", "dapple"]) == 2
    assert "--seq-len applies to the whole-layout search" in capsys.readouterr().err


def test_device_maps_that_place_alike_are_one_candidate():
    """With one pipeline device or one replica, Llama 3's and Megatron's orders are one placement
    (the same simulated time): the search keeps one candidate for them, and both where D, R > 1."""
    from dataclasses import replace
    tiny = load_model("tiny")
    cl = _small_h100(4)          # 8 GPUs: T = 2 x (D, R) in (1, 4), (2, 2), (4, 1)
    space = LayoutSpace(tp=(2,), schedules=("dapple",), micro_batches=(1,), recompute=("none",),
                        sequence_parallel=(False,), zero=(0,), device_maps=("sequential", "megatron"))
    cands = candidates(tiny, cl, 8, space, cost_model="linear")
    by_shape = {}
    for j in cands:
        by_shape.setdefault((j.layout.devices, j.layout.replicas), []).append(j.mapping)
    assert by_shape == {(1, 4): ["sequential"], (2, 2): ["sequential", "megatron"], (4, 1): ["sequential"]}
    for D, R in ((1, 4), (4, 1)):
        job = next(j for j in cands if (j.layout.devices, j.layout.replicas) == (D, R))
        times = {simulate_job(replace(job, device_map=m)).result.iteration_time for m in ("sequential", "megatron")}
        assert len(times) == 1, (D, R, times)


def test_context_parallel_axis_auto_and_asked():
    """auto C: 1 and every power of two that leaves a GPU >= 8,192 tokens (none at 8,192); a dense
    model only; an asked C is the model's check, and one that no T places is one line."""
    from planner.layout import context_parallel_sizes
    cl = _h100(2048)
    m = load_model("llama3-405b")
    assert context_parallel_sizes(m, cl, None) == [1]
    assert context_parallel_sizes(m.replace(seq_len=131072), cl, None) == [1, 2, 4, 8, 16]
    assert context_parallel_sizes(load_model("mixtral-8x7b").replace(seq_len=131072), cl, None) == [1]
    with pytest.raises(ValueError, match="--cp 3 needs the sequence length"):
        context_parallel_sizes(m, cl, (3,))
    jobs = candidates(SMALL, _small_h100(4), 16, LayoutSpace(schedules=("dapple",), cp=(1, 2, 4)))
    assert {(j.parallel.tp, j.parallel.cp) for j in jobs} == {(t, c) for t in (1, 2, 4) for c in (1, 2, 4)
                                                              if t * c <= 8 and (t * c <= 4 or t * c % 4 == 0)}
    assert all(j.gpus == 8 for j in jobs)
    assert not [j for j in jobs if j.parallel.cp == 1 and j.parallel.cp_comm != "ring"]
    long = SMALL.replace(seq_len=32768)          # auto C: 1, 2, 4; every candidate by the formulas
    jobs = candidates(long, _small_h100(4), 16, LayoutSpace(schedules=("dapple",)))
    assert {j.parallel.cp for j in jobs} == {1, 2, 4} and {j.cost_model for j in jobs} == {"linear"}
    jobs = candidates(long, _small_h100(4), 16, LayoutSpace(schedules=("dapple",)), cost_model="kernels")
    assert {j.parallel.cp for j in jobs} == {1}
    with pytest.raises(ValueError, match="--cp 2 is priced by --cost-model linear"):
        candidates(long, _small_h100(4), 16, LayoutSpace(schedules=("dapple",), cp=(1, 2)), cost_model="kernels")
    with pytest.raises(ValueError, match="--cp 16 fits no layout"):
        candidates(SMALL.replace(seq_len=4096), _small_h100(4), 16, LayoutSpace(schedules=("dapple",), cp=(16,)))


@pytest.mark.slow
def test_llama3_405b_at_131k_tokens_plans_a_context_parallel_layout():
    """Llama-3-405B, 131,072-token sequences, 16 M tokens a step (128 sequences) on 16,384 H100s: the
    search answers with a CP layout (Llama 3 trained at TP 8 x CP 16), priced like every candidate by
    the linear model, more than 5x faster than the best without CP on the same model (which fits only
    with R = 64 replicas of N = 2 micro-batches: a pipeline of bubbles)."""
    m = load_model("llama3-405b").replace(seq_len=131072)
    res = plan_layouts(m, load_cluster("h100-pods:2048"), 128, LayoutSpace(), top_k=1)
    best = res.best.job
    assert best.parallel.cp > 1 and best.gpus == 16384
    assert best.parallel.tp * best.parallel.cp * best.layout.devices * best.layout.replicas == 16384
    assert res.best.memory_need <= res.usable
    assert res.best.job.cost_model == "linear"
    flat = plan_layouts(m, load_cluster("h100-pods:2048"), 128, LayoutSpace(cp=(1,)), top_k=1, cost_model="linear")
    assert flat.best.job.parallel.cp == 1 and flat.best.iteration_time > 5 * res.best.iteration_time
