"""Tensor parallelism in the executor (gloo on the CPU) against the single-process reference.

Two spawns run the matrix (processes reused across jobs): 4 processes hold every schedule family
at T = 2 x D = 2 (plus recomputation and split-backward runs, and a tiny Llama: GQA, SwiGLU,
RMSNorm, rotary, untied head), 8 processes dapple and zb-v at
T = 2 x D = 2 x R = 2. A small GPT (4 blocks, 4 heads) trains 3 SGD steps (2 with R = 2): every per-step loss
equals the reference's within 1e-5 (relative), every final parameter -- gathered from its shards
-- within 1e-5 of the reference's, and the TP ranks of a group end with bit-identical replicated
weights. Placement follows Megatron's order (TP, then DP, then PP). A third spawn (D = 2 x R = 2)
trains with ZeRO-1 (``--zero 1``): the same losses and weights, the optimizer memory per rank cut by R.

Sequence parallelism (``sp-`` cases, in the same spawns): every family at T = 2 x D = 2, with
selective and full recomputation, split backward, the Llama, and dapple and zb-v at T2 D2 R2 with
ZeRO-1, to the same bounds; stage boundaries carry 1/T of the sequence. Memory (``mem-`` cases, a
wider model, Adam, one step): the measured peak activation bytes per rank within 1% of the
simulator's ledger at T = 2 with and without sequence parallelism and recomputation (dapple, and
zb-v's split backward), and at T2 D2 R2 with ZeRO-1; weights, gradients and optimizer state per
rank equal to the ledger's.
"""
import os

import pytest
import torch

from cost_models import load_model
from cost_models.job import Job, Layout
from executor.config import RunConfig, lowered_schedule
from executor.launch import run, run_many
from executor.mesh import Mesh, placement
from executor.model import stage_module
from executor.reference import run_reference
from executor.tensor_parallel import TensorParallel, gather, shard, split_of
from schedules import ScheduleError, names
from tests.helpers import (assert_losses_equal, assert_params_equal_reference, params_by_name, reference_cache,
                           torchrun_cli)

SPEC = load_model("tiny").replace(layers=4, hidden=32, heads=4, seq_len=16, vocab=64)
# a tiny Llama: grouped-query attention (2 KV heads for 4 query heads), SwiGLU, RMSNorm, rotary, untied
LLAMA = SPEC.replace(name="tiny-llama", kind="llama", kv_heads=2, ffn_hidden=48)
BASE = dict(steps=3, optimizer="sgd", lr=0.05, collect_params=True, timeout=30.0, model=SPEC, tp=2,
            device_map="megatron")


SP_RECOMPUTE = ("zb-v-recompute-selective-T2D2", "zb-h1-recompute-full-T2D2", "llama-dapple-recompute-none-T2D2",
                "llama-zb-v-recompute-full-T2D2")


def _cases_world4():
    cases = {}
    for name in names():
        cfg = RunConfig.of(schedule=name, devices=2, microbatches=4, **BASE)
        try:
            lowered_schedule(cfg)
        except (ScheduleError, ValueError):
            continue
        cases[f"{name}-T2D2"] = cfg
    for name, mode in (("dapple", "full"), ("zb-v", "selective"), ("zb-h1", "full")):
        cases[f"{name}-recompute-{mode}-T2D2"] = RunConfig.of(schedule=name, devices=2, microbatches=4,
                                                           recompute=mode, **BASE)
    for name, mode in (("dapple", "none"), ("interleaved", "none"), ("zb-v", "none"), ("zb-v", "full")):
        cases[f"llama-{name}-recompute-{mode}-T2D2"] = RunConfig.of(schedule=name, devices=2, microbatches=4,
                                                                 recompute=mode, **dict(BASE, model=LLAMA))
    # sequence parallelism: every family, with recomputation and split backward, and the Llama
    for key, cfg in list(cases.items()):
        if "recompute" not in key or key in SP_RECOMPUTE:
            cases[f"sp-{key}"] = cfg.with_(sequence_parallel=True)
    return cases


