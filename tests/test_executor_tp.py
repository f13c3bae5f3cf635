"""Tensor parallelism in the executor (gloo on the CPU) against the single-process reference.

Two spawns run the matrix (processes reused across jobs): 4 processes hold every schedule family
at T = 2 x D = 2 (plus recomputation and split-backward runs, and a tiny Llama: GQA, SwiGLU,
RMSNorm, rotary, untied head), 8 processes dapple and zb-v at
T = 2 x D = 2 x R = 2. A small GPT (4 blocks, 4 heads) trains 3 SGD steps (2 with R = 2): every per-step loss
equals the reference's within 1e-5 (relative), every final parameter -- gathered from its shards
-- within 1e-5 of the reference's, and the TP ranks of a group end with bit-identical replicated
weights. Placement follows Megatron's order (TP, then DP, then PP).
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

SPEC = load_model("tiny").replace(layers=4, hidden=32, heads=4, seq_len=16, vocab=64)
# a tiny Llama: grouped-query attention (2 KV heads for 4 query heads), SwiGLU, RMSNorm, rotary, untied
LLAMA = SPEC.replace(name="tiny-llama", kind="llama", kv_heads=2, ffn_hidden=48)
BASE = dict(steps=3, optimizer="sgd", lr=0.05, collect_params=True, timeout=30.0, model=SPEC, tp=2,
            device_map="megatron")


def _cases_world4():
    cases = {}
    for name in names():
        cfg = RunConfig(schedule=name, devices=2, microbatches=4, **BASE)
        try:
            lowered_schedule(cfg)
        except (ScheduleError, ValueError):
            continue
        cases[f"{name}-T2D2"] = cfg
    for name, mode in (("dapple", "full"), ("zb-v", "selective"), ("zb-h1", "full")):
        cases[f"{name}-recompute-{mode}-T2D2"] = RunConfig(schedule=name, devices=2, microbatches=4,
                                                           recompute=mode, **BASE)
    for name, mode in (("dapple", "none"), ("interleaved", "none"), ("zb-v", "none"), ("zb-v", "full")):
        cases[f"llama-{name}-recompute-{mode}-T2D2"] = RunConfig(schedule=name, devices=2, microbatches=4,
                                                                 recompute=mode, **dict(BASE, model=LLAMA))
    return cases


CASES = {4: _cases_world4(),
         8: {f"{s}-T2D2R2": RunConfig(schedule=s, devices=2, microbatches=2, replicas=2, **dict(BASE, steps=2))
             for s in ("dapple", "zb-v")}}
IDS = [(w, k) for w, cases in CASES.items() for k in cases]


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(cfg):
        key = cfg.with_(schedule="", recompute="none", tp=1)
        if key not in cache:
            cache[key] = run_reference(key)
        return cache[key]
    return get


def test_every_family_is_in_the_matrix():
    fams = {k.rsplit("-T2D2", 1)[0] for k in CASES[4] if not k.startswith("llama")}
    assert {"gpipe", "dapple", "interleaved", "chimera", "bitpipe", "zb-h1", "zb-v", "dualpipe-v"} <= fams


@pytest.mark.parametrize("world,case", IDS, ids=[k for _, k in IDS])
def test_losses_and_parameters_equal_reference(runs, references, world, case):
    cfg, sched, res = runs(world)[case]
    ref = references(cfg)
    assert len(res.losses) == cfg.steps == len(ref.losses)
    for got, want in zip(res.losses, ref.losses):
        assert abs(got - want) <= 1e-5 * abs(want), (res.losses, ref.losses)
    by_name: dict[str, list[torch.Tensor]] = {}
    for key, tensor in res.params.items():
        by_name.setdefault(key.split("/", 1)[1], []).append(tensor)
    assert set(by_name) == set(ref.params)
    for name, tensors in by_name.items():
        assert len(tensors) == sched.num_copies * sched.replicas
        want = ref.params[name]
        assert tensors[0].shape == want.shape, name
        for t in tensors:
            assert float((t - want).abs().max() / want.abs().max().clamp_min(1e-12)) <= 1e-5, name
    # the replicated weights (norms, biases, position embedding) of a TP group never drift apart
    assert res.extra["tp_replica_drift"] == 0.0


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
        lowered_schedule(RunConfig(schedule="dapple", devices=2, microbatches=4, model=SPEC, tp=3))
    with pytest.raises(ValueError, match=r"--tp 4 does not divide kv_heads \(2\)"):
        lowered_schedule(RunConfig(schedule="dapple", devices=2, microbatches=4, model=LLAMA, tp=4))
    with pytest.raises(ValueError, match=r"--tp 8 does not divide the vocabulary \(36\)"):
        lowered_schedule(RunConfig(schedule="dapple", devices=2, microbatches=4,
                                   model=SPEC.replace(vocab=36, heads=8, hidden=64), tp=8))


def test_world_not_t_x_d_x_r_is_refused(monkeypatch):
    """Under torchrun the world must be T x D x R: refused before any process group starts."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("PIPETWIN_WORKDIR", raising=False)
    cfg = RunConfig(schedule="dapple", devices=2, microbatches=4, replicas=2, model=SPEC, tp=2)
    with pytest.raises(ValueError, match=r"torchrun started 4 processes but the run needs T x D x R = 2 x 2 x 2 = 8"):
        run(cfg)


