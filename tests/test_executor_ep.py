"""Expert parallelism in the executor (``pipetwin run --ep E``): the mesh's expert fold, the
refusals, and (spawned gloo ranks) training against the single-process reference."""
from __future__ import annotations

import pytest
import torch

from cost_models import load_model
from cost_models.job import Job
from executor.config import RunConfig
from executor.mesh import Mesh
from tests.helpers import (assert_losses_equal, assert_params_equal_reference, moe_blocks_on, params_by_name,
                           reference_cache)


@pytest.mark.parametrize("tp,ep,etp,eps,edps", [
    # T 1, R 4 (stage on pipeline ranks 0, 2, 4, 6): EP 2 -> EP groups of consecutive replicas, EDP 2
    (1, 2, 1, ((0, 2), (4, 6)), ((0, 4), (2, 6))),
    (1, 4, 1, ((0, 2, 4, 6),), ((0,), (2,), (4,), (6,))),
    # T 2, R 4: 8 processes 0,1 4,5 8,9 12,13; EP 2 x ETP 2 -> member (k EP + e) ETP + u
    (2, 2, 2, ((0, 4), (1, 5), (8, 12), (9, 13)), ((0, 8), (1, 9), (4, 12), (5, 13))),
    (2, 4, 1, ((0, 1, 4, 5), (8, 9, 12, 13)), ((0, 8), (1, 9), (4, 12), (5, 13))),
])
def test_expert_fold_is_megatrons(tp, ep, etp, eps, edps):
    """Process i of the stage's T x R (TP fastest) is EP rank e of EP group (k, u) and EDP rank k
    of EDP group (e, u), i = (k EP + e) ETP + u (cost_models.moe's folding)."""
    mesh = Mesh(tp, 8)          # D 2 x R 4 pipeline ranks; the stage on device 0: ranks 0, 2, 4, 6
    got_ep, got_edp = mesh.expert_fold((0, 2, 4, 6), ep, etp)
    assert got_ep == eps and got_edp == edps
    assert sorted(r for g in got_ep for r in g) == sorted(r for g in got_edp for r in g) == \
        sorted(mesh.rank(p, t) for p in (0, 2, 4, 6) for t in range(tp))


# ---------------------------------------------------------------------------- training (spawned gloo ranks)
BASE = dict(steps=2, optimizer="sgd", lr=0.05, collect_params=True, timeout=30.0, devices=2, microbatches=4,
            replicas=2, ep=2)
SCHEDULES = ("dapple", "interleaved", "zb-v", "dualpipe-v")
CASES = {4: {f"{m}-{s}": RunConfig.of(schedule=s, model=m, **BASE) for m in ("tiny-mixtral", "tiny-deepseek")
             for s in SCHEDULES}}
for _m in ("tiny-mixtral", "tiny-deepseek"):
    CASES[4][f"{_m}-dapple-zero"] = RunConfig.of(schedule="dapple", model=_m, zero=1, **BASE)
    CASES[4][f"{_m}-zb-v-recompute-full"] = RunConfig.of(schedule="zb-v", model=_m, recompute="full", **BASE)
CASES[4]["tiny-mixtral-zb-v-zero-adam"] = RunConfig.of(schedule="zb-v", model="tiny-mixtral", zero=1,
                                                       **dict(BASE, optimizer="adam", lr=1e-3))
CASES[4]["tiny-mixtral-dualpipe-v-recompute-selective"] = RunConfig.of(
    schedule="dualpipe-v", model="tiny-mixtral", recompute="selective", **BASE)
# memory: a wider model, Adam, one step; routing balanced by construction (top-k = E: every token goes to
# every expert, so each EP rank receives exactly n k / EP x EP = n k rows per micro-batch), and the same
# at EP 1, where the ledger's per-GPU activations are EP 2's
BALANCED = load_model("tiny-mixtral").replace(name="mem-mixtral", hidden=256, ffn_hidden=384, experts=4, top_k=4,
                                              dropout=False, attention="flash")
MEM = dict(BASE, model=BALANCED, optimizer="adam", lr=1e-3, steps=1, collect_params=False)
for _s in ("dapple", "zb-v"):
    for _z in (0, 1):
        CASES[4][f"mem-{_s}-zero{_z}"] = RunConfig.of(schedule=_s, zero=_z, **MEM)
        CASES[4][f"mem-{_s}-zero{_z}-ep1"] = RunConfig.of(schedule=_s, zero=_z, **dict(MEM, ep=1))
IDS = sorted(k for k in CASES[4] if not k.startswith("mem-"))
ADAM = {"tiny-mixtral-zb-v-zero-adam"}


@pytest.fixture(scope="module")
def references():
    return reference_cache()


