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
    from cost_models.bind import bind
    from cost_models.memory import peak_activation
    cfg, sched, res = runs(4)[case]
    ledger = bind(Job(layout=cfg.layout, parallel=cfg.parallel, model=cfg.spec(), cluster="dgx-a100-1x8"))
    assert [op for prog in ledger.lowered.programs for op in prog] == [op for prog in sched.programs for op in prog]
    assert [d["static_bytes"] + d["gathered_bytes"] for d in res.per_device] == \
        [int(x) for x in ledger.costs.static_mem]
    act = peak_activation(ledger.lowered, ledger.costs)
    for d, want in zip(res.per_device, act, strict=True):
        assert abs(d["peak_activation_bytes"] - want) <= 0.01 * want, (case, d["peak_activation_bytes"], want)
