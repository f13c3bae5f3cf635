"""ZeRO 2 and 3 with expert parallelism (``pipetwin run --ep E --zero 2|3``), and context parallelism
with a mixture of experts (``--cp C --ep E``), in the executor: spawned gloo ranks against the
single-process reference and the simulator's ledger.

ZeRO with EP (:mod:`executor.zero`): a stage module has two shards, its dense parameters over the
stage's shard group (the S replicas x C CP ranks that hold them) and its routed experts over their
EDP group (:meth:`executor.mesh.Mesh.expert_fold`); ZeRO 2 reduce-scatters each micro-batch's
gradients of both as its backward completes them, ZeRO 3 also gathers both before the module's F
and B. At D 1 x R 4, EP 2 (EDP 2: each expert on two processes, its state sharded over the pair) and
D 2 x R 2, EP 2 (EDP 1: the experts unsharded, the dense state over the two replicas)."""
from __future__ import annotations

import pytest
import torch

from cost_models import load_model
from cost_models.job import Job
from executor.config import RunConfig
from tests.helpers import assert_losses_equal, assert_params_equal_reference, reference_cache

D1R4 = dict(devices=1, replicas=4, microbatches=2)
D2R2 = dict(devices=2, replicas=2, microbatches=4)
BASE = dict(steps=2, optimizer="sgd", lr=0.05, collect_params=True, timeout=60.0, ep=2, schedule="dapple",
            model="tiny-mixtral")
CASES = {4: {}}
for _n, _lay in (("D1R4", D1R4), ("D2R2", D2R2)):
    for _z in (2, 3):
        CASES[4][f"zero{_z}-{_n}"] = RunConfig.of(zero=_z, **_lay, **BASE)
CASES[4]["zero3-resharded-D1R4"] = RunConfig.of(zero=3, reshard_after_forward=True, **D1R4, **BASE)
CASES[4]["zero2-zb-v-D2R2"] = RunConfig.of(**dict(BASE, schedule="zb-v"), zero=2, **D2R2)
# memory: the wider, balanced tiny Mixtral of tests/test_executor_ep.py (top-k = E: every token to every
# expert, so every EP rank receives the same rows), Adam, one step
BALANCED = load_model("tiny-mixtral").replace(name="mem-mixtral", hidden=256, ffn_hidden=384, experts=4, top_k=4,
                                              dropout=False, attention="flash")
MEM = dict(BASE, model=BALANCED, optimizer="adam", lr=1e-3, steps=1, collect_params=False)
for _n, _lay in (("D1R4", D1R4), ("D2R2", D2R2)):
    for _z in (2, 3):
        CASES[4][f"mem-zero{_z}-{_n}"] = RunConfig.of(zero=_z, **_lay, **MEM)
TRAIN_IDS = sorted(k for k in CASES[4] if not k.startswith("mem-"))
MEM_IDS = sorted(k for k in CASES[4] if k.startswith("mem-"))


@pytest.fixture(scope="module")
def references():
    return reference_cache()