CASES = {4: _cases_world4(),
         8: {f"{s}-T2D2R2": RunConfig.of(schedule=s, devices=2, microbatches=2, replicas=2, **dict(BASE, steps=2))
             for s in ("dapple", "zb-v")}}
CASES[8]["zb-v-zero-T2D2R2"] = CASES[8]["zb-v-T2D2R2"].with_(zero=1)
for _s in ("dapple", "zb-v"):
    CASES[8][f"sp-{_s}-zero-T2D2R2"] = CASES[8][f"{_s}-T2D2R2"].with_(zero=1, sequence_parallel=True)
CASES[8]["sp-zb-v-recompute-full-T2D2R2"] = CASES[8]["zb-v-T2D2R2"].with_(sequence_parallel=True, recompute="full")
# memory against the simulator's ledger: a wider model (the bytes the ledger leaves out, a norm's
# statistics and the loss's target indices, are ~0.5% of a rank's peak), no dropout and fused
# attention as the executor's model; Adam (the ledger's 16 bytes per fp32 parameter)
MEM_SPEC = SPEC.replace(hidden=256, dropout=False, attention="flash")
MEM = dict(BASE, model=MEM_SPEC, optimizer="adam", lr=1e-3, steps=1, collect_params=False)
for _sp in (False, True):
    for _rc in ("none", "selective", "full"):
        CASES[4][f"mem-adam-{'sp' if _sp else 'tp'}-{_rc}-T2D2"] = RunConfig.of(
            schedule="dapple", devices=2, microbatches=4, sequence_parallel=_sp, recompute=_rc, **MEM)
for _sp, _rc in ((False, "none"), (True, "none"), (True, "full")):     # split backward: what waits for W
    CASES[4][f"mem-adam-{'sp' if _sp else 'tp'}-{_rc}-zb-v-T2D2"] = RunConfig.of(
        schedule="zb-v", devices=2, microbatches=4, sequence_parallel=_sp, recompute=_rc, **MEM)
for _s in ("zb-h1", "zb-h2"):    # split backward on the first stage: B ends at the embedding lookups
    for _rc in ("none", "full"):
        CASES[4][f"mem-adam-tp-{_rc}-{_s}-T2D2"] = RunConfig.of(schedule=_s, devices=2, microbatches=4, recompute=_rc,
                                                             **MEM)
# the Llama block keeps what the ledger counts (RMS norm: input and 1/rms; rotary: nothing; SwiGLU:
# gate and up; attention: the key/value heads unrepeated)
MEM_LLAMA = MEM_SPEC.replace(name="mem-llama", kind="llama", kv_heads=2, ffn_hidden=384)
for _sp in (False, True):
    for _rc in ("none", "full"):
        CASES[4][f"mem-adam-llama-{'sp' if _sp else 'tp'}-{_rc}-T2D2"] = RunConfig.of(
            schedule="dapple", devices=2, microbatches=4, sequence_parallel=_sp, recompute=_rc,
            **dict(MEM, model=MEM_LLAMA))
for _s, _sp in (("zb-v", True), ("zb-h1", False)):
    CASES[4][f"mem-adam-llama-{'sp' if _sp else 'tp'}-none-{_s}-T2D2"] = RunConfig.of(
        schedule=_s, devices=2, microbatches=4, sequence_parallel=_sp, **dict(MEM, model=MEM_LLAMA))
CASES[8]["mem-adam-sp-zero-T2D2R2"] = RunConfig.of(schedule="dapple", devices=2, microbatches=2, replicas=2, zero=1,
                                                sequence_parallel=True, **MEM)
ZBASE = dict(BASE, tp=1, device_map="sequential")
CASES["zero"] = {"dapple-zero-D2R2": RunConfig.of(schedule="dapple", devices=2, microbatches=4, replicas=2, zero=1,
                                               **ZBASE),
                 "zb-v-zero-D2R2": RunConfig.of(schedule="zb-v", devices=2, microbatches=4, replicas=2, zero=1,
                                                **ZBASE),
                 "dapple-adam-zero-D2R2": RunConfig.of(schedule="dapple", devices=2, microbatches=4, replicas=2, zero=1,
                                                    **dict(ZBASE, optimizer="adam", lr=1e-3)),
                 "dapple-adam-D2R2": RunConfig.of(schedule="dapple", devices=2, microbatches=4, replicas=2,
                                               **dict(ZBASE, optimizer="adam", lr=1e-3))}
