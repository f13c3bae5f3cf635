"""What each rank process does: join the process group, build its stages, run the steps, report.

:func:`run_jobs` is the target :mod:`executor.launch` starts on every rank (spawned worker or
``torchrun`` process). It joins the default process group once (env:// rendezvous: MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE), then runs each job in turn on the same processes (tests run many
schedules per spawn). Per job every rank:

1. builds the stage modules its device holds (``schedule.stages_on``) with the seed's weights
   (several model copies of one stage on a device, as in a planner plan with stage replicas, share
   one module: one set of weights, gradients and optimizer state), pre-allocates their gradients
   and makes the optimizer; a model file's ranks first check that they built the same weights (a
   checksum per layer against rank 0's, :func:`executor.user_model.check_same_weights`);
2. creates the all-reduce subgroups ``schedule.stage_group(s)`` (every rank calls ``new_group``
   for every distinct group in stage order, as torch.distributed requires; groups are cached)
   and warms every communicator the program will use (one tiny message per pair and direction,
   one tiny all-reduce per group), so none is created lazily in the middle of a step;
3. aligns clocks: a barrier, then every rank reads ``perf_counter`` and the readings are
   exchanged with ``all_gather_object``; ranks on one host share a monotonic clock, so they all
   measure from the earliest reading on their host (exact alignment); across hosts the barrier
   bounds the skew;
4. runs the steps with :class:`executor.runtime.PipelineRuntime`;
5. sends its trace rows, losses, memory and (on request) parameters to rank 0, which merges them
   into a :class:`executor.config.RunResult`.

With ``probe`` > 0 every rank also times, all at once, the forward and backward of one transformer
block on one micro-batch, ``probe`` times before and as many after the steps: the host's speed
during the run (``RunResult.extra["probe_seconds"]``: :func:`schedules.trace.noise_free` of all
ranks' times, the statistic steps are summarised by; the times in ``extra["probe_samples"]``).
Validation compares it with the speed the calibration saw (the same probe in its traced runs), so
a host that is slower or faster than when it was calibrated (a shared VM drifts by 10-30% over
minutes) is told apart from an error of the model. Such runs also report the CPU other processes
used while the steps ran (``extra["foreign_cores"]``, see :mod:`executor.host`) and the ranks'
own (``extra["rank_cpu_seconds"]``, per rank, over the median rank's ``extra["wall_seconds"]``).

With ``pin_cores`` every rank is pinned to a core of its own before the process group starts
its threads, where the host has a core per rank (:func:`executor.host.pin_to_core`;
``extra["pinned"]`` says whether all were).
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from schedules import Schedule
from schedules.trace import make_trace, noise_free, step_metrics

from .config import RunConfig, RunResult
from .data import TokenSource
from .expert_parallel import is_expert_param
from .device import DeviceContext, NullMeter, cpu_threads, select_device
from .host import CpuMeter, foreign_cores, pin_to_core
from .mesh import Mesh, placement
from .context_parallel import ContextParallel, GradientSums, warm_up as warm_up_ring
from .model import block, boundary_shape, make_optimizer, stage_module
from .moe import expert_load_by_rank, take_expert_load
from .p2p import DirectionalGroups, Mailbox
from .runtime import PipelineRuntime
from .tensor_parallel import TensorParallel, gather, sequence_partial, split_of
from .zero import ShardedOptimizer, ShardGroups, shard_groups


@dataclass(frozen=True)
class Job:
    config: RunConfig
    schedule: Schedule  # lowered and validated (executor.config.lowered_schedule)
    layout: object = None   # a model file's StackLayout (executor.user_model), made here from the config

    def __post_init__(self):
        if self.layout is None and self.config.is_model_file:
            object.__setattr__(self, "layout", self.config.stack_layout(self.schedule.num_stages))


class ProcessGroups:
    """Process groups of one world, created once and reused by every job."""

    def __init__(self, world: int, backend: str):
        self.backend = backend
        self.p2p = DirectionalGroups(world, backend)
        self._stage: dict[tuple[int, ...], object] = {}

    def for_stages(self, sched: Schedule, rank: int, device, mesh: Mesh | None = None) -> dict[int, object]:
        """Stage -> all-reduce group (stages held by more than one rank; with tensor parallelism the
        same TP rank of each, with context parallelism every CP rank of each: :meth:`executor.mesh.Mesh.stage_group`).
        A new group runs one tiny all-reduce
        right away, so its (NCCL) communicator exists before the program needs it; all ranks create
        and warm groups in stage order (then TP rank order), which cannot deadlock."""
        mesh = mesh or Mesh(1, sched.num_ranks)
        mine = mesh.coords(rank)[1]
        out = {}
        for s in range(sched.num_stages):
            ranks = tuple(sched.stage_group(s))
            if len(ranks) < 2:
                continue
            for t in range(mesh.tp):
                group = self.for_ranks(mesh.stage_group(ranks, t), rank, device)
                if t == mine:
                    out[s] = group
        return out

    def for_shards(self, sched: Schedule, rank: int, device, mesh: Mesh, dp_shard: int) -> dict[int, ShardGroups]:
        """Stage -> this rank's ZeRO shard and HSDP replicate groups (:func:`executor.zero.shard_groups`
        over the processes that hold the stage's weights: with tensor parallelism those of the same
        TP rank, with context parallelism every CP rank of each, :meth:`Mesh.stage_group`, so a
        shard group is S replicas x C). Every rank creates every group, in stage, TP rank, then
        process order."""
        out = {}
        for s in range(sched.num_stages):
            for t in range(mesh.tp):
                procs = mesh.stage_group(sched.stage_group(s), t)
                if len(procs) < 2:
                    continue
                for p in procs:
                    shard, rep, i = shard_groups(procs, p, sched.replicas, dp_shard)
                    g = self.for_ranks(shard, rank, device) if len(shard) > 1 else None
                    r = self.for_ranks(rep, rank, device) if len(rep) > 1 else None
                    if p == rank:
                        out[s] = ShardGroups(g, i, len(shard), r, len(rep))
        return out

    def for_experts(self, sched: Schedule, rank: int, device, mesh: Mesh, ep: int, etp: int = 1,
                    wire: float | None = None) -> dict:
        """Stage -> this rank's :class:`executor.expert_parallel.ExpertGroups` (its EP group and its EDP
        group, :meth:`Mesh.expert_fold` of the stage's processes). Every rank creates every group, in
        stage, then fold order; a group of one is None (stages on one device share their groups: the
        same ranks, one cached group). ``wire``: the emulated wire's bytes/s (``--a2a-wire``)."""
        from .expert_parallel import ExpertGroups, ExpertParallel, ExpertTensorParallel
        out = {}
        for s in range(sched.num_stages):
            eps, edps = mesh.expert_fold(sorted(sched.stage_group(s)), ep, etp)
            etps = mesh.expert_tp_groups(sorted(sched.stage_group(s)), ep, etp) if etp > 1 else ()
            for ranks in eps + edps + etps:
                if len(ranks) > 1:
                    self.for_ranks(ranks, rank, device)
            mine_ep = next((g for g in eps if rank in g), None)
            if mine_ep is None:
                continue
            mine_edp = next(g for g in edps if rank in g)
            mine_etp = next((g for g in etps if rank in g), None)
            out[s] = ExpertGroups(ExpertParallel(ep, mine_ep.index(rank), self._stage.get(mine_ep), mine_ep, wire=wire),
                                  mine_edp, self._stage.get(mine_edp), mine_edp.index(rank),
                                  ExpertTensorParallel(etp, mine_etp.index(rank), self._stage.get(mine_etp), mine_etp)
                                  if mine_etp else None)
        return out

    def for_tensor_parallel(self, mesh: Mesh, rank: int, device) -> object:
        """This rank's TP group (every TP group is created, by all ranks in pipeline-rank, then CP-rank order)."""
        mine = None
        for p in range(mesh.ranks):
            for c in range(mesh.cp):
                group = self.for_ranks(mesh.tp_group(p, c), rank, device)
                if rank in mesh.tp_group(p, c):
                    mine = group
        return mine

    def for_context_parallel(self, mesh: Mesh, rank: int, device) -> object:
        """This rank's CP group (every CP group is created, by all ranks in pipeline-rank, then TP-rank order)."""
        mine = None
        for p in range(mesh.ranks):
            for t in range(mesh.tp):
                group = self.for_ranks(mesh.cp_group(p, t), rank, device)
                if rank in mesh.cp_group(p, t):
                    mine = group
        return mine

    def for_ranks(self, ranks, rank: int, device):
        """The (cached) group of ``ranks``; every rank must ask for the same groups in one order."""
        ranks = tuple(ranks)
        if ranks not in self._stage:
            group = self._stage[ranks] = dist.new_group(list(ranks), backend=self.backend)
            if rank in ranks:
                dist.all_reduce(torch.zeros(1, device=device), group=group)
        return self._stage[ranks]

    def warm_up_p2p(self, sched: Schedule, rank: int, device, mesh: Mesh | None = None) -> None:
        mesh = mesh or Mesh(1, sched.num_ranks)
        pairs = {tuple(sorted(mesh.lift((r, op.peer), t, c))) for r in range(sched.num_ranks)
                 for op in sched.program(r) if op.peer >= 0 for t in range(mesh.tp) for c in range(mesh.cp)}
        self.p2p.warm_up(rank, pairs, device)


