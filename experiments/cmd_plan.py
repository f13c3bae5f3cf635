"""``pipetwin plan``: the fastest layout of a model on a cluster. Two searches (:func:`search_of`):
the whole-layout search (:mod:`experiments.plan_layout`; the default for transformers) and, with
``--search dapple`` (the default for layer profiles and the DAPPLE paper's models), the DAPPLE
planner: the fastest data x pipeline plan that fits, and its baselines. The rest of this note is
the DAPPLE search's.

Searches stages, partition, per-stage replicas, placement (fresh-first / append-first /
scatter-first) and micro-batch count exactly under DAPPLE's latency model, re-simulates the best
candidates with the SimPy engine and prints the best plan, its simulated iteration time and memory,
and the simulated times of the PipeDream planner's plan and of pure data parallelism. ``--out``
writes a plan file for ``pipetwin simulate --plan`` / ``pipetwin run --plan``; ``--json`` prints
one object (the plan file's content plus ``baselines`` and ``search``).

``--profile FILE`` (``pipetwin calibrate``) plans with measured per-layer costs instead of the
formulas: the only way to plan a model file ``--model PATH.py:FUNC``. Without ``--cluster`` the plan
is for this machine as calibrated (``--gpus`` CPU ranks, default the profile's), with one it is
for that cluster, the measured times scaled onto its devices (:func:`cost_models.scaled_layer_costs`).
"""
from __future__ import annotations

import sys

from cost_models._spec import size_bytes

from .common import parse_schedules, print_json, stated_lines
from .jobs import cluster_from_args
from .options import AUTO_VALUE, add_options, auto_values
from .plan_layout import DAPPLE_ONLY, DEFAULT_POLICIES, LAYOUT_ONLY, given
from .tables import byte_unit, fmt_bytes, fmt_table, printable, wrap_cell

NAME = "plan"
HELP = ("find the fastest layout for a model on a cluster: the whole layout (T x D x R, schedule, micro-batch, "
        "recompute, ZeRO, SP), or --search dapple: DAPPLE's data x pipeline planner")

def add_arguments(p):
    add_options(p, NAME)


def search_of(args) -> str:
    """Which search the options ask for: ``--search``, else the DAPPLE search where it is the only
    one that applies (a layer profile FILE.txt, a DAPPLE paper model, a BERT, a model file, a
    ``--profile``) or an option only it takes is given (and none only the whole-layout search
    takes), else the whole-layout search."""
    from cost_models import is_model_ref, load_model
    from cost_models.model_spec import ModelSpec
    from cost_models.workloads.paper_models import PAPER_MODELS
    from cost_models.workloads.workload import is_profile_path
    if args.search is not None:
        return args.search
    o = vars(args)
    layout = [f for f, d in LAYOUT_ONLY if given(args, d)]
    dapple = [f for f, d in DAPPLE_ONLY if o.get(d)] + (["--policies"] if args.policies != DEFAULT_POLICIES else [])
    if layout and dapple:
        budget = "; the GPU budget is --gpus N, -D the pipeline's D" if "--devices" in layout else ""
        verb = "belongs" if len(layout) == 1 else "belong"
        raise ValueError(f"{', '.join(layout)} {verb} to the whole-layout search and {', '.join(dapple)} to the "
                         f"DAPPLE planner (T=1): drop one or the other, or give --search{budget}")
    if layout:
        return "layout"
    if dapple:
        return "dapple"
    m = args.model
    if isinstance(m, ModelSpec):        # --from-megatron's model
        return "layout" if m.kind != "bert" else "dapple"
    if m is None or is_profile_path(m) or m in PAPER_MODELS or is_model_ref(m):
        return "dapple"
    return "layout" if load_model(m).kind != "bert" else "dapple"


def emit(args, job) -> None:
    """``--emit TARGET``: the plan's job as ``pipetwin export --to TARGET`` writes it (standard output;
    torchtitan's schedule CSV beside ``--out``, the plan file)."""
    from cost_models.frameworks import export_job

    from .cmd_export import write_export
    ex = export_job(job, args.emit, args.out)
    print(f"{args.emit} arguments of the plan:" if args.emit != "torch-csv" else "the plan's schedule as "
          "torch.distributed.pipelining CSV:")
    write_export(type(ex)(ex.text, ex.files, ex.notes), None, args.emit)
    for path in ex.files:
        print(f"wrote {printable(path)}: the schedule as torch.distributed.pipelining CSV")


