"""Planning on clusters of mixed devices (issue 45, item 3): the typed partition against its brute
force, the type-aware planner against a brute force over pool assignments and layer splits, and the
gain over the type-blind plan that the stage-time imbalance predicts."""
from __future__ import annotations

import itertools
import random

import pytest

from cost_models.partition import speed_counts, typed_split
from planner.search import compositions


def lexi_best(values):
    """The least (slowest, sum) of ``values``, slowest times within a relative 1e-12 of the least
    counted as equal (the search's rule: sums in another order round differently)."""
    values = list(values)
    if not values:
        return None
    b = min(v[0] for v in values)
    return min((v for v in values if v[0] <= b * (1 + 1e-12)), key=lambda v: v[1])


def brute_split(times, S, limits, static=None, act=None, inflight=None, caps=None, sequence=None):
    """(max, sum) of the lexicographically best split, over every kind sequence and composition."""
    L, K = len(times[0]), len(times)
    vals = []
    seqs = [tuple(sequence)] if sequence is not None else itertools.product(range(K), repeat=S)
    for kinds in seqs:
        if any(kinds.count(k) > limits[k] for k in range(K)):
            continue
        for counts in compositions(L, S):
            edges = list(itertools.accumulate((0, *counts)))
            ts, ok = [], True
            for s, k in enumerate(kinds):
                i, j = edges[s], edges[s + 1]
                if caps is not None and sum(static[i:j]) + inflight[s] * sum(act[i:j]) > caps[k]:
                    ok = False
                    break
                ts.append(sum(times[k][i:j]))
            if ok:
                vals.append((max(ts), sum(ts)))
    return lexi_best(vals)


@pytest.mark.parametrize("seed", range(40))
def test_typed_split_is_the_brute_force(seed):
    rng = random.Random(seed)
    K = rng.choice((1, 2, 3))
    L = rng.randint(1, 8)
    S = rng.randint(1, min(L, 4) + 1)
    base = [rng.choice((1.0, 2.0, 3.0, 0.5)) for _ in range(L)]
    speeds = [rng.choice((1.0, 1.5, 2.0, 3.0)) for _ in range(K)]
    times = [[b / sp for b in base] for sp in speeds]
    limits = [rng.randint(0, S) for _ in range(K)]
    mem = rng.random() < 0.5
    static = [rng.choice((1.0, 2.0)) for _ in range(L)] if mem else None
    act = [rng.choice((0.5, 1.0)) for _ in range(L)] if mem else None
    inflight = [min(S - s, 3) for s in range(S)] if mem else None
    caps = [rng.choice((3.0, 5.0, 9.0)) for _ in range(K)] if mem else None
    got = typed_split(times, S, limits, static=static, act=act, inflight=inflight, caps=caps)
    want = brute_split(times, S, limits, static, act, inflight, caps)
    if want is None:
        assert got is None
        return
    assert got is not None
    assert (got.slowest, got.total) == pytest.approx(want, rel=1e-12)
    assert sum(got.counts) == L and min(got.counts) >= 1
    assert all(got.kinds.count(k) <= limits[k] for k in range(K))
    # the split it returns has the value it claims
    edges = list(itertools.accumulate((0, *got.counts)))
    ts = [sum(times[k][edges[s]:edges[s + 1]]) for s, k in enumerate(got.kinds)]
    assert (max(ts), sum(ts)) == pytest.approx((got.slowest, got.total), rel=1e-12)


def test_speed_counts_puts_layers_in_proportion_to_speed():
    """24 uniform layers over 2 stages at speed 1 and 2 at speed 3: L_a / L_h = 1 / 3 exactly, so
    3, 3, 9, 9 (every stage 3 s); at speeds 1 and 2 the continuous optimum, 4 and 8, is whole too."""
    assert speed_counts([1.0] * 24, [1, 1, 3, 3]) == [3, 3, 9, 9]
    assert speed_counts([1.0] * 24, [1, 2, 1, 2]) == [4, 8, 4, 8]
    # 10 layers at speeds 1 and 2: continuous 3.33 | 6.67; whole: 3 | 7 (7 / 2 = 3.5 s) beats 4 | 6 (4 s)
    assert speed_counts([1.0] * 10, [1, 2]) == [3, 7]


