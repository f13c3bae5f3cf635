"""``pipetwin sweep``: simulate a grid of configurations on local workers or a Ray cluster.

Every point is ``pipetwin simulate --json`` of one (schedule, D, N, R, micro-batch); rows go to
``DIR/sweep.csv`` as they finish (points already there are skipped: rerun to resume), the full
records to ``DIR/sweep.jsonl``, figures to ``DIR/throughput.png`` and ``DIR/pareto.png``. See
:mod:`experiments.sweep`.
"""
from __future__ import annotations

import os
import sys

from cost_models import MAPPINGS

from .checks import output_dir, positive_int
from .common import parse_schedules
from .costs import DEFAULT_CLUSTER, DEFAULT_MODEL, add_cluster_shape_args, add_cost_model_args
from .tables import fmt_table

NAME = "sweep"
HELP = "simulate a grid of schedules x devices x micro-batches x replicas x micro-batch sizes"


def add_arguments(p):
    p.add_argument("--schedules", "-s", default="all", help="comma-separated schedule names, or 'all'")
    p.add_argument("--devices", "-D", required=True, help="pipeline devices, comma-separated (e.g. 4,8)")
    p.add_argument("--microbatches", "-N", required=True, help="micro-batches per iteration, comma-separated")
    p.add_argument("--dp", default="1", help="data-parallel replicas, comma-separated (default 1)")
    p.add_argument("--micro-batch", help="micro-batch sizes, comma-separated (default: the model spec's)")
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"model preset or YAML file (default {DEFAULT_MODEL}), or a model file PATH.py:FUNC with "
                        f"its --profile")
    p.add_argument("--cluster", "-c", default=DEFAULT_CLUSTER,
                   help=f"cluster preset or YAML file, optionally NAME:NODES (default {DEFAULT_CLUSTER})")
    add_cluster_shape_args(p)
    add_cost_model_args(p)
    p.add_argument("--unit-costs", action="store_true", help="closed-form unit costs instead of model x cluster")
    p.add_argument("--profile", metavar="FILE.yaml", help="a calibration profile's costs and network")
    p.add_argument("--device-map", default="sequential", choices=sorted(MAPPINGS),
                   help="how ranks are placed on the cluster's devices (copies-same-node: BitPipe's mapping)")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--chunks", "-v", type=positive_int, default=2, help="chunks per device for interleaved schedules")
    p.add_argument("--no-eager", action="store_true", help="all-reduce gradients at the end")
    p.add_argument("--exact", action="store_true", help="simulate every replica even when they are identical")
    p.add_argument("--out", required=True, metavar="DIR", type=output_dir,
                   help="folder for sweep.csv, sweep.jsonl and the figures")
    p.add_argument("--workers", type=positive_int, default=None, help="local worker processes (default: all cores)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the points on a Ray cluster (ADDRESS, e.g. 'auto'; alone: a local Ray); "
                        "needs pip install 'pipetwin[ray]'")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-figures", action="store_true", help="skip the figures")


def main(args) -> int:
    from .sweep import Common, Grid, parse_ints, run_sweep
    grid = Grid(schedules=tuple(parse_schedules(args.schedules)), devices=parse_ints(args.devices, "--devices"),
                microbatches=parse_ints(args.microbatches, "--microbatches"), dp=parse_ints(args.dp, "--dp"),
                micro_batch=(None,) if args.micro_batch is None else parse_ints(args.micro_batch, "--micro-batch"))
    if args.unit_costs and args.micro_batch is not None:
        raise ValueError("--micro-batch has no meaning with --unit-costs; drop one")
    if args.workers is not None and args.ray is not None:
        raise ValueError("--workers is for local processes; Ray places the points itself (drop one)")
    # fail fast on what every point shares (a bad model, cluster or fabric), before any worker starts
    from .costs import load_shaped_cluster
    if not args.unit_costs and not args.profile:
        if not str(args.model).endswith(".txt"):
            from cost_models import load_model
            load_model(args.model)
        load_shaped_cluster(args)
    elif args.profile and not os.path.isfile(args.profile):
        raise FileNotFoundError(f"--profile: no such file: {args.profile}")
    elif args.profile:
        from cost_models import is_model_ref, load_profile

        from .costs import check_profile_model
        if is_model_ref(args.model):
            check_profile_model(load_profile(args.profile), args.model)
    common = Common(model=args.model, cluster=args.cluster, nodes=args.nodes, fabric=args.fabric,
                    oversubscription=args.oversubscription, nodes_per_leaf=args.nodes_per_leaf,
                    unit_costs=args.unit_costs, profile=args.profile, device_map=args.device_map,
                    recompute=args.recompute, chunks=args.chunks, no_eager=args.no_eager, exact=args.exact,
                    cost_model=args.cost_model, profile_batch=args.profile_batch)
    rows = run_sweep(grid, common, args.out, workers=args.workers, use_ray=args.ray is not None,
                     ray_address=args.ray, progress=not args.no_progress and sys.stderr.isatty(),
                     figures=not args.no_figures)
    ran = [r for r in rows if not r["error"]]
    print(f"sweep: {len(rows)} points ({len(ran)} ran, {len(rows) - len(ran)} impossible) -> {args.out}/sweep.csv")
    show = [{**r, **{k: float(r[k]) for k in ("iteration_time", "throughput", "bubble_ratio")}}
            for r in sorted(ran, key=lambda r: -float(r["throughput"]))[:10]]
    if show:
        print("fastest points (throughput in samples per time unit):")
        print(fmt_table(show, ["schedule", "devices", "microbatches", "dp", "micro_batch", "iteration_time",
                               "throughput", "bubble_ratio", "out_of_memory"],
                        {"iteration_time": "{:.6g}", "throughput": "{:.6g}", "bubble_ratio": "{:.4f}"}))
    for r in rows:
        if r["error"]:
            b = f" b={r['micro_batch']}" if r["micro_batch"] else ""
            print(f"impossible: {r['schedule']} D={r['devices']} N={r['microbatches']} R={r['dp']}{b}: {r['error']}")
    if not args.no_figures:
        print(f"wrote figures: {args.out}/throughput.png, {args.out}/pareto.png")
    return 0