def _model_name(args) -> str | None:
    """``--model`` as printed: its name, or the name of an imported spec (--from-megatron)."""
    return getattr(args.model, "name", args.model)


def _parse_limit(text):
    if text is None:
        return None
    return size_bytes(text.strip(), "--memory-limit", "memory-limit")


def check_limit(limit: float | None, device, force: bool) -> None:
    """A ``--memory-limit`` above the memory of the cluster's ``device`` (a DeviceSpec) is refused
    without ``force``: a plan that fits it would not fit the device."""
    have = device.memory_bytes
    if limit is not None and have and limit > have and not force:
        raise ValueError(f"--memory-limit {fmt_bytes(limit)} is above the {device.name}'s {fmt_bytes(have)} of "
                         f"memory: a plan within it would not fit the device (lower it, or pass --force)")


def main(args) -> int:
    from planner import SearchSpace, plan_record, plan_training, save_plan

    if (args.global_batch is None) == (args.global_tokens is None):
        from planner.choose import batch_in_sequences
        batch_in_sequences(args.global_batch, args.global_tokens, None)     # refuses: neither, or both
    if args.top < 1:
        raise ValueError(f"--top must be >= 1; got {args.top}")
    search = search_of(args)
    if args.emit is not None and args.json:
        raise ValueError("--emit prints the plan's job after the plan's text; with --json write the plan (--out "
                         "PLAN.json) and run 'pipetwin export --to TARGET --plan PLAN.json'")
    if args.emit is not None and search != "layout":
        raise ValueError("--emit writes a whole-layout plan's job (T x D x R, schedule); the DAPPLE search's stage "
                         "replicas run in pipetwin only (drop --search dapple)")
    if args.emit is not None and args.schedules is None:     # search only what the target runs
        from cost_models.frameworks import runs_on
        from planner.layout import EXCLUDED_BY_DEFAULT
        args.schedules = ",".join(n for n in runs_on(args.emit) if n not in EXCLUDED_BY_DEFAULT)
    if args.cluster is not None and not args.profile:
        mixed = cluster_from_args(args).load()
        if mixed.is_mixed and args.search != "layout":   # pools of several devices: DAPPLE's, type-aware
            from .plan_mixed import main_mixed
            return main_mixed(args, mixed, _parse_limit(args.memory_limit), _model_name(args),
                              lambda: _sequences(args, args.model))
    if args.type_blind:
        raise ValueError("--type-blind compares plans on a mixed cluster (pools of several devices); "
                         + (f"cluster {args.cluster} has one kind" if args.cluster else "give one with --cluster"))
    if search == "layout":
        from .plan_layout import main_layout
        code = main_layout(args, _parse_limit(args.memory_limit), check_limit)
        if args.emit is not None:
            emit(args, args._best_job)
        return code
    for flag, dest in LAYOUT_ONLY:
        if given(args, dest):
            if dest == "devices":
                raise ValueError("--devices is the pipeline's devices D, searched by the whole-layout search; the "
                                 "DAPPLE search picks its stages itself: give its GPU budget as --gpus N (and at most "
                                 "S stages as --max-stages S)")
            raise ValueError(f"{flag} applies to the whole-layout search; drop --search dapple (or give a gpt/llama "
                             f"model)")
    if args.recompute is not None and args.recompute != AUTO_VALUE and len(args.recompute) > 1:
        raise ValueError(f"--recompute: the DAPPLE search plans one recomputation; got "
                         f"{','.join(args.recompute)} (search several with the whole-layout search)")
    args.recompute = (auto_values(args.recompute) or ("none",))[0]
    args.schedules = args.schedules or "dapple"
    scheds = parse_schedules(args.schedules)
    model, cost_model = args.model, None
    if args.profile:
        cluster, model = _calibrated_model(args)
    elif args.model is None or args.cluster is None:
        raise ValueError("give --model and --cluster (or --profile FILE.yaml, which brings the model and, without "
                         "--cluster, this machine)")
    else:
        cluster = cluster_from_args(args).load()
        cost_model = args.cost_model      # None: plan_training's default, every command's
    args.global_batch = _sequences(args, model)
    limit = _parse_limit(args.memory_limit)
    check_limit(limit, cluster.device, args.force)
    space = SearchSpace(policies=tuple(x.strip() for x in args.policies.split(",") if x.strip()),
                        max_stages=args.max_stages, uniform=args.uniform, devices=args.gpus)
    res = plan_training(model, cluster, args.global_batch, memory_limit=limit, recompute=args.recompute,
                        schedules=scheds, top_k=args.top, simulate=not args.no_simulate,
                        baselines=not args.no_baselines, progress=not args.no_progress and sys.stderr.isatty(),
                        space=space, model_name=_model_name(args) or getattr(model, "name", None),
                        cost_model=cost_model,
                        profile_batch=args.profile_batch)
    best = res.best
    rec = plan_record(best.plan, res.workload, cluster, limit, best.estimate, best.sim)
    if args.out:
        save_plan(args.out, best.plan, res.workload, cluster, limit, best.estimate, best.sim)
    base = {}
    for key, ev in (("dapple", best), ("pipedream", res.pipedream), ("data_parallel", res.data_parallel)):
        if ev is not None:
            base[key] = ev.to_dict()
            base[key]["speedup_of_dapple"] = ev.time / best.time
        elif key in res.baseline_notes:
            base[key] = {"note": res.baseline_notes[key]}
    s = res.search
    stats = {"seconds": s.seconds, "stage_placements_evaluated": s.evaluated, "complete_plans": s.complete,
             "partial_plans_kept": s.labels, "configurations": s.configurations,
             "baseline_seconds": res.baseline_seconds,
             "candidates": [c.to_dict() for c in res.candidates]}
    said = dapple_stated(res.workload, cluster, None if args.profile else _model_name(args))
    if args.json:
        print_json({**rec, **said, "baselines": base, "search": stats})
        return 0
    _print_human(res, rec, base, stats, args, said)
    return 0


