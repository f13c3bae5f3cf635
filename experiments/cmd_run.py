"""``pipetwin run``: train a GPT with a schedule on real processes (torch.distributed executor).

Spawns D x R ranks (CPU + gloo) or, under ``torchrun``, runs as one of its ranks (NCCL on
``cuda:LOCAL_RANK``; only rank 0 prints). ``--reference`` instead trains the same model on the
same batches in this one process; ``--check`` trains both, the run then the reference (on the device
the run trained on), and compares their losses step by step (:class:`executor.reference.LossCheck`:
within 1e-5 relative in fp32, 1e-3 in bf16): one line says they are equal (stdout; stderr with
``--json``, whose object has them under ``check``), or ``pipetwin: check failed:`` names the first
step beyond and its difference (stderr, exit status 1). ``--dtype bf16`` trains in bf16 mixed precision (autocast, fp32
master weights and optimizer state; :mod:`executor.precision`), ``--recompute selective|full``
recomputes activations in the backward (:mod:`executor.recompute`). Both print the same fields; ``--json`` prints
``losses`` (one per step), ``iteration_times`` (s) and ``per_device`` with
``peak_activation_bytes`` (and ``peak_activation_ma``, in units of Ma = ``ma_bytes``).
A rank that fails ends the run: exit status 1 with the failing rank's traceback, or with the
signal of a rank killed from outside. ``--inject-fault RANK:TOKEN[:STEP]`` makes a rank raise at
one op of its program (checked against the program first), to try that out.

``--plan PLAN.json`` runs a plan written by ``pipetwin plan --out`` instead of -s/-D/-N/--dp/--model:
uniform plans (R replicas of a D-stage pipeline) with the named schedule, non-uniform plans (stage s
on r_s devices) with the planner's model-copy schedule; the plan's layer partition and per-replica
micro-batch size apply, and ``--reference`` trains the same model on the same global batch.

Placement: under torchrun every process runs the pipeline rank that the plan's device map (or
``--device-map sequential|copies-same-node``, laid over torchrun's nodes x processes per node)
puts on its (node, local rank), not torchrun's rank (:func:`executor.launch.torchrun_placement`).
On spawned CPU ranks there is nothing to place: they are local processes.
"""
from __future__ import annotations

import math
import sys


from .common import check_all_replicas, print_json, write_chrome, write_csv
from .jobs import check_plan_args, job_from_args, layout_from_args
from .options import add_options, fields_of
from .tables import byte_unit, fmt_bytes, fmt_table, printable

NAME = "run"
HELP = "train a model with a schedule on torch.distributed (or --reference: in one process)"


def add_arguments(p):
    add_options(p, NAME)


def _common_options(args) -> dict:
    """The training options of a run (the RunConfig fields a job does not carry), read through the
    option table; --recv-lookahead 0 is None (all receives posted at the step's start)."""
    opts = fields_of(args, "RunConfig")
    opts["recv_lookahead"] = opts.get("recv_lookahead") or None
    return opts


def job_of_run(args):
    """The job a run's options describe: layout, model (default tiny), micro-batch, partition (the
    counts given, or ``time``: balanced by ``--profile``'s measured layer times), recompute,
    device map, eager all-reduce."""
    from cost_models import is_model_ref, load_model

    check_plan_args(args)
    model = args.model or "tiny"
    layout = layout_from_args(args)
    if not is_model_ref(model):     # a model file is checked (built) with the schedule: lowered_schedule
        spec = load_model(model)
        layout.check_size(one_replica=False, layers=spec.layers, model_name=spec.name)   # before anything is built
    return job_from_args(args, layout=layout, model=model, partition=run_partition(args, model, layout))


def config_from_args(args):
    from executor.config import RunConfig
    return RunConfig.from_job(job_of_run(args), **_common_options(args))


