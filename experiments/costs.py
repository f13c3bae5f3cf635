"""Cost-model and simulator options shared by simulate / compare / demo.

``--cost-model`` picks how layer times are computed from ``--model`` on the cluster's device:
``kernels`` (the default where the device preset has the kernel model's constants:
:mod:`cost_models.kernels`, checked against measured V100 layers by ``pipetwin reproduce
cost-curves``; per-sample costs fall with the micro-batch) or ``linear`` (FLOPs at the device's
fixed efficiency: the same per sample at every micro-batch, the closed-form view). ``--model
FILE.txt`` reads a per-layer profile in PipeDream's graph format (DAPPLE's released profiles),
profiled at ``--profile-batch`` (default: the ``pbs-B`` in the file name) and scaled linearly to
the micro-batch as DAPPLE did unless ``--cost-model kernels`` is asked for.
"""
from __future__ import annotations

from cost_models import MAPPINGS, TransformerCostModel, UnitCostModel, load_cluster, load_model, load_profile
from cost_models.kernels import COST_MODELS
from sim import SimOptions
from sim.host import on_one_host

DEFAULT_MODEL = "gpt-96"
DEFAULT_CLUSTER = "dgx-a100-4x8-ib"


def add_cost_args(p):
    p.add_argument("--unit-costs", action="store_true",
                   help="closed-form unit costs: F=1, B=2 per full stage, no communication, memory in Ma")
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"model preset or YAML file (default {DEFAULT_MODEL}; see cost_models/presets/models), or a "
                        f"per-layer profile in PipeDream's graph format (FILE.txt, e.g. DAPPLE's profiles)")
    add_cost_model_args(p)
    p.add_argument("--cluster", "-c", default=DEFAULT_CLUSTER,
                   help=f"cluster preset or YAML file (default {DEFAULT_CLUSTER})")
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


def add_cost_model_args(p) -> None:
    """``--cost-model`` and ``--profile-batch`` (shared with ``pipetwin plan``)."""
    p.add_argument("--cost-model", choices=list(COST_MODELS), default=None,
                   help="layer times: 'kernels' (GEMM tiles and waves, memory-bound kernels, launch overhead: costs "
                        "depend on the micro-batch; default where the device has the constants) or 'linear' (FLOPs "
                        "at a fixed efficiency; the default for --model FILE.txt profiles, as DAPPLE scaled them)")
    p.add_argument("--profile-batch", type=int, metavar="B",
                   help="the batch a --model FILE.txt profile was measured at (default: the pbs-B in its name)")


def cost_model_for(choice: str | None, device, profile: bool) -> str:
    """The cost model to use: the one asked for, else linear for profiles and for devices without
    kernel constants, kernels otherwise."""
    if choice is not None:
        if choice not in COST_MODELS:
            raise ValueError(f"--cost-model must be one of {', '.join(COST_MODELS)}; got {choice!r}")
        if choice == "kernels" and device.kernels is None:
            raise ValueError(f"--cost-model kernels needs the device's kernel constants; {device.name} has none "
                             f"(add a 'kernels:' block to its YAML, or use --cost-model linear)")
        return choice
    if profile or device.kernels is None:
        return "linear"
    return "kernels"


def _profile_costs(args, low, cluster, cost_model):
    """StageCosts of a PipeDream/DAPPLE profile: the planner's workload at the micro-batch (default
    the profile batch), a work-balanced contiguous partition over the schedule's stages."""
    from cost_models.partition import balanced_edges
    from planner.load import load_workload
    from cost_models import PerLayerCostModel
    work = load_workload(args.model, cluster.device, recompute=args.recompute, cost_model=cost_model,
                         profile_batch=args.profile_batch)
    mb = args.micro_batch if args.micro_batch is not None else work.source["profile_batch"]
    if mb < 1:
        raise ValueError(f"--micro-batch must be >= 1; got {mb}")
    S = low.num_stages
    if S > work.num_layers:
        raise ValueError(f"{S} stages but the profile has {work.num_layers} layers; use fewer devices/chunks")
    t = work.at(mb)
    edges = balanced_edges([t.fwd(i, i + 1) + t.bwd(i, i + 1) for i in range(work.num_layers)], S)
    part = tuple(edges[i + 1] - edges[i] for i in range(S))
    costs = PerLayerCostModel(work.layer_costs(mb), part).bind(low)
    costs.meta.update(memory_capacity=cluster.device.memory_bytes)
    return costs, mb, part


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
    if getattr(args, "cost_model", None) and (getattr(args, "unit_costs", False) or getattr(args, "profile", None)):
        raise ValueError("--cost-model applies to --model/--cluster costs; drop it with --unit-costs / --profile")
    if getattr(args, "unit_costs", False):
        return UnitCostModel().bind(low), None, {"cost_model": "unit"}
    if getattr(args, "profile", None):
        prof = load_profile(args.profile)
        costs = prof.cost_model(low.num_stages, recompute=args.recompute).bind(low)
        net = prof.cluster(low.num_ranks)
        return costs, net, {"cost_model": f"profile {args.profile}", "cluster": net.name,
                            "host": (prof.cores, prof.oversubscribed_slowdown) if prof.cores else None}
    cluster = load_cluster(args.cluster)
    if low.num_ranks > cluster.num_devices:
        raise ValueError(f"{low.num_ranks} ranks (D={low.num_devices} x R={low.replicas}) do not fit on cluster "
                         f"{cluster.name} with {cluster.num_devices} devices; pick a bigger --cluster")
    profile = str(args.model).endswith(".txt")
    cost_model = cost_model_for(getattr(args, "cost_model", None), cluster.device, profile)
    if getattr(args, "profile_batch", None) is not None and not profile:
        raise ValueError("--profile-batch applies to a profile file (--model FILE.txt) only")
    placed = cluster.place(low, args.device_map)
    if profile:
        costs, mb, part = _profile_costs(args, low, cluster, cost_model)
        return costs, placed, {"cost_model": cost_model, "model": str(args.model), "micro_batch": mb,
                               "partition": list(part), "cluster": cluster.name, "device_map": args.device_map,
                               "memory_capacity": costs.meta.get("memory_capacity")}
    model = load_model(args.model)
    if args.micro_batch is not None:
        if args.micro_batch < 1:
            raise ValueError(f"--micro-batch must be >= 1; got {args.micro_batch}")
        model = model.replace(micro_batch=args.micro_batch)
    costs = TransformerCostModel(model, cluster.device, recompute=args.recompute, compute=cost_model).bind(low)
    return costs, placed, {"cost_model": cost_model, "model": model.name, "micro_batch": model.micro_batch,
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
    if args.jitter < 0:
        raise ValueError("--jitter must be >= 0")
    base = SimOptions(slowdown=slow, link_slowdown=links, jitter=args.jitter, seed=args.seed)
    return on_one_host(base, low.num_ranks, *host) if host else base