def _sequences(args, model) -> int:
    """The global batch in sequences (-G, or --global-tokens at the model's sequence length; a layer
    profile or paper model has none): :func:`planner.choose.batch_in_sequences`."""
    from cost_models import is_model_ref
    from cost_models.workloads.workload_sources import workload_spec
    from planner.choose import batch_in_sequences
    spec = None if isinstance(model, str) and is_model_ref(model) else workload_spec(model)
    return batch_in_sequences(args.global_batch, args.global_tokens, getattr(spec, "seq_len", None))


def dapple_stated(work, cluster, model_ref) -> dict:
    """What the DAPPLE search's numbers assume (:func:`cost_models.bind.stated_fields`): a transformer's
    sequence, precision, cost model and Hugging Face approximations; any workload's device provenance."""
    if work.spec is None:       # a layer profile, a paper model, measured costs: no formulas' assumptions
        return {"device_fitted": cluster.device.provenance()}
    from cost_models.bind import stated_fields
    from cost_models.transformer import TransformerCostModel
    return stated_fields(work.spec, cluster.device, work.cost_model,
                         TransformerCostModel(work.spec, cluster.device).resolved_precision(), model_ref)


def _layers_held(plan, work) -> list[str]:
    """Per plan stage, the layers its devices hold: its own range, or for a split plan the ranges
    of the schedule's stages placed on it (``3-4, 7-8`` for zb-v's V)."""
    def rng(a, b):
        return f"{a}-{b - 1} ({work.layer_names[a]}..{work.layer_names[b - 1]})"
    if not plan.split:
        return [rng(st.start, st.stop) for st in plan.stages]
    from schedules import build
    sched = build(plan.schedule, plan.num_stages, plan.microbatches, chunks=plan.chunks)
    edges = [sum(plan.split[:t]) for t in range(len(plan.split) + 1)]
    out = []
    for s in range(plan.num_stages):
        mine = sorted({t for row in sched.placement for t, d in enumerate(row) if d == s})
        out.append(", ".join(f"{edges[t]}-{edges[t + 1] - 1}" for t in mine))
    return out