def run_partition(args, model: str, layout):
    """``--partition`` in layers per stage of a model copy (a GPT's embedding and head count as
    layers); ``time`` balanced by the measured layer times of ``--profile`` over the layout's stages."""
    from cost_models import load_profile
    from cost_models.bind import check_profile_model, profile_partition

    from .jobs import parse_partition
    choice = parse_partition(args.partition)
    if choice is None:
        if args.profile:
            raise ValueError("--profile is read for --partition time; give that too (or drop --profile)")
        return None
    if choice != "time":
        return choice
    if not args.profile:
        raise ValueError("--partition time balances measured layer times: give --profile FILE.yaml "
                         "(pipetwin calibrate --model ...)")
    prof = load_profile(args.profile)
    check_profile_model(prof, model)
    return profile_partition(prof, choice, layout.num_stages())


def plan_config_from_args(args):
    """``(config, lowered schedule, info)`` for ``--plan`` (:func:`experiments.plan_files.config_from_plan`):
    the options the plan fixes refused (:func:`experiments.jobs.check_plan_args`), but ``--device-map``,
    which only says which torchrun process runs which of the plan's ranks (the losses are the same),
    for a torchrun whose nodes are not the plan's cluster's."""
    from .plan_files import config_from_plan
    plan = check_plan_args(args, applied=("device_map",))
    options = _common_options(args)
    if args.device_map is not None:
        options["device_map"] = args.device_map
    return config_from_plan(plan, eager=not args.no_eager, **options)


def main(args) -> int:
    from executor.faults import FaultError

    try:
        return _main(args)
    except FaultError as e:
        raise ValueError(f"--inject-fault {args.inject_fault}: {e}") from None


def _main(args) -> int:
    from executor.config import lowered_schedule
    from executor.launch import LaunchError, check_launch_env, run
    from executor.reference import run_reference

    check_launch_env()      # leftover RANK / WORLD_SIZE / MASTER_*: refused before any work
    check_all_replicas(args, args.plot)
    sched, info = None, None
    if args.reference and args.inject_fault:
        raise ValueError("--inject-fault makes a rank of the pipeline raise; --reference runs no ranks (drop one)")
    if args.reference and args.check:
        raise ValueError("--check trains the reference beside the run; --reference trains only the reference "
                         "(drop one)")
    if args.runtime == "torch":
        _check_torch_args(args)
    if args.plan:
        cfg, sched, info = plan_config_from_args(args)
        if args.runtime == "torch":     # refused before the plan is announced
            from executor.torch_pipelining import check_torch_run
            check_torch_run(cfg, sched)
        _announce_plan(cfg, sched, info, args)
    else:
        cfg = config_from_args(args)
    if args.runtime == "torch":
        return _main_torch(args, cfg, sched, info)
    if args.reference:
        lowered_schedule(cfg, sched)  # same checks as an executor run
        result = run_reference(cfg)
    else:
        try:
            result = run(cfg, sched)
        except LaunchError as e:
            print(f"pipetwin: run failed: {e}", file=sys.stderr)
            return 1
    if result is None:  # a torchrun rank other than 0
        return 0
    bad = next((i for i, x in enumerate(result.losses) if not math.isfinite(x)), None)
    if bad is not None:     # a trained model whose loss is NaN or infinite is no result
        print(f"pipetwin: run failed: the loss is {result.losses[bad]} at step {bad} (model "
              f"{result.config.model_name}); lower --lr or check the model's loss", file=sys.stderr)
        return 1
    check = None
    if args.check:      # the reference beside the run (this process: rank 0 under torchrun)
        from executor.reference import LossCheck
        on_gpu = result.trace is not None and result.trace.attrs.get("backend") == "nccl"
        ref = run_reference(cfg.with_(device="cuda") if on_gpu else cfg)    # the same kernels as the run's
        check = LossCheck(tuple(result.losses), tuple(ref.losses), cfg.dtype)
        result.extra["check"] = check.to_dict()
    if info is not None:
        result.extra["plan"] = {"file": str(args.plan), **info}
    if cfg.layout.schedule_file is not None:
        result.extra["schedule_file"] = cfg.layout.schedule_file.describe()
    if cfg.job.faults.slowdown:     # --slowdown, or a mixed --cluster's slower pools (executor.config)
        result.extra["slowdown"] = {str(r): k for r, k in cfg.job.faults.slowdown}
    if cfg.emulation is not None:
        result.extra["emulation"] = cfg.emulation.line()
    _write_outputs(result, args)
    if args.json:
        print_json(result.to_dict())
    else:
        _print_human(result, args)
        if cfg.emulation is not None:
            print(cfg.emulation.line())
        if cfg.job.faults.slowdown:
            print("slowed (F, B and W sleep (k - 1) x their measured time): " +
                  ", ".join(f"rank {r} x{k:.3f}" for r, k in cfg.job.faults.slowdown))
    if check is not None and not check.equal:
        print(f"pipetwin: check failed: {check.line()}", file=sys.stderr)
        return 1
    if check is not None:
        print(check.line(), file=sys.stderr if args.json else sys.stdout)
    return 0


