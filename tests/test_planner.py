"""The DAPPLE planner: exact search (= brute force), memory, errors, placement, plan files, IR forms."""
from __future__ import annotations

import json
import random

import pytest

from cost_models import LINK_TYPES, Cluster, LayerCosts, LinkSpec, load_cluster, load_device
from schedules.dapple_replicated import replicated_schedule
from planner import (Plan, PlanError, SearchSpace, StagePlan, Topology, estimate, exhaustive, load_plan,
                     save_plan, search_plans, simulate_plan)
from cost_models.workloads.workload_sources import load_workload
from cost_models.workloads.paper_models import paper_workload
from planner.plan import Plan as _Plan
from planner.search import all_plans
from planner.simulate import build_plan
from cost_models.workloads.workload import from_layer_costs
from schedules import lower, validate

V100 = load_device("v100")


def rand_work(rng, L, cap=None):
    f = tuple(rng.uniform(0.2e-3, 3e-3) for _ in range(L))
    lc = LayerCosts(f=f, b_input=f, w=tuple(x * rng.uniform(0.5, 1.5) for x in f),
                    act=tuple(rng.uniform(1e8, 8e8) for _ in range(L)), act_w=(0.0,) * L,
                    out_bytes=tuple(rng.uniform(1e5, 5e7) for _ in range(L)),
                    params=tuple(rng.uniform(1e6, 3e8) for _ in range(L)),
                    bytes_per_param_static=16.0, grad_bytes_per_param=2.0, optim_time_per_param=1e-11)
    return from_layer_costs("rand", lc, memory_capacity=cap)


def cluster(nodes, dpn, intra, inter, device=V100, name="t"):
    return Cluster(name=name, nodes=nodes, devices_per_node=dpn, device=device, intra=LINK_TYPES[intra],
                   inter=LINK_TYPES[inter])


def small_cluster(rng, nodes, dpn):
    return Cluster(name="t", nodes=nodes, devices_per_node=dpn, device=V100,
                   intra=LINK_TYPES[rng.choice(["nvlink2", "pcie3"])],
                   inter=LINK_TYPES[rng.choice(["eth-25g", "ib-edr"])], nics_per_node=rng.choice([1, dpn]))


SPACES = [SearchSpace(), SearchSpace(uniform=True), SearchSpace(max_stages=2), SearchSpace(max_stages=1),
          SearchSpace(devices=3), SearchSpace(policies=("scatter-first",))]


@pytest.mark.parametrize("seed", range(12))
def test_search_equals_brute_force(seed):
    """On small cases the exact search finds the brute-force optimum of the whole space, for
    DAPPLE's latency and for PipeDream's slowest element, with and without memory limits."""
    rng = random.Random(seed)
    nodes, dpn = [(2, 2), (1, 4), (4, 1), (2, 3), (3, 2), (1, 3)][seed % 6]
    topo = Topology(small_cluster(rng, nodes, dpn))
    work = rand_work(rng, rng.randint(2, 5), rng.choice([None, 4e9, 8e9, 16e9]))
    G = rng.choice([4, 6, 8, 12])
    space = SPACES[seed % len(SPACES)]
    for obj in ("dapple", "pipedream"):
        best, plan, n = exhaustive(work, topo, G, objective=obj, space=space)
        assert n > 0
        if plan is None:
            with pytest.raises(PlanError):
                search_plans(work, topo, G, objective=obj, space=space)
            continue
        got = search_plans(work, topo, G, objective=obj, space=space).best
        assert got.value == pytest.approx(best, rel=1e-9)
        e = got.estimate
        assert e.fits
        assert (e.latency if obj == "dapple" else e.slowest) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("seed", range(10))