# ---------------------------------------------------------------------- the planner with types
def small_mixed(first: str, second: str, per: int = 2):
    from cost_models import cluster_from_dict
    return cluster_from_dict({"name": f"{first}-{second}", "between": "ib-hdr", "pools": [
        {"nodes": 1, "device": first, "devices_per_node": per, "intra": "nvlink3", "inter": "ib-hdr"},
        {"nodes": 1, "device": second, "devices_per_node": per, "intra": "nvlink3", "inter": "ib-hdr"}]})


def stage_values(plan, works, cluster, caps):
    """(slowest stage, sum of stages) per micro-batch of a plan, and whether it fits each pool's
    memory: from :func:`planner.cost.estimate` on the stitched workload (not the planner's DP)."""
    from planner.cost import estimate
    from planner.hetero import _stage_fits, plan_pools, stitched
    from planner.placement import Topology
    est = estimate(plan, stitched(works, plan_pools(plan, cluster)), Topology(cluster), None)
    ts = [s.f + s.b for s in est.stages]
    return (max(ts), sum(ts)), _stage_fits(est, plan, cluster, caps)


def brute_by_pool(works, cluster, G, M, D, R, caps):
    """The least (slowest, sum) over every pool of every stage (each pool's GPUs permitting, R devices
    a stage, taken in order inside its pool) and every layer split."""
    from planner.hetero import _plan
    L = works[0].num_layers
    sizes = [p.num_devices for p in cluster.pools]
    firsts = [sum(sizes[:k]) for k in range(len(sizes))]
    vals = []
    for kinds in itertools.product(range(len(sizes)), repeat=D):
        if any(kinds.count(k) * R > sizes[k] for k in range(len(sizes))):
            continue
        nxt, devs = list(firsts), []
        for k in kinds:
            devs.append(tuple(range(nxt[k], nxt[k] + R)))
            nxt[k] += R
        for counts in compositions(L, D):
            v, fits = stage_values(_plan("m", cluster.name, G, M, counts, devs, "by-pool"), works, cluster, caps)
            if fits:
                vals.append(v)
    return lexi_best(vals)


@pytest.mark.parametrize("pools, model, limit, found", [
    (("a100", "h100"), "gpt3-1.3b", None, 22),
    (("v100-16gb", "a100"), "llama3-8b", None, 21),
    (("h100", "a100"), "gpt3-1.3b", 14 * 2 ** 30, 18)])
def test_type_aware_split_is_the_brute_force_over_pools_and_splits(pools, model, limit, found):
    """On 2 + 2 GPUs of two kinds, for every (M, D, R) of G = 8, the type-aware candidate (stages on
    one pool each) has the least (slowest stage, sum of stages) of every assignment of stages to
    pools and every layer split that fits each pool's memory (the V100-16GB pool, or a 14 GiB
    limit, leaves whole-model stages out), as priced by DAPPLE's estimate on the stitched workload."""
    from cost_models import load_model
    from planner.hetero import AWARE, _configs, aware_candidates, pool_caps, pool_workloads
    from planner.search import SearchSpace
    cluster = small_mixed(*pools)
    works = pool_workloads(load_model(model).replace(layers=5), cluster)
    caps = pool_caps(cluster, works, limit)
    G, checked, fitting = 8, 0, 0
    for M, D, R in _configs(G, cluster.num_devices, works[0].num_layers, SearchSpace()):
        want = brute_by_pool(works, cluster, G, M, D, R, caps)
        got = [p for p in aware_candidates(works, cluster, G, M, D, R, caps, "m") if
               len({cluster.pool_of_device(d) for d in p.stages[0].devices}) == 1 and
               all(len({cluster.pool_of_device(d) for d in st.devices}) == 1 for st in p.stages)]
        by_pool = [p for p in got if p.policy == AWARE][:1]
        checked += 1
        if want is None:
            assert not by_pool or not stage_values(by_pool[0], works, cluster, caps)[1]
            continue
        fitting += 1
        assert by_pool, (M, D, R)
        v, fits = stage_values(by_pool[0], works, cluster, caps)
        assert fits and v == pytest.approx(want, rel=1e-9), (M, D, R)
    # every (M, D, R) of G = 8 on 4 GPUs: M = 1, 2 (R = 1, 2, 4: D <= 4, 2, 1), M = 4 (R = 1, 2),
    # M = 8 (R = 1): 7 + 7 + 6 + 4
    assert checked == 24
    assert fitting == found