RENDEZVOUS_MIN_SECONDS = 30.0   # the rendezvous waits at least this long: ranks start seconds apart (torch's import)
_ANNOUNCE_SECONDS = 5.0          # a rendezvous still waiting after this long says for whom (stderr)


class RendezvousError(RuntimeError):
    """The ranks did not all meet within the rendezvous bound; the one-line message names the
    missing ranks where they are known."""


def rendezvous_seconds(timeout: float) -> float:
    """How long a rank waits for the others to join: ``--timeout``, at least :data:`RENDEZVOUS_MIN_SECONDS`."""
    return max(timeout, RENDEZVOUS_MIN_SECONDS)


def rendezvous(launch_rank: int, world: int, wait: float):
    """The env:// rendezvous (MASTER_ADDR, MASTER_PORT; under torchrun with its agent's store, else
    launch rank 0 hosts it), bounded: every rank checks in under its launch rank and waits until
    all ``world`` have, at most ``wait`` seconds; past it :class:`RendezvousError` names the ranks
    that never came (the store's host tells the others the same line), or the address that could
    not be reached. Returns the store."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    hosting = not agent and launch_rank == 0
    where = f"MASTER_ADDR={addr} MASTER_PORT={port}"
    host = "torchrun's store" if agent else "rank 0's store"
    t0 = time.monotonic()
    try:
        if not hosting:
            _reachable(addr, port, t0 + wait)
        store = dist.TCPStore(addr, port, world_size=world, is_master=hosting, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=max(1.0, wait - (time.monotonic() - t0))),
                              multi_tenant=True)
    except (RuntimeError, OSError) as e:     # DistNetworkError, DistStoreError: RuntimeErrors
        if hosting:
            raise RendezvousError(f"rank 0 could not host the rendezvous at {where}: {_first_line(e)}; give "
                                  f"MASTER_PORT a free port (the same on every rank)") from None
        raise RendezvousError(f"rank {launch_rank} could not reach the rendezvous ({host} at {where}) within "
                              f"{wait:g} s: {_first_line(e)}; start rank 0 with the same MASTER_ADDR and MASTER_PORT "
                              f"on every rank") from None
    store = dist.PrefixStore(f"pipetwin/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    try:
        _check_in(store, launch_rank, world, wait, t0, where, hosting)
    except RuntimeError as e:
        if isinstance(e, RendezvousError):
            raise
        raise RendezvousError(f"rank {launch_rank} lost the rendezvous ({host} at {where}) while waiting for "
                              f"the other ranks: {_first_line(e)}") from None
    return store


def _reachable(addr: str, port: int, deadline: float) -> None:
    """Wait until something listens at ``addr:port`` (the store's host), at most until ``deadline``."""
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise OSError(f"nothing listens there ({e.strerror or e})") from None
            time.sleep(0.1)


def _check_in(store, launch_rank: int, world: int, wait: float, t0: float, where: str, hosting: bool) -> None:
    store.set(f"joined/{launch_rank}", "1")
    joined, announced = store.add("joined", 1), False
    while joined < world:
        waited = time.monotonic() - t0
        if store.check(["abort"]):
            raise RendezvousError(store.get("abort").decode())
        if waited >= wait or (not announced and waited >= _ANNOUNCE_SECONDS):
            missing = [r for r in range(world) if not store.check([f"joined/{r}"])]
            if waited >= wait:
                line = (f"rank {launch_rank} waited {wait:g} s (the rendezvous bound: --timeout, at least "
                        f"{RENDEZVOUS_MIN_SECONDS:g} s) for {_ranks(missing)} of WORLD_SIZE {world} to join at "
                        f"{where}; start every rank with the same WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
                if hosting:     # the others read the same line before the store goes away with this process
                    store.set("abort", line)
                    time.sleep(0.5)
                raise RendezvousError(line)
            if launch_rank == 0:
                print(f"pipetwin: rank 0 is waiting for {_ranks(missing)} of {world} to join at {where} (at most "
                      f"{wait:g} s)", file=sys.stderr, flush=True)
            announced = True
        time.sleep(0.05)
        joined = store.add("joined", 0)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:160] if text else type(e).__name__


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` / ``ranks 1, 2, 5`` / ``ranks 1, 2, ... (12 in all)``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:8]))
    return f"ranks {shown}" + (f", ... ({len(ranks)} in all)" if len(ranks) > 8 else "")


def init_world(device: str, rank: int, world: int, local_rank: int, local_world: int,
               timeout: float = 60.0, launch_rank: int | None = None) -> DeviceContext:
    """Pick the device (``local_rank``'s), size the CPU thread pool and join the default process
    group as ``rank``. The rendezvous (env://: MASTER_ADDR, MASTER_PORT; :func:`rendezvous`, which
    waits at most :func:`rendezvous_seconds`) is made as the launcher's rank ``launch_rank``
    (default ``rank``): under torchrun a process may run another pipeline rank than the one
    torchrun gave it (placement, :func:`executor.launch.torchrun_placement`)."""
    ctx = select_device(device, local_rank)
    if not ctx.is_cuda:
        torch.set_num_threads(cpu_threads(local_world))
    wait = rendezvous_seconds(timeout)
    store = rendezvous(rank if launch_rank is None else launch_rank, world, wait)
    bound = datetime.timedelta(seconds=wait)
    try:
        dist.init_process_group(ctx.backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=world,
                                timeout=bound, device_id=ctx.device if ctx.is_cuda else None)
    except RuntimeError as e:      # every rank checked in, then one went (or its network) before the group formed
        raise RendezvousError(f"rank {rank}: the {ctx.backend} process group of {world} ranks did not form within "
                              f"{wait:g} s after every rank had joined: {_first_line(e)}") from None
    return ctx


def run_spawned(jobs: list[Job], rank: int, world: int, local_rank: int, local_world: int) -> list | None:
    """A spawned local rank (one node of ``world`` processes): with tensor or context parallelism the
    mesh rank its device runs (:func:`executor.mesh.placement`, the function torchrun's processes
    use); without, the launch order."""
    tp, cp = jobs[0].config.parallel.tp, jobs[0].config.parallel.cp
    if tp * cp == 1:
        return run_jobs(jobs, rank, world, local_rank, local_world)
    mesh_rank, _ = placement(jobs[0].config.device_map, jobs[0].schedule, tp, 0, rank, 1, world, cp)
    return run_jobs(jobs, mesh_rank, world, local_rank, local_world, launch_rank=rank)


def run_jobs(jobs: list[Job], rank: int, world: int, local_rank: int, local_world: int,
             launch_rank: int | None = None) -> list[RunResult] | None:
    """Run ``jobs`` on this (process-group) rank; rank 0 returns their results, the other ranks None."""
    devices = {j.config.device for j in jobs}
    if len(devices) != 1:
        raise ValueError(f"jobs of one launch must use one device kind; got {sorted(devices)}")
    pins = {j.config.pin_cores for j in jobs}
    if len(pins) != 1:
        raise ValueError("jobs of one launch must agree on pin_cores (a process is pinned once)")
    # pinned before the process group starts gloo's threads (they inherit the affinity)
    core = pin_to_core(local_rank, local_world) if pins.pop() else None
    ctx = init_world(devices.pop(), rank, world, local_rank, local_world, max(j.config.timeout for j in jobs),
                     launch_rank=launch_rank)
    groups = ProcessGroups(world, ctx.backend)
    total = sum(j.config.steps for j in jobs)
    what = "training" if len(jobs) == 1 else f"{len(jobs)} runs"
    done = [0]

    def step_done(seconds: float) -> None:
        done[0] += 1
        if rank == 0:
            report_progress(done[0], total, what, seconds)
    results = [run_job(job, rank, world, ctx, groups, on_step=step_done, core=core) for job in jobs]
    dist.barrier()
    dist.destroy_process_group()
    return results if rank == 0 else None


@dataclass
class RankSetup:
    """One rank's part of a job, ready to run steps."""

    runtime: PipelineRuntime
    modules: dict
    params: list
    optimizer: torch.optim.Optimizer
    probe: object = None     # a layer stack's speed-probe work (None: the GPT block's)
    tp_rank: int = 0         # this process's rank in its tensor-parallel group
    cp_rank: int = 0         # and in its context-parallel group
    experts: dict | None = None     # stage -> its ExpertGroups (expert parallelism)


def setup_rank(job: Job, rank: int, world: int, ctx: DeviceContext, groups: "ProcessGroups") -> RankSetup:
    """Steps 1-3 of the module docstring: stages, optimizer, groups, mailbox, aligned clock. ``rank``
    is the process-group rank: pipeline rank ``rank // (T C)``, CP rank ``rank // T % C``, TP rank
    ``rank % T`` (:mod:`executor.mesh`)."""
    cfg, sched = job.config, job.schedule
    mesh = Mesh(cfg.parallel.tp, sched.num_ranks, cfg.parallel.cp)
    if mesh.world != world:
        raise ValueError(f"{sched.name} with T={cfg.parallel.tp}, C={cfg.parallel.cp}, D={sched.num_devices}, "
                         f"R={sched.replicas} needs {mesh.world} processes; {world} were started")
    tp_group = groups.for_tensor_parallel(mesh, rank, ctx.device) if mesh.tp > 1 else None
    cp_group = groups.for_context_parallel(mesh, rank, ctx.device) if mesh.cp > 1 else None
    par = cfg.parallel
    # expert parallelism: the EP and EDP groups of each stage this process holds (executor.expert_parallel)
    experts = groups.for_experts(sched, rank, ctx.device, mesh, par.ep, par.etp, cfg.job.faults.a2a_wire) \
        if par.ep * par.etp > 1 else {}
    pipe_rank, tp_rank = mesh.coords(rank)
    cp_rank = mesh.cp_rank(rank)
    tp = TensorParallel(mesh.tp, tp_rank, tp_group, cfg.parallel.sequence_parallel)
    cp = ContextParallel(mesh.cp, cp_rank, cp_group, mesh.cp_group(pipe_rank, tp_rank), cfg.parallel.cp_comm)
    global_rank, rank = rank, pipe_rank     # from here on: the pipeline rank, as the program names it
    stack = None
    if job.layout is not None:      # a model file: executor.user_model builds this rank's stages
        from .user_model import NoOptimizer, TiedGradients, build_rank, check_same_weights
        stack = build_rank(job.layout, sched, rank, seed=cfg.seed, device=ctx.device, probe=bool(cfg.probe))
        check_same_weights(stack.digests, job.layout, world)     # every rank, before step 0
        modules, params, data = stack.modules, stack.params, stack.data
        layout, precision = job.layout, cfg.precision

        def buffer(op):   # a floating message travels in the wire dtype (executor.precision.to_wire)
            t = layout.message_buffer(op, ctx.device)
            return precision.to_wire(t) if t.is_floating_point() else t
    else:
        spec = cfg.spec()
        built, modules = {}, {}
        for c, s in sched.stages_on(sched.rank_device(rank)):   # copies of one stage share its module
            if s not in built:
                built[s] = cfg.precision.prepare(stage_module(spec, sched.num_stages, s, seed=cfg.seed,
                                                              partition=cfg.blocks, tp=tp, cp=cp,
                                                              moe=cfg.moe_run(experts[s] if s in experts
                                                                              else None)).to(ctx.device))
            modules[(c, s)] = built[s]
        params = [p for m in built.values() for p in m.parameters()]
        data = TokenSource(spec, cfg.seed, cfg.data)
        shape, wire = boundary_shape(spec, tp, cp), cfg.precision.wire_dtype
        buffer = lambda op: torch.empty(shape, dtype=wire, device=ctx.device)  # noqa: E731
    if par.zero < 2:     # ZeRO 2, 3: the unsharded gradients exist from a stage's first backward to its ALLREDUCE
        for p in params:
            p.grad = torch.zeros_like(p)
    mailbox = Mailbox(rank, sched.program(rank), groups.p2p, buffer, timeout=cfg.timeout,
                      lookahead=cfg.recv_lookahead, to_rank=lambda p: mesh.rank(p, tp_rank, cp_rank))
    groups.warm_up_p2p(sched, global_rank, ctx.device, mesh)
    warm_up_ring(cp, ctx.device)
    stage_groups = groups.for_stages(sched, global_rank, ctx.device, mesh)
    tied = partial = None
    if stack is not None:       # parameters shared across stages: one group per set of ranks, all ranks alike
        tied = TiedGradients(rank, [(ranks, groups.for_ranks(ranks, rank, ctx.device) if len(ranks) > 1 else None,
                                     ps) for ranks, ps in stack.tie_groups], stack.excluded)
    elif tp.sequence:           # norms on 1/T of the sequence: their gradients summed over the TP group
        # (routed experts held apart: summed over their EDP group below; at EP = ETP = 1 the TP ranks are in it)
        partial = [p for m in built.values() for n, p in m.named_parameters() if sequence_partial(n)
                   and not (experts and is_expert_param(n))]
    if partial and not cfg.parallel.zero:    # ZeRO-1 sums them on its shard instead (executor.zero)
        from .user_model import TiedGradients
        tied = TiedGradients(global_rank, [(mesh.tp_group(rank, cp_rank), tp_group, partial)], set(),
                             what="the sequence-parallel norm gradients")
    if cp.on:       # the stages no ALLREDUCE sums (one pipeline rank holds them): over the CP ranks at OPTIM
        # (with ZeRO their shard groups span the CP ranks: the reduce-scatter sums them)
        from .user_model import TiedGradients
        # (a routed expert's holders are its EDP group, which with EP spans the CP ranks: summed there, below)
        folded = {id(p) for m in built.values() for n, p in m.named_parameters() if is_expert_param(n)} \
            if experts else set()
        alone = [] if par.zero else \
            [p for s, m in built.items() if len(sched.stage_group(s)) == 1 for p in m.parameters()
             if id(p) not in folded]
        over_cp = TiedGradients(global_rank, [(cp.ranks, cp_group, alone)], set(),
                                what="the context-parallel ranks' gradients") if alone else None
        tied = GradientSums([over_cp, tied])     # first over CP, then the norms' over TP
    # expert parallelism: a routed expert's gradients summed over its EDP group at OPTIM, left out of the
    # stage's all-reduce over its replicas (and, with ZeRO-1, sharded over the EDP group: below)
    routed = {s: [p for n, p in m.named_parameters() if is_expert_param(n)] for s, m in built.items()} \
        if experts and stack is None else {}
    if any(routed.values()):
        from .user_model import TiedGradients
        # (ZeRO 2, 3 reduce-scatter them over the EDP group at each backward: left out of the sum here)
        over_edp = TiedGradients(global_rank, [] if par.zero >= 2 else
                                 [(experts[s].edp_ranks, experts[s].edp_group, ps)
                                  for s, ps in sorted(routed.items()) if ps],
                                 {id(p) for ps in routed.values() for p in ps},
                                 what="the routed experts' gradients over their EDP group")
        tied = GradientSums([tied, over_edp])
    # ZeRO 1, 2, 3: each rank of a stage's shard group steps its shard (executor.zero); the shards in stage
    # order on every rank, so that two stages over the same ranks (chimera) meet at OPTIM in one order
    if par.zero:
        shards = groups.for_shards(sched, global_rank, ctx.device, mesh, par.dp_shard)
        mine = set().union(*({id(p) for p in ps} for ps in routed.values()))
        entries = []
        for s, m in sorted(built.items()):      # the dense parameters over the stage's shard group
            entries.append(([p for p in m.parameters() if id(p) not in mine], shards.get(s, ShardGroups(None, 0, 1)),
                            s))
            if routed.get(s):                   # its routed experts over their EDP group
                g = experts[s]
                entries.append((routed[s], ShardGroups(g.edp_group, g.edp_index, len(g.edp_ranks)), s))
        optimizer = ShardedOptimizer(entries, cfg.optimizer, cfg.lr, zero=par.zero,
                                     reshard_after_forward=par.reshard_after_forward,
                                     partial=(partial, tp_group) if partial else None,
                                     timeout=cfg.timeout, rank=global_rank)
    else:
        optimizer = make_optimizer(params, cfg.optimizer, cfg.lr) if params else NoOptimizer()
    # after the optimizer: ZeRO-1 moves the weights into one buffer, the meter must know where they live
    meter = ctx.meter(params) if cfg.measure_memory else NullMeter()
    # a mixture of experts keeps what its routing gives (rows per expert differ between micro-batches): every
    # forward metered, none accounted from another's bytes (executor.device)
    moe_metered = cfg.meter_every_forward or (stack is None and spec.is_moe)
    runtime = PipelineRuntime(sched, rank, modules=modules, optimizer=optimizer, data=data, ctx=ctx, meter=meter,
                              mailbox=mailbox, stage_groups=stage_groups, timeout=cfg.timeout,
                              clock0=_aligned_clock(world), fault=cfg.fault, precision=cfg.precision,
                              recompute=cfg.parallel.recompute, meter_every_forward=moe_metered, tied=tied,
                              slowdown=cfg.job.faults.slowdown_map.get(rank, 1.0))
    if par.zero:        # ZeRO 3's gathered weights move: the meter and the recomputation follow them
        optimizer.watch(meter, runtime.recompute)
    return RankSetup(runtime, modules, params, optimizer, stack.probe if stack is not None else None, tp_rank,
                     cp_rank, experts)


def report_progress(done: int, total: int, what: str, seconds: float) -> None:
    """Rank 0 after each step: into the spawned launcher's progress file (it draws the bar), or under
    torchrun a line on stderr when stderr is a terminal."""
    work = os.environ.get("PIPETWIN_WORKDIR")
    if work:
        tmp = os.path.join(work, "progress.tmp")
        with open(tmp, "w") as f:
            f.write(f"{done} {total} {what}")
        os.replace(tmp, os.path.join(work, "progress"))
    elif sys.stderr.isatty():
        print(f"pipetwin: {what}: step {done}/{total} ({seconds:.3g} s)", file=sys.stderr, flush=True)


def run_job(job: Job, rank: int, world: int, ctx: DeviceContext, groups: "ProcessGroups",
            on_step=None, *, core: int | None = None) -> RunResult | None:
    cfg, sched = job.config, job.schedule
    rs = setup_rank(job, rank, world, ctx, groups)
    probe_host = speed_probe(None if job.layout is not None else cfg.spec(), ctx, cfg.probe, rs.probe) \
        if cfg.probe else None
    probe = probe_host() if probe_host else []
    rows, losses, peak, phases = [], [], 0, []
    load = {st: [] for _, st in rs.runtime.modules}     # stage -> tokens per expert, per step (MoE)
    cpu = CpuMeter() if cfg.probe else None
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        out = rs.runtime.run_step(step)
        if on_step is not None:
            on_step(time.perf_counter() - t0)
        rows += out.rows
        phases += [(step, *p) for p in out.phases]
        losses.append(out.loss_sum)
        peak = max(peak, out.peak_activation)
        for st, steps in load.items():
            steps.append(take_expert_load(m for (_, s), m in rs.runtime.modules.items() if s == st))
    window = cpu.stop() if cpu else None
    zero = rs.optimizer if isinstance(rs.optimizer, ShardedOptimizer) else None
    collectives = dict(zero.counts) if zero is not None else {}     # the steps' (not the final gather's)
    if probe_host:
        probe += probe_host()
    node, local, _, per_node = topology()
    pipe_rank = rank // (cfg.parallel.tp * cfg.parallel.cp)
    report = {"rank": pipe_rank, "tp": rs.tp_rank, "cp": rs.cp_rank, "rows": rows, "losses": losses, "peak": peak,
              "phases": phases,
              "fwd_bytes": rs.runtime.fwd_bytes,
              "seg_bytes": [(c, st, list(b)) for (c, st, n), b in rs.runtime.seg_bytes.items() if n > 1],
              "static_bytes": _static_bytes(rs.params, rs.optimizer), "probe": probe, "cpu": window, "core": core,
              "gathered_bytes": zero.peak_gathered if zero is not None else 0,
              "grad_buffer_bytes": zero.peak_grad_buffer if zero is not None else 0, "collectives": collectives,
              "placement": {"node": node, "local_rank": local, "device": node * per_node + local,
                            "host": socket.gethostname()},
              "ep_sent": {s: list(g.ep.sent) for s, g in (rs.experts or {}).items()},
              "expert_load": {st: steps for st, steps in load.items() if steps and steps[0] is not None}}
    if cfg.collect_params:
        if zero is not None:      # ZeRO 3: the weights gathered from their shards
            zero.gather_all()
        replica = pipe_rank // sched.num_devices
        report["params"] = {f"r{replica}.c{c}/{n}": _whole_expert(n, p, (rs.experts or {}).get(s)).cpu().clone()
                            for (c, s), m in rs.modules.items() for n, p in m.named_parameters(remove_duplicate=False)}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(report, gathered, dst=0)
    return merge_reports(cfg, sched, gathered, backend=ctx.backend) if rank == 0 else None


def speed_probe(spec, ctx: DeviceContext, repeats: int, work=None):
    """A probe of the host's speed: each call returns the seconds of ``repeats`` forward +
    backward passes of one transformer block on one micro-batch (or of ``work()``: a layer
    stack's, see :mod:`executor.user_model`), started on every rank at once (a barrier first),
    after one untimed pass."""
    if work is None:
        gen = torch.Generator().manual_seed(1234)
        layer = block(spec).to(ctx.device)
        x = torch.randn(spec.micro_batch, spec.seq_len, spec.hidden, generator=gen).to(ctx.device).requires_grad_(True)

        def work():
            layer(x).sum().backward()

    def probe() -> list[float]:
        dist.barrier()
        out = []
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            work()
            ctx.synchronize()
            if i:
                out.append(time.perf_counter() - t0)
        return out
    return probe


def _aligned_clock(world: int) -> float:
    dist.barrier()
    mine = (socket.gethostname(), time.perf_counter())
    readings = [None] * world
    dist.all_gather_object(readings, mine)
    return min(t for host, t in readings if host == mine[0])


def _static_bytes(params, optimizer) -> int:
    """Weights, gradients and optimizer state a rank keeps (ZeRO: at rest, :mod:`executor.zero`)."""
    if isinstance(optimizer, ShardedOptimizer):
        return optimizer.static_bytes()
    n = sum(p.numel() * p.element_size() * 2 for p in params)  # weights + gradients
    for state in optimizer.state.values():
        n += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    return n


def merge_reports(cfg: RunConfig, sched: Schedule, reports: list[dict], *, backend: str) -> RunResult:
    """Rank 0: one trace, the global loss per step, per-rank memory (bytes and Ma), per pipeline rank
    (with tensor and context parallelism: TP rank 0 of CP rank 0 stands for its T x C processes, as
    one simulated rank does; the loss sums the CP ranks' shares; every process's placement is
    listed and the parameters are gathered from their shards)."""
    everyone = reports
    losing = [rep for rep in everyone if rep.get("tp", 0) == 0]      # each CP rank's share of the loss
    reports = [rep for rep in losing if rep.get("cp", 0) == 0]
    D, S = sched.num_devices, sched.num_stages
    fwd: dict[int, int] = {}
    for rep in reports:
        for s, b in rep["fwd_bytes"].items():
            fwd.setdefault(s, b)
    ma = sum(fwd.get(s, 0) for s in range(S)) / D
    static = {rep["rank"]: rep["static_bytes"] for rep in reports}
    trace = make_trace([row for rep in reports for row in rep["rows"]], engine="executor", schedule=sched.name,
                       devices=D, microbatches=sched.num_microbatches, replicas=sched.replicas, time_unit="s",
                       mem_unit="B", static_mem=static, ma_bytes=ma, model=cfg.model_name, backend=backend)
    G = cfg.global_microbatches
    losses = [sum(rep["losses"][k] for rep in losing) / G for k in range(cfg.steps)]
    metrics = step_metrics(trace)
    per_metrics = {m.device: m for m in metrics.per_device}
    per_device = []
    for rep in sorted(reports, key=lambda r: r["rank"]):
        r = rep["rank"]
        m = per_metrics.get(r)
        per_device.append({"device": r, "peak_activation_bytes": rep["peak"],
                           "peak_activation_ma": rep["peak"] / ma if ma else None,
                           "static_bytes": rep["static_bytes"], "gathered_bytes": rep["gathered_bytes"],
                           "grad_buffer_bytes": rep["grad_buffer_bytes"],
                           "busy_s": m.busy if m else 0.0, "bubble_ratio": m.bubble_ratio if m else None})
    params, drift = gather_params([rep["params"] for rep in sorted(everyone, key=lambda x: x["tp"])
                                   if rep["rank"] == r and rep.get("cp", 0) == 0] for r in range(sched.num_ranks)) \
        if cfg.collect_params else (None, None)
    if params is not None and cfg.parallel.ep > 1 and cfg.parallel.cp > 1:   # EP folds over the CP ranks: their
        for rep in everyone:                                                # experts are other experts
            if rep.get("cp", 0) and rep["tp"] == 0:
                for key, value in rep["params"].items():
                    if is_expert_param(key.split("/", 1)[1]):
                        params.setdefault(key, value)
    if params is not None and cfg.parallel.ep > 1:
        params = whole_experts(params)
    extra = {} if drift is None or cfg.parallel.tp == 1 else {"tp_replica_drift": drift}
    if cfg.collect_params and cfg.parallel.cp > 1:    # the CP ranks of a pipeline rank hold the same weights
        extra["cp_replica_drift"] = cp_drift(everyone)
    # the overlapped F&B pairs' sub-phases (executor.overlap.Phase), per rank and step
    phases = [dict(zip(("device", "step", "token", "segment", "kind", "start", "end"), (rep["rank"], *p)))
              for rep in reports for p in rep.get("phases", ())]
    if phases:
        extra["phases"] = phases
        # per rank (TP rank 0), copy and stage: the activation bytes each segment of a cut forward kept
        extra["segment_bytes"] = [{"device": rep["rank"], "copy": c, "stage": st, "bytes": b}
                                  for rep in reports for c, st, b in rep.get("seg_bytes", ())]
    extra |= {"placement": [dict(rep["placement"], rank=rep["rank"], tp=rep["tp"], cp=rep.get("cp", 0))
                           for rep in sorted(everyone, key=lambda r: (r["rank"], r.get("cp", 0), r["tp"]))]}
    probes = sorted(t for rep in reports for t in rep["probe"])
    if probes:
        extra["probe_seconds"] = noise_free(probes)
        extra["probe_samples"] = probes
    # every process's CPU (a TP group's other ranks are the run's, not other processes' load)
    windows = [rep["cpu"] for rep in everyone if rep.get("cpu") is not None]
    if windows and len(windows) == len(everyone):
        extra["foreign_cores"] = foreign_cores(windows)
        extra["rank_cpu_seconds"] = [w.own for w in windows]
        extra["wall_seconds"] = sorted(w.wall for w in windows)[len(windows) // 2]
    if cfg.parallel.zero:    # ZeRO: the collectives each process issued over the steps (executor.zero)
        extra["zero_collectives"] = [dict(rep["collectives"], rank=rep["rank"], tp=rep["tp"])
                                     for rep in sorted(everyone, key=lambda r: (r["rank"], r["tp"]))]
    if cfg.parallel.ep > 1:     # each process's all-to-alls: stage -> the send counts of each exchange
        extra["ep_sent"] = {rep["rank"]: rep["ep_sent"] for rep in everyone}
    loads = expert_load_by_rank(everyone)
    if loads:       # tokens routed to each expert: pipeline rank -> stage -> per step (its processes summed)
        extra["expert_load"] = loads
    if cfg.pin_cores:
        extra["pinned"] = all(rep.get("core") is not None for rep in reports)
    return RunResult(cfg, losses, metrics.iteration_times, per_device, ma, "executor", trace=trace, params=params,
                     extra=extra)


def _whole_expert(name: str, p: torch.Tensor, groups) -> torch.Tensor:
    """Parameter ``p`` whole: a routed expert's ETP slice all-gathered over its ETP group (every member
    reads every parameter in one order, so the gathers meet); any other as it is."""
    from .expert_parallel import etp_split_of
    from .tensor_parallel import gather as gather_shards
    etp = getattr(groups, "etp", None)
    split = etp_split_of(name) if etp is not None and etp.size > 1 else None
    if split is None:
        return p.detach()
    parts = [torch.empty_like(p) for _ in range(etp.size)]
    dist.all_gather(parts, p.detach().contiguous(), group=etp.group)
    return gather_shards(parts, *split)


def gather_params(per_rank) -> tuple[dict, float]:
    """The whole parameters of every pipeline rank from its TP ranks' (in TP rank order): split ones
    concatenated (:func:`executor.tensor_parallel.gather`), replicated ones from TP rank 0; and the
    largest difference of a replicated parameter between the TP ranks holding it (0 when they agree)."""
    out, drift = {}, 0.0
    for shards in per_rank:
        keys = dict.fromkeys(k for s in shards for k in s)     # a routed expert: on the TP ranks of its EP rank
        for key in keys:
            holders = [s for s in shards if key in s]
            if len(holders) < len(shards):      # routed experts (EP folded over the TP ranks): whole on each
                out[key] = holders[0][key]
                continue
            value = shards[0][key]
            split = split_of(key) if len(shards) > 1 else None
            if split is not None:
                out[key] = gather([s[key] for s in shards], *split)
                continue
            out[key] = value
            for other in shards[1:]:
                if key in other:
                    drift = max(drift, float((other[key] - value).abs().max()))
    return out, drift


def whole_experts(params: dict) -> dict:
    """``r{replica}.c{copy}/NAME`` parameters with every replica's model whole: a routed expert is held
    by one EP rank (:mod:`executor.expert_parallel`), so each replica takes those its EP group's other
    members hold (the same tensors: EDP copies agree after every step's sum)."""
    held: dict = {}
    for key, value in params.items():
        where, name = key.split("/", 1)
        if is_expert_param(name):
            held.setdefault((where.split(".", 1)[1], name), value)
    out = dict(params)
    for where in {k.split("/", 1)[0] for k in params}:
        copy = where.split(".", 1)[1]
        for (c, name), value in held.items():
            if c == copy:
                out.setdefault(f"{where}/{name}", value)
    return out


def cp_drift(reports: list[dict]) -> float:
    """The largest difference of a parameter between a process and CP rank 0 of its pipeline and TP
    rank (0 when the CP ranks agree), over the parameters both hold (with EP folded over the CP
    ranks, each holds other routed experts)."""
    first = {(r["rank"], r["tp"]): r["params"] for r in reports if r.get("cp", 0) == 0}
    return max((float((t - first[(r["rank"], r["tp"])][k]).abs().max()) for r in reports if r.get("cp", 0)
                for k, t in r["params"].items() if k in first[(r["rank"], r["tp"])]), default=0.0)


def local_env() -> tuple[int, int, int, int]:
    """(rank, world, local rank, local world) from the launcher's / torchrun's environment."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return rank, world, local_rank, local_world


def topology() -> tuple[int, int, int, int]:
    """(node, local rank, nodes, processes per node) of this process: torchrun's GROUP_RANK (the
    node's rank), LOCAL_RANK and LOCAL_WORLD_SIZE; spawned ranks are all on node 0."""
    rank, world, local_rank, local_world = local_env()
    if world % local_world:
        raise ValueError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local_world}: nodes must "
                         f"run the same number of processes")
    node = int(os.environ.get("GROUP_RANK", rank // local_world))
    return node, local_rank, world // local_world, local_world