def test_searches_sharing_a_topology_equal_brute_force(seed):
    """Searches of one workload on one topology share the tables that depend on the job only (seeds,
    need tables, bounds; kept on the topology by all their inputs): a sequence of searches with
    memory limits loosening then tightening, other objectives and spaces in between, each finds the
    brute-force optimum of its own limit and space."""
    rng = random.Random(900 + seed)
    nodes, dpn = rng.choice([(2, 2), (1, 4), (2, 3), (3, 2)])
    topo = Topology(small_cluster(rng, nodes, dpn))
    work = rand_work(rng, rng.randint(3, 5))
    G = rng.choice([4, 8, 12])
    whole = work.total_params * work.bytes_per_param_static + work.activation(0, work.num_layers) * G
    caps = sorted(whole * rng.uniform(0.05, 0.6) for _ in range(3))
    for cap in caps + caps[::-1] + [None]:
        obj = rng.choice(["dapple", "pipedream"])
        space = rng.choice(SPACES)
        best, plan, _ = exhaustive(work, topo, G, objective=obj, space=space, capacity=cap)
        if plan is None:
            with pytest.raises(PlanError):
                search_plans(work, topo, G, objective=obj, space=space, capacity=cap)
            continue
        got = search_plans(work, topo, G, objective=obj, space=space, capacity=cap).best
        assert got.value == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_search_equals_brute_force_on_fabrics(seed):
    """Suffixes of different sizes are compared only where moving a plan by whole nodes (whole leaves
    on fat-tree and rail fabrics) changes no cost: the optimum is still the brute force's."""
    from dataclasses import replace
    rng = random.Random(100 + seed)
    nodes, dpn, fabric, per = [(4, 1, "fat-tree", 2), (4, 2, "rail", 2), (3, 2, "fat-tree", 2),
                               (4, 1, "flat", 1), (2, 2, "rail", 1), (4, 2, "fat-tree", 1)][seed]
    base = small_cluster(rng, nodes, dpn)
    topo = Topology(replace(base, fabric=fabric, nodes_per_leaf=per, oversubscription=rng.choice([1.0, 4.0]),
                            nics_per_node=dpn))
    work = rand_work(rng, rng.randint(2, 4), rng.choice([None, 8e9]))
    G = rng.choice([4, 8])
    for obj in ("dapple", "pipedream"):
        best, plan, _ = exhaustive(work, topo, G, objective=obj)
        got = search_plans(work, topo, G, objective=obj).best
        assert got.value == pytest.approx(best, rel=1e-9)


def test_brute_force_space_is_complete():
    """all_plans enumerates every (M, policy, S, partition, replicas) combination: count one by hand."""
    topo = Topology(cluster(1, 2, "nvlink2", "eth-25g"))
    work = rand_work(random.Random(0), 3)
    plans = list(all_plans(work, topo, 2, SearchSpace(policies=("append-first",))))
    # M=1 (b=2, r in {1, 2}): S=1: 2 plans; S=2: 2 partitions x (1,1) = 2; S=3 needs 3 devices: 0
    # M=2 (b=1, r=1): S=1: 1; S=2: 2 partitions = 2
    assert len(plans) == 2 + 2 + 1 + 2


def test_memory_limit_never_exceeded():
    """The unconstrained optimum does not fit a tighter limit; the planner then returns a plan that
    fits, analytically and in simulation, and it is the brute-force optimum under the limit."""
    rng = random.Random(3)
    topo = Topology(cluster(2, 2, "nvlink2", "ib-edr"))
    work = rand_work(rng, 5)
    free = search_plans(work, topo, 8, capacity=1e15).best
    lowest = min(estimate(p, work, topo).peak_memory for p in all_plans(work, topo, 8))
    assert lowest < free.estimate.peak_memory
    limit = (lowest + free.estimate.peak_memory) / 2
    got = search_plans(work, topo, 8, capacity=limit, top_k=4)
    for c in got.candidates:
        assert c.estimate.peak_memory <= limit
    assert got.best.value > free.value
    assert got.best.value == pytest.approx(exhaustive(work, topo, 8, capacity=limit)[0], rel=1e-9)
    sim = simulate_plan(got.best.plan, work, topo.cluster, limit)
    assert not sim.oom and sim.peak_memory == pytest.approx(got.best.estimate.peak_memory, rel=1e-9)


