"""The planner with micro-batch-dependent costs: it picks a larger micro-batch where per-sample time
falls, stays exact (= brute force), and the kernel model reaches plan, plan files and simulate."""
import dataclasses
import json
import random

import pytest

from cost_models import LINK_TYPES, Cluster, LayerCosts, LinkSpec, load_device
from experiments.cli import main
from planner import PlanError, SearchSpace, Topology, estimate, exhaustive, search_plans, simulate_plan
from cost_models.workloads.workload_sources import load_workload
from cost_models.workloads.workload import from_layer_costs
from tests.test_planner import rand_work

V100 = load_device("v100")
IDEAL = LinkSpec("ideal", 1e15, 0.0)


def curved(work, k):
    """Per-sample times (1 + k / q) x the base ones: a fixed cost per micro-batch of k samples' worth."""
    base = (work.f, work.b_input, work.w)

    def curve(q):
        s = 1.0 + k / q
        return tuple(tuple(x * s for x in xs) for xs in base)
    return dataclasses.replace(work, per_sample_at=curve, cost_model="kernels")


def two_layers():
    u = 1e-3
    lc = LayerCosts(f=(u / 3, u / 3), b_input=(u / 3, u / 3), w=(u / 3, u / 3), act=(1.0, 1.0), act_w=(0.0, 0.0),
                    out_bytes=(0.0, 0.0), params=(1.0, 1.0))
    return from_layer_costs("two", lc)


def test_larger_micro_batch_where_per_sample_time_falls():
    """Two equal layers (F + B = u per sample each), two devices, no communication, G = 16, one
    replica per stage. A 2-stage 1F1B pipeline takes L = (M + 1)(F + B)_stage(q) q with q = G / M:
    linear costs give L = u (M + 1) 16 / M, least at M = 16 (b = 1, 17 u); per-sample times
    u (1 + 4 / q) give L = u (M + 1)(16 / M + 4): M = 1: 40 u, M = 2: 36 u, M = 4: 40 u, M = 16: 85 u,
    least at M = 2 (b = 8); the single-stage plan costs 2u (16 + 4M) >= 40 u."""
    u = 1e-3
    topo = Topology(Cluster(name="two", nodes=1, devices_per_node=2, device=V100, intra=IDEAL, inter=IDEAL))
    space = SearchSpace(replicas=(1,), policies=("append-first",))
    lin = search_plans(two_layers(), topo, 16, space=space).best
    assert lin.plan.microbatches == 16 and lin.plan.num_stages == 2
    assert lin.value == pytest.approx(17 * u)
    work = curved(two_layers(), 4.0)
    got = search_plans(work, topo, 16, space=space).best
    assert got.plan.microbatches == 2 and got.plan.micro_batch == 8 and got.plan.num_stages == 2
    assert got.value == pytest.approx(36 * u)
    for M, L in ((1, 40), (4, 40), (16, 85)):
        alt = search_plans(work, topo, 16, space=dataclasses.replace(space, microbatches=(M,))).best
        assert alt.value == pytest.approx(L * u), M
    # the simulator agrees with the closed form
    assert simulate_plan(got.plan, work, topo.cluster).iteration_time == pytest.approx(36 * u, rel=1e-9)


def rand_curved(rng, L):
    return curved(rand_work(rng, L, cap=rng.choice([None, 8e9, 16e9])), rng.uniform(0.5, 8))


@pytest.mark.parametrize("seed", range(6))
def test_search_stays_exact_with_curved_costs(seed):
    """With per-sample times that depend on the micro-batch (and on the replica share b / r) the search
    still finds the brute-force optimum of DAPPLE's latency and PipeDream's slowest element."""
    rng = random.Random(100 + seed)
    nodes, dpn = [(2, 2), (1, 4), (4, 1)][seed % 3]
    cl = Cluster(name="t", nodes=nodes, devices_per_node=dpn, device=V100, intra=LINK_TYPES["nvlink2"],
                 inter=LINK_TYPES[rng.choice(["eth-25g", "ib-edr"])])
    topo = Topology(cl)
    work = rand_curved(rng, rng.randint(2, 4))
    G = rng.choice([4, 8, 12])
    for obj in ("dapple", "pipedream"):
        best, plan, _ = exhaustive(work, topo, G, objective=obj)
        if plan is None:
            with pytest.raises(PlanError):
                search_plans(work, topo, G, objective=obj)
            continue
        got = search_plans(work, topo, G, objective=obj).best
        assert got.value == pytest.approx(best, rel=1e-9), obj


