"""Cost-model and simulator options shared by simulate / compare / demo."""
from __future__ import annotations

import math

from cost_models import (
    FABRICS,
    MAPPINGS,
    TransformerCostModel,
    UnitCostModel,
    load_cluster,
    load_model,
    load_profile,
    with_fabric,
    with_nodes,
)
from sim import SimOptions
from sim.host import on_one_host

DEFAULT_MODEL = "gpt-96"
DEFAULT_CLUSTER = "dgx-a100-4x8-ib"


def add_cost_args(p):
    p.add_argument("--unit-costs", action="store_true",
                   help="closed-form unit costs: F=1, B=2 per full stage, no communication, memory in Ma")
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"model preset or YAML file (default {DEFAULT_MODEL}; see cost_models/presets/models)")
    p.add_argument("--cluster", "-c", default=DEFAULT_CLUSTER,
                   help=f"cluster preset or YAML file, optionally sized NAME:NODES (default {DEFAULT_CLUSTER}; "
                        f"e.g. dgx-h100-ib:128)")
    add_cluster_shape_args(p)
    p.add_argument("--profile", metavar="FILE.yaml",
                   help="a calibration profile (pipetwin calibrate): measured costs and network instead of "
                        "--model/--cluster formulas")
    p.add_argument("--device-map", default="sequential", choices=sorted(MAPPINGS),
                   help="how ranks are placed on the cluster's devices (copies-same-node: BitPipe's mapping)")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                   help="activation recomputation")
    p.add_argument("--micro-batch", type=int, help="micro-batch size (default: the model spec's)")
    p.add_argument("--slowdown", action="append", default=[], metavar="RANK=FACTOR",
                   help="a straggler: compute on RANK takes FACTOR times longer (repeatable)")
    p.add_argument("--slow-link", action="append", default=[], metavar="LINK=FACTOR",
                   help="a slow link: divide the bandwidth of LINK (e.g. n1.nic0.out) by FACTOR (repeatable)")
    p.add_argument("--jitter", type=float, default=0.0, help="relative std-dev of per-op compute noise")
    p.add_argument("--seed", type=int, default=0, help="seed for --jitter")
    p.add_argument("--exact", action="store_true",
                   help="simulate every data-parallel replica op by op even when they are identical (by default "
                        "one replica stands for all when nothing tells them apart)")


def add_cluster_shape_args(p):
    """--nodes / --fabric / --oversubscription / --nodes-per-leaf: any cluster preset resized and rewired."""
    p.add_argument("--nodes", type=int, help="number of nodes of the cluster's kind (overrides the preset's)")
    p.add_argument("--fabric", choices=FABRICS, help="inter-node fabric: flat (one non-blocking switch), fat-tree "
                   "(leaves of --nodes-per-leaf nodes) or rail (rail-optimised: NIC k of a group on one switch)")
    p.add_argument("--oversubscription", type=float,
                   help="fat-tree / rail: a leaf's down / up bandwidth (1 = non-blocking, e.g. 2)")
    p.add_argument("--nodes-per-leaf", type=int, help="fat-tree / rail: nodes under one leaf (rail) switch")


def shape_cluster(cluster, args):
    """A loaded cluster with the --nodes / --fabric / --oversubscription / --nodes-per-leaf of ``args``."""
    nodes = getattr(args, "nodes", None)
    over = getattr(args, "oversubscription", None)
    per = getattr(args, "nodes_per_leaf", None)
    if nodes is not None and nodes < 1:
        raise ValueError(f"--nodes must be >= 1; got {nodes}")
    if over is not None and not (math.isfinite(over) and over >= 1):
        raise ValueError(f"--oversubscription must be a finite number >= 1 (1 = non-blocking); got {over}")
    if per is not None and per < 1:
        raise ValueError(f"--nodes-per-leaf must be >= 1; got {per}")
    if nodes is not None:
        cluster = with_nodes(cluster, nodes)
    return with_fabric(cluster, getattr(args, "fabric", None), over, per)


def load_shaped_cluster(args, loader=load_cluster):
    """The cluster of ``--cluster`` (``NAME:NODES`` allowed) shaped by the options of :func:`add_cluster_shape_args`."""
    return shape_cluster(loader(args.cluster), args)


def _pairs(items, what, key=int, example="3=1.5", label="RANK"):
    out = {}
    for it in items:
        try:
            k, v = it.split("=")
            out[key(k)] = float(v)
        except ValueError:
            raise ValueError(f"{what} expects {label}=FACTOR, e.g. {example}; got {it!r}") from None
        if out[key(k)] <= 0:
            raise ValueError(f"{what}: the factor must be > 0; got {it!r}")
    return out


def resolve_costs(args, low):
    """(StageCosts, network or None, extra report fields) for a lowered schedule."""
    if getattr(args, "unit_costs", False):
        return UnitCostModel().bind(low), None, {"cost_model": "unit"}
    if getattr(args, "profile", None):
        prof = load_profile(args.profile)
        costs = prof.cost_model(low.num_stages, recompute=args.recompute).bind(low)
        net = prof.cluster(low.num_ranks)
        return costs, net, {"cost_model": f"profile {args.profile}", "cluster": net.name,
                            "host": (prof.cores, prof.oversubscribed_slowdown) if prof.cores else None}
    model = load_model(args.model)
    if args.micro_batch is not None:
        if args.micro_batch < 1:
            raise ValueError(f"--micro-batch must be >= 1; got {args.micro_batch}")
        model = model.replace(micro_batch=args.micro_batch)
    cluster = load_shaped_cluster(args)
    if low.num_ranks > cluster.num_devices:
        raise ValueError(f"{low.num_ranks} ranks (D={low.num_devices} x R={low.replicas}) do not fit on cluster "
                         f"{cluster.name} with {cluster.num_devices} devices; pick a bigger --cluster")
    placed = cluster.place(low, args.device_map)
    costs = TransformerCostModel(model, cluster.device, recompute=args.recompute).bind(low)
    return costs, placed, {"cost_model": "transformer", "model": model.name, "micro_batch": model.micro_batch,
                           "cluster": cluster.name, "device_map": args.device_map,
                           "memory_capacity": costs.meta.get("memory_capacity")}


def sim_options(args, low, network=None, host: tuple[int, float] | None = None) -> SimOptions:
    """Simulator options from the CLI; ``host`` = (cores, slowdown when oversubscribed): all ranks
    run on one host with that many cores (calibrated CPU runs), so they share them."""
    slow = _pairs(args.slowdown, "--slowdown")
    links = _pairs(getattr(args, "slow_link", []), "--slow-link", key=str, example="n1.nic0.out=4", label="LINK")
    if links:
        if network is None or not hasattr(network, "links"):
            raise ValueError("--slow-link needs a cluster (not --unit-costs)")
        known = {ln.name for ln in network.links()}
        for name in links:
            if name not in known:
                raise ValueError(f"--slow-link: no link named {name!r} in this cluster; links look like "
                                 f"{', '.join(sorted(known)[:4])} ...")
    for r in slow:
        if not 0 <= r < low.num_ranks:
            raise ValueError(f"--slowdown names rank {r}, but the run has ranks 0..{low.num_ranks - 1}")
    if not (args.jitter >= 0 and math.isfinite(args.jitter)):
        raise ValueError(f"--jitter must be a finite number >= 0; got {args.jitter}")
    base = SimOptions(slowdown=slow, link_slowdown=links, jitter=args.jitter, seed=args.seed,
                      exact=getattr(args, "exact", False))
    return on_one_host(base, low.num_ranks, *host) if host else base