def _check_torch_args(args) -> None:
    """What ``--runtime torch`` cannot take from the command line (the job's own limits are
    :func:`executor.torch_pipelining.check_torch_run`'s)."""
    from executor.launch import under_torchrun
    if args.reference:
        raise ValueError("--runtime torch trains under torch.distributed.pipelining beside pipetwin's executor; "
                         "--reference trains in one process instead (drop one)")
    if under_torchrun():
        raise ValueError("--runtime torch trains two worlds one after the other (torch's runtime, then pipetwin's "
                         "executor), which one torchrun process cannot join; run it on spawned ranks (without "
                         "torchrun)")


def _main_torch(args, cfg, sched, info) -> int:
    """``--runtime torch``: torch's runtime trains from the schedule's torch CSV, then pipetwin's executor the
    same job (and with --check the reference); the losses side by side, checked."""
    from executor.launch import LaunchError, run
    from executor.reference import LossCheck, run_reference
    from executor.torch_pipelining import csv_of_file, run_torch_many, torch_job

    file = cfg.layout.schedule_file
    job = torch_job(cfg, csv_of_file(file), schedule=sched)
    try:
        theirs = run_torch_many([job])[0]
        ours = run(cfg, sched)
    except LaunchError as e:
        print(f"pipetwin: run failed: {e}", file=sys.stderr)
        return 1
    ref = run_reference(cfg) if args.check else None
    against = LossCheck(tuple(theirs.losses), tuple(ours.losses), cfg.dtype, against="pipetwin's executor's")
    checks = [against] + ([LossCheck(tuple(theirs.losses), tuple(ref.losses), cfg.dtype)] if ref else [])
    source = (f"{file.path} as written" if file is not None and file.format == "torch-csv" else
              f"the export of {job.schedule.name}")
    form = ("compute-only, lowered by torch's _load_csv" if job.format == "compute_only" else
            "with its communication, as written")
    ours.extra["torch"] = {"engine": theirs.engine, "losses": theirs.losses,
                           "iteration_times": theirs.iteration_times, "csv": job.csv, "csv_source": source,
                           "format": job.format, "check": against.to_dict(),
                           **({"reference_check": checks[1].to_dict()} if ref else {})}
    if info is not None:
        ours.extra["plan"] = {"file": str(args.plan), **info}
    _write_outputs(ours, args)
    out = sys.stderr if args.json else sys.stdout
    if args.json:
        print_json(ours.to_dict())
    else:
        lay = cfg.layout
        print(f"{theirs.engine} beside pipetwin's executor, {lay.label}: D={lay.devices} N={lay.microbatches} "
              f"R={lay.replicas}  model {printable(cfg.model_name)}  {cfg.optimizer} lr={cfg.lr:g}  "
              f"({theirs.extra['backend']})")
        print(f"torch CSV: {printable(source)} ({form})")
        if lay.replicas > 1:
            print(f"replicas: {lay.replicas} pipelines under torch's runtime, their gradients averaged before the "
                  f"optimizer" + ("; ZeRO-1 shards the optimizer state in pipetwin's run only (the same update)"
                                  if cfg.parallel.zero else ""))
        rows = [{"step": k, "loss_torch": a, "loss_pipetwin": b, "difference": d, "torch_s": ta, "pipetwin_s": tb}
                for k, (a, b, d, ta, tb) in enumerate(zip(theirs.losses, ours.losses, against.differences,
                                                           theirs.iteration_times, ours.iteration_times))]
        cols = ["step", "loss_torch", "loss_pipetwin", "difference", "torch_s", "pipetwin_s"]
        fmt = {"loss_torch": "{:.6f}", "loss_pipetwin": "{:.6f}", "difference": "{:.1e}", "torch_s": "{:.4f}",
               "pipetwin_s": "{:.4f}"}
        if ref is not None:
            for row, loss in zip(rows, ref.losses):
                row["loss_reference"] = loss
            cols.insert(3, "loss_reference")
            fmt["loss_reference"] = "{:.6f}"
        print(fmt_table(rows, cols, fmt))
    failed = next((c for c in checks if not c.equal), None)
    if failed is not None:
        print(f"pipetwin: check failed: torch.distributed.pipelining's {failed.line()}", file=sys.stderr)
        return 1
    for c in checks:
        print(f"torch.distributed.pipelining's {c.line()}", file=out)
    return 0