@pytest.mark.parametrize("model, G, M, tol", [("gpt3-1.3b", 128, 16, 0.05), ("llama3-8b", 64, 8, 0.05)])
def test_type_aware_gain_on_a100_h100_is_what_the_imbalance_predicts(model, G, M, tol):
    """2 A100 nodes + 2 H100 nodes (a100-h100), D x R = 4 x 8 GPUs (R = 8 a stage, M fixed): both
    planners use 4 stages, 2 on each pool, and differ only in awareness.

    Closed form (uniform blocks of c_a seconds a micro-batch on an A100, c_h on an H100, rho =
    c_a / c_h; the embedding e and the head h on the end stages). DAPPLE's 1F1B iteration is the
    pivot formula without communication, T = max_s (sum_{s' <= s} t_s' + (M - 1) t_s).
    Type-blind: the default split, N / 4 blocks a stage, stages 0-1 on A100s, 2-3 on H100s:
    t = (e + N/4 c_a, N/4 c_a, N/4 c_h, N/4 c_h + h_h), the slowest an A100 stage. Type-aware: the
    blocks in proportion to speed, a_1 + a_2 on the A100s and h_1 + h_2 on the H100s with
    (a_1 + a_2) / (h_1 + h_2) ~ 1 / rho (continuous: every stage 2 N c_a / (4 (1 + rho)), a gain of
    (1 + rho) / 2 on the slowest stage); whole blocks: the best (a_1, a_2, h_1, h_2) with
    t = (e + a_1 c_a, a_2 c_a, h_1 c_h, h_2 c_h + h_h). Predicted gain = T_blind / T_aware.

    Tolerance 5%: the closed form leaves out what both plans pay besides compute (the boundary
    transfers, the stages' gradient all-reduces sticking out of the drain, the optimizer step),
    about the same seconds C in each, which pulls the simulated gain (T_b + C) / (T_a + C) below
    the predicted one by (gain - 1) C / (T_a + C): with C under 10% of T_a (a few ms of p2p on
    NVLink / IB per micro-batch, an all-reduce of 1/4 of the model inside a node) that is under
    5% of the gain; the simulated gain is never above the prediction."""
    from cost_models import load_cluster
    from planner.hetero import pool_workloads, plan_mixed
    from planner.search import SearchSpace
    cluster = load_cluster("a100-h100")
    works = pool_workloads(model, cluster)
    res = plan_mixed(model, cluster, G, space=SearchSpace(microbatches=(M,), replicas=(8,)), works=works)
    aware, blind = res.aware.evaluated.plan, res.blind.evaluated.plan
    assert (aware.num_stages, aware.dp, blind.num_stages, blind.dp) == (4, 8, 4, 8)
    assert sorted(cluster.pool_of_device(st.devices[0]) for st in aware.stages) == [0, 0, 1, 1]
    q = G // M // 8
    a, h = works[0].at(q), works[1].at(q)
    per = lambda w, l: (w.f[l] + w.b_input[l] + w.w[l]) * q  # noqa: E731
    ca, ch, e, hh = per(a, 1), per(h, 1), per(a, 0), per(h, -1)
    N = works[0].num_layers - 2
    assert all(per(a, l) == pytest.approx(ca) for l in range(1, N + 1))      # uniform blocks

    def pivot(ts):
        return max(sum(ts[:s + 1]) + (M - 1) * ts[s] for s in range(len(ts)))
    n = N // 4
    t_blind = pivot([e + n * ca, n * ca, n * ch, n * ch + hh])
    t_aware = min(pivot([e + a1 * ca, a2 * ca, h1 * ch, (N - a1 - a2 - h1) * ch + hh])
                  for a1 in range(1, N) for a2 in range(1, N - a1) for h1 in range(1, N - a1 - a2))
    predicted = t_blind / t_aware
    rho = ca / ch
    assert predicted < (1 + rho) / 2 + 1e-9          # whole blocks and the head: at most the continuous gain
    assert res.gain <= predicted * (1 + 1e-9)
    assert res.gain == pytest.approx(predicted, rel=tol)
    # what the closed form leaves out is a small positive overhead on each plan (the tolerance's premise)
    for sim, closed in ((res.aware.time, t_aware), (res.blind.time, t_blind)):
        assert 0 < sim - closed < 0.10 * closed
    assert res.summary() == (f"type-aware {res.aware.time:.4g} s/step vs type-blind {res.blind.time:.4g} s/step: "
                             f"{res.blind.time / res.aware.time:.2f}x")


