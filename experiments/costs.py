"""Cost-model and simulator options shared by simulate / compare / demo.

``--cost-model`` picks how layer times are computed from ``--model`` on the cluster's device:
``kernels`` (the default where the device preset has the kernel model's constants:
:mod:`cost_models.kernels`, checked against measured V100 layers by ``pipetwin reproduce
cost-curves``; per-sample costs fall with the micro-batch) or ``linear`` (FLOPs at the device's
fixed efficiency: the same per sample at every micro-batch, the closed-form view). ``--model
FILE.txt`` reads a per-layer profile in PipeDream's graph format (DAPPLE's released profiles),
profiled at ``--profile-batch`` (default: the ``pbs-B`` in the file name) and scaled linearly to
the micro-batch as DAPPLE did unless ``--cost-model kernels`` is asked for.

The cost source is one of three, never silently two: ``--unit-costs``, ``--profile FILE`` (measured
costs and network) or ``--model``/``--cluster`` (formulas; the defaults when none is given).
:func:`cost_inputs` reads them (cheap: presets and files) so that the size checks can run before a
schedule is built; :func:`bind_costs` binds them to the built schedule.

A calibration profile (``pipetwin calibrate``; the only cost source of a model file
``--model PATH.py:FUNC``, which may be named beside it and must be the profile's) is used on this machine as calibrated
(the ranks share its cores), or with ``--cluster`` scaled onto that cluster's devices
(:func:`cost_models.scaled_layer_costs`: every measured time times this host's FLOP rate over the
device's achievable one) and placed on its network. :func:`calibrated_costs` is that choice as a
library call (``pipetwin sweep`` can call it too). ``--partition`` gives layers per stage (or
``time``: balanced by a profile's measured layer times).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from cost_models import (FABRICS, MAPPINGS, PerLayerCostModel, TransformerCostModel, UnitCostModel, is_model_ref,
                         load_cluster, load_model, load_profile, scaled_layer_costs, with_fabric, with_nodes)
from cost_models.comm import links_used
from cost_models.stack import same_model_ref
from cost_models.kernels import COST_MODELS
from sim import SimOptions
from sim.host import HostCores, on_one_host

from .checks import factor_pair, float_in, nonneg_float, nonneg_int, pairs_dict, positive_int

DEFAULT_MODEL = "gpt-96"
DEFAULT_CLUSTER = "dgx-a100-4x8-ib"


def add_cost_args(p):
    p.add_argument("--unit-costs", action="store_true",
                   help="closed-form unit costs: F=1, B=2 per full stage, no communication, memory in Ma")
    p.add_argument("--model", "-m", default=None,
                   help=f"model preset or YAML file (default {DEFAULT_MODEL}; 'pipetwin presets' lists them), a "
                        f"per-layer profile in PipeDream's graph format (FILE.txt, e.g. DAPPLE's profiles), or a "
                        f"model file PATH.py:FUNC with its --profile")
    add_cost_model_args(p)
    p.add_argument("--cluster", "-c", default=None,
                   help=f"cluster preset or YAML file, optionally sized NAME:NODES (default {DEFAULT_CLUSTER}; "
                        f"e.g. dgx-h100-ib:128); with --profile: the measured layer times scaled onto it (default "
                        f"there: this machine, as calibrated)")
    add_cluster_shape_args(p)
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
    p.add_argument("--micro-batch", type=positive_int, help="micro-batch size (default: the model spec's)")
    p.add_argument("--slowdown", action="append", default=[], metavar="RANK=FACTOR", type=factor_pair("RANK", int),
                   help="a straggler: compute on RANK takes FACTOR times longer (repeatable)")
    p.add_argument("--slow-link", action="append", default=[], metavar="LINK=FACTOR",
                   type=factor_pair("LINK", str, "n1.nic0.out=4"),
                   help="a slow link: divide the bandwidth of LINK (e.g. n1.nic0.out) by FACTOR (repeatable); "
                        "the run must cross it")
    p.add_argument("--jitter", type=nonneg_float, default=0.0, help="relative std-dev of per-op compute noise")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed for --jitter")
    p.add_argument("--exact", action="store_true",
                   help="simulate every data-parallel replica op by op even when they are identical (by default "
                        "one replica stands for all when nothing tells them apart)")


def add_cluster_shape_args(p):
    """--nodes / --fabric / --oversubscription / --nodes-per-leaf: any cluster preset resized and rewired."""
    p.add_argument("--nodes", type=positive_int, help="number of nodes of the cluster's kind (overrides the preset's)")
    p.add_argument("--fabric", choices=FABRICS, help="inter-node fabric: flat (one non-blocking switch), fat-tree "
                   "(leaves of --nodes-per-leaf nodes) or rail (rail-optimised: NIC k of a group on one switch)")
    p.add_argument("--oversubscription", type=float_in(1.0, 1e6), metavar="RATIO",
                   help="fat-tree / rail: a leaf's down / up bandwidth (1 = non-blocking, e.g. 2)")
    p.add_argument("--nodes-per-leaf", type=positive_int, help="fat-tree / rail: nodes under one leaf (rail) switch")


def shape_cluster(cluster, args):
    """A loaded cluster with the --nodes / --fabric / --oversubscription / --nodes-per-leaf of ``args``
    (values checked by the parser; a library caller's bad value is the Cluster's SpecError)."""
    nodes = getattr(args, "nodes", None)
    if nodes is not None:
        cluster = with_nodes(cluster, nodes)
    return with_fabric(cluster, getattr(args, "fabric", None), getattr(args, "oversubscription", None),
                       getattr(args, "nodes_per_leaf", None))


def load_shaped_cluster(args, loader=load_cluster, default: str = DEFAULT_CLUSTER):
    """The cluster of ``--cluster`` (``NAME:NODES`` allowed) shaped by :func:`add_cluster_shape_args`' options."""
    return shape_cluster(loader(getattr(args, "cluster", None) or default), args)


