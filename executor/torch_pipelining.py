"""Training under ``torch.distributed.pipelining``'s own runtime from a schedule's torch CSV.

pipetwin writes a single-copy schedule as torch's CSV of actions
(:func:`schedules.torch_interop.to_torch_text`: ``0F1``, ``1I0``, ``1W0``, ``1B0``,
``(0F3;5B1)OVERLAP_F_B``). This module hands such a CSV to PyTorch's
``_PipelineScheduleRuntime`` and trains with it, so that what pipetwin exports is run by the
runtime users train with, not by pipetwin's executor:

1. every rank builds pipetwin's own stage modules for the stages the schedule puts on it
   (:func:`executor.model.stage_module`: the same weights from the same seed, the same split and
   partition) and wraps each in a ``torch.distributed.pipelining.PipelineStage`` with static
   shapes (token ids [b, s] into stage 0, hidden states [b, s, h] between stages, logits
   [b, s, V] out of the last; given as tensors that require grad, as a forward's would: torch
   derives the gradients' buffers from them);
2. ``_PipelineScheduleRuntime(stages, N, loss_fn)`` loads the CSV with its ``_load_csv``: a
   compute-only CSV through torch's own validation, stage -> rank inference and lowering
   (``_add_unshard_reshard``, ``_add_reduce_grad``, ``_add_send_recv``); a CSV that already holds
   communication actions (``SEND_F``, ``RECV_B``, ``REDUCE_GRAD`` ...) as written
   (``format="compute_comms"``, :func:`csv_format`);
3. each step, the ranks holding stage 0 pass the N micro-batches of pipetwin's data
   (:class:`executor.data.TokenSource`, micro-batch g of the step, g < N) concatenated along the
   batch dimension to ``step()``, which splits them back into the same N micro-batches; the ranks
   holding the last stage pass the targets alike and get the N losses of the model's loss
   (:func:`executor.model.lm_loss`, the mean cross-entropy). Torch sums a stage's gradients over
   the micro-batches and divides them by N (``scale_grads``, at the stage's ``REDUCE_GRAD``), then
   every rank steps pipetwin's optimizer (:func:`executor.model.make_optimizer`) on its stages'
   parameters. The step's loss is the mean of the N micro-batch losses.

Data parallelism (``--dp`` R, a plan's replicas): R pipelines of D ranks, each torch's runtime over
a process group of its own (ranks r*D .. r*D+D-1, rows 0..D-1 of the CSV), replica r training the
step's global micro-batches r*N .. r*N+N-1 of G = R*N (pipetwin's numbering); between ``step()``
and the optimizer the replicas of a device average their gradients (one all-reduce over ranks d,
D+d, ..., what DDP would do; torch's own DDP/FSDP wrapping is not used). ZeRO-1 shards only the
optimizer state, not the update: torch's run keeps the state whole on every rank.

So the run is pipetwin's run (model, weights, data, micro-batches, loss, optimizer) with only the
pipeline runtime exchanged, and its losses must equal pipetwin's executor's and the one-process
reference's within :data:`executor.reference.CHECK_TOLERANCE` (1e-5 relative in fp32): the
arithmetic differs only in where the 1/N is applied (torch scales the summed gradient, pipetwin
each micro-batch's loss) and in the order of sums (measured: 3e-8 on the tiny GPT).

What torch's runtime would not train as pipetwin does is refused before any process starts, in
one line (:func:`check_torch_run`): several model copies (a torch action names a stage by its
index and one rank holds it; the line names the nearest single-copy family,
:func:`schedules.torch_interop.single_copy_refusal`), a last stage whose forwards do not run in
micro-batch order (torch keeps the losses in the order they were computed and takes micro-batch
m's backward from the m-th: it would differentiate another micro-batch's loss), tensor
parallelism, ZeRO-2/3, recomputation and bf16 (torch's stages run none of pipetwin's), model
files. The ranks are spawned as pipetwin's are (:func:`executor.launch.launch`: CPU + gloo; or one
rank per process under torchrun): a rank that fails, or a receive that never comes (the pipeline's
process groups wait ``--timeout``), ends the run with :class:`executor.launch.LaunchError` naming
the rank, the step and the action torch was running first.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from schedules import Schedule
from schedules.ir import F
from schedules.torch_interop import single_copy_refusal, to_torch_text

from .config import RunConfig, RunResult, lowered_schedule
from .data import TokenSource
from .model import lm_loss, make_optimizer, stage_module
from .runtime import flatten, unflatten_into

ENGINE = "torch.distributed.pipelining"
FORMATS = ("compute_only", "compute_comms")   # the forms _PipelineScheduleRuntime._load_csv reads


@dataclass(frozen=True)
class TorchJob:
    """One run under torch's runtime: the config (model, data, optimizer, steps), its lowered
    schedule (which rank holds which stage, N) and the CSV text torch loads, in ``format``
    (:data:`FORMATS`)."""

    config: RunConfig
    schedule: Schedule
    csv: str
    format: str = "compute_only"


def csv_format(text: str) -> str:
    """``compute_comms`` when the CSV holds communication actions (read with torch's own
    ``_Action.from_str``), else ``compute_only``."""
    from torch.distributed.pipelining.schedules import _Action
    comms = False
    for r, line in enumerate(text.splitlines()):
        for tok in (t.strip() for t in _split_cells(line)):
            if not tok:
                continue
            try:
                action = _Action.from_str(tok)
            except (ValueError, RuntimeError, AttributeError):
                action = None
            if action is None or str(action) != tok:     # from_str reads a prefix: '0F0 0B0' as 0F0
                raise ValueError(f"row {r} of the torch CSV: {tok[:40]!r} is not one action as torch writes them "
                                 f"(_Action.__repr__); torch reads comma-separated actions such as 0F1, 1I0, 1W0, "
                                 f"1B0, 0SEND_F1, (0F3;5B1)OVERLAP_F_B")
            comms = comms or not action.is_compute_op
    return "compute_comms" if comms else "compute_only"


def csv_of_file(schedule_file) -> str | None:
    """The rows torch loads for a schedule read from a file (:class:`schedules.io.ScheduleFile`): a
    torch CSV's own rows as written (its ``#`` comment lines and blank lines left out, as pipetwin
    reads it); None for pipetwin's text form (torch loads the schedule's export)."""
    from cost_models.files import read_text
    if schedule_file is None or schedule_file.format != "torch-csv":
        return None
    text = read_text(schedule_file.path, "schedule file")
    return "\n".join(ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#"))


def _split_cells(line: str) -> list[str]:
    """The cells of one CSV row (an ``(a;b)OVERLAP_F_B`` cell holds no comma)."""
    import csv
    return next(csv.reader([line]), [])


def check_torch_run(config: RunConfig, schedule: Schedule | None = None) -> None:
    """Refuse, in one line, what torch's runtime would not train as pipetwin does (see the module
    docstring): the config's options, then (given) the run's lowered ``schedule``."""
    par = config.parallel
    given = [what for what, on in (
        (f"--tp {par.tp}", par.tp > 1), ("--sequence-parallel", par.sequence_parallel), (f"--cp {par.cp}", par.cp > 1),
        (f"--ep {par.ep}", par.ep > 1), (f"--etp {par.etp}", par.etp > 1),
        (f"--zero {par.zero}", par.zero > 1), (f"--recompute {par.recompute}", par.recompute != "none"),
        (f"--dtype {config.dtype}", config.dtype != "fp32"),
        (f"--model {config.model_name} (a model file)", config.is_model_file),
        (f"--inject-fault {config.fault}", config.fault is not None),
        (f"--model {config.model_name} (a mixture of experts: its balance loss is pipetwin's runtime's)",
         not config.is_model_file and config.spec().is_moe),
        ("--slowdown (pipetwin's runtime sleeps for it)", bool(config.job.faults.slowdown)),
        ("--overlap-fb", par.overlap_fb)) if on]
    if given:
        raise ValueError(f"torch.distributed.pipelining's runtime trains pipetwin's GPT or Llama stages in fp32, "
                         f"replicated whole; drop {', '.join(given)}")
    if schedule is None:
        return
    refusal = single_copy_refusal(schedule)
    if refusal is not None:
        raise ValueError(refusal)
    last = schedule.num_stages - 1
    order = [op.mb for prog in schedule.compute_programs() for op in prog if op.kind == F and op.stage == last]
    if order != sorted(order):
        k = next(i for i in range(1, len(order)) if order[i] < order[i - 1])
        raise ValueError(f"{schedule.name}: the last stage (stage {last}) runs forward {order[k]} after forward "
                         f"{order[k - 1]}; torch's runtime keeps the losses in the order they were computed and "
                         f"gives micro-batch m's backward the m-th, so run the last stage's forwards in micro-batch "
                         f"order")


def torch_job(config: RunConfig, csv: str | None = None, *, schedule: Schedule | None = None) -> TorchJob:
    """The checked :class:`TorchJob` of ``config``: ``csv`` the text torch loads (None: the export of
    the config's schedule, :func:`schedules.torch_interop.to_torch_text`; its format by
    :func:`csv_format`); ``schedule`` a schedule in place of the config's (as
    :func:`executor.launch.run` takes one), e.g. the one pipetwin read from that CSV."""
    check_torch_run(config)             # before the schedule and the model are built
    low = lowered_schedule(config, schedule)
    check_torch_run(config, low)
    text = (to_torch_text(low) if csv is None else csv).strip("\n") + "\n"
    return TorchJob(config, low, text, csv_format(text))


def run_torch(config: RunConfig, csv: str | None = None, **kw) -> RunResult | None:
    """Train ``config`` under torch's runtime from ``csv`` (:func:`torch_job`): rank 0's
    :class:`RunResult` (``engine`` = :data:`ENGINE`, no trace), None on other torchrun ranks."""
    return run_torch_many([torch_job(config, csv, **kw)])[0]


def run_torch_many(jobs: list[TorchJob]) -> list:
    """Several :class:`TorchJob` with one world size, one after the other on one set of ranks."""
    from .launch import LaunchError, check_host_memory, launch, under_torchrun
    from .worker import Job, RendezvousError, local_env
    worlds = {j.schedule.num_ranks for j in jobs}
    if len(worlds) != 1:
        raise ValueError(f"run_torch_many needs one world size for all jobs; got {sorted(worlds)}")
    world = worlds.pop()
    if not under_torchrun():
        jobs = [TorchJob(j.config.with_(device="cpu"), j.schedule, j.csv, j.format)
                if j.config.device == "auto" else j for j in jobs]
        check_host_memory([Job(j.config, j.schedule) for j in jobs], world)
        return launch("executor.torch_pipelining:run_torch_ranks", jobs, world)
    rank, started, local_rank, local_world = local_env()
    if started != world:
        raise ValueError(f"torchrun started {started} processes but the schedule's pipeline has {world} ranks")
    try:
        return run_torch_ranks(jobs, rank, world, local_rank, local_world) or [None] * len(jobs)
    except RendezvousError as e:
        raise LaunchError(str(e)) from None


# ------------------------------------------------------------------------------------- a rank
def run_torch_ranks(jobs: list[TorchJob], rank: int, world: int, local_rank: int, local_world: int) -> list | None:
    """Every rank's target: join the process group (:func:`executor.worker.init_world`), run each
    job, rank 0 returns the results."""
    from .worker import init_world
    devices = {j.config.device for j in jobs}
    if len(devices) != 1:
        raise ValueError(f"jobs of one launch must use one device kind; got {sorted(devices)}")
    ctx = init_world(devices.pop(), rank, world, local_rank, local_world, max(j.config.timeout for j in jobs))
    results = [_run_rank(job, rank, world, ctx) for job in jobs]
    dist.barrier()
    dist.destroy_process_group()
    return results if rank == 0 else None


def _stage(module, s: int, num_stages: int, spec, device, group):
    """A static-shape ``PipelineStage`` around pipetwin's stage module ``s``, its messages in ``group``."""
    from torch.distributed.pipelining import PipelineStage
    b, t, h = spec.micro_batch, spec.seq_len, spec.hidden
    x = (torch.zeros((b, t), dtype=torch.int64, device=device) if s == 0 else
         torch.zeros((b, t, h), device=device, requires_grad=True))
    y = torch.zeros((b, t, spec.vocab if s == num_stages - 1 else h), device=device, requires_grad=True)
    return PipelineStage(module, s, num_stages, device, input_args=x, output_args=y, group=group)


