"""``pipetwin plan``'s whole-layout search (:mod:`planner.layout`; ``--search layout``, the default for
transformers). Its axes take ``auto`` or a comma-separated list (the option table's auto-or-list
grammar): ``--tp``, ``--devices`` (pipeline D), ``--micro-batch``, ``--recompute``, ``--device-map``,
and for a mixture of experts ``--ep`` and ``--etp`` (``--overlap-fb``: the overlap searched on every
schedule, not only dualpipe-v; the routing knobs, ``--expert-imbalance`` ..., are every candidate's).

T x C x D x R (``--cp``: context parallelism, auto where a GPU keeps at least 8,192 tokens), schedule
family (chunks, variants), micro-batch, recompute, ZeRO-1 and sequence
parallelism for a transformer preset, YAML or config on a cluster, under each GPU's memory; the
best ``--top`` K are simulated and printed (``--json``: their records), ``--out`` writes the best
as a plan file for ``simulate --plan`` and ``run --plan``, ``--plot`` draws every simulated
candidate.
"""
from __future__ import annotations

from .common import parse_schedules, print_json, stated_lines
from .jobs import cluster_from_args
from .options import DEFAULT_POLICIES, auto_values, fields_of
from .tables import fmt_bytes, fmt_table, printable, wrap_cell

# the options only the DAPPLE search takes (given, they choose it) and only the whole-layout search takes
DAPPLE_ONLY = (("--profile", "profile"), ("--profile-batch", "profile_batch"), ("--uniform", "uniform"),
               ("--no-simulate", "no_simulate"), ("--no-baselines", "no_baselines"))
LAYOUT_ONLY = (("--tp", "tp"), ("--cp", "cp"), ("--cp-comm", "cp_comm"), ("--devices", "devices"),
               ("--micro-batch", "micro_batch"),
               ("--device-map", "device_map"), ("--plot", "plot"), ("--seq-len", "seq_len"), ("--ep", "ep"),
               ("--etp", "etp"), ("--overlap-fb", "overlap_fb"), ("--expert-imbalance", "expert_imbalance"),
               ("--capacity-factor", "capacity_factor"), ("--fp8-dispatch", "fp8_dispatch"),
               ("--a2a-hierarchical", "a2a_hierarchical"), ("--route-nodes", "route_nodes"),
               ("--overlap-sm-share", "overlap_sm_share"))


def given(args, dest: str) -> bool:
    """Whether option ``dest`` was given (a switch: set)."""
    return vars(args).get(dest) not in (None, False)

COLUMNS = ["tp", "devices", "dp", "schedule", "chunks", "micro_batch", "recompute", "zero", "sp", "step_s",
           "tokens/s", "mfu", "mem_GiB", "bubble"]


def space_from_args(args, cluster=None):
    """The :class:`planner.layout.LayoutSpace` the options ask for (``cluster``: ``--etp auto``'s
    node size)."""
    from planner.layout import DEFAULT_MICRO_BATCHES, FIXED_KNOBS, LayoutSpace, node_divisors
    from cost_models.parallel import RECOMPUTE, Parallel
    scheds = None if args.schedules is None else tuple(parse_schedules(args.schedules))
    etp = (1,) if args.etp is None else auto_values(args.etp) or tuple(node_divisors(cluster))
    knobs = Parallel(**{k: v for k, v in fields_of(args, "Parallel").items() if k in FIXED_KNOBS})
    return LayoutSpace(tp=auto_values(args.tp), devices=auto_values(args.devices), schedules=scheds,
                       micro_batches=auto_values(args.micro_batch) or DEFAULT_MICRO_BATCHES,
                       recompute=auto_values(args.recompute) or RECOMPUTE, max_stages=args.max_stages, gpus=args.gpus,
                       device_maps=auto_values(args.device_map), ep=auto_values(args.ep), etp=etp,
                       cp=auto_values(args.cp), cp_comm=args.cp_comm or "ring",
                       overlap_schedules=None if not args.overlap_fb else scheds or tuple(registry_names()),
                       knobs=knobs)


def registry_names() -> list[str]:
    from schedules import registry
    return registry.names()