@pytest.mark.slow
@pytest.mark.parametrize("case", TRAIN_IDS)
def test_losses_and_parameters_equal_reference(runs, references, case):
    """Every step's loss within 1e-5 of the single-process reference's and every final parameter (ZeRO
    3's gathered from their shards; each replica's model whole, its routed experts from its EP peers)
    within 1e-5 relative; an expert's holders end bit-identical. Collectives per step and rank, N_m =
    the module's micro-batches (B ops), two shards per stage module (dense, experts; a shard of one
    process issues none): ZeRO 2 and 3 reduce-scatter N_m times per shard and all-gather once (ZeRO 2:
    the updated weights; ZeRO 3: before the first F), or 2 N_m times with --reshard-after-forward."""
    cfg, sched, res = runs(4)[case]
    ref = references(cfg)
    assert_losses_equal(res, ref)
    by_name = assert_params_equal_reference(res, ref, sched)
    assert all(torch.equal(t, ts[0]) for ts in by_name.values() for t in ts)
    par, N = cfg.parallel, sched.num_microbatches
    shards = 1 + (cfg.layout.replicas // par.ep > 1)         # the experts' shard collects over EDP > 1
    per_step = {"reduce_scatter": shards * N,
                "all_gather": shards * (2 * N if par.reshard_after_forward else 1)}
    for c in res.extra["zero_collectives"]:
        stages = len(sched.stages_on(c["rank"] % sched.num_devices))
        assert {k: c[k] for k in per_step} == {k: v * stages * cfg.steps for k, v in per_step.items()}, c


@pytest.mark.slow
@pytest.mark.parametrize("case", MEM_IDS)
def test_bytes_per_rank_equal_the_simulators_ledger(runs, case):
    """The simulator's ledger (:func:`cost_models.bind.bind`: weights, gradients and Adam state of the
    dense parameters over the stage's shard group and of the routed experts over their EDP group,
    ZeRO 3's gathered weights booked whole for the stages a rank holds) equals the measured weights,
    gradients, optimizer state and gathered weights per rank to the byte; the peak activations are
    within 1 % of the ledger's walk."""
    from tests.helpers import assert_bytes_equal_the_ledger
    assert_bytes_equal_the_ledger(*runs(4)[case])


# ---------------------------------------------------------------------------- context parallelism with experts
def test_expert_fold_spans_the_cp_ranks():
    """Megatron's folding with C > 1 (executor.mesh): the stage's T x C x R processes in rank order
    (TP fastest, then CP, then the replicas) are folded ETP x EP x EDP. C 2, one pipeline rank: the
    EP 2 group is its two CP ranks, EDP 1; at EP 1 the two CP ranks are one EDP group. C 2 x R 2
    (the stage on pipeline ranks 0 and 1, processes 0, 1 | 2, 3): EP 2 groups {0, 1}, {2, 3} (each
    replica's CP ranks), EDP groups {0, 2}, {1, 3}; EP 4: one group of all four."""
    from executor.mesh import Mesh
    assert Mesh(1, 2, cp=2).expert_fold((0,), 2) == (((0, 1),), ((0,), (1,)))
    assert Mesh(1, 2, cp=2).expert_fold((0,), 1) == (((0,), (1,)), ((0, 1),))
    assert Mesh(1, 2, cp=2).expert_fold((0, 1), 2) == (((0, 1), (2, 3)), ((0, 2), (1, 3)))
    assert Mesh(1, 2, cp=2).expert_fold((0, 1), 4) == (((0, 1, 2, 3),), ((0,), (1,), (2,), (3,)))
    with pytest.raises(ValueError, match=r"EP 4 x ETP 1 must fold onto the stage's T x C x R = 2 processes"):
        Mesh(1, 2, cp=2).expert_fold((0,), 4)


def test_the_simulator_folds_the_experts_over_the_cp_ranks_too():
    """cost_models.moe: EDP = T x C x R / (EP x ETP), and EP x ETP must divide T x C x R."""
    from cost_models.moe import check_expert_parallel, expert_data_parallel
    from cost_models.parallel import Parallel
    spec = load_model("tiny-mixtral")
    assert expert_data_parallel(Parallel(cp=2, ep=2), 2) == 2
    assert expert_data_parallel(Parallel(cp=2, ep=4), 2) == 1
    check_expert_parallel(spec, Parallel(cp=2, ep=2), 1)
    with pytest.raises(ValueError, match=r"T x C x R = 1 x 2 x 1 GPUs"):
        check_expert_parallel(spec, Parallel(cp=2, ep=4), 1)


CP = dict(BASE, cp=2, device_map="sequential")     # one map per launch (zb-v and dapple differ by default)
CASES["cp-D2R1"] = {"cp2-ep2-D2R1": RunConfig.of(**CP, devices=2, replicas=1, microbatches=4),
                    "cp2-ep1-D2R1": RunConfig.of(**dict(CP, ep=1), devices=2, replicas=1, microbatches=4),
                    "cp2-ep2-zb-v-D2R1": RunConfig.of(**dict(CP, schedule="zb-v"), devices=2, replicas=1,
                                                      microbatches=4)}
CASES["cp-D1R2"] = {"cp2-ep2-D1R2": RunConfig.of(**CP, devices=1, replicas=2, microbatches=2),
                    "cp2-ep2-zero1-D1R2": RunConfig.of(**CP, zero=1, devices=1, replicas=2, microbatches=2)}
CP_IDS = [(w, k) for w in ("cp-D2R1", "cp-D1R2") for k in sorted(CASES[w])]


@pytest.mark.slow
@pytest.mark.parametrize("key,case", CP_IDS, ids=[k for _, k in CP_IDS])
def test_cp_with_experts_equals_reference(runs, references, key, case):
    """tiny Mixtral (aux loss 0.01, dropless) at C 2: each CP rank routes its s/C tokens, the aux loss
    is each rank's share over the micro-batch's load summed over the CP group, the EP group folds
    over the CP ranks first (EP 2 at R 1: the two CP ranks, EDP 1; at R 2 each replica's two CP
    ranks, EDP 2 over the replicas; EP 1: the experts summed over the CP ranks). Every step's loss
    within 1e-5 of the single-process reference's, every final parameter within 1e-5 relative (the
    experts gathered from the CP ranks that hold them), the CP ranks' common weights bit-equal."""
    cfg, sched, res = runs(key)[case]
    ref = references(cfg)
    assert_losses_equal(res, ref)
    assert_params_equal_reference(res, ref, sched)
    assert res.extra["cp_replica_drift"] == 0.0


CASES["cp-D2R1"]["mem-cp2-ep2-D2R1"] = RunConfig.of(**dict(MEM, cp=2, device_map="sequential"), devices=2,
                                                    replicas=1, microbatches=4)
CASES["cp-D1R2"]["mem-cp2-ep2-zero1-D1R2"] = RunConfig.of(**dict(MEM, cp=2, device_map="sequential"), zero=1,
                                                          devices=1, replicas=2, microbatches=2)
CP_MEM_IDS = [("cp-D2R1", "mem-cp2-ep2-D2R1"), ("cp-D1R2", "mem-cp2-ep2-zero1-D1R2")]


@pytest.mark.slow
@pytest.mark.parametrize("key,case", CP_MEM_IDS, ids=[k for _, k in CP_MEM_IDS])
def test_cp_with_experts_bytes_equal_the_ledger(runs, key, case):
    """C 2, EP 2 (Adam, the balanced wide tiny Mixtral): each CP rank holds E/2 experts; the weights,
    gradients and Adam state per rank equal the simulator's ledger (experts folded over T x C x R,
    EDP = C R / EP; ZeRO-1's dense state over R x C, the experts' over EDP) to the byte; the peak
    activations (s/C tokens a rank) within 1 % of the ledger's walk."""
    from cost_models.bind import bind
    from cost_models.memory import peak_activation
    cfg, sched, res = runs(key)[case]
    ledger = bind(Job(layout=cfg.layout, parallel=cfg.parallel, model=cfg.spec(), cluster="dgx-a100-1x8"))
    assert [d["static_bytes"] for d in res.per_device] == [int(x) for x in ledger.costs.static_mem]
    act = peak_activation(ledger.lowered, ledger.costs)
    for d, want in zip(res.per_device, act, strict=True):
        assert abs(d["peak_activation_bytes"] - want) <= 0.01 * want, (case, d["peak_activation_bytes"], want)
