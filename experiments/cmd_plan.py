"""``pipetwin plan``: the DAPPLE planner: the fastest data x pipeline plan that fits, and its baselines.

Searches stages, partition, per-stage replicas, placement (fresh-first / append-first /
scatter-first) and micro-batch count exactly under DAPPLE's latency model, re-simulates the best
candidates with the SimPy engine and prints the best plan, its simulated iteration time and memory,
and the simulated times of the PipeDream planner's plan and of pure data parallelism. ``--out``
writes a plan file for ``pipetwin simulate --plan`` / ``pipetwin run --plan``; ``--json`` prints
one object (the plan file's content plus ``baselines`` and ``search``).
"""
from __future__ import annotations

import sys

from cost_models._spec import size_bytes

from .common import parse_schedules, print_json
from .costs import add_cluster_shape_args, load_shaped_cluster
from .tables import fmt_table

NAME = "plan"
HELP = "find the fastest data x pipeline plan for a model on a cluster (DAPPLE planner)"


def add_arguments(p):
    p.add_argument("--model", "-m", required=True,
                   help="model: a cost_models preset (gpt-96, bert-48, ...), a YAML file, or a DAPPLE paper model "
                        "(vgg-19, gnmt-16, amoebanet-36, xlnet-36)")
    p.add_argument("--cluster", "-c", required=True,
                   help="cluster preset or YAML file, optionally sized NAME:NODES (also v100-4x8-25gbe, a100-8x8-ib)")
    add_cluster_shape_args(p)
    p.add_argument("--global-batch", "-G", type=int, required=True, help="samples (sequences) per iteration")
    p.add_argument("--memory-limit", metavar="BYTES",
                   help="memory per device, e.g. '16 GiB' (default: the device's memory)")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                   help="activation recomputation (transformers)")
    p.add_argument("--schedules", default="dapple",
                   help="schedules to try on uniform plans, comma-separated (default dapple; e.g. dapple,gpipe,zb-h1)")
    p.add_argument("--top", type=int, default=6, help="candidates re-simulated (default 6)")
    p.add_argument("--devices", type=int, help="use at most this many of the cluster's devices")
    p.add_argument("--max-stages", type=int, help="at most this many pipeline stages")
    p.add_argument("--uniform", action="store_true", help="only R x D plans (every stage on R devices)")
    p.add_argument("--policies", default="fresh-first,append-first,scatter-first",
                   help="placement policies to search (comma-separated)")
    p.add_argument("--no-simulate", action="store_true", help="rank by the analytical model only")
    p.add_argument("--no-baselines", action="store_true", help="skip the PipeDream and data-parallel baselines")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", metavar="PLAN.json", help="write the plan file")


def _parse_limit(text):
    if text is None:
        return None
    return size_bytes(text.strip(), "--memory-limit", "memory-limit")


def main(args) -> int:
    from planner import SearchSpace, plan_record, plan_training, save_plan
    from planner.clusters import resolve_cluster

    if args.global_batch < 1:
        raise ValueError(f"--global-batch must be >= 1; got {args.global_batch}")
    if args.top < 1:
        raise ValueError(f"--top must be >= 1; got {args.top}")
    scheds = parse_schedules(args.schedules)
    cluster = load_shaped_cluster(args, resolve_cluster)
    limit = _parse_limit(args.memory_limit)
    space = SearchSpace(policies=tuple(x.strip() for x in args.policies.split(",") if x.strip()),
                        max_stages=args.max_stages, uniform=args.uniform, devices=args.devices)
    res = plan_training(args.model, cluster, args.global_batch, memory_limit=limit, recompute=args.recompute,
                        schedules=scheds, top_k=args.top, simulate=not args.no_simulate,
                        baselines=not args.no_baselines, progress=not args.no_progress and sys.stderr.isatty(),
                        space=space, model_name=args.model)
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
    if args.json:
        print_json({**rec, "baselines": base, "search": stats})
        return 0
    _print_human(res, rec, base, stats, args)
    return 0


def _print_human(res, rec, base, stats, args) -> None:
    best, cl, work = res.best, res.cluster, res.workload
    plan, est = best.plan, best.estimate
    gib = 2 ** 30
    print(f"DAPPLE plan for {args.model} on {cl.name} ({cl.num_devices} x {cl.device.name}), global batch "
          f"{plan.global_batch}")
    print(f"  {plan.describe()}")
    per = "" if not plan.uniform else f" ({plan.micro_batch // plan.dp} per pipeline replica)"
    print(f"  {plan.microbatches} micro-batches of {plan.micro_batch} samples{per}; devices in use "
          f"{plan.devices_used} of {cl.num_devices}")
    dpn = cl.devices_per_node
    rows = []
    for s, (st, se) in enumerate(zip(plan.stages, est.stages)):
        nodes = sorted({d // dpn for d in st.devices})
        first, last = work.layer_names[st.start], work.layer_names[st.stop - 1]
        rows.append({"stage": s, "layers": f"{st.start}-{st.stop - 1} ({first}..{last})", "replicas": st.replicas,
                     "nodes": ",".join(map(str, nodes)), "fwd_ms": se.f * 1e3, "bwd_ms": se.b * 1e3,
                     "allreduce_ms": se.allreduce * 1e3, "memory_GiB": se.memory / gib})
    print(fmt_table(rows, ["stage", "layers", "replicas", "nodes", "fwd_ms", "bwd_ms", "allreduce_ms", "memory_GiB"],
                    {"fwd_ms": "{:.2f}", "bwd_ms": "{:.2f}", "allreduce_ms": "{:.2f}", "memory_GiB": "{:.2f}"}))
    print(f"  analytical: L = {est.latency:.4g} s = warm-up {est.warmup:.4g} + steady {est.steady:.4g} + "
          f"ending {est.ending:.4g} (pivot {est.pivot}); with 1F1B round trips {est.latency_rt:.4g} s"
          + ("" if plan.schedule == "dapple" else f"  [the model is DAPPLE's 1F1B; {plan.schedule} is simulated]"))
    cap = res.capacity
    if best.sim is not None:
        sm = best.sim
        print(f"  simulated: iteration {sm.iteration_time:.4g} s "
              f"({plan.global_batch / sm.iteration_time:.1f} samples/s), "
              f"bubble {sm.bubble_ratio:.3f}, peak memory {sm.peak_memory / gib:.2f} GiB"
              + (f" of {cap / gib:.1f} GiB" if cap else ""))
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
        print(f"baselines ({kind} iteration times):")
        print(fmt_table(rows, ["plan", "iteration_s", "dapple_speedup", "detail"],
                        {"iteration_s": "{:.4g}", "dapple_speedup": "{:.2f}x"}))
    print(f"search: {stats['seconds']:.2f} s, {stats['stage_placements_evaluated']:,} stage placements evaluated, "
          f"{stats['complete_plans']:,} complete plans, {stats['configurations']} (micro-batch count, policy) "
          f"configurations; {len(stats['candidates'])} candidates re-simulated; baselines "
          f"{stats['baseline_seconds']:.2f} s")
    run = rec["run"]
    if run is not None:
        print(f"executor: pipetwin run --schedule {run['schedule']} --devices {run['devices']} --microbatches "
              f"{run['microbatches']} --dp {run['dp']}  (micro-batch {run['micro_batch']} per replica, partition "
              f"{run['partition']}; or --plan FILE)")
    else:
        print("executor: a non-uniform plan (stage replicas " + ":".join(map(str, plan.replicas))
              + "): run it with 'pipetwin run --plan FILE' (sub-batches as model copies)")
    if args.out:
        print(f"wrote plan file: {args.out}")