def main_layout(args, limit: float | None, check_limit) -> int:
    """The search of the options ``args`` with ``--memory-limit`` parsed (``limit``), refused above
    the device's memory by ``check_limit`` (:func:`experiments.cmd_plan.check_limit`)."""
    from cost_models import load_model
    from planner.layout import plan_layouts
    from planner.plan_io import layout_plan_record
    from cost_models.files import write_output

    given = [f for f, d in DAPPLE_ONLY if vars(args).get(d)]
    if args.policies != DEFAULT_POLICIES:
        given.append("--policies")
    if given:
        verb, them = ("belongs", "it") if len(given) == 1 else ("belong", "them")
        raise ValueError(f"{', '.join(given)} {verb} to the DAPPLE planner (--search dapple, T=1); drop {them} for "
                         f"the whole-layout search (--search layout, --tp ...)")
    if args.model is None or args.cluster is None:
        raise ValueError("give --model and --cluster (NAME:NODES) for the whole-layout search")
    from cost_models.workloads.paper_models import PAPER_MODELS
    if args.model in PAPER_MODELS:
        raise ValueError(f"--tp: {args.model} is a layer-profile workload of the DAPPLE paper, not a transformer "
                         f"whose layers can be split; plan it without --tp (--search dapple), or give a gpt/llama "
                         f"model")
    model = load_model(args.model)
    if args.seq_len is not None:
        model = model.replace(seq_len=args.seq_len)
    from planner.choose import batch_in_sequences
    args.global_batch = batch_in_sequences(args.global_batch, args.global_tokens, model.seq_len)
    choice = cluster_from_args(args)
    cluster = choice.load()
    if cluster.is_mixed and args.emit is not None:
        raise ValueError(f"--emit on the mixed cluster {cluster.name}: its plan places stages by pool with layers "
                         f"split by type, which {args.emit}'s launch does not say; it runs in pipetwin only "
                         f"(drop --emit)")
    check_limit(limit, min((p.device for p in cluster.pools), key=lambda d: d.memory_bytes or float("inf")),
                args.force)
    space = space_from_args(args, cluster)
    most = min(model.layers, cluster.num_devices)
    for D in space.devices or ():
        if D > most:
            raise ValueError(f"--devices {D}: -D is the pipeline's devices D (at most {most}: {model.name} has "
                             f"{model.layers} layers, {cluster.name} {cluster.num_devices} GPUs); the GPU budget is "
                             f"--gpus N")
    from .progress import counter
    tick = counter("layouts judged", show=not args.no_progress)    # a terminal only
    try:
        res = plan_layouts(model, cluster, args.global_batch, space, top_k=args.top, cluster_choice=choice,
                           cost_model=args.cost_model, memory_limit=limit, progress=tick)
    finally:
        tick.close()
    blind = None
    if cluster.is_mixed:        # beside it, the plan made as if every GPU were the first pool's
        from planner.layout import plan_type_blind
        blind = plan_type_blind(model, cluster, args.global_batch, space, cluster_choice=choice,
                                cost_model=args.cost_model, memory_limit=limit)
    recs = res.records()
    args._best_job = res.best.job       # plan --emit writes it for another framework (experiments.cmd_plan)
    if args.out:
        rec = layout_plan_record(res.best.job, cluster, args.global_batch, memory_limit=limit, simulated=recs[0])
        import json
        write_output(args.out, json.dumps(rec, indent=2) + "\n", "plan file")
    if args.plot:
        from .plots import plot_layouts
        pts = [c.record(res.global_batch, model, res.peak_flops) for c in res.confirmed]
        plot_layouts(pts, res.usable, recs[0], args.plot,
                     title=f"{model.name} on {gpus_of(cluster)}, global batch "
                           f"{args.global_batch}")
    stats = search_stats(res)
    from cost_models.bind import CostInputs, stated
    best = res.best.job if args.seq_len is None else res.best.job.with_(seq_len=args.seq_len)
    said = stated(best, CostInputs("transformer", model=model, cluster=cluster), model_ref=args.model)
    if args.json:
        extra = {} if blind is None else {"type_blind": blind_record(blind, res)}
        print_json({"model": model.name, "cluster": cluster.name, "gpus": cluster.num_devices,
                    "global_batch": args.global_batch, "usable_memory": res.usable, **said, "top": recs,
                    "search": stats, **extra})
        return 0
    args.memory_limit_bytes = limit
    _print_human(res, recs, stats, args, said, blind)
    return 0


def gpus_of(cluster) -> str:
    """``32 x h100``; a mixed cluster pool by pool, ``16 x a100 + 16 x h100``."""
    return " + ".join(f"{p.num_devices:,} x {p.device.name}" for p in cluster.pools)


def blind_record(blind, res) -> dict:
    """The type-blind plan of a mixed cluster beside the search's best, and the gain (one place:
    :func:`planner.hetero.gain`)."""
    from planner.hetero import gain
    j = blind.job
    return {"tp": j.parallel.tp, "devices": j.layout.devices, "dp": j.layout.replicas, "schedule": j.layout.schedule,
            "micro_batch": j.parallel.micro_batch, "recompute": j.parallel.recompute, "zero": j.parallel.zero,
            "device_map": j.mapping, "believed": blind.believed, "iteration_time": blind.iteration_time,
            "fits": blind.fits, "gain": gain(res.best.iteration_time, blind.iteration_time)}