def _announce_plan(cfg, sched, info, args) -> None:
    """What a --plan run runs (stdout; stderr with --json) and the device-map note (rank 0 only)."""
    import os

    from executor.launch import under_torchrun
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if (under_torchrun() and not args.reference and isinstance(cfg.device_map, tuple)
            and per_node != info["devices_per_node"]):
        raise ValueError(f"the plan's cluster has {info['devices_per_node']} devices per node but torchrun "
                         f"runs {per_node} processes per node; launch --nproc-per-node "
                         f"{info['devices_per_node']} (or pass --device-map)")
    if under_torchrun() and int(os.environ.get("RANK", "0")) != 0:
        return
    out = sys.stderr if args.json else sys.stdout
    what = "reference (one process) for" if args.reference else f"{sched.num_ranks * cfg.parallel.tp} processes:"
    print(f"plan {printable(args.plan)}: {info['plan']}", file=out)
    split = ("the default split of the blocks" if cfg.blocks is None else
             f"layers per stage {list(cfg.blocks)}" if cfg.is_model_file else
             f"blocks per stage {list(cfg.blocks)} (layers {info['partition_layers']} with embedding and head)")
    print(f"running {what} {info['layout']}; global batch {info['global_batch']} = {cfg.global_microbatches} "
          f"micro-batches of {cfg.samples_per_microbatch}; {split}; schedule {sched.name}", file=out)
    if args.reference:
        return
    dmap = info["device_map"]
    if isinstance(dmap, str):       # a whole-layout plan: placed by a mapping's rule (Megatron's at T > 1)
        print(f"placement: --device-map {dmap}", file=out)
        return
    pairs = ", ".join(f"{r}->{d}" for r, d in enumerate(dmap))
    if under_torchrun():
        print(f"placement: rank -> device {pairs} (device = node * {info['devices_per_node']} + local rank)"
              if isinstance(cfg.device_map, tuple) else f"placement: --device-map {cfg.device_map}", file=out)
    elif cfg.device == "cuda":
        print(f"note: spawned ranks run on cuda:rank of this machine; the plan's device map (rank -> device "
              f"{pairs}) is not applied", file=out)
    else:
        print(f"note: the plan's device map (rank -> device {pairs}) is ignored on the CPU: the ranks are "
              f"local processes", file=out)


def _write_outputs(result, args) -> None:
    trace = result.trace
    wanted = [(args.trace, "--trace"), (args.chrome_trace, "--chrome-trace"), (args.plot, "--plot")]
    if trace is None:
        for path, flag in wanted:
            if path:
                raise ValueError(f"{flag} needs an executor run (the reference records no trace)")
        return
    if args.trace:
        write_csv(trace, args.trace, "trace")
    if args.chrome_trace:
        write_chrome(trace, args.chrome_trace)
    if args.plot:
        from .plots import plot_timeline
        plot_timeline(trace, args.plot, all_replicas=args.all_replicas)