def test_plan_command_on_a_mixed_cluster_reports_the_gain_and_writes_a_plan_that_simulates_as_planned(
        tmp_path, capsys):
    """``pipetwin plan -c a100-h100`` prints both plans and the gain line of :func:`plan_mixed`; its
    plan file, read back (each stage's layers on its pool's device), simulates to the planned time;
    ``--type-blind`` keeps the type-blind plan."""
    from cost_models import load_cluster
    from experiments.cli import main
    from planner import load_plan
    from planner.hetero import plan_mixed
    from planner.simulate import simulate_plan
    res = plan_mixed("gpt3-1.3b", load_cluster("a100-h100"), 64)
    for blind in (False, True):
        path = tmp_path / f"plan-{blind}.json"
        assert main(["plan", "-m", "gpt3-1.3b", "-c", "a100-h100", "-G", "64", "--no-progress", "--out", str(path)]
                    + (["--type-blind"] if blind else [])) == 0
        out = capsys.readouterr().out
        assert res.summary() in out.splitlines()
        kept = res.blind if blind else res.aware
        assert out.splitlines()[1] == f"  type-{'blind' if blind else 'aware'}: {kept.evaluated.plan.describe()}"
        loaded = load_plan(path)
        assert loaded.plan == kept.evaluated.plan
        assert simulate_plan(loaded.plan, loaded.workload, loaded.cluster).iteration_time == kept.time


# ---------------------------------------------------------------- the whole-layout search, type-aware
def _mid():
    """A llama of 8 blocks wide enough (hidden 4,096) that an A100 and an H100 price a block apart
    (the 1,024-wide test model is launch-bound: its blocks cost about the same on both)."""
    from cost_models.model_spec import ModelSpec
    return ModelSpec(name="mid-llama", kind="llama", layers=8, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                     seq_len=2048, vocab=32000, micro_batch=1, dtype_bytes=2)


# (GiB limit or None, space): two small spaces on 4 A100s + 4 H100s (small_mixed(..., 4)), global batch 16
LAYOUT_CASES = [
    (None, dict(schedules=("dapple", "zb-h1", "zb-v", "interleaved"), micro_batches=(1, 2),
                recompute=("none", "full"))),
    (14, dict(schedules=("dapple", "zb-h1", "gpipe"), micro_batches=(1, 2), recompute=("none", "selective"),
              sequence_parallel=(False, True))),
]