CASES["t1"] = {f"mem-adam-{_rc}-{_s}-D2": RunConfig.of(schedule=_s, devices=2, microbatches=4, recompute=_rc,
                                                     **dict(MEM, tp=1, device_map="sequential"))
               for _s in ("zb-h1", "zb-h2") for _rc in ("none", "full")}
IDS = [(w, k) for w, cases in CASES.items() for k in cases if "adam" not in k]


@pytest.fixture(scope="module")
def references():
    return reference_cache()


def test_every_family_is_in_the_matrix():
    fams = {k.rsplit("-T2D2", 1)[0] for k in CASES[4] if not k.startswith("llama")}
    every = {"gpipe", "dapple", "interleaved", "chimera", "bitpipe", "zb-h1", "zb-v", "dualpipe-v"}
    assert every <= fams and {f"sp-{f}" for f in every} <= fams
    assert all(c.parallel.sequence_parallel for k, c in CASES[4].items() if k.startswith("sp-"))


@pytest.mark.slow
@pytest.mark.parametrize("world,case", IDS, ids=[k for _, k in IDS])
def test_losses_and_parameters_equal_reference(runs, references, world, case):
    cfg, sched, res = runs(world)[case]
    ref = references(cfg)
    assert_losses_equal(res, ref)
    by_name = assert_params_equal_reference(res, ref, sched)
    # the replicated weights (norms, biases, position embedding) of a TP group never drift apart
    assert cfg.parallel.tp == 1 or res.extra["tp_replica_drift"] == 0.0
    if cfg.parallel.zero:    # ZeRO-1: every replica ends with the same weights
        assert all(torch.equal(t, ts[0]) for ts in by_name.values() for t in ts)


@pytest.mark.slow
@pytest.mark.parametrize("world,case", IDS, ids=[k for _, k in IDS])
def test_trace_has_one_row_per_op_of_each_pipeline_rank(runs, world, case):
    """TP rank 0 stands for its group in the trace (as one simulated rank does): one row per op of
    every pipeline rank, activation memory back to 0 at every OPTIM."""
    cfg, sched, res = runs(world)[case]
    t = res.trace
    for rank in range(sched.num_ranks):
        assert (t["device"] == rank).sum() == len(sched.program(rank)) * cfg.steps
    last = t.sort_values("seq").groupby(["device", "step"]).tail(1)
    assert (last["kind"] == "OPTIM").all() and (last["act_mem"] == 0).all()
    assert len(res.per_device) == sched.num_ranks
    # a stage boundary carries the TP rank's activations: 1/T of the sequence with sequence parallelism
    spec = cfg.spec()
    tokens = spec.seq_len // cfg.parallel.tp if cfg.parallel.sequence_parallel else spec.seq_len
    assert (t[t["kind"].isin(["SEND", "RECV"])]["bytes"] == spec.micro_batch * tokens * spec.hidden * 4).all()