def test_placement_refuses_a_tp_group_across_nodes():
    sched = lowered_schedule(RunConfig(schedule="dapple", devices=2, microbatches=4, model=SPEC, tp=2))
    with pytest.raises(ValueError, match="--tp 2 does not divide the 3 processes per node"):
        placement("megatron", sched, 2, 0, 0, 2, 3)
    assert placement("megatron", sched, 2, 1, 1, 2, 2) == (3, 3)


def test_a_job_with_tp_runs_and_sp_zero_are_refused():
    lay = Layout(schedule="dapple", devices=2, microbatches=4, tp=2, replicas=2)
    cfg = RunConfig.from_job(Job(layout=lay, model="tiny"), steps=1)
    assert cfg.tp == 2 and cfg.device_map == "megatron"
    for extra, flag in ((dict(sequence_parallel=True), "--sequence-parallel"), (dict(zero=1), "--zero")):
        with pytest.raises(ValueError, match=f"{flag}.*simulated only"):
            RunConfig.from_job(Job(layout=lay, model="tiny", **extra), steps=1)
    assert RunConfig.from_job(Job(layout=lay, model="tiny", seq_len=16), steps=1).spec().seq_len == 16


def test_run_many_needs_one_world():
    a = RunConfig(schedule="dapple", devices=2, microbatches=4, model=SPEC, tp=2)
    with pytest.raises(ValueError, match=r"one world size \(T x D x R\)"):
        run_many([a, a.with_(tp=1)])
    assert os.environ.get("RANK") is None


def test_torchrun_runs_the_mesh_placed_by_the_device_map():
    """Under torchrun (its environment variables, 2 nodes x 2 processes, gloo) each process runs
    the mesh rank its device holds: T = 2 x D = 2 with Megatron's order puts pipeline rank d on
    node d, TP rank t on local rank t. Losses equal the reference's."""
    import json
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["-s", "dapple", "-D", "2", "-N", "2", "--tp", "2", "--steps", "2", "--device", "cpu", "--optimizer", "sgd",
            "--lr", "0.05", "--timeout", "60", "--json"]
    procs = []
    for launch_rank in range(4):
        node, local = divmod(launch_rank, 2)
        env = dict(os.environ, RANK=str(launch_rank), WORLD_SIZE="4", LOCAL_RANK=str(local), LOCAL_WORLD_SIZE="2",
                   GROUP_RANK=str(node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        env.pop("PIPETWIN_WORKDIR", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "experiments", "run", *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        outs.append(out)
    assert [i for i, o in enumerate(outs) if o.strip()] == [0]
    res = json.loads(outs[0])
    assert res["tp"] == 2
    assert [(p["rank"], p["tp"], p["node"], p["local_rank"]) for p in res["placement"]] == \
        [(0, 0, 0, 0), (0, 1, 0, 1), (1, 0, 1, 0), (1, 1, 1, 1)]
    ref = run_reference(RunConfig(schedule="dapple", devices=2, microbatches=2, steps=2, optimizer="sgd", lr=0.05))
    for a, b in zip(res["losses"], ref.losses):
        assert abs(a - b) <= 1e-5 * abs(b)