@pytest.mark.slow
@pytest.mark.parametrize("case", IDS)
def test_losses_and_parameters_equal_reference(runs, references, case):
    """EP 2 at D 2 x R 2 (world 4; each EP group the two replicas of a stage, EDP 1): every step's
    loss within 1e-5 of the single-process reference's, every final parameter -- each replica's
    model whole, its routed experts from its EP peer -- within 1e-5; the replicas' dense weights
    bit-identical (their all-reduce), the routed experts each held once."""
    cfg, sched, res = runs(4)[case]
    ref = references(cfg)
    assert_losses_equal(res, ref)
    if case in ADAM:    # Adam divides by the root of the squared gradients: an expert's near-zero gradients,
        # summed in another order, move its weights by ~1e-7 (as tests/test_executor_tp.py's ZeRO-1 Adam run)
        for key, value in res.params.items():
            assert torch.allclose(value, ref.params[key.split("/", 1)[1]], rtol=0, atol=1e-6), key
        by_name = params_by_name(res)
    else:
        by_name = assert_params_equal_reference(res, ref, sched)
    assert all(torch.equal(t, ts[0]) for ts in by_name.values() for t in ts)


@pytest.mark.slow
@pytest.mark.parametrize("case", IDS)
def test_routing_is_uneven_and_differs_between_ep_ranks(runs, case):
    """The all-to-alls carry what routing gives: some exchange sends unequal row counts to the two
    EP ranks, and the two members of an EP group send different counts in the same exchange (the
    k-th all-to-all of a stage on both); per stage the members issue the same number of exchanges."""
    cfg, sched, res = runs(4)[case]
    sent = res.extra["ep_sent"]
    uneven = differ = False
    for d in range(sched.num_devices):
        a, b = sent[d], sent[d + sched.num_devices]     # replicas 0 and 1 of device d: one EP group
        assert a.keys() == b.keys() and all(len(a[s]) == len(b[s]) for s in a)
        for s in a:
            uneven |= any(x[0] != x[1] for x in a[s] + b[s])
            differ |= any(x != y for x, y in zip(a[s], b[s]))
    assert uneven and differ


MEM_IDS = sorted(k for k in CASES[4] if k.startswith("mem-") and not k.endswith("-ep1"))


@pytest.mark.slow
@pytest.mark.parametrize("case", MEM_IDS)
def test_memory_per_rank_equals_the_ledger_at_ep2(runs, case):
    """Weights, gradients and Adam state per rank equal the simulator's ledger at EP 2 to the byte
    (each rank holds E/EP routed experts; with ZeRO-1 the dense state sharded over R = 2, the
    experts' over EDP = 1), and EP 1's run equals its ledger too; without ZeRO a rank at EP 2 holds
    16 bytes (weight, gradient, Adam's m and v, fp32) less per parameter of the E/2 experts of each
    of its MoE blocks. Peak activations: the ledger's per GPU at EP 2 is its EP 1's (imbalance 1:
    the same token-expert pairs per GPU) plus what EP adds, the experts' row regrouping indices
    (:func:`cost_models.moe.regroup_bytes`: 16 B a pair, n k = 32 x 4 pairs a micro-batch: 2,048 B
    per MoE block-micro-batch kept at the peak), and the measured peak at EP 2 is within 1 % of it
    and of the measured at EP 1 (balanced routing)."""
    import dataclasses
    from cost_models.bind import bind
    from cost_models.memory import peak_activation
    from cost_models.moe import expert_params, regroup_bytes
    cfg, sched, res = runs(4)[case]
    _, _, one = runs(4)[case + "-ep1"]
    ledger = {}
    for ep in (2, 1):
        job = Job(layout=cfg.layout, parallel=dataclasses.replace(cfg.parallel, ep=ep), model=cfg.spec(),
                  cluster="dgx-a100-1x8")
        b = bind(job)
        assert [op for prog in b.lowered.programs for op in prog] == [op for prog in sched.programs for op in prog]
        ledger[ep] = ([int(x) for x in b.costs.static_mem], peak_activation(b.lowered, b.costs))
    assert [d["static_bytes"] for d in res.per_device] == ledger[2][0]
    assert [d["static_bytes"] for d in one.per_device] == ledger[1][0]
    spec = cfg.spec()
    if not cfg.parallel.zero:
        for r, (a, b) in enumerate(zip(res.per_device, one.per_device)):
            blocks = moe_blocks_on(cfg, sched, r % sched.num_devices)
            assert b["static_bytes"] - a["static_bytes"] == 16 * blocks * spec.experts // 2 * expert_params(spec)
    per = regroup_bytes(cfg.parallel, spec.micro_batch * spec.seq_len * spec.top_k)
    assert per == 16 * 32 * 4
    kept = [(a - b) / per for a, b in zip(ledger[2][1], ledger[1][1])]
    assert all(x.is_integer() and x >= 1 for x in kept), kept
    for a, b, want in zip(res.per_device, one.per_device, ledger[2][1]):
        assert abs(a["peak_activation_bytes"] - want) <= 0.01 * want, (case, a["peak_activation_bytes"], want)
        assert abs(a["peak_activation_bytes"] - b["peak_activation_bytes"]) <= 0.01 * b["peak_activation_bytes"]