def run_command(rec: dict, work, model: str | None, recompute: str = "none") -> tuple[str | None, str]:
    """The ``pipetwin run`` command line that trains a uniform plan record ``rec`` as planned (its
    schedule, layout, per-replica micro-batch and the split the simulator uses), or (None, why not)."""
    import inspect
    import shlex
    from schedules.registry import get
    run = rec["run"]
    if run is None:
        return None, "a non-uniform plan runs with --plan FILE"
    spec = work.spec
    if not work.source.get("stack") and (spec is None or spec.kind != "gpt"):
        kind = "a layer-cost model" if spec is None else f"of kind {spec.kind!r}"
        return None, (f"{work.name} is {kind}; the executor trains GPT decoders and model files (simulate the plan "
                      f"with 'pipetwin simulate --plan FILE')")
    name = work.name if work.source.get("stack") else (model or work.source.get("name") or work.name)
    chunks = f" --chunks {run['chunks']}" if "chunks" in inspect.signature(get(run["schedule"]).build).parameters \
        else ""
    rc = f" --recompute {recompute}" if recompute != "none" else ""
    return (f"pipetwin run --model {shlex.quote(str(name))} --schedule {run['schedule']} --devices {run['devices']} "
            f"--microbatches {run['microbatches']} --dp {run['dp']}{chunks} --micro-batch {run['micro_batch']} "
            f"--partition {','.join(map(str, run['partition']))}{rc}"), ""


def _calibrated_model(args):
    """(cluster, workload) of ``--profile``: this machine as calibrated, or scaled onto ``--cluster``."""
    from cost_models import load_profile
    from cost_models.workloads.paper_models import calibrated_workload

    from cost_models.bind import check_profile_model
    if args.cost_model is not None or args.profile_batch is not None:
        raise ValueError("--profile brings measured costs; drop --cost-model / --profile-batch")
    if args.recompute != "none":
        raise ValueError("--recompute is not modelled with a calibration profile; use none")
    prof = load_profile(args.profile)
    check_profile_model(prof, args.model)
    if args.cluster is None:
        n = args.gpus or int(prof.meta.get("ranks", 2))
        return prof.cluster(n), calibrated_workload(prof)
    cluster = cluster_from_args(args).load()
    return cluster, calibrated_workload(prof, cluster.device)


def _say(text: str, width: int = 120) -> None:
    """A line of prose, wrapped to ``width`` columns (continuation lines indented)."""
    import textwrap
    text = printable(text)
    lead = len(text) - len(text.lstrip())
    print(textwrap.fill(text, width, initial_indent="", subsequent_indent=" " * (lead + 4),
                        break_long_words=False, break_on_hyphens=False, drop_whitespace=True)
          if len(text) > width else text)