@pytest.mark.parametrize("case", range(len(LAYOUT_CASES)))
def test_layout_search_on_a_mixed_cluster_is_the_brute_force(case):
    """The whole-layout search on a mixed cluster against its twin (every candidate bound, judged by
    each pool's ledger and simulated on the mixed cluster): every bound at or below its truth, the
    top 3 the brute force's. Every candidate is in Megatron's order (pipeline device d of replica r
    on GPUs (d R + r) T ..: a stage's replicas neighbours, on one pool where T x R divides the 4
    GPUs of a pool, else the D = 1 or 2 layouts of T x R = 8 straddle both), C = 1 and ZeRO 0/1
    (what a mixed cluster prices), its layers :func:`typed_split`'s over the schedule's stages, each
    stage's kind its replicas' pools at the slowest's pace. Under the 14 GiB limit the split keeps
    each stage within memory: of the layouts that fit, the 38 whose layers memory moved (off the
    H100 stages, the faster pool's) are out of memory with the time-only split."""
    from cost_models.bind import transformer_cost_model
    from cost_models.partition import typed_split
    import dataclasses

    from cost_models.bind import CostInputs
    from planner.layout import Confirmed, LayoutSpace, confirm, device_pools
    from schedules import build
    from tests.helpers import assert_search_is_the_brute_force
    limit, kw = LAYOUT_CASES[case]
    cluster, model = small_mixed("a100", "h100", 4), _mid()
    brute, fits, res = assert_search_is_the_brute_force(model, cluster, 16, LayoutSpace(**kw),
                                                        memory_limit=None if limit is None else limit * 2 ** 30)
    assert res.simulated < len(fits) and res.candidates == len(brute)
    ooms = [c for c, got in brute if isinstance(got, tuple) and got[0] == "oom"]
    assert (limit is None) == (not ooms)
    jobs = [c.job for c, _ in brute]
    assert {j.parallel.zero for j in jobs} == {0, 1} and {j.parallel.cp for j in jobs} == {1}
    assert {j.mapping for j in jobs} == {"megatron"}
    uneven = straddle = moved = 0
    cs = {}
    got_of = {c.job: got for c, got in brute}
    for j in jobs:
        lay, group = j.layout, j.parallel.tp * j.layout.replicas
        sched = build(lay.schedule, lay.devices, lay.microbatches, **lay.family_options())
        where = device_pools(cluster, lay.devices, j.parallel.tp, lay.replicas)
        for d in range(lay.devices):        # a pipeline device's T x R GPUs: on one pool where they fit
            assert where[d] == {cluster.pool_of_device(g) for g in range(d * group, (d + 1) * group)}
            assert len(where[d]) == (1 if 4 % group == 0 else 2)
        straddle += group == 8
        kinds = [where[sched.placement[0][s]] for s in range(sched.num_stages)]
        used = list(dict.fromkeys(kinds))
        for p in range(2):
            cs[p] = transformer_cost_model(j, j.parallel.sized(model), cluster.pool_cluster(p)).layer_costs()
        per = [[f + b + w for f, b, w in zip(c.f, c.b_input, c.w)] for c in (cs[0], cs[1])]
        times = [[max(per[p][l] for p in k) for l in range(len(per[0]))] for k in used]
        want = typed_split(times, len(kinds), [len(kinds)] * len(used), sequence=tuple(used.index(k) for k in kinds))
        if want is None:        # more stages than layers: no split (the candidate is refused when bound)
            assert j.partition is None
            continue
        if limit is None:       # no memory binds: the time-only split
            assert j.partition == want.counts
        elif j.partition != want.counts and isinstance(got_of[j], Confirmed):
            # memory moved layers off the faster pool's stage: the time-only split is out of memory there
            t = dataclasses.replace(j, partition=want.counts)
            inputs = CostInputs("transformer", model=t.parallel.sized(model), cluster=cluster)
            assert confirm(t, inputs, limit * 2 ** 30, None)[0] == "oom"
            moved += 1
        uneven += len(set(j.partition)) > 1 and len(used) > 1
    assert uneven and straddle
    assert moved == (0 if limit is None else 38)