# a transport error that only says a peer went away: the peer's own error is the cause
_PEER_GONE = ("closed by peer", "reset by peer", "Connection closed", "Broken pipe")
PEER_GONE_DELAY = 1.0   # seconds such a rank waits before reporting, so that the cause is reported first


@contextlib.contextmanager
def _named_failure(rank: int, step: int):
    """An error inside torch's ``step()`` raised again as one line naming the rank, the step and
    the action torch was running (torch logs it: ``_PipelineScheduleRuntime caught exception at step
    %s when running action %s``); a rank whose peer went away reports after
    :data:`PEER_GONE_DELAY`, so the launcher names the peer's error first (gloo closes a pair on
    a receive's timeout)."""
    seen: list = []

    class Catch(logging.Handler):
        def emit(self, record):
            if not seen and "caught exception" in record.msg:
                seen.append(record.args)

    log = logging.getLogger("torch.distributed.pipelining.schedules")
    handler = Catch(logging.ERROR)
    log.addHandler(handler)
    try:
        yield
    except Exception as e:
        text = str(e).strip().splitlines()
        first = next((ln.strip() for ln in text if ln.strip()), type(e).__name__)
        if any(m in str(e) for m in _PEER_GONE):
            time.sleep(PEER_GONE_DELAY)
        where = f" at its action {seen[0][1]} (position {seen[0][0]} of the rank's lowered order)" if seen else ""
        raise RuntimeError(f"rank {rank} step {step}: torch's runtime failed{where}: {first}") from e
    finally:
        log.removeHandler(handler)