def _print_human(result, args) -> None:
    c = result.config
    where = result.trace.attrs.get("backend", "") if result.trace is not None else "one process"
    lay, par = c.layout, c.parallel
    tp = f"T={par.tp}{' (sequence parallel)' if par.sequence_parallel else ''} " \
        if par.tp > 1 and result.engine == "executor" else ""
    if par.cp > 1 and result.engine == "executor":
        tp += f"C={par.cp} ({par.cp_comm}) "
    print(f"{result.engine} {lay.label}: {tp}D={lay.devices} N={lay.microbatches} R={lay.replicas}  "
          f"model {printable(c.model_name)}  {c.optimizer} lr={c.lr:g}  ({where})")
    if c.layout.schedule_file is not None:
        print(f"  schedule file {printable(c.layout.schedule_file.describe())}")
    if not c.is_model_file and result.engine == "executor":
        spec = c.spec()
        if spec.has_dropout or spec.attention_kind == "eager":
            print("note: trained without dropout, with fused attention (the spec's dropout and eager attention "
                  "are simulated only)")
    steps = [{"step": i, "loss": l, "iteration_s": t}
             for i, (l, t) in enumerate(zip(result.losses, result.iteration_times))]
    print(fmt_table(steps, ["step", "loss", "iteration_s"], {"loss": "{:.6f}", "iteration_s": "{:.4f}"}))
    what = "samples" if c.is_model_file else "sequences"
    print(f"throughput {result.throughput:.1f} {what}/s (steps after the first); Ma = {fmt_bytes(result.ma_bytes)} "
          f"(one micro-batch's activations over the whole model / D)")
    unit, div = byte_unit([d["peak_activation_bytes"] for d in result.per_device])
    act = f"peak_activation_{unit}"
    rows = [{**d, act: d["peak_activation_bytes"] / div} for d in result.per_device]
    cols = ["device", act, "peak_activation_ma"]
    fmts = {act: "{:.4g}", "peak_activation_ma": "{:.2f}", "busy_s": "{:.4f}", "bubble_ratio": "{:.3f}"}
    if par.zero and result.engine == "executor":     # the sharded state per rank (executor.zero)
        for key, col in (("static_bytes", "state"), ("gathered_bytes", "gathered")):
            if key == "static_bytes" or par.zero == 3:
                name = f"{col}_{unit}"
                rows = [{**r, name: r[key] / div} for r in rows]
                cols.append(name)
                fmts[name] = "{:.4g}"
    if result.trace is not None:
        cols += ["busy_s", "bubble_ratio"]
    print(fmt_table(rows, cols, fmts))
    if par.zero and result.engine == "executor":
        first = result.extra["zero_collectives"][0]
        counts = {k.replace("_", "-"): first[k] / c.steps for k in ("all_gather", "reduce_scatter", "all_reduce")
                  if first.get(k)}
        per = ", ".join(f"{n:g} {k}{'s' if n != 1 else ''}" for k, n in counts.items())
        over = f"{par.dp_shard} of {lay.replicas} replicas (HSDP)" if par.dp_shard else f"{lay.replicas} replicas"
        if par.cp > 1:      # the C processes of a replica hold the same weights and shard them too
            over += f" x C={par.cp}"
        mode = ", resharded after forward" if par.reshard_after_forward else ""
        print(f"ZeRO-{par.zero} over {over}{mode}; rank 0 per step: {per}")
        print(f"(state: weights, gradients and optimizer state at rest"
              f"{'; gathered: the weights gathered at the peak' if par.zero == 3 else ''})")
    for what, path in (("trace", args.trace), ("chrome trace", args.chrome_trace), ("figure", args.plot)):
        if path:
            print(f"wrote {what}: {printable(path)}")
