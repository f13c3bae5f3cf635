"""Shared test helpers."""
import pytest

from schedules import ScheduleError, build


def admissible(name, D, max_n=None):
    """(N, schedule) for every N in 1..4D (or max_n) that the family accepts on D devices."""
    for N in range(1, (max_n or 4 * D) + 1):
        try:
            yield N, build(name, D, N)
        except ScheduleError:
            continue


def torchrun_cli(args, *, nodes: int = 2, per_node: int = 2, timeout: float = 240) -> list[str]:
    """``pipetwin run ARGS`` as torchrun would start it on ``nodes`` x ``per_node`` processes (its
    environment variables, one local rendezvous); each process's stdout (each must exit 0)."""
    import os
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for launch_rank in range(nodes * per_node):
        node, local = divmod(launch_rank, per_node)
        env = dict(os.environ, RANK=str(launch_rank), WORLD_SIZE=str(nodes * per_node), LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(node), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", TORCHELASTIC_RUN_ID="pipetwin-test")
        env.pop("PIPETWIN_WORKDIR", None)
        procs.append(subprocess.Popen([sys.executable, "-m", "experiments", "run", *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err[-2000:]
        outs.append(out)
    return outs


def assert_losses_equal(res, ref, rel: float = 1e-5) -> None:
    """Every step's loss of a run within ``rel`` (relative) of the reference's."""
    assert len(res.losses) == res.config.steps == len(ref.losses)
    for got, want in zip(res.losses, ref.losses):
        assert abs(got - want) <= rel * abs(want), (res.losses, ref.losses)


def params_by_name(res) -> dict:
    """A run's final parameters by global name: every copy on every replica (``r0.c1/NAME``) in a list."""
    out: dict = {}
    for key, tensor in res.params.items():
        out.setdefault(key.split("/", 1)[1], []).append(tensor)
    return out


def assert_params_equal_reference(res, ref, sched, rel: float = 1e-5) -> dict:
    """Every copy and replica of every parameter of ``res`` within ``rel`` of the reference's (relative
    to the tensor's largest magnitude); the parameters by name."""
    by_name = params_by_name(res)
    assert set(by_name) == set(ref.params)
    for name, tensors in by_name.items():
        assert len(tensors) == sched.num_copies * sched.replicas
        want = ref.params[name]
        for t in tensors:
            assert t.shape == want.shape, name
            assert float((t - want).abs().max() / want.abs().max().clamp_min(1e-12)) <= rel, name
    return by_name


def reference_cache():
    """``get(cfg)``: the single-process reference of a run's config, run once per distinct
    reference (the knobs the reference does not read, schedule, T, C, ZeRO, recomputation and the
    device map, set to their plainest for the cache's key)."""
    from executor.reference import run_reference
    cache: dict = {}

    def get(cfg):
        key = cfg.with_(schedule="gpipe", recompute="none", tp=1, sequence_parallel=False, cp=1, cp_comm="ring",
                        zero=0, dp_shard=0, reshard_after_forward=False, device_map="sequential", overlap_fb=False)
        if key not in cache:
            cache[key] = run_reference(key)
        return cache[key]
    return get


def assert_search_is_the_brute_force(model, cluster, global_batch, space, *, memory_limit=None, top_k: int = 3):
    """The layout search against its twin (:func:`planner.layout.brute_force`: every candidate bound,
    judged by the ledger and, where it fits, simulated): every bound at or below its truth (the
    simulated time; the ledger's need, of a candidate that fits or one out of memory) and the
    search's top ``top_k`` the brute force's best, the same jobs and times. (brute, fits, result)
    for the test's own claims."""
    from planner.layout import Confirmed, brute_force, plan_layouts, ranked
    brute = brute_force(model, cluster, global_batch, space, memory_limit=memory_limit)
    fits = ranked([got for _, got in brute if isinstance(got, Confirmed)])
    for c, got in brute:
        if isinstance(got, Confirmed):
            assert got.iteration_time >= c.time_bound * (1 - 1e-12)
            assert got.memory_need >= c.memory_bound * (1 - 1e-12)
        elif got[0] == "oom":
            assert got[1] >= c.memory_bound * (1 - 1e-12)
    res = plan_layouts(model, cluster, global_batch, space, top_k=top_k, memory_limit=memory_limit)
    assert [x.job for x in res.top] == [x.job for x in fits[:top_k]]
    assert [x.iteration_time for x in res.top] == pytest.approx([x.iteration_time for x in fits[:top_k]], rel=1e-12)
    return brute, fits, res


def reference_one_thread(cfg):
    """The single-process reference of ``cfg`` on one thread: on a busy 2-core host two spinning
    threads make it 10-50x slower."""
    import torch

    from executor.reference import run_reference
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_reference(cfg)
    finally:
        torch.set_num_threads(threads)


def moe_blocks_on(cfg, sched, device: int) -> int:
    """The MoE blocks (index >= the spec's dense layers) of the stages ``device`` holds."""
    from cost_models.partition import block_ranges
    spec = cfg.spec()
    ranges = block_ranges(spec.layers, sched.num_stages, cfg.blocks)
    return sum(1 for c, s in sched.stages_on(device) for i in ranges[s] if i >= spec.dense_layers)


def assert_bytes_equal_the_ledger(cfg, sched, res) -> None:
    """A run's program is the ledger's (:func:`cost_models.bind.bind` of the same job), its weights,
    gradients, optimizer state and ZeRO-3's gathered weights per rank equal the ledger's static
    bytes to the byte, and its peak activation bytes are within 1 % of the ledger's walk."""
    from cost_models.bind import bind
    from cost_models.job import Job
    from cost_models.memory import peak_activation
    ledger = bind(Job(layout=cfg.layout, parallel=cfg.parallel, model=cfg.spec(), cluster="dgx-a100-1x8"))
    assert [op for prog in ledger.lowered.programs for op in prog] == [op for prog in sched.programs for op in prog]
    assert [d["static_bytes"] + d["gathered_bytes"] for d in res.per_device] == \
        [int(x) for x in ledger.costs.static_mem]
    act = peak_activation(ledger.lowered, ledger.costs)
    for d, want in zip(res.per_device, act, strict=True):
        assert abs(d["peak_activation_bytes"] - want) <= 0.01 * want, ([d["peak_activation_bytes"] for d in
                                                                         res.per_device], act)
