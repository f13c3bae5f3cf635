"""``pipetwin plan --tp auto|T,...``: the whole-layout search (:mod:`planner.layout`).

T x D x R, schedule family (chunks, variants), micro-batch, recompute, ZeRO-1 and sequence
parallelism for a transformer preset, YAML or config on a cluster, under each GPU's memory; the
best ``--top`` K are simulated and printed (``--json``: their records), ``--out`` writes the best
as a plan file for ``simulate --plan`` and ``run --plan``, ``--plot`` draws every simulated
candidate.
"""
from __future__ import annotations

import sys

from .common import parse_schedules, print_json
from .jobs import cluster_from_args
from .tables import fmt_bytes, fmt_table, printable, wrap_cell

# the DAPPLE planner's options that the whole-layout search has no use for
DAPPLE_ONLY = (("--profile", "profile"), ("--uniform", "uniform"), ("--no-simulate", "no_simulate"),
               ("--no-baselines", "no_baselines"), ("--profile-batch", "profile_batch"))
DEFAULT_POLICIES = "fresh-first,append-first,scatter-first"
COLUMNS = ["tp", "devices", "dp", "schedule", "chunks", "micro_batch", "recompute", "zero", "sp", "step_s",
           "tokens/s", "mfu", "mem_GiB", "bubble"]


def _ints(text: str, option: str) -> tuple[int, ...]:
    out = []
    for t in text.split(","):
        t = t.strip()
        try:
            v = int(t)
        except ValueError:
            raise ValueError(f"{option} takes comma-separated integers >= 1; got {text!r}") from None
        if v < 1:
            raise ValueError(f"{option} takes comma-separated integers >= 1; got {text!r}")
        out.append(v)
    return tuple(out)


def space_from_args(args):
    """The :class:`planner.layout.LayoutSpace` the options ask for."""
    from planner.layout import DEFAULT_MICRO_BATCHES, LayoutSpace
    from cost_models.parallel import RECOMPUTE
    tp = None if args.tp.strip() == "auto" else _ints(args.tp, "--tp")
    mbs = DEFAULT_MICRO_BATCHES if args.micro_batches is None else _ints(args.micro_batches, "--micro-batches")
    scheds = None if args.schedules is None else tuple(parse_schedules(args.schedules))
    return LayoutSpace(tp=tp, schedules=scheds, micro_batches=mbs,
                       recompute=RECOMPUTE if args.recompute is None else (args.recompute,),
                       max_stages=args.max_stages, gpus=args.devices,
                       device_maps=("sequential",) if args.device_map is None else
                       tuple(m.strip() for m in args.device_map.split(",")))


def main_layout(args, limit: float | None, check_limit) -> int:
    """The search of the options ``args`` with ``--memory-limit`` parsed (``limit``), refused above
    the device's memory by ``check_limit`` (:func:`experiments.cmd_plan.check_limit`)."""
    from cost_models import load_model
    from planner.clusters import resolve_cluster
    from planner.layout import plan_layouts
    from planner.plan_io import layout_plan_record
    from cost_models.files import write_output

    given = [f for f, d in DAPPLE_ONLY if vars(args).get(d)]
    if args.policies != DEFAULT_POLICIES:
        given.append("--policies")
    if given:
        raise ValueError(f"{', '.join(given)} belong to the DAPPLE planner (T=1); drop them with --tp")
    if args.model is None or args.cluster is None:
        raise ValueError("give --model and --cluster (NAME:NODES) with --tp")
    from cost_models.workloads.paper_models import PAPER_MODELS
    if args.model in PAPER_MODELS:
        raise ValueError(f"--tp: {args.model} is a layer-profile workload of the DAPPLE paper, not a transformer "
                         f"whose layers can be split; plan it without --tp, or give a gpt/llama model")
    model = load_model(args.model)
    if args.seq_len is not None:
        model = model.replace(seq_len=args.seq_len)
    choice = cluster_from_args(args)
    cluster = choice.load(resolve_cluster)
    check_limit(limit, cluster.device, args.force)
    space = space_from_args(args)
    show = not args.no_progress and sys.stderr.isatty()

    def progress(i, n):
        if show and i % 200 == 0:
            print(f"\rcandidates {i:,} of {n:,} ...", end="", file=sys.stderr, flush=True)

    res = plan_layouts(model, cluster, args.global_batch, space, top_k=args.top, cluster_choice=choice,
                       cost_model=args.cost_model, memory_limit=limit, progress=progress)
    if show:
        print("\r" + " " * 40 + "\r", end="", file=sys.stderr)
    recs = res.records()
    if args.out:
        rec = layout_plan_record(res.best.job, cluster, args.global_batch, memory_limit=limit, simulated=recs[0])
        import json
        write_output(args.out, json.dumps(rec, indent=2) + "\n", "plan file")
    if args.plot:
        from .plots import plot_layouts
        pts = [c.record(res.global_batch, model, res.peak_flops) for c in res.confirmed]
        plot_layouts(pts, res.usable, recs[0], args.plot,
                     title=f"{model.name} on {cluster.num_devices:,} x {cluster.device.name}, global batch "
                           f"{args.global_batch}")
    stats = search_stats(res)
    if args.json:
        print_json({"model": model.name, "cluster": cluster.name, "gpus": cluster.num_devices,
                    "global_batch": args.global_batch, "usable_memory": res.usable, "top": recs, "search": stats})
        return 0
    _print_human(res, recs, stats, args)
    return 0


def res_maps(args) -> list[str]:
    """The device maps searched."""
    return ["sequential"] if args.device_map is None else [m.strip() for m in args.device_map.split(",")]


def search_stats(res) -> dict:
    return {"seconds": res.seconds, "candidates": res.candidates, "memory_pruned": res.memory_pruned,
            "refused": res.refused, "out_of_memory": res.out_of_memory, "simulated": res.simulated}


def _print_human(res, recs, stats, args) -> None:
    cl, m = res.cluster, res.model
    print(printable(f"whole-layout plan for {m.name} on {cl.name} ({cl.num_devices:,} x {cl.device.name}), "
                    f"global batch {args.global_batch} x {m.seq_len} tokens; {fmt_bytes(res.usable)} usable per GPU"))
    rows = [{"tp": r["tp"], "devices": r["devices"], "dp": r["dp"], "schedule": r["schedule"] +
             (f"/{r['variant']}" if r["variant"] else ""), "chunks": r["chunks"], "micro_batch": r["micro_batch"],
             "recompute": r["recompute"], "zero": r["zero"], "sp": "yes" if r["sequence_parallel"] else "no",
             "map": r["device_map"], "step_s": r["iteration_time"], "tokens/s": r["tokens_per_s"], "mfu": r["mfu"],
             "mem_GiB": r["peak_memory"] / 2**30, "bubble": r["bubble_ratio"]} for r in recs]
    cols = COLUMNS if len(res_maps(args)) == 1 else COLUMNS[:9] + ["map"] + COLUMNS[9:]
    print(fmt_table(rows, cols, {"step_s": "{:.4g}", "tokens/s": "{:,.0f}", "mfu": "{:.1%}",
                                    "mem_GiB": "{:.1f}", "bubble": "{:.3f}"}))
    for line in wrap_cell(f"best: {recs[0]['memory_verdict']}", 116):
        print("  " + line)
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