def _run_rank(job: TorchJob, rank: int, world: int, ctx) -> RunResult | None:
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    cfg, sched = job.config, job.schedule
    spec = cfg.spec()
    S, N, D, R, dev = sched.num_stages, sched.num_microbatches, sched.num_devices, sched.replicas, ctx.device
    replica, device = divmod(rank, D)
    mine = sorted(s for _, s in sched.stages_on(device))
    modules = {s: stage_module(spec, S, s, seed=cfg.seed, partition=cfg.blocks).to(dev) for s in mine}
    # each replica's pipeline in a group of its own (torch's runtime and its CSV see ranks 0..D-1), the
    # replicas of a device in another; their waits end after --timeout (the world's default group waits
    # as long as the rendezvous may: at least 30 s). Every rank creates every group, in one order.
    bound = datetime.timedelta(seconds=cfg.timeout)
    pipes = [dist.new_group(list(range(r * D, (r + 1) * D)), timeout=bound) for r in range(R)]
    across = [dist.new_group(list(range(d, D * R, D)), timeout=bound) for d in range(D)] if R > 1 else None
    runtime = _PipelineScheduleRuntime([_stage(modules[s], s, S, spec, dev, pipes[replica]) for s in mine], N,
                                       loss_fn=lm_loss, scale_grads=True)
    with tempfile.TemporaryDirectory(prefix="pipetwin-torch-") as tmp:    # _load_csv reads a file
        path = os.path.join(tmp, "schedule.csv")
        with open(path, "w") as f:
            f.write(job.csv)
        runtime._load_csv(path, format=job.format)
    params = [p for s in mine for p in modules[s].parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = make_optimizer(params, cfg.optimizer, cfg.lr)
    data = TokenSource(spec, cfg.seed, cfg.data)
    first, last = 0 in modules, S - 1 in modules
    loss_sums, times = [], []
    for step in range(cfg.steps):
        # replica r's micro-batch m is the step's global micro-batch r * N + m of G = R * N (executor.data)
        batches = [data.batch(step, replica * N + m, R * N) for m in range(N)] if first or last else []
        args = (torch.cat([x for x, _ in batches]).to(dev),) if first else ()
        kw = {"target": torch.cat([y for _, y in batches]).to(dev), "losses": []} if last else {}
        t0 = time.perf_counter()
        with _named_failure(rank, step):
            runtime.step(*args, return_outputs=False, **kw)
        if across is not None:      # the replicas' mean gradient: torch's step gave each replica's mean over N
            grads = [p.grad for p in params]
            flat = flatten(grads)
            dist.all_reduce(flat, group=across[device])
            unflatten_into(flat.div_(R), grads)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        ctx.synchronize()
        times.append(time.perf_counter() - t0)
        if last:     # summed as pipetwin's last stage sums them, in fp32
            total = 0.0
            for loss in kw["losses"]:
                total = total + loss.detach()
            loss_sums.append(float(total))
    report = {"rank": rank, "stages": mine, "loss_sums": loss_sums, "times": times,
              "params": {f"r{replica}.c0/{n}": p.detach().cpu().clone() for s in mine
                         for n, p in modules[s].named_parameters()} if cfg.collect_params else None}
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(report, gathered, dst=0)
    if rank != 0:
        return None
    losses = [sum(r["loss_sums"][k] for r in gathered if r["loss_sums"]) / (R * N) for k in range(cfg.steps)]
    per_device = [{"device": r["rank"], "stages": r["stages"]} for r in gathered]
    step_times = [max(r["times"][k] for r in gathered) for k in range(cfg.steps)]   # the slowest rank's
    params = {k: v for r in gathered for k, v in (r["params"] or {}).items()} if cfg.collect_params else None
    return RunResult(cfg, losses, step_times, per_device, float("nan"), ENGINE, params=params,
                     extra={"backend": ctx.backend, "torch_csv": job.csv, "torch_format": job.format})