def _print_human(res, rec, base, stats, args, said: dict) -> None:
    best, cl, work = res.best, res.cluster, res.workload
    plan, est = best.plan, best.estimate
    costs = f"measured costs from {args.profile}" if args.profile else f"{work.cost_model} cost model"
    _say(f"DAPPLE plan for {_model_name(args) or work.name} on {cl.name} ({cl.num_devices} x {cl.device.name}), global "
         f"batch {plan.global_batch}, {costs}")
    print("\n".join(stated_lines(said)))
    print(f"  {plan.describe()}")
    per = "" if not plan.uniform else f" ({plan.micro_batch // plan.dp} per pipeline replica)"
    print(f"  {plan.microbatches} micro-batches of {plan.micro_batch} samples{per}; devices in use "
          f"{plan.devices_used} of {cl.num_devices}")
    dpn = cl.devices_per_node
    unit, div = byte_unit([se.memory for se in est.stages])
    mem = f"memory_{unit}"
    rows, held = [], _layers_held(plan, work)
    for s, (st, se) in enumerate(zip(plan.stages, est.stages)):
        nodes = sorted({d // dpn for d in st.devices})
        rows.append({"stage": s, "layers": held[s], "replicas": st.replicas,
                     "nodes": ",".join(map(str, nodes)), "fwd_ms": se.f * 1e3, "bwd_ms": se.b * 1e3,
                     "allreduce_ms": se.allreduce * 1e3, mem: se.memory / div})
    # a split plan's stages hold the schedule's stages (zb-v: two per device): DAPPLE's per-stage
    # estimate is of the plan's own partition, so its columns are left out
    cols = ["stage", "layers", "replicas", "nodes"] + ([] if plan.split else ["fwd_ms", "bwd_ms", "allreduce_ms", mem])
    print(fmt_table(rows, cols, {"fwd_ms": "{:.2f}", "bwd_ms": "{:.2f}", "allreduce_ms": "{:.2f}", mem: "{:.3g}"}))
    _say(f"  analytical: L = {est.latency:.4g} s = warm-up {est.warmup:.4g} + steady {est.steady:.4g} + "
          f"ending {est.ending:.4g} (pivot {est.pivot}); with 1F1B round trips {est.latency_rt:.4g} s"
          + ("" if plan.schedule == "dapple" else f"  [the model is DAPPLE's 1F1B; {plan.schedule} is simulated]"))
    cap = res.capacity
    if best.sim is not None:
        sm = best.sim
        _say(f"  simulated: iteration {sm.iteration_time:.4g} s "
              f"({plan.global_batch / sm.iteration_time:.1f} samples/s), "
              f"bubble {sm.bubble_ratio:.3f}, peak memory {fmt_bytes(sm.peak_memory)}"
              + (f" of {fmt_bytes(cap)}" + (" usable" if args.memory_limit is None else "") if cap else ""))
    rows = []
    for key, label in (("dapple", "DAPPLE planner"), ("pipedream", "PipeDream planner"),
                       ("data_parallel", "data parallel")):
        b = base.get(key)
        if b is None:
            continue
        if "iteration_time" not in b:
            rows.append({"plan": label, "detail": b.get("note", "")})
            continue
        rows.append({"plan": label, "iteration_s": b["iteration_time"],
                     "dapple_speedup": b["speedup_of_dapple"], "detail": b["plan"]})
    if rows:
        kind = "simulated" if best.sim is not None else "analytical"
        print(f"baselines ({kind} iteration times; each plan below the table):")
        print(fmt_table(rows, ["plan", "iteration_s", "dapple_speedup"],
                        {"iteration_s": "{:.4g}", "dapple_speedup": "{:.2f}x"}))
        for r in rows:   # the details run to hundreds of characters: wrapped under the table
            lines = wrap_cell(r["detail"], 116 - len(r["plan"]))
            print(f"  {r['plan']}: {lines[0]}")
            for line in lines[1:]:
                print(" " * (len(r["plan"]) + 4) + line)
    _say(f"search: {stats['seconds']:.2f} s, {stats['stage_placements_evaluated']:,} stage placements evaluated, "
          f"{stats['complete_plans']:,} complete plans, {stats['configurations']} (micro-batch count, policy) "
          f"configurations; {len(stats['candidates'])} candidates re-simulated; baselines "
          f"{stats['baseline_seconds']:.2f} s")
    cmd, why = run_command(rec, work, _model_name(args), args.recompute)
    if not isinstance(args.model, (str, type(None))):       # an imported spec: no name 'pipetwin run' reads
        cmd, why = None, "the model is the --from-megatron file's: run the plan with 'pipetwin run --plan FILE'"
    if cmd is not None:     # runs as printed: lines continued with a backslash, as a shell reads them
        print("executor (or pipetwin run --plan FILE):")
        print("  " + " \\\n    ".join(wrap_cell(printable(cmd), 110)))
    elif rec["run"] is None:
        _say("executor: a non-uniform plan (stage replicas " + ":".join(map(str, plan.replicas))
              + "): run it with 'pipetwin run --plan FILE' (sub-batches as model copies)")
    else:
        _say(f"executor: {why}")
    if args.out:
        print(f"wrote plan file: {printable(args.out)}")