def test_replica_share_prices_the_stage():
    """A stage on r replicas runs b / r samples each, at the per-sample times of b / r."""
    topo = Topology(Cluster(name="four", nodes=1, devices_per_node=4, device=V100, intra=IDEAL, inter=IDEAL))
    work = curved(two_layers(), 4.0)
    from planner.plan import Plan, StagePlan
    plan = Plan("two", "four", 16, 2, (StagePlan(0, 1, (0, 1)), StagePlan(1, 2, (2, 3))), "append-first")
    e = estimate(plan, work, topo)
    q = 4                                  # b = 8 over 2 replicas
    per = (1 + 4 / q) * 1e-3 / 3
    assert e.stages[0].f == pytest.approx(per * q) and e.stages[0].b == pytest.approx(2 * per * q)


def test_kernel_model_planner_picks_fewer_micro_batches_than_linear():
    cl = Cluster(name="v", nodes=1, devices_per_node=4, device=V100, intra=LINK_TYPES["nvlink2"],
                 inter=LINK_TYPES["eth-25g"])
    topo = Topology(cl)
    uniform = SearchSpace(uniform=True)
    lin = search_plans(load_workload("bert-48", V100), topo, 32, space=uniform).best
    ker = search_plans(load_workload("bert-48", V100, cost_model="kernels"), topo, 32, space=uniform).best
    assert lin.plan.microbatches == 32                  # linear: more micro-batches only shrink the bubble
    assert ker.plan.microbatches < lin.plan.microbatches


def test_plan_cli_kernels_default_round_trips_through_a_plan_file(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = main(["plan", "-m", "bert-48", "-c", "v100-2x8-25gbe", "-G", "32", "--uniform", "--top", "2",
               "--no-baselines", "--no-progress", "--json", "--out", str(out)])
    rec = json.loads(capsys.readouterr().out)
    assert rc == 0 and rec["model"]["cost_model"] == "kernels"
    rc = main(["simulate", "--plan", str(out), "--json"])
    again = json.loads(capsys.readouterr().out)
    assert again["iteration_time"] == pytest.approx(rec["simulated"]["iteration_time"], rel=1e-9)
    rc = main(["plan", "-m", "bert-48", "-c", "v100-2x8-25gbe", "-G", "32", "--uniform", "--top", "2",
               "--no-baselines", "--no-progress", "--json", "--cost-model", "linear"])
    lin = json.loads(capsys.readouterr().out)
    assert lin["model"]["cost_model"] == "linear" and lin["plan"]["microbatches"] > rec["plan"]["microbatches"]


def test_simulate_per_sample_time_depends_on_micro_batch(capsys):
    """bert-48 on v100-16x1-25gbe simulated at micro-batch 1 and 64. Linear: the same time per
    sample; kernels: much less per sample at 64."""
    per = {}
    for cmodel in ("linear", "kernels"):
        for mb in (1, 64):
            rc = main(["simulate", "-s", "dapple", "-D", "16", "-N", "16", "-m", "bert-48", "-c", "v100-16x1-25gbe",
                       "--micro-batch", str(mb), "--cost-model", cmodel, "--json"])
            rec = json.loads(capsys.readouterr().out)
            assert rc == 0 and rec["cost_model"] == cmodel
            per[cmodel, mb] = max(d["busy"] for d in rec["per_device"]) / (16 * mb)
    assert per["linear", 1] == pytest.approx(per["linear", 64], rel=1e-6)
    assert per["kernels", 1] > 4 * per["kernels", 64]


def test_cost_model_errors(capsys):
    rc = main(["plan", "-m", "bert-48", "-c", "v100-2x8-25gbe", "-G", "8", "--cost-model", "kernels",
               "--memory-limit", "1 KiB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("pipetwin: error: no plan of bert-48")
    with pytest.raises(ValueError, match="cost model must be one of kernels, linear"):
        load_workload("bert-48", V100, cost_model="fast")
    rc = main(["simulate", "-s", "dapple", "-D", "2", "-N", "2", "--unit-costs", "--cost-model", "linear"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--cost-model applies to --model/--cluster costs" in err[0]