# EDP > 1: one pipeline device, R = 4 replicas: EP 2 folds them into EP groups {0, 1}, {2, 3} and EDP groups
# {0, 2}, {1, 3} (each expert held twice, its gradients summed over its EDP pair); EP 4: EDP 1
R4 = dict(BASE, devices=1, replicas=4, microbatches=2)
CASES["r4"] = {f"{m}-ep{e}{'-zero' if z else ''}-D1R4": RunConfig.of(schedule="dapple", model=m, zero=z,
                                                                       **dict(R4, ep=e))
               for m in ("tiny-mixtral", "tiny-deepseek") for e in (2, 4) for z in (0, 1)}
R4_IDS = sorted(CASES["r4"])


@pytest.mark.slow
@pytest.mark.parametrize("case", R4_IDS)
def test_expert_gradients_summed_over_their_edp_group(runs, references, case):
    """At D 1 x R 4 with EP 2 each routed expert lives on two processes (EDP 2) whose gradients are
    summed over that pair alone (the dense ones over all four); with ZeRO-1 the experts' Adam/SGD
    state is sharded over the pair. Losses and every parameter equal the reference's, and the two
    holders of an expert end bit-identical (at EP 4: one holder each)."""
    cfg, sched, res = runs("r4")[case]
    ref = references(cfg)
    assert_losses_equal(res, ref)
    by_name = assert_params_equal_reference(res, ref, sched)
    assert all(torch.equal(t, ts[0]) for ts in by_name.values() for t in ts)
    if cfg.parallel.zero:
        zc = res.extra["zero_collectives"]
        # one reduce-scatter and one all-gather per step for the dense shard (over R = 4), and at EP 2
        # one all-gather for the experts' shard (over the EDP pair; their sum is an all-reduce at OPTIM)
        ep = cfg.parallel.ep
        assert all(c["all_gather"] == cfg.steps * (2 if ep == 2 else 1) for c in zc), zc
        assert all(c["reduce_scatter"] == cfg.steps for c in zc), zc


@pytest.mark.slow
def test_rank_killed_inside_an_all_to_all_ends_the_run_naming_it():
    """``--inject-fault 1:a2a:1``: rank 1 is SIGKILLed inside its first expert all-to-all of step 1,
    after the counts went out, while rank 3 (its EP peer) waits there for its rows. The run ends
    within 30 s of step 0's end (the kill follows it at once), exit status 1, its first line naming
    rank 1 and the signal."""
    import subprocess
    import sys
    import time
    from pathlib import Path
    from tests.test_any_folder_and_kill import _workers_of
    p = subprocess.Popen([sys.executable, "-c", "import sys; from experiments.cli import main; sys.exit(main())",
                          "run", "-s", "dapple", "-D", "2", "-N", "2", "--dp", "2", "--ep", "2", "--model",
                          "tiny-mixtral", "--steps", "3", "--inject-fault", "1:a2a:1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, work, t_step = time.monotonic() + 90, None, None
        while time.monotonic() < deadline and p.poll() is None and t_step is None:
            for pid in _workers_of(p.pid).values():
                env = (Path("/proc") / str(pid) / "environ").read_bytes().decode(errors="replace")
                work = next(kv.split("=", 1)[1] for kv in env.split("\0") if kv.startswith("PIPETWIN_WORKDIR="))
                break
            if work and (Path(work) / "progress").exists():
                t_step = time.monotonic()
            time.sleep(0.05)
        _, err = p.communicate(timeout=120)
        t_end = time.monotonic()
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert t_step is not None, err[-2000:]
    assert p.returncode == 1
    first = err.strip().splitlines()[0]
    assert first.startswith("pipetwin: run failed: rank 1 was killed by SIGKILL (9) by --inject-fault (inside an "
                            "expert all-to-all)"), err[-2000:]
    assert "from outside" not in first, first
    assert t_end - t_step < 30.0
    print(f"ended {t_end - t_step:.2f} s after step 0")


@pytest.mark.slow
def test_an_emulated_wire_changes_no_number():
    """``--a2a-wire 20 MB/s`` (interleaved, D 1 x R 2, EP 2, overlapped pairs and unpaired ops both):
    the exchanges only wait longer (the sleep's size is exact with a fake clock,
    tests/test_expert_parallel.py), so losses and parameters are bit for bit the run's without it."""
    from cost_models.job import Faults
    from executor.launch import run_many
    base = dict(schedule="interleaved", devices=1, microbatches=4, replicas=2, ep=2, model="tiny-mixtral", steps=2,
                overlap_fb=True, optimizer="sgd", lr=0.05, collect_params=True, timeout=60.0)
    plain, wired = run_many([RunConfig.of(**base), RunConfig.of(**base, faults=Faults(a2a_wire=20e6))])
    assert wired.losses == plain.losses
    for name, tensors in params_by_name(wired).items():
        assert all(torch.equal(t, p) for t, p in zip(tensors, params_by_name(plain)[name])), name