def add_cost_model_args(p) -> None:
    """``--cost-model`` and ``--profile-batch`` (shared with ``pipetwin plan``)."""
    p.add_argument("--cost-model", choices=list(COST_MODELS), default=None,
                   help="layer times: 'kernels' (GEMM tiles and waves, memory-bound kernels, launch overhead: costs "
                        "depend on the micro-batch; default where the device has the constants) or 'linear' (FLOPs "
                        "at a fixed efficiency; the default for --model FILE.txt profiles, as DAPPLE scaled them)")
    p.add_argument("--profile-batch", type=positive_int, metavar="B",
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
    from cost_models.workload_sources import load_workload
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
    """A ``--model`` given with a calibration profile must be the profile's model."""
    if model is None:
        return
    ok = same_model_ref(model, prof.model_name) if is_model_ref(model) or prof.is_stack else \
        model == prof.model_name or load_model(model) == prof.model
    if not ok:
        raise ValueError(f"{where} {prof.name} was measured for model {prof.model_name}, not {model}; calibrate "
                         f"{model} (pipetwin calibrate --model {model}) or drop --model")


def profile_partition(prof, choice, num_stages: int) -> tuple[int, ...] | None:
    """Layers per stage over a calibration profile's layers: the given counts, ``"time"`` (balanced
    by the measured layer times) or None (the executor's default split)."""
    if choice == "time":
        return prof.time_partition(num_stages)
    return choice


def calibrated_costs(prof, low, *, cluster=None, device_map: str = "sequential", partition=None,
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
                            "host": host_record(prof)}
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


@dataclass(frozen=True)
class CostInputs:
    """What the cost options name, loaded: ``kind`` unit | profile | transformer | layer-profile (a
    PipeDream-format ``--model FILE.txt``, read when bound: its partition needs the schedule)."""

    kind: str
    model: object = None     # ModelSpec (transformer)
    cluster: object = None   # Cluster (transformer; a profile's scaled onto it)
    profile: object = None   # CalibrationProfile (profile)

    def limits(self) -> dict:
        """Keyword arguments of :func:`experiments.checks.check_run_size` (cluster size, layers)."""
        if self.kind == "transformer":
            return {"cluster_devices": self.cluster.num_devices, "cluster_name": self.cluster.name,
                    "layers": self.model.layers + 2, "model_name": self.model.name}
        if self.kind == "layer-profile":
            return {"cluster_devices": self.cluster.num_devices, "cluster_name": self.cluster.name}
        if self.kind == "profile":
            m = self.profile.model
            size = {"cluster_devices": self.cluster.num_devices, "cluster_name": self.cluster.name} \
                if self.cluster is not None else {}
            return {"layers": m.num_layers if self.profile.is_stack else m.layers + 2, "model_name": m.name, **size}
        return {}


def cost_inputs(args) -> CostInputs:
    """Load the cost source the options name (see the module docstring); conflicting sources are an error."""
    if getattr(args, "cost_model", None) and (getattr(args, "unit_costs", False) or getattr(args, "profile", None)):
        raise ValueError("--cost-model applies to --model/--cluster costs; drop it with --unit-costs / --profile")
    given = [f for f, v in (("--model", getattr(args, "model", None)), ("--cluster", getattr(args, "cluster", None)),
                            ("--micro-batch", getattr(args, "micro_batch", None)),
                            ("--cost-model", getattr(args, "cost_model", None)),
                            ("--profile-batch", getattr(args, "profile_batch", None)),
                            ("--nodes", getattr(args, "nodes", None)), ("--fabric", getattr(args, "fabric", None)),
                            ("--oversubscription", getattr(args, "oversubscription", None)),
                            ("--nodes-per-leaf", getattr(args, "nodes_per_leaf", None))) if v is not None]
    if getattr(args, "unit_costs", False):
        if getattr(args, "profile", None) or given:
            raise ValueError(f"--unit-costs replaces every cost model; drop {', '.join(given or ['--profile'])}")
        return CostInputs("unit")
    if getattr(args, "profile", None):
        # a model file (--model PATH.py:FUNC) is checked against the profile's model, a --cluster is
        # where its measured times are scaled to; any other model option is a second cost source
        shape = ("--nodes", "--fabric", "--oversubscription", "--nodes-per-leaf")
        if not getattr(args, "cluster", None) and any(f in shape for f in given):
            raise ValueError(f"{', '.join(f for f in given if f in shape)} shape a --cluster; with --profile give "
                             f"the --cluster to scale the measured times onto (or drop them)")
        given = [f for f in given if f not in ("--cluster", "--micro-batch", *shape)
                 and not (f == "--model" and is_model_ref(args.model))]
        if given:
            raise ValueError(f"--profile brings the measured model and network; drop {', '.join(given)}")
        prof = load_profile(args.profile)
        check_profile_model(prof, args.model)
        if args.micro_batch is not None and args.micro_batch != prof.micro_batch:
            raise ValueError(f"profile {args.profile} was measured at micro-batch {prof.micro_batch}; calibrate "
                             f"again with --micro-batch {args.micro_batch} (measured costs are not extrapolated)")
        return CostInputs("profile", profile=prof, cluster=load_shaped_cluster(args) if args.cluster else None)
    if parse_partition(getattr(args, "partition", None)) == "time":
        raise ValueError("--partition time balances measured layer times: it needs --profile FILE.yaml")
    cluster = load_shaped_cluster(args)
    if str(args.model).endswith(".txt"):
        return CostInputs("layer-profile", cluster=cluster)
    if getattr(args, "profile_batch", None) is not None:
        raise ValueError("--profile-batch applies to a profile file (--model FILE.txt) only")
    model = load_model(args.model or DEFAULT_MODEL)
    if args.micro_batch is not None:
        model = model.replace(micro_batch=args.micro_batch)
    return CostInputs("transformer", model=model, cluster=cluster)


def bind_costs(args, inputs: CostInputs, low):
    """(StageCosts, network or None, extra report fields) for a lowered schedule."""
    if inputs.kind == "unit":
        return UnitCostModel().bind(low), None, {"cost_model": "unit"}
    choice = parse_partition(getattr(args, "partition", None))
    if inputs.kind == "profile":
        return calibrated_costs(inputs.profile, low, cluster=inputs.cluster, device_map=args.device_map,
                                partition=choice, recompute=args.recompute, label=f"profile {args.profile}")
    model, cluster = inputs.model, inputs.cluster
    if low.num_ranks > cluster.num_devices:
        raise ValueError(f"{low.num_ranks} ranks (D={low.num_devices} x R={low.replicas}) do not fit on cluster "
                         f"{cluster.name} with {cluster.num_devices} devices; pick a bigger --cluster")
    profile = inputs.kind == "layer-profile"
    cost_model = cost_model_for(getattr(args, "cost_model", None), cluster.device, profile)
    placed = cluster.place(low, args.device_map)
    if profile:
        if choice is not None:
            raise ValueError("--partition does not apply to a --model FILE.txt profile (it is split by work)")
        costs, mb, part = _profile_costs(args, low, cluster, cost_model)
        return costs, placed, {"cost_model": cost_model, "model": str(args.model), "micro_batch": mb,
                               "partition": list(part), "cluster": cluster.name, "device_map": args.device_map,
                               "memory_capacity": costs.meta.get("memory_capacity")}
    costs = TransformerCostModel(model, cluster.device, recompute=args.recompute, compute=cost_model,
                                 partition=choice).bind(low)
    return costs, placed, {"cost_model": cost_model, "model": model.name, "micro_batch": model.micro_batch,
                           "cluster": cluster.name, "device_map": args.device_map,
                           "memory_capacity": costs.meta.get("memory_capacity")}


def resolve_costs(args, low):
    """:func:`cost_inputs` then :func:`bind_costs` (for callers that built the schedule already)."""
    return bind_costs(args, cost_inputs(args), low)


def check_slow_links(links: dict, network, low, *, crossed: bool = True) -> None:
    """Every ``--slow-link`` must be a link of ``network`` and (``crossed``) one the run crosses
    (else it would do nothing)."""
    if not links:
        return
    if network is None or not hasattr(network, "links"):
        raise ValueError("--slow-link needs a cluster (not --unit-costs)")
    known = {ln.name for ln in network.links()}
    for name in links:
        if name not in known:
            raise ValueError(f"--slow-link: no link named {name!r} in this cluster; links look like "
                             f"{', '.join(sorted(known)[:4])} ...")
    if not crossed:
        return
    used = links_used(low, network)
    for name in links:
        if name not in used:
            some = ", ".join(sorted(used)[:6]) or "none (no messages)"
            raise ValueError(f"--slow-link: this run never crosses link {name!r}, so slowing it changes nothing; "
                             f"it crosses {some}{' ...' if len(used) > 6 else ''}")


def host_record(prof) -> dict | None:
    """How a profile's ranks share their host, as a record (:class:`sim.host.HostCores`'s fields;
    None when the profile names no cores): the ``host`` entry of a simulation's report."""
    host = HostCores.of(prof)
    return None if host is None else asdict(host)


def sim_options(args, low, network=None, host: dict | None = None, *,
                check_links: bool = True) -> SimOptions:
    """Simulator options from the CLI; ``host`` (:func:`host_record`): all ranks run on that one
    host (calibrated CPU runs), so they share its cores."""
    slow = pairs_dict(args.slowdown, "--slowdown")
    links = pairs_dict(getattr(args, "slow_link", []), "--slow-link")
    check_slow_links(links, network, low, crossed=check_links)
    for r in slow:
        if not 0 <= r < low.num_ranks:
            raise ValueError(f"--slowdown names rank {r}, but the run has ranks 0..{low.num_ranks - 1}")
    base = SimOptions(slowdown=slow, link_slowdown=links, jitter=args.jitter, seed=args.seed,
                      exact=getattr(args, "exact", False))
    return on_one_host(base, low.num_ranks, HostCores(**host)) if host else base