def test_cluster_too_small_is_a_clear_error(capsys):
    from experiments.cli import main
    two = cluster(1, 2, "nvlink3", "ib-hdr", device=load_device("a100"), name="two")
    work = load_workload("gpt-96", two.device)
    with pytest.raises(PlanError, match=r"needs 1[0-9.]+ GiB of weights.*within 80.0 GiB per device"):
        search_plans(work, Topology(two), 8)
    rc = main(["plan", "-m", "bert-48", "-c", "v100-2x8-25gbe", "-G", "16", "--memory-limit", "64 MiB",
               "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("pipetwin: error: no plan of bert-48")
    assert "alone needs" in err[0] and "0.1 GiB per device" in err[0]


def test_placement_policies():
    topo = Topology(cluster(2, 4, "nvlink2", "eth-25g"))
    # append-first packs in device order (stage 1 straddles the two nodes)
    assert topo.place("append-first", [2, 4, 2]) == [(0, 1), (2, 3, 4, 5), (6, 7)]
    # fresh-first: every stage on its own machine(s), the rest of a machine idle
    assert topo.place("fresh-first", [2, 4]) == [(0, 1), (4, 5, 6, 7)]
    with pytest.raises(ValueError, match="take 12 slots"):
        topo.place("fresh-first", [2, 4, 2])
    # scatter-first: round robin over the machines
    assert topo.place("scatter-first", [2, 2, 4]) == [(0, 4), (1, 5), (2, 6, 3, 7)]
    # unused devices are the first of the order
    assert topo.place("append-first", [2, 2]) == [(4, 5), (6, 7)]


def test_estimate_closed_form_and_simulation():
    """No communication, equal layers: L = (M + S - 1)(F + B) with the pivot on the last stage, and
    the simulator agrees; memory: stage s keeps min(S - s, M) micro-batches."""
    L, S, M = 8, 4, 6
    f = (1e-3,) * L
    lc = LayerCosts(f=f, b_input=f, w=f, act=(1e6,) * L, act_w=(0.0,) * L, out_bytes=(0.0,) * L,
                    params=(1e3,) * L)
    work = from_layer_costs("eq", lc)
    ideal = LinkSpec("ideal", 1e15, 0.0)
    cl = Cluster(name="fast", nodes=1, devices_per_node=4, device=V100, intra=ideal, inter=ideal)
    topo = Topology(cl)
    plan = Plan("eq", "fast", M, M, tuple(StagePlan(2 * s, 2 * s + 2, (s,)) for s in range(S)), "append-first")
    e = estimate(plan, work, topo)
    assert e.latency == pytest.approx((M + S - 1) * 6e-3)
    assert e.pivot == f"stage {S - 1}"
    assert [st.act_mem for st in e.stages] == [min(S - s, M) * 2e6 for s in range(S)]
    sim = simulate_plan(plan, work, cl)
    assert sim.iteration_time == pytest.approx(e.latency, rel=1e-9)
    assert sim.per_device_peak == tuple(st.memory for st in e.stages)


def test_pivot_moves_to_a_slow_stage():
    """A stage twice as slow as the others becomes the pivot: L = sum F..Q + (M-1)(F_Q + B_Q) + sum B."""
    f = (1e-3, 1e-3, 2e-3, 1e-3)
    lc = LayerCosts(f=f, b_input=f, w=f, act=(1.0,) * 4, act_w=(0.0,) * 4, out_bytes=(0.0,) * 4, params=(1.0,) * 4)
    work = from_layer_costs("slow", lc)
    ideal = LinkSpec("ideal", 1e15, 0.0)
    topo = Topology(Cluster(name="fast", nodes=1, devices_per_node=4, device=V100, intra=ideal, inter=ideal))
    M = 10
    plan = Plan("slow", "fast", M, M, tuple(StagePlan(s, s + 1, (s,)) for s in range(4)), "append-first")
    e = estimate(plan, work, topo)
    assert e.pivot == "stage 2"
    assert e.latency == pytest.approx((1 + 1 + 2) * 1e-3 + (M - 1) * 6e-3 + (2 + 2 + 4) * 1e-3)
    assert e.steady == pytest.approx((M - 1) * 6e-3)


def test_replicated_schedule_is_valid_and_matches_the_estimate():
    """Non-uniform replicas through model copies: valid FIFO-safe programs, per-stage all-reduce groups,
    memory equal to the analytical model."""
    low = lower(replicated_schedule((2, 1, 3), 4))
    validate(low)
    assert low.num_devices == 6 and low.num_copies == 6 and low.num_microbatches == 24
    assert [low.stage_group(s) for s in range(3)] == [[0, 1], [2], [3, 4, 5]]
    c = load_cluster("v100-2x8-25gbe")
    work = load_workload("bert-48", c.device)
    topo = Topology(c)
    plan = Plan("bert-48", c.name, 48, 4,
                tuple(StagePlan(a, b, d) for (a, b), d in zip([(0, 14), (14, 30), (30, 50)],
                                                               topo.place("append-first", [2, 1, 3]))),
                "append-first")
    e = estimate(plan, work, topo)
    sim = simulate_plan(plan, work, c)
    assert sim.per_device_peak == pytest.approx([e.stages[s].memory for s, r in enumerate((2, 1, 3)) for _ in range(r)])
    assert sim.iteration_time == pytest.approx(e.latency_rt, rel=0.15)


SPLIT = [  # (cluster changes, replicas, layers per stage, policy, M, G, kinds of alike replicas)
    ({"devices_per_node": 2, "nodes": 8, "nics_per_node": 2, "fabric": "rail", "nodes_per_leaf": 4,
      "oversubscription": 4.0}, (4, 8, 4), (8, 12, 6), "fresh-first", 4, 32, 2),
    ({"devices_per_node": 2, "nodes": 8, "nics_per_node": 1, "fabric": "fat-tree", "nodes_per_leaf": 4,
      "oversubscription": 4.0}, (4, 8, 4), (8, 12, 6), "fresh-first", 4, 32, 2),
    ({"devices_per_node": 2, "nodes": 8, "nics_per_node": 2}, (2, 4, 6, 4), (5, 8, 8, 5), "append-first", 2, 48, 1),
    ({"nodes": 2}, (2, 4, 2, 4), (6, 8, 6, 6), "scatter-first", 4, 32, 1),
    ({}, (2, 4, 2), (8, 11, 7), "append-first", 4, 32, 2)]


def _plan_of(topo, model, G, M, reps, layers, policy):
    edges = [sum(layers[:s]) for s in range(len(layers) + 1)]
    devs = topo.place(policy, list(reps))
    return Plan(model, topo.cluster.name, G, M,
                tuple(StagePlan(edges[s], edges[s + 1], devs[s]) for s in range(len(reps))), policy)


@pytest.mark.parametrize("kw,reps,layers,policy,M,G,kinds", SPLIT, ids=[f"{c[1]}-{c[3]}" for c in SPLIT])
def test_split_replicas_equal_the_ir_form(kw, reps, layers, policy, M, G, kinds):
    """A non-uniform plan simulated as gcd(r_s) data-parallel replicas of the plan with r_s / gcd
    replicas (build_plan(split=True)) is its IR form's simulation: the same iteration time and every
    device's peak memory to the byte, with one replica of each kind simulated."""
    from dataclasses import replace

    from sim import run
    c = replace(load_cluster("dgx-a100-4x8-ib"), **kw)
    work = load_workload("gpt3-1.3b", c.device)
    plan = _plan_of(Topology(c), "gpt3-1.3b", G, M, reps, layers, policy)
    g = min(reps)
    bt = build_plan(plan, work, c, split=True)          # validated
    assert bt.lowered.replicas == g and bt.lowered.num_devices == sum(reps) // g
    assert bt.extra["sub_batches"] == build_plan(plan, work, c).extra["sub_batches"]
    assert sorted(bt.network.device_map) == sorted(d for st in plan.stages for d in st.devices)
    res = run(bt.lowered, bt.costs, bt.network)
    assert res.simulated_replicas == (kinds if kinds < g else g)
    a, b = simulate_plan(plan, work, c, split=True), simulate_plan(plan, work, c, split=False)
    assert a.iteration_time == pytest.approx(b.iteration_time, rel=1e-9)
    assert a.per_device_peak == b.per_device_peak


@pytest.mark.long
def test_split_replicas_at_scale():
    """The planner's exact optimum for GPT-96 on 1,024 A100s at M = 16 (17 stages, replicas
    32:64:...:64:32, stages straddling rail groups): 32 replicas of 4 kinds, 128 of 1,024 ranks
    simulated, the IR form's result (all 1,024 ranks)."""
    c = load_cluster("dgx-a100-ib:128")
    work = load_workload("gpt-96", c.device)
    plan = _plan_of(Topology(c), "gpt-96", 1024, 16, (32,) + (64,) * 15 + (32,),
                    (4, 9, 9, 8, 8, 7, 7, 6, 6, 6, 5, 5, 5, 4, 4, 4, 1), "fresh-first")
    from sim import run
    bt = build_plan(plan, work, c, check=False, split=True)
    assert run(bt.lowered, bt.costs, bt.network).simulated_replicas == 4
    a, b = simulate_plan(plan, work, c, split=True), simulate_plan(plan, work, c, split=False)
    assert a.iteration_time == pytest.approx(b.iteration_time, rel=1e-9)
    assert a.per_device_peak == b.per_device_peak


def test_uniform_plan_in_the_ir():
    c = load_cluster("v100-2x8-25gbe")
    work = load_workload("bert-48", c.device)
    topo = Topology(c)
    devs = topo.place("fresh-first", [8, 8])
    plan = Plan("bert-48", c.name, 64, 4, (StagePlan(0, 26, devs[0]), StagePlan(26, 50, devs[1])), "fresh-first")
    bt = build_plan(plan, work, c)
    assert bt.lowered.num_devices == 2 and bt.lowered.replicas == 8
    assert bt.network.device_map == tuple(8 * (r % 2) + r // 2 for r in range(16))
    assert bt.costs.meta["partition"] == [26, 24]
    assert bt.costs.f[0][0] == pytest.approx(work.fwd(0, 26) * 2)      # b / R = 16 / 8 samples


def test_uniform_plan_schedules_equal_their_closed_forms():
    """A uniform plan run with each schedule family the planner offers: R = 2 replicas of a D = 4
    stage pipeline, M = 4 micro-batches of b = 4 samples (q = b / R = 2 per replica), 8 equal layers
    (forward u per sample, backward 2u), no communication. A stage of 2 layers takes F + B = 6 u q per
    micro-batch: GPipe and DAPPLE (1F1B) take (M + D - 1)(F + B) = 42 u q, bubble 3/7; the
    interleaved schedule with v = 2 chunks (the 8 layers as 8 one-layer chunks, F / v each) takes
    M (F + B) + (D - 1)(F + B) / v = 33 u q, bubble 3/11 (the design's unit-cost figures)."""
    u, L, D, R, M, G = 1e-3, 8, 4, 2, 4, 16
    f = (u,) * L
    lc = LayerCosts(f=f, b_input=f, w=f, act=(1e6,) * L, act_w=(0.0,) * L, out_bytes=(0.0,) * L,
                    params=(1e3,) * L)
    work = from_layer_costs("eq", lc)
    ideal = LinkSpec("ideal", 1e15, 0.0)
    cl = Cluster(name="fast", nodes=1, devices_per_node=R * D, device=V100, intra=ideal, inter=ideal)
    devs = Topology(cl).place("append-first", [R] * D)
    plan = Plan("eq", "fast", G, M, tuple(StagePlan(2 * s, 2 * s + 2, devs[s]) for s in range(D)), "append-first")
    q = G // M // R
    closed = {"gpipe": ((M + D - 1) * 6 * u * q, 3 / 7), "dapple": ((M + D - 1) * 6 * u * q, 3 / 7),
              "interleaved": ((M * 6 + (D - 1) * 6 / 2) * u * q, 3 / 11)}
    for sched, (time, bubble) in closed.items():
        p = plan.with_schedule(sched)
        bt = build_plan(p, work, cl)
        assert bt.lowered.replicas == R and bt.costs.meta["partition"] == ([1] * L if sched == "interleaved"
                                                                            else [2] * D)
        sim = simulate_plan(p, work, cl)
        assert sim.iteration_time == pytest.approx(time, rel=1e-9), sched
        assert sim.bubble_ratio == pytest.approx(bubble, rel=1e-9), sched


@pytest.mark.parametrize("model", ["bert-48", "vgg-19"])
def test_plan_file_round_trip(tmp_path, model):
    c = load_cluster("v100-16x1-25gbe")
    work = load_workload(model, c.device)
    res = search_plans(work, Topology(c), 32)
    plan = res.best.plan
    path = tmp_path / "plan.json"
    rec = save_plan(path, plan, work, c, memory_limit=30 * 2 ** 30, est=res.best.estimate)
    lp = load_plan(path)
    assert lp.plan == plan and lp.cluster == c and lp.memory_limit == 30 * 2 ** 30
    assert lp.workload == work
    assert json.loads(path.read_text())["plan"] == rec["plan"]
    if plan.uniform:
        run = rec["run"]
        assert (run["devices"], run["dp"], run["microbatches"]) == (plan.num_stages, plan.dp, plan.microbatches)
        assert run["partition"] == list(plan.partition) and run["micro_batch"] * plan.dp * plan.microbatches == 32
    low, costs, net = lp.build().astuple()
    assert low.num_ranks == plan.devices_used and len(costs.static_mem) == low.num_ranks
    assert lp.simulate().iteration_time == pytest.approx(simulate_plan(plan, work, c).iteration_time)


def test_plan_file_errors(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{}")
    with pytest.raises(ValueError, match="not a pipetwin plan file"):
        load_plan(p)
    with pytest.raises(FileNotFoundError):
        load_plan(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="cannot be split over 3 replicas"):
        _Plan("m", "c", 8, 2, (StagePlan(0, 2, (0, 1, 2)),), "append-first")


def test_paper_models():
    v = paper_workload("vgg-19", V100)
    assert v.num_layers == 19 and v.total_params == pytest.approx(143.67e6, rel=1e-3)
    assert sum(v.f) * V100.achievable_flops("fp32") == pytest.approx(39.26e9, rel=1e-3)   # 19.6 GMAC
    assert paper_workload("xlnet-36", V100).num_layers == 38
    with pytest.raises(ValueError, match="unknown paper model"):
        paper_workload("resnet", V100)


def test_round_trip_search_and_budget():
    """The round-trip-aware search returns latency_rt of its plan (>= the pivot latency); on these
    small cases it also finds the brute-force optimum. A budget stops a search early, flagged."""
    rng = random.Random(11)
    topo = Topology(small_cluster(rng, 2, 2))
    work = rand_work(rng, 5)
    r = search_plans(work, topo, 8, objective="dapple-rt")
    e = estimate(r.best.plan, work, topo)
    assert r.best.value == pytest.approx(e.latency_rt, rel=1e-12) and e.latency_rt >= e.latency
    assert r.best.value == pytest.approx(exhaustive(work, topo, 8, objective="dapple-rt")[0], rel=1e-9)
    full = search_plans(work, topo, 8)
    assert full.exhausted
    for budget in (5, 20, 50):
        cut = search_plans(work, topo, 8, budget=budget)
        # it runs up to the budget and stops within one sweep of a stage's start layers past it
        assert not cut.exhausted and budget < cut.evaluated <= budget + work.num_layers ** 2 < full.evaluated


def test_plan_file_run_record(tmp_path):
    c = load_cluster("v100-2x8-25gbe")
    work = load_workload("bert-48", c.device)
    topo = Topology(c)
    devs = topo.place("fresh-first", [8, 8])
    plan = Plan("bert-48", c.name, 64, 4, (StagePlan(0, 26, devs[0]), StagePlan(26, 50, devs[1])), "fresh-first")
    save_plan(tmp_path / "u.json", plan, work, c)
    run = load_plan(tmp_path / "u.json").record["run"]
    assert (run["schedule"], run["devices"], run["microbatches"], run["dp"]) == ("dapple", 2, 4, 8)
    assert run["micro_batch"] == 2 and run["partition"] == [26, 24]
    assert run["device_map"] == list(plan.device_map())
    nonu = Plan("bert-48", c.name, 64, 4, tuple(StagePlan(a, b, d) for (a, b), d in
                                                zip([(0, 26), (26, 50)], topo.place("append-first", [8, 4]))),
                "append-first")
    save_plan(tmp_path / "n.json", nonu, work, c)
    assert load_plan(tmp_path / "n.json").record["run"] is None   # not an R x D layout


@pytest.mark.parametrize("seed", range(40))
def test_pipedream_in_two_phases_equals_one_search(seed):
    """PipeDream's objective (slowest element, then L) searched in two phases (top_k = 1: the least
    slowest element p*, then the least L with every element within p*) gives the value, the latency
    and the plan of one search over (slowest, L) labels (what top_k > 1 runs), and both are the
    brute-force optimum in that order: the least slowest element, then the least L among the plans
    that have it, on random small jobs (memory limits, several fabrics, restricted spaces)."""
    from dataclasses import replace
    rng = random.Random(500 + seed)
    nodes, dpn = rng.choice([(2, 2), (1, 4), (4, 1), (2, 3), (3, 2), (2, 4)])
    cl = small_cluster(rng, nodes, dpn)
    if seed % 3 == 1:
        cl = replace(cl, fabric=rng.choice(["fat-tree", "rail"]), nodes_per_leaf=rng.choice([1, 2]),
                     oversubscription=2.0, nics_per_node=dpn)
    topo = Topology(cl)
    work = rand_work(rng, rng.randint(2, 6), rng.choice([None, 4e9, 8e9]))
    G = rng.choice([4, 6, 8, 12])
    space = SPACES[seed % len(SPACES)]
    ests = [e for e in (estimate(p, work, topo, work.memory_capacity) for p in all_plans(work, topo, G, space))
            if e.fits]
    if not ests:
        return
    slowest = min(e.slowest for e in ests)
    latency = min(e.latency for e in ests if e.slowest <= slowest * (1 + 1e-9))
    two = search_plans(work, topo, G, objective="pipedream", space=space).best
    one = search_plans(work, Topology(cl), G, objective="pipedream", space=space, top_k=2).best
    assert two.value == one.value and two.value == pytest.approx(slowest, rel=1e-9)
    assert two.estimate.latency == one.estimate.latency == pytest.approx(latency, rel=1e-9)
    assert two.plan == one.plan


@pytest.mark.parametrize("fabric,per", [("flat", 1), ("fat-tree", 2), ("rail", 2), ("rail", 3)])
def test_boundary_costs_equal_up_to_renaming_alike_nodes(fabric, per, monkeypatch):
    """Boundary transfers are cached by their devices with alike nodes renamed (Topology.relabel):
    the costs equal those computed on the devices themselves, exactly, for stages at any offsets and
    replica counts (node-major and scatter orders), and the renaming is the identity where the
    fabric's groups differ (a last group with fewer nodes); the same stages with another tensor size
    reuse the stages' transfer terms and still equal the direct costs, and the form for stages of
    distinct devices (Topology._distinct_terms) equals the pair-by-pair one."""
    from dataclasses import replace
    rng = random.Random(per)
    base = replace(small_cluster(rng, 6, 4), nics_per_node=4)
    cl = replace(base, fabric=fabric, nodes_per_leaf=per, oversubscription=2.0)
    fast = Topology(cl)
    ref = Topology(cl)
    monkeypatch.setattr(ref, "relabel", lambda src, dst: (src, dst))
    # and the reference prices every boundary pair by pair (fast: the faster form for distinct devices)
    monkeypatch.setattr(ref, "_distinct_terms", ref._pair_terms)
    for _ in range(300):
        pol = rng.choice(["fresh-first", "append-first", "scatter-first"])
        r, r1 = rng.choice([1, 2, 3, 4, 6, 8]), rng.choice([1, 2, 4, 5, 8])
        sl = fast.slots(pol, r)
        if sl + fast.slots(pol, r1) > cl.num_devices:
            continue
        off = rng.randrange(cl.num_devices - sl - fast.slots(pol, r1) + 1)
        nbytes = rng.uniform(1e5, 1e8)
        a, b = ref.devices(pol, off, r), ref.devices(pol, off + sl, r1)
        assert fast.boundary(pol, off, r, r1, nbytes) == (ref.transfer(a, b, nbytes), ref.transfer(b, a, nbytes))
        # the same stages with another tensor size (its transfer terms kept by the stages alone)
        big = nbytes * rng.uniform(1.5, 40.0)
        assert fast.boundary(pol, off, r, r1, big) == (ref.transfer(a, b, big), ref.transfer(b, a, big))
    # nodes 0, 1, 2, 4, 0 of 4 devices each: renamed 0, 1, 2, 3 on a flat fabric; 5 nodes in groups
    # of 2 or 3 leave a smaller last group, so no renaming
    got = Topology(replace(cl, nodes=5)).relabel((0, 5, 9), (17, 2))
    assert got == (((0, 5, 9), (13, 2)) if fabric == "flat" else ((0, 5, 9), (17, 2)))


@pytest.mark.parametrize("seed", range(8))
def test_allreduce_floor_is_below_every_offset(seed):
    """Topology.allreduce_floor(policy, r) is at most the all-reduce of the stage of r replicas at every
    offset of the allocation order (every size), on flat, fat-tree and rail fabrics; on DGX nodes it
    is within 1% of the least of them, for stages on whole nodes (fresh-first) and spread over nodes
    (scatter-first)."""
    from dataclasses import replace
    rng = random.Random(1300 + seed)
    nodes, dpn = rng.choice([(4, 2), (3, 4), (6, 2), (2, 4), (8, 1)])
    cl = small_cluster(rng, nodes, dpn)
    if seed % 2:
        cl = replace(cl, fabric=rng.choice(["fat-tree", "rail"]), nodes_per_leaf=2, oversubscription=2.0,
                     nics_per_node=dpn)
    topo = Topology(cl)
    N = cl.num_devices
    for pol in ("fresh-first", "append-first", "scatter-first"):
        for r in range(1, N + 1):
            s = topo.slots(pol, r)
            if s > N:
                continue
            a, b = topo.allreduce_floor(pol, r)
            for off in range(N - s + 1):
                alpha, beta = topo.allreduce_at(pol, off, r)      # what the search charges there
                for nbytes in (0.0, 1e3, 1e9):
                    assert a + b * nbytes <= (alpha + beta * nbytes) * (1 + 1e-12)
                    assert a + b * nbytes <= topo.allreduce(topo.devices(pol, off, r), nbytes) * (1 + 1e-12) \
                        or nbytes == 0
    # tight where the planner leans on it: DGX nodes (one NIC per GPU), whole nodes or spread over nodes
    dgx = Topology(load_cluster("dgx-a100-ib:4"))
    for pol, r in (("fresh-first", 8), ("fresh-first", 16), ("fresh-first", 32), ("scatter-first", 4),
                   ("scatter-first", 8), ("scatter-first", 16)):
        a, b = dgx.allreduce_floor(pol, r)
        least = min(dgx.allreduce(dgx.devices(pol, off, r), 1e9) for off in range(32 - dgx.slots(pol, r) + 1))
        assert least * 0.99 <= a + b * 1e9 <= least


def _prefix_terms(work, topo, plan_stages, policy, b, M):
    """(C + Tp, R + Tp, FW) of a prefix: stages [(i, j, devs)] from layer 0 with their boundaries
    (planner.search._prefix_tables)."""
    from planner.cost import boundary_bytes, stage_estimate
    C = Tp = -float("inf")
    R = FW = BW = 0.0
    for s, (i, j, devs) in enumerate(plan_stages):
        if s:
            a = plan_stages[s - 1][2]
            nb = boundary_bytes(work, i - 1, b)
            fb, bb = topo.transfer(a, devs, nb), topo.transfer(devs, a, nb)
            C = max(C, R + fb + bb + (M - 1) * max(fb, bb))
            R, FW, BW = R + fb + bb, FW + fb, BW + bb
        st = stage_estimate(work, topo, i, j, devs, b, 1)
        rt = st.f + st.b
        C = max(C, R + rt + (M - 1) * rt)
        Tp = max(Tp, st.allreduce + st.optim - BW)
        R, FW, BW = R + rt, FW + st.f, BW + st.b
    return C + Tp, R + Tp, FW


@pytest.mark.parametrize("seed", range(10))
def test_prefix_tables_bound_every_prefix(seed):
    """Every entry of the whole-prefix bound tables is at most the least (C + Tp, R + Tp, FW) of the
    prefixes it stands for (stages [0, i) that fit with w micro-batches in flight, on at most f slots,
    at any offset), checked by enumerating the prefixes of small jobs; and Y of the first layer is
    within 2% of its best one-stage prefix (the bound is not vacuous)."""
    import itertools
    from dataclasses import replace
    import planner.search as ps
    rng = random.Random(1400 + seed)
    nodes, dpn = rng.choice([(2, 2), (1, 4), (2, 3), (3, 2)])
    cl = small_cluster(rng, nodes, dpn)
    if seed % 3 == 2:
        cl = replace(cl, fabric="fat-tree", nodes_per_leaf=2, oversubscription=2.0, nics_per_node=dpn)
    topo = Topology(cl)
    work = rand_work(rng, rng.randint(2, 5), rng.choice([None, 8e9, 16e9]))
    cap = float("inf") if work.memory_capacity is None else work.memory_capacity
    G = rng.choice([4, 8, 12])
    N = cl.num_devices
    closest = float("inf")
    for M in (m for m in ps.divisors(G) if m <= 4):
        b = G // M
        for pol in ("fresh-first", "append-first", "scatter-first"):
            slots = {r: topo.slots(pol, r) for r in ps._rep_values(ps.SearchSpace(), b, N)}
            reps = [r for r, s in slots.items() if s <= N]
            for w in (1, 2):
                Y, X, F = ps._prefix_tables(work, topo, pol, b, M, w, reps, slots, cap, N, 1)
                for i in range(1, work.num_layers + 1):
                    for S in range(1, i + 1):
                        for cuts in itertools.combinations(range(1, i), S - 1):
                            edges = (0, *cuts, i)
                            for rv in itertools.product(reps, repeat=S):
                                used = sum(slots[r] for r in rv)
                                if used > N or any(
                                        work.param_count(edges[s], edges[s + 1]) * work.bytes_per_param_static
                                        + w * work.activation(edges[s], edges[s + 1]) * b / rv[s] > cap
                                        for s in range(S)):
                                    continue
                                for end in range(used, N + 1):      # the prefix's last slot
                                    off, stages = end - used, []
                                    for s, r in enumerate(rv):
                                        stages.append((edges[s], edges[s + 1], topo.devices(pol, off, r)))
                                        off += slots[r]
                                    y, x, fw = _prefix_terms(work, topo, stages, pol, b, M)
                                    for f in range(used, N + 1):
                                        assert Y[i][f] <= y * (1 + 1e-12)
                                        assert X[i][f] <= x * (1 + 1e-12)
                                        assert F[i][f] <= fw * (1 + 1e-12)
                                    if i == 1:
                                        closest = min(closest, (y - Y[i][N]) / y)
    assert 0 <= closest <= 0.02     # one layer: its one-stage prefix is within the all-reduce floor of Y


@pytest.mark.parametrize("seed", range(12))
def test_latency_floor_and_the_pipedream_skip(seed, monkeypatch):
    """latency_floor(M) is at most DAPPLE's latency of every plan with M micro-batches that fits (brute
    force), and the PipeDream baseline that skips the Ms by it keeps the plan of the scan over every M."""
    import planner.choose as ch
    import planner.search as ps
    rng = random.Random(1500 + seed)
    nodes, dpn = rng.choice([(2, 2), (1, 4), (4, 1), (2, 3), (3, 2)])
    topo = Topology(small_cluster(rng, nodes, dpn))
    work = rand_work(rng, rng.randint(2, 5), rng.choice([None, 8e9, 16e9]))
    G = rng.choice([4, 8, 12])
    space = SPACES[seed % len(SPACES)]
    for M in ps.divisors(G):
        floor = ps.latency_floor(work, topo, G, M, space=space)
        best, plan, _ = exhaustive(work, topo, G, space=replace_space(space, M))
        assert floor <= best * (1 + 1e-12)
        if plan is not None:
            assert floor > 0
    skip = ch.pipedream_plan(work, topo, G, space=space)
    scan = ch.pipedream_plan(work, Topology(topo.cluster), G, space=space, skip_by_floor=False)
    assert (skip is None) == (scan is None)
    if scan is not None:
        assert skip.plan == scan.plan


def replace_space(space, M):
    from dataclasses import replace
    return replace(space, microbatches=(M,))


def test_pipedream_skip_keeps_the_mid_size_baseline(monkeypatch):
    """On a mid-size job the skipping baseline searches fewer micro-batch counts and keeps the same plan."""
    import planner.choose as ch
    cl = load_cluster("dgx-a100-ib:4")
    work = load_workload("gpt-96", cl.device)
    calls = []
    real = ch.search_plans
    monkeypatch.setattr(ch, "search_plans", lambda *a, **k: calls.append(k["space"].microbatches) or real(*a, **k))
    skip = ch.pipedream_plan(work, Topology(cl), 64)
    searched = len(calls)
    scan = ch.pipedream_plan(work, Topology(cl), 64, skip_by_floor=False)
    assert skip.plan == scan.plan and skip.estimate.latency_rt == scan.estimate.latency_rt
    assert searched < len(calls) - searched == 7