def res_maps(args) -> list[str]:
    """The device maps searched."""
    return list(auto_values(args.device_map) or ("sequential",))


def search_stats(res) -> dict:
    return {"seconds": res.seconds, "candidates": res.candidates, "memory_pruned": res.memory_pruned,
            "refused": res.refused, "out_of_memory": res.out_of_memory, "simulated": res.simulated}


def _print_human(res, recs, stats, args, said: dict, blind=None) -> None:
    cl, m = res.cluster, res.model
    usable = f"; {fmt_bytes(res.usable)} usable per GPU" if not cl.is_mixed else ""
    print(printable(f"whole-layout plan for {m.name} on {cl.name} ({gpus_of(cl)}), "
                    f"global batch {args.global_batch} x {m.seq_len} tokens{usable}"))
    if cl.is_mixed:
        from cost_models.memory import usable_memory
        each = [args.memory_limit_bytes if args.memory_limit_bytes is not None else
                usable_memory(p.device.memory_bytes) for p in cl.pools]
        print("  usable per GPU: " + ", ".join(f"{fmt_bytes(u)} on {p.name}" for u, p in zip(each, cl.pools)))
    print("\n".join(stated_lines(said)))
    rows = [{"tp": r["tp"], "cp": r["cp"], "devices": r["devices"], "dp": r["dp"], "schedule": r["schedule"] +
             (f"/{r['variant']}" if r["variant"] else ""), "chunks": r["chunks"], "micro_batch": r["micro_batch"],
             "recompute": r["recompute"], "zero": r["zero"], "sp": "yes" if r["sequence_parallel"] else "no",
             "ep": r["ep"], "etp": r["etp"], "overlap": "yes" if r["overlap_fb"] else "no",
             "map": r["device_map"], "step_s": r["iteration_time"], "tokens/s": r["tokens_per_s"], "mfu": r["mfu"],
             "mem_GiB": r["peak_memory"] / 2**30, "bubble": r["bubble_ratio"]} for r in recs]
    experts = (["ep"] + (["etp"] if any(r["etp"] != 1 for r in recs) else []) + ["overlap"]) if m.is_moe else []
    maps = ["map"] if len(res_maps(args)) > 1 or (m.is_moe and len({r["device_map"] for r in recs}) > 1) else []
    cols = COLUMNS[:1] + (["cp"] if any(r["cp"] > 1 for r in recs) else []) + COLUMNS[1:9] + experts + maps + \
        COLUMNS[9:]
    print(fmt_table(rows, cols, {"step_s": "{:.4g}", "tokens/s": "{:,.0f}", "mfu": "{:.1%}",
                                    "mem_GiB": "{:.1f}", "bubble": "{:.3f}"}))
    for line in wrap_cell(f"best: {recs[0]['memory_verdict']}", 116):
        print("  " + line)
    if blind is not None:
        from planner.hetero import gain_line
        j, best = blind.job, res.best.job
        print(f"  layers per stage: {','.join(map(str, best.partition or ()))} (stages on pools in order, "
              f"more layers on the faster)")
        print(f"  type-blind: tp {j.parallel.tp}, D {j.layout.devices}, dp {j.layout.replicas}, {j.layout.schedule}, "
              f"micro-batch {j.parallel.micro_batch}, recompute {j.parallel.recompute}, zero {j.parallel.zero}, "
              f"map {j.mapping}")
        print(f"    believed {blind.believed:.4g} s/step (as if every GPU were the {cl.pools[0].device.name}), "
              f"simulated {blind.iteration_time:.4g} s/step" + ("" if blind.fits else " (over a pool's memory)"))
        print(gain_line(res.best.iteration_time, blind.iteration_time))
    print(f"search: {stats['seconds']:.2f} s, {stats['candidates']:,} candidates; {stats['memory_pruned']:,} over "
          f"the memory bound, {stats['refused']:,} refused by their schedule's requirements,")
    print(f"  {stats['out_of_memory']:,} out of memory by the ledger, {stats['simulated']:,} simulated; the rest "
          f"bounded above the {'best' if args.top == 1 else f'{_ordinal(args.top)} best'} simulated time")
    if args.out:
        print(f"wrote plan file: {printable(args.out)}")
    if args.plot:
        print(f"wrote figure: {printable(args.plot)}")


def _ordinal(k: int) -> str:
    """2 -> 2nd, 3 -> 3rd, 11 -> 11th, 21 -> 21st."""
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"