def test_layout_search_gain_on_a100_h100_is_what_the_imbalance_predicts():
    """llama3-8b on a100-h100 (16 A100 + 16 H100), the space narrowed to one layout shape (T = 1,
    D = 4, R = 8, DAPPLE's 1F1B, micro-batch 1, so N = 64 / 8 = 8 micro-batches, ZeRO-1): the
    type-aware search places stages 0-1 on the A100s and 2-3 on the H100s (Megatron's order) with
    its layers split by type; the type-blind one (the same search as if every GPU were an A100)
    keeps the default split and Llama 3's order, a replica's pipeline on 4 consecutive GPUs, so
    replicas 0-3 run on A100s, 4-7 on H100s, and the A100 replicas set the step (the gradient
    all-reduce waits for them).

    Closed form, the pivot formula of 1F1B without communication, T = max_s (sum_{s' <= s} t_s' +
    (N - 1) t_s), with c_a, c_h the seconds of a block's F + B + W on an A100 / H100, e the
    embedding's on an A100, h_a, h_h the head's: type-blind t = (e + 8 c_a, 8 c_a, 8 c_a,
    8 c_a + h_a) (32 blocks, 8 a stage, all on A100s); type-aware the best whole-block (a_1, a_2,
    h_1, h_2), t = (e + a_1 c_a, a_2 c_a, h_1 c_h, h_2 c_h + h_h): (6, 6, 12, 8) blocks, a gain
    T_blind / T_aware of 1.94 (rho = c_a / c_h = 2.34, and the 128k-vocabulary head moves to an
    H100). The search's split is typed_split's, the least slowest stage, (5, 5, 12, 10) blocks:
    its pivot T_typed is 4.8% above T_aware (the pivot formula weighs a stage by its place in the
    fill, the least-slowest split does not), a predicted gain of 1.85. The simulated gain lies
    between (1.88): both plans pay a few percent besides compute (boundary transfers, the
    all-reduce sticking out of the drain, the optimizer step), the type-blind one's all-reduce
    crossing the pools. Tolerance 5% of either prediction."""
    from cost_models import load_cluster, load_model
    from cost_models.bind import transformer_cost_model
    from planner.hetero import gain, gain_line
    from planner.layout import LayoutSpace, plan_layouts, plan_type_blind
    cluster, model = load_cluster("a100-h100"), load_model("llama3-8b")
    space = LayoutSpace(schedules=("dapple",), tp=(1,), devices=(4,), micro_batches=(1,), recompute=("none",),
                        zero=(1,))
    res = plan_layouts(model, cluster, 64, space)
    blind = plan_type_blind(model, cluster, 64, space)
    job = res.best.job
    assert (job.layout.devices, job.layout.replicas, job.mapping) == (4, 8, "megatron")
    assert (blind.job.layout.devices, blind.job.layout.replicas, blind.job.mapping) == (4, 8, "sequential")
    assert blind.job.partition is None and blind.fits
    N = job.layout.microbatches
    assert N == 8
    cs = [transformer_cost_model(job, job.parallel.sized(model), cluster.pool_cluster(p)).layer_costs()
          for p in range(2)]
    per = lambda c, l: c.f[l] + c.b_input[l] + c.w[l]  # noqa: E731
    ca, ch, e, ha, hh = per(cs[0], 1), per(cs[1], 1), per(cs[0], 0), per(cs[0], -1), per(cs[1], -1)
    B = model.layers
    assert all(per(cs[0], l) == pytest.approx(ca) and per(cs[1], l) == pytest.approx(ch) for l in range(1, B + 1))

    def pivot(ts):
        return max(sum(ts[:s + 1]) + (N - 1) * ts[s] for s in range(len(ts)))
    n = B // 4
    t_blind = pivot([e + n * ca, n * ca, n * ca, n * ca + ha])
    t_aware = min(pivot([e + a1 * ca, a2 * ca, h1 * ch, (B - a1 - a2 - h1) * ch + hh])
                  for a1 in range(1, B) for a2 in range(1, B - a1) for h1 in range(1, B - a1 - a2))
    predicted = t_blind / t_aware
    assert 1.93 < predicted < 1.95
    # the typed split: stages 0-1 (A100) hold the embedding and 10 blocks, 2-3 (H100) 22 blocks and the head
    assert job.partition == (6, 5, 12, 11)
    t_typed = pivot([e + 5 * ca, 5 * ca, 12 * ch, 10 * ch + hh])
    assert t_typed == pytest.approx(1.048 * t_aware, rel=1e-3)
    assert 1.84 < t_blind / t_typed < 1.86
    assert blind.believed == pytest.approx(blind.iteration_time, rel=1e-4)     # the A100 replicas set the pace
    got = gain(res.best.iteration_time, blind.iteration_time)
    assert got == pytest.approx(predicted, rel=0.05) and got == pytest.approx(t_blind / t_typed, rel=0.05)
    for sim, closed in ((res.best.iteration_time, t_typed), (blind.iteration_time, t_blind)):
        assert 0 < sim - closed < 0.05 * closed
    assert gain_line(res.best.iteration_time, blind.iteration_time) == (
        f"type-aware {res.best.iteration_time:.4g} s/step vs type-blind {blind.iteration_time:.4g} s/step: "
        f"{blind.iteration_time / res.best.iteration_time:.2f}x")