@pytest.mark.slow
def test_zero1_shards_the_optimizer_state_over_the_replicas(runs, references):
    """ZeRO-1 with Adam at R = 2: the losses equal the unsharded run's (and the reference's), the
    replicas end with identical weights, and each rank's optimizer memory (Adam's two moments of
    its shard; the shard is a view of the fp32 weights, no master copy) is 1/R of the unsharded
    Adam state: 2 x 4 bytes x n / 2 against 2 x 4 bytes x n, per rank holding n parameters."""
    _, _, plain = runs("zero")["dapple-adam-D2R2"]
    cfg, sched, zero = runs("zero")["dapple-adam-zero-D2R2"]
    ref = references(cfg)
    for a, b, r in zip(zero.losses, plain.losses, ref.losses):
        assert abs(a - b) <= 1e-6 * abs(b) and abs(a - r) <= 1e-5 * abs(r)
    assert zero.losses[-1] < zero.losses[0]
    for key, value in zero.params.items():
        assert torch.allclose(value, plain.params[key], rtol=0, atol=1e-6), key
    by_name = params_by_name(zero)
    assert all(torch.equal(v[0], v[1]) for v in by_name.values())
    for zd, pd in zip(zero.per_device, plain.per_device):
        n = sum(v.numel() for k, v in zero.params.items() if k.startswith("r0.") and
                _rank_of(sched, k) == zd["device"] % sched.num_devices)
        weights_and_grads = 2 * 4 * n
        assert pd["static_bytes"] - weights_and_grads == 2 * 4 * n            # Adam: m and v
        shard = -(-n // 2)
        assert zd["static_bytes"] - weights_and_grads == 2 * 4 * shard         # m and v of n / R


MEMORY_IDS = [(4, k) for k in CASES[4] if k.startswith("mem-")] + [(8, "mem-adam-sp-zero-T2D2R2"),
                                                                    ("zero", "dapple-adam-zero-D2R2")] + \
    [("t1", k) for k in CASES["t1"]]


@pytest.mark.slow
@pytest.mark.parametrize("world,case", MEMORY_IDS, ids=[k for _, k in MEMORY_IDS])
def test_memory_per_rank_equals_the_simulators_ledger(runs, world, case):
    """Measured peak activation bytes per rank (the saved-tensor meter of TP rank 0, which stands
    for its group) within 1% of the simulator's ledger (the Korthikanti et al. closed forms of
    :mod:`cost_models.transformer` walked along the rank's program), with and without sequence
    parallelism and recomputation, and with a split backward (zb-v: what waits from B to W); the
    weights, gradients and optimizer state per rank equal the ledger's exactly, ZeRO-1 at R = 2
    included (Adam's state halved, no master copy)."""
    from cost_models.bind import bind
    from cost_models.memory import peak_activation
    cfg, sched, res = runs(world)[case]
    job = Job(layout=cfg.layout, parallel=cfg.parallel, model=cfg.spec(), cluster="dgx-a100-1x8")
    ledger = bind(job)
    assert [op for prog in ledger.lowered.programs for op in prog] == [op for prog in sched.programs for op in prog]
    act = peak_activation(ledger.lowered, ledger.costs)
    measured = [d["peak_activation_bytes"] for d in res.per_device]
    assert len(measured) == len(act) == sched.num_ranks
    if cfg.model in (MEM_SPEC, MEM_LLAMA):   # (the T = 1 ZeRO run trains the tiny model with the ledger's dropout)
        for m, want in zip(measured, act):
            assert abs(m - want) <= 0.01 * want, (measured, act)
    assert [d["static_bytes"] for d in res.per_device] == [int(x) for x in ledger.costs.static_mem]


@pytest.mark.slow
def test_sequence_parallelism_and_recomputation_cut_the_measured_memory(runs):
    """What the ledger's forms say, measured: sequence parallelism keeps less per rank than tensor
    parallelism alone, selective recomputation less than none, full recomputation least."""
    peak = {k: [d["peak_activation_bytes"] for d in runs(4)[k][2].per_device] for k in CASES[4] if k.startswith("mem-")}
    for rc in ("none", "selective", "full"):
        assert all(s < t for s, t in zip(peak[f"mem-adam-sp-{rc}-T2D2"], peak[f"mem-adam-tp-{rc}-T2D2"]))
    for mode in ("tp", "sp"):
        none, sel, full = (peak[f"mem-adam-{mode}-{rc}-T2D2"] for rc in ("none", "selective", "full"))
        assert all(f < s < n for f, s, n in zip(full, sel, none))


def _rank_of(sched, key):
    """The pipeline device holding the stage of parameter ``key`` (``r0.c0/blocks.3.fc.weight``)."""
    from cost_models.partition import block_ranges
    name = key.split("/", 1)[1]
    ranges = block_ranges(SPEC.layers, sched.num_stages)
    if name.startswith("embed."):
        stage = 0
    elif name.startswith(("norm.", "head.")):
        stage = sched.num_stages - 1
    else:
        stage = next(s for s, r in enumerate(ranges) if int(name.split(".")[1]) in r)
    return sched.placement[0][stage]


@pytest.mark.slow
def test_placement_is_megatrons_order(runs):
    """Pipeline rank p = r * D + d, TP rank t runs on device (d * R + r) * T + t."""
    cfg, sched, res = runs(8)["dapple-T2D2R2"]
    D, R, T = 2, 2, 2
    got = {(p["rank"], p["tp"]): p["device"] for p in res.extra["placement"]}
    assert got == {(r * D + d, t): (d * R + r) * T + t for d in range(D) for r in range(R) for t in range(T)}


def test_shard_and_gather_are_inverse_and_qkv_is_split_per_head():
    full = torch.arange(3 * 8 * 2, dtype=torch.float32).reshape(24, 2)
    parts = [shard(full, t, 2, 0, 3) for t in range(2)]
    assert torch.equal(parts[0][:4], full[:4]) and torch.equal(parts[0][4:8], full[8:12])   # q_0, k_0
    assert torch.equal(parts[1][8:], full[20:])                                               # v_1
    assert torch.equal(gather(parts, 0, 3), full)
    assert split_of("blocks.3.attn.qkv.weight") == (0, 3) and split_of("blocks.3.ln1.weight") is None


def test_stage_shards_are_the_whole_stages_weights():
    """Each TP rank's stage holds exactly its shards of the reference's initial weights."""
    whole = stage_module(SPEC, 2, 1, seed=3).state_dict()
    shards = [stage_module(SPEC, 2, 1, seed=3, tp=TensorParallel(2, t)).state_dict() for t in range(2)]
    assert set(shards[0]) == set(whole) and set(shards[1]) < set(whole)   # row-parallel biases on rank 0
    for name, value in whole.items():
        split = split_of(name)
        if split is None:
            assert torch.equal(shards[0][name], value), name
        else:
            assert torch.equal(gather([s[name] for s in shards], *split), value), name
            assert shards[0][name].numel() * 2 == value.numel()


def test_llama_shards_split_query_and_kv_heads():
    """T = 2 of the tiny Llama: 2 of 4 query heads and 1 of 2 KV heads per rank, half of SwiGLU's
    inner size; no biases, so nothing is held by TP rank 0 alone."""
    shards = [stage_module(LLAMA, 1, 0, tp=TensorParallel(2, t)).state_dict() for t in range(2)]
    whole = stage_module(LLAMA, 1, 0).state_dict()
    assert set(shards[0]) == set(shards[1]) == set(whole)
    assert shards[0]["blocks.0.attn.q.weight"].shape == (16, 32)
    assert shards[0]["blocks.0.attn.k.weight"].shape == (8, 32)
    assert shards[1]["blocks.0.mlp.down.weight"].shape == (32, 24)
    assert not any(k.endswith("pos.weight") for k in whole)     # rotary positions: no table
    for name, value in whole.items():
        split = split_of(name)
        got = shards[0][name] if split is None else gather([s[name] for s in shards], *split)
        assert torch.equal(got, value), name


def test_mesh_ranks():
    mesh = Mesh(2, 4)
    assert mesh.world == 8 and mesh.coords(5) == (2, 1) and mesh.tp_group(3) == (6, 7)
    assert mesh.lift((0, 2), 1) == (1, 5)


def test_tp_not_dividing_heads_is_refused():
    with pytest.raises(ValueError, match=r"--tp 3 does not divide heads \(4\)"):
        lowered_schedule(RunConfig.of(schedule="dapple", devices=2, microbatches=4, model=SPEC, tp=3))
    with pytest.raises(ValueError, match=r"--tp 4 does not divide kv_heads \(2\)"):
        lowered_schedule(RunConfig.of(schedule="dapple", devices=2, microbatches=4, model=LLAMA, tp=4))
    with pytest.raises(ValueError, match=r"--tp 8 does not divide the vocabulary \(36\)"):
        lowered_schedule(RunConfig.of(schedule="dapple", devices=2, microbatches=4,
                                   model=SPEC.replace(vocab=36, heads=8, hidden=64), tp=8))


def test_world_not_t_x_d_x_r_is_refused(monkeypatch):
    """Under torchrun the world must be T x C x D x R: refused before any process group starts."""
    for var, value in dict(RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="29500", TORCHELASTIC_RUN_ID="test").items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("PIPETWIN_WORKDIR", raising=False)
    cfg = RunConfig.of(schedule="dapple", devices=2, microbatches=4, replicas=2, model=SPEC, tp=2)
    with pytest.raises(ValueError, match=r"torchrun started 4 processes but the run needs T x C x D x R = "
                                         r"2 x 1 x 2 x 2 = 8"):
        run(cfg)


def test_placement_refuses_a_tp_group_across_nodes():
    sched = lowered_schedule(RunConfig.of(schedule="dapple", devices=2, microbatches=4, model=SPEC, tp=2))
    with pytest.raises(ValueError, match="--tp 2 does not divide the 3 processes per node"):
        placement("megatron", sched, 2, 0, 0, 2, 3)
    assert placement("megatron", sched, 2, 1, 1, 2, 2) == (3, 3)


def test_a_job_with_tp_and_sp_runs_and_tp_overlap_is_refused():
    lay = Layout(schedule="dapple", devices=2, microbatches=4, replicas=2)
    cfg = RunConfig.from_job(Job.of(layout=lay, model="tiny", tp=2), steps=1)
    assert cfg.parallel.tp == 2 and cfg.device_map == "megatron" and not cfg.parallel.sequence_parallel
    assert RunConfig.from_job(Job.of(layout=lay, model="tiny", tp=2, sequence_parallel=True),
                              steps=1).parallel.sequence_parallel
    with pytest.raises(ValueError, match="--tp-overlap.*simulated only"):
        RunConfig.from_job(Job.of(layout=lay, model="tiny", tp=2, tp_overlap=True), steps=1)
    with pytest.raises(ValueError, match="--sequence-parallel acts on a tensor-parallel group; give --tp > 1"):
        RunConfig.of(schedule="dapple", devices=2, microbatches=4, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"--tp 2 does not divide the sequence length \(--sequence-parallel\) "
                                         r"\(15\)"):
        lowered_schedule(RunConfig.of(schedule="dapple", devices=2, microbatches=4, model=SPEC.replace(seq_len=15),
                                   tp=2, sequence_parallel=True))
    lowered_schedule(RunConfig.of(schedule="dapple", devices=2, microbatches=4, model=SPEC.replace(seq_len=15), tp=2))
    assert RunConfig.from_job(Job.of(layout=lay, model="tiny", seq_len=16), steps=1).spec().seq_len == 16
    assert RunConfig.from_job(Job.of(layout=lay, model="tiny", zero=1), steps=1).parallel.zero == 1
    with pytest.raises(ValueError, match="--zero 1 shards over the data-parallel replicas"):
        RunConfig.of(schedule="dapple", devices=2, microbatches=4, zero=1)


def test_run_many_needs_one_world():
    a = RunConfig.of(schedule="dapple", devices=2, microbatches=4, model=SPEC, tp=2)
    with pytest.raises(ValueError, match=r"one world size \(T x C x D x R\)"):
        run_many([a, a.with_(tp=1)])
    assert os.environ.get("RANK") is None


@pytest.mark.slow
def test_torchrun_runs_the_mesh_placed_by_the_device_map():
    """Under torchrun (its environment variables, 2 nodes x 2 processes, gloo) each process runs
    the mesh rank its device holds: T = 2 x D = 2 with Megatron's order puts pipeline rank d on
    node d, TP rank t on local rank t. Losses equal the reference's."""
    import json
    outs = torchrun_cli(["-s", "dapple", "-D", "2", "-N", "2", "--tp", "2", "--steps", "2", "--device", "cpu",
                         "--optimizer", "sgd", "--lr", "0.05", "--timeout", "60", "--json"], timeout=120)
    assert [i for i, o in enumerate(outs) if o.strip()] == [0]
    res = json.loads(outs[0])
    assert res["tp"] == 2
    assert [(p["rank"], p["tp"], p["node"], p["local_rank"]) for p in res["placement"]] == \
        [(0, 0, 0, 0), (0, 1, 0, 1), (1, 0, 1, 0), (1, 1, 1, 1)]
    ref = run_reference(RunConfig.of(schedule="dapple", devices=2, microbatches=2, steps=2, optimizer="sgd", lr=0.05))
    for a, b in zip(res["losses"], ref.losses):
        assert abs(a - b) <= 1e-5 * abs(b)


@pytest.mark.slow
def test_a_hugging_face_config_trains_at_t2_as_the_reference():
    """``--model config.json`` builds the same Llama in the executor (GQA, SwiGLU, RMSNorm, rotary,
    untied), at T = 2 x D = 2: per-step losses equal to one process."""
    from pathlib import Path

    from cost_models.job import Job
    from executor import RunConfig, run, run_reference
    cfg_path = Path(__file__).parent / "data" / "hf" / "tiny-llama" / "config.json"
    job = Job.of(schedule="dapple", devices=2, microbatches=4, tp=2, model=str(cfg_path))
    cfg = RunConfig.from_job(job, steps=2)
    got, want = run(cfg).losses, run_reference(cfg).losses
    assert len(got) == 2 and max(abs(a - b) for a, b in zip(got, want)) < 1e-5
    assert got[1] < got[0]


def test_llama_block_keeps_the_ledgers_bytes_with_eager_gradients():
    """One Llama block (GQA 4:2, SwiGLU, RMS norm, rotary) saves for its backward exactly the bytes
    of the ledger's block (eager modules would keep 1.48x: the normalised inputs, rotary's tables,
    silu(gate), the repeated key/value heads), and its gradients are the eager block's."""
    import torch.nn as nn
    import torch.nn.functional as Fn

    from cost_models.transformer import block_activation_bytes
    from executor.llama import _GQA, LlamaBlock
    spec = MEM_LLAMA.replace(micro_batch=1)
    torch.manual_seed(0)
    block = LlamaBlock(spec)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    kept = {}

    def pack(t):
        ptr = t.data_ptr() - t.storage_offset() * t.element_size()
        if ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()
        return t
    x = torch.randn(1, spec.seq_len, spec.hidden, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(x)
    want = block_activation_bytes(spec)
    extra = 0 if _GQA else 2 * spec.seq_len * spec.hidden * 4 * (1 - spec.kv / spec.heads)   # repeated K, V
    assert abs(sum(kept.values()) - want - extra) <= 0.001 * want, (sum(kept.values()), want)

    def eager(blk, x):     # the same block in plain modules and ops
        def rms(m, t):
            return Fn.rms_norm(t, (spec.hidden,), m.weight, m.eps)

        def rot(t):
            d, s = t.shape[-1], t.shape[-2]
            inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
            ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)
            ang = torch.cat([ang, ang], -1)
            return t * ang.cos() + torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1) * ang.sin()
        a = blk.attn
        hN = rms(blk.ln1, x)
        b, s, _ = hN.shape
        q = a.q(hN).view(b, s, a.heads, a.head_dim).transpose(1, 2)
        k = a.k(hN).view(b, s, a.kv_heads, a.head_dim).transpose(1, 2)
        v = a.v(hN).view(b, s, a.kv_heads, a.head_dim).transpose(1, 2)
        g = a.heads // a.kv_heads
        o = Fn.scaled_dot_product_attention(rot(q), rot(k).repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                            is_causal=True)
        x = x + nn.functional.linear(o.transpose(1, 2).reshape(b, s, -1), a.proj.weight)
        h2 = rms(blk.ln2, x)
        m = blk.mlp
        return x + nn.functional.linear(Fn.silu(m.gate(h2)) * m.up(h2), m.down.weight)
    x2 = x.detach().clone().requires_grad_()
    y2 = eager(block, x2)
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-6)
    gy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *block.parameters()], gy)
    ref = torch.autograd.grad(y2, [x2, *block.parameters()], gy)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
