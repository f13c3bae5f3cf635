"""Cost-model and simulator options shared by simulate / compare / bubbles / demo.

Costs come from unit costs, from a transformer spec on a cluster preset (formulas), or from a
calibration profile (``pipetwin calibrate``; the only source for a model file ``PATH.py:FUNC``):
on this machine as calibrated (the ranks share its cores), or with ``--cluster`` scaled onto that
cluster's devices (:func:`cost_models.scaled_layer_costs`: every measured time times this host's
FLOP rate over the device's achievable one) and placed on its network. :func:`profile_costs` is
that choice as a library call (``pipetwin sweep`` can call it too).
"""
from __future__ import annotations

from cost_models import (
    MAPPINGS,
    PerLayerCostModel,
    TransformerCostModel,
    UnitCostModel,
    is_model_ref,
    load_cluster,
    load_model,
    load_profile,
    scaled_layer_costs,
)
from cost_models.stack import same_model_ref
from sim import SimOptions
from sim.host import on_one_host

DEFAULT_MODEL = "gpt-96"
DEFAULT_CLUSTER = "dgx-a100-4x8-ib"


def add_cost_args(p):
    p.add_argument("--unit-costs", action="store_true",
                   help="closed-form unit costs: F=1, B=2 per full stage, no communication, memory in Ma")
    p.add_argument("--model", "-m", default=None,
                   help=f"model preset or YAML file (default {DEFAULT_MODEL}; see cost_models/presets/models), or a "
                        f"model file PATH.py:FUNC with its --profile")
    p.add_argument("--cluster", "-c", default=None,
                   help=f"cluster preset or YAML file (default {DEFAULT_CLUSTER}; with --profile: this machine as "
                        f"calibrated, or the profile's layer times scaled onto the cluster given)")
    p.add_argument("--profile", metavar="FILE.yaml",
                   help="a calibration profile (pipetwin calibrate): measured costs and network instead of "
                        "--model/--cluster formulas")
    p.add_argument("--partition", metavar="COUNTS|time",
                   help="layers per stage of a model copy, e.g. 3,2,2,3 (a transformer's embedding and head count "
                        "as layers), or 'time': balanced by the profile's measured layer times (default: the "
                        "executor's split)")
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


def parse_partition(text: str | None):
    """``--partition``: None, ``"time"`` or a tuple of layer counts."""
    if text is None:
        return None
    if text.strip() == "time":
        return "time"
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--partition takes layer counts per stage (e.g. 3,2,2,3) or 'time'; got {text!r}") from None
    if any(c < 0 for c in counts):
        raise ValueError(f"--partition: layer counts must be >= 0; got {text!r}")
    return counts


def check_profile_model(prof, model: str | None, where: str = "--profile") -> None:
    """A ``--model`` given with a profile must be the profile's model."""
    if model is None:
        return
    ok = same_model_ref(model, prof.model_name) if is_model_ref(model) or prof.is_stack else \
        model == prof.model_name or load_model(model) == prof.model
    if not ok:
        raise ValueError(f"{where} {prof.name} was measured for model {prof.model_name}, not {model}; calibrate "
                         f"{model} (pipetwin calibrate --model {model}) or drop --model")


def profile_partition(prof, choice, num_stages: int) -> tuple[int, ...] | None:
    """Layers per stage over the profile's layers: the given counts, ``"time"`` (balanced by the
    measured layer times) or None (the executor's default split)."""
    if choice == "time":
        return prof.time_partition(num_stages)
    return choice


def profile_costs(prof, low, *, cluster=None, device_map: str = "sequential", partition=None,
                  recompute: str = "none", label: str = "profile"):
    """(StageCosts, network, extra report fields) of a lowered schedule from calibration profile
    ``prof``: on its own host (``cluster`` None: cpu ranks sharing the calibrated cores, extra
    ``host``) or scaled onto ``cluster`` (a Cluster: the module docstring's scaling, placed with
    ``device_map``). ``partition``: layer counts, ``"time"`` or None (the executor's split)."""
    part = profile_partition(prof, partition, low.num_stages)
    if cluster is None:
        costs = prof.cost_model(low.num_stages, part, recompute=recompute).bind(low)
        net = prof.cluster(low.num_ranks)
        return costs, net, {"cost_model": label, "cluster": net.name, "micro_batch": prof.micro_batch,
                            "host": (prof.cores, prof.oversubscribed_slowdown) if prof.cores else None}
    if recompute != "none":
        raise ValueError("--recompute with a profile scaled onto a cluster is not modelled; use none")
    if low.num_ranks > cluster.num_devices:
        raise ValueError(f"{low.num_ranks} ranks (D={low.num_devices} x R={low.replicas}) do not fit on cluster "
                         f"{cluster.name} with {cluster.num_devices} devices; pick a bigger --cluster")
    layers, factor = scaled_layer_costs(prof, cluster.device)
    costs = PerLayerCostModel(layers, part or prof.default_partition(low.num_stages)).bind(low)
    costs.meta.update(memory_capacity=cluster.device.memory_bytes)
    return costs, cluster.place(low, device_map), {
        "cost_model": f"{label} scaled onto {cluster.device.name} (measured times x {factor:.3g}: this host's FLOP "
                      f"rate / the device's achievable fp32 rate)",
        "cluster": cluster.name, "micro_batch": prof.micro_batch, "device_map": device_map,
        "memory_capacity": cluster.device.memory_bytes}


def resolve_costs(args, low):
    """(StageCosts, network or None, extra report fields) for a lowered schedule."""
    if getattr(args, "unit_costs", False):
        return UnitCostModel().bind(low), None, {"cost_model": "unit"}
    choice = parse_partition(getattr(args, "partition", None))
    if getattr(args, "profile", None):
        prof = load_profile(args.profile)
        check_profile_model(prof, args.model)
        if args.micro_batch is not None and args.micro_batch != prof.micro_batch:
            raise ValueError(f"profile {args.profile} was measured at micro-batch {prof.micro_batch}; calibrate "
                             f"again with --micro-batch {args.micro_batch} (costs are not extrapolated)")
        cluster = load_cluster(args.cluster) if args.cluster else None
        return profile_costs(prof, low, cluster=cluster, device_map=args.device_map, partition=choice,
                             recompute=args.recompute, label=f"profile {args.profile}")
    if choice == "time":
        raise ValueError("--partition time balances measured layer times: it needs --profile FILE.yaml")
    model = load_model(args.model or DEFAULT_MODEL)
    if args.micro_batch is not None:
        if args.micro_batch < 1:
            raise ValueError(f"--micro-batch must be >= 1; got {args.micro_batch}")
        model = model.replace(micro_batch=args.micro_batch)
    cluster = load_cluster(args.cluster or DEFAULT_CLUSTER)
    if low.num_ranks > cluster.num_devices:
        raise ValueError(f"{low.num_ranks} ranks (D={low.num_devices} x R={low.replicas}) do not fit on cluster "
                         f"{cluster.name} with {cluster.num_devices} devices; pick a bigger --cluster")
    placed = cluster.place(low, args.device_map)
    costs = TransformerCostModel(model, cluster.device, recompute=args.recompute, partition=choice).bind(low)
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
    if args.jitter < 0:
        raise ValueError("--jitter must be >= 0")
    base = SimOptions(slowdown=slow, link_slowdown=links, jitter=args.jitter, seed=args.seed)
    return on_one_host(base, low.num_ranks, *host) if host else base