def test_plan_search_layout_on_a_mixed_cluster_prints_the_type_blind_plan_and_the_gain(tmp_path, capsys):
    """``pipetwin plan -c a100-h100 --search layout``: the search's table, the layers per stage, the
    type-blind plan and the gain line of :func:`planner.hetero.gain_line` (the numbers of
    :func:`plan_layouts` and :func:`plan_type_blind`); its plan file simulates to the planned time."""
    from cost_models import load_cluster, load_model
    from experiments.cli import main
    from planner.hetero import gain_line
    from planner.layout import LayoutSpace, plan_layouts, plan_type_blind
    space = LayoutSpace(schedules=("dapple", "zb-h1"), micro_batches=(1,), recompute=("none",))
    cluster, model = load_cluster("a100-h100"), load_model("gpt3-1.3b")
    res = plan_layouts(model, cluster, 64, space)
    blind = plan_type_blind(model, cluster, 64, space)
    path = tmp_path / "plan.json"
    assert main(["plan", "-m", "gpt3-1.3b", "-c", "a100-h100", "-G", "64", "--search", "layout", "--schedules",
                 "dapple,zb-h1", "--micro-batch", "1", "--recompute", "none", "--top", "1", "--no-progress",
                 "--out", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("whole-layout plan for gpt3-1.3b on a100-h100 (16 x a100 + 16 x h100)")
    assert gain_line(res.best.iteration_time, blind.iteration_time) in lines
    assert f"  layers per stage: {','.join(map(str, res.best.job.partition))} (stages on pools in order, more " \
           f"layers on the faster)" in lines
    j = blind.job
    assert lines[1] == "  usable per GPU: 75 GiB on a100, 75 GiB on h100"
    at = lines.index(f"  type-blind: tp {j.parallel.tp}, D {j.layout.devices}, dp {j.layout.replicas}, "
                     f"{j.layout.schedule}, micro-batch {j.parallel.micro_batch}, recompute none, zero "
                     f"{j.parallel.zero}, map {j.mapping}")
    assert lines[at + 1] == (f"    believed {blind.believed:.4g} s/step (as if every GPU were the a100), simulated "
                             f"{blind.iteration_time:.4g} s/step")
    assert max(map(len, lines)) <= 120
    assert main(["simulate", "--plan", str(path), "--json"]) == 0
    import json
    assert json.loads(capsys.readouterr().out)["iteration_time"] == pytest.approx(res.best.iteration_time, rel=1e-12)


def test_in_flight_counts_the_micro_batches_a_stage_holds():
    """1F1B (dapple) holds min(D - s, N) micro-batches at stage s; GPipe all N; ZB-H1 the same as
    1F1B (its W work runs after B, which frees the input's activations)."""
    from planner.layout import in_flight
    from schedules import build
    assert in_flight(build("dapple", 4, 8)) == [4, 3, 2, 1]
    assert in_flight(build("dapple", 4, 2)) == [2, 2, 2, 1]
    assert in_flight(build("gpipe", 4, 8)) == [8, 8, 8, 8]
    assert in_flight(build("zb-h1", 4, 8)) == [4, 3, 2, 1]
