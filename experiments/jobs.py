"""The command line's options of a job, and the one place they become a :class:`cost_models.job.Job`.

A command adds the option groups it takes (:func:`add_layout_args`, :func:`add_cost_args`,
:func:`add_fault_args`) and calls :func:`job_from_args` once; the job is then all that the
library sees (:func:`sim.simulate_job`, :func:`cost_models.bind.bind`,
:meth:`executor.RunConfig.from_job`). The job checks itself field by field (one line naming the
option, exit status 2); the options' types (:mod:`experiments.checks`) already refuse malformed
values while parsing.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from cost_models import FABRICS, MAPPINGS
from cost_models.job import DEFAULT_CLUSTER, DEFAULT_MODEL, ClusterChoice, Faults, Job, Layout, route_fields
from cost_models.kernels import COST_MODELS
from cost_models.parallel import RECOMPUTE, ZERO_STAGES, Parallel
from schedules import families, get, names
from schedules.registry import ALIASES

from .checks import byte_size, factor_pair, memory_limit, float_in, input_file, nonneg_float, nonneg_int, positive_int

SCHEDULE_DEFAULTS = {"chunks": 2, "dp": 1, "tp": 1}     # chunks: for the families that take them (check_chunks)
# What a --plan file fixes: these options describe the layout the planner chose (or the model and
# cluster it chose it for), so with a plan they are refused (check_plan_args), never dropped: (the
# option's dest, what it fixes). --tp-overlap and --cost-model are what-ifs a whole-layout plan takes
# (its job rebound with them); a plan without a tensor-parallel group, and a DAPPLE plan's layer
# costs, fix them (plan_facts names them only then). The other options of simulate / run are applied
# to the plan: --no-eager, --fabric / --oversubscription / --nodes-per-leaf and --memory-reserve (the
# plan's bind, planner.plan_io), the faults and --exact (sim.job_options), run's training options and
# run's --device-map (which torchrun process runs which of the plan's ranks, see cmd_run).
PLAN_FIXES = (
    ("schedule", "the schedule"), ("schedule_file", "the schedule"), ("devices", "the pipeline devices"),
    ("microbatches", "the micro-batches"),
    ("chunks", "the chunks"), ("variant", "the schedule's variant"), ("dp", "the data-parallel replicas"),
    ("tp", "tensor parallelism"), ("memory_limit", "the memory limit"), ("model", "the model"),
    ("seq_len", "the sequence length"), ("cluster", "the cluster"), ("nodes", "the cluster's size"),
    ("unit_costs", "the costs"), ("profile", "the costs and the layer partition"), ("stage_costs", "the costs"),
    ("profile_batch", "the costs"), ("micro_batch", "the micro-batch size"), ("partition", "the layer partition"),
    ("recompute", "recomputation"), ("zero", "ZeRO"), ("sequence_parallel", "sequence parallelism"),
    ("device_map", "the device map"), ("tp_overlap", "tensor parallelism"), ("cost_model", "the layer costs"),
)


# ---------------------------------------------------------------------- option groups
def add_layout_args(p, *, schedule=True, many=False, plan: str | None = None):
    """-s/-D/-N/--chunks/--variant/--dp/--no-eager. With ``plan`` (the help text of a ``--plan
    PLAN.json`` option) a plan file may bring the schedule and layout instead: those options then
    default to None and :func:`check_plan_args` requires them, after parsing, when no plan is
    given. ``many``: ``--schedules`` (a list) instead of ``-s``."""
    required = plan is None
    if schedule:
        p.add_argument("--schedule", "-s", required=False, help=f"one of: {', '.join(names())} (or an upstream name: "
                       f"{', '.join(f'{a} = {n}' for a, n in ALIASES.items())})")
    if many:
        p.add_argument("--schedules", default="all", help="comma-separated schedule names, or 'all'")
    p.add_argument("--schedule-file", metavar="FILE", type=input_file,
                   help="a schedule written as a file: torch.distributed.pipelining's CSV (FILE.csv, compute actions "
                        "0F1 1I0 1W0 1B0) or pipetwin's text form (one line 'd: F0.s0 B0.s0 ...' per device; "
                        "'pipetwin schedules --export' writes both); it fixes D and N and is checked for deadlocks "
                        "before anything runs" + ("; compared beside --schedules" if many else ""))
    p.add_argument("--devices", "-D", type=positive_int, help="pipeline devices D")
    p.add_argument("--microbatches", "-N", type=positive_int, help="micro-batches N per iteration")
    p.add_argument("--chunks", "-v", type=positive_int, default=None,
                   help=f"chunks per device for the schedules that take them ({', '.join(chunked())}; default 2)")
    p.add_argument("--variant", default=None,
                   help="a schedule's variant (default: its first); " +
                        "; ".join(f"{n}: {', '.join(f.variants)}" for n, f in families().items() if f.variants))
    p.add_argument("--dp", type=positive_int, default=SCHEDULE_DEFAULTS["dp"] if required else None,
                   help="data-parallel replicas R of the whole pipeline (default 1)")
    p.add_argument("--tp", type=positive_int, default=SCHEDULE_DEFAULTS["tp"] if required else None,
                   help="tensor-parallel size T: GPUs per pipeline device that split every layer Megatron-style "
                            "(T x D x R GPUs; default 1)")
    p.add_argument("--memory-limit", type=memory_limit, metavar="MA|BYTES",
                   help="zb-auto: each device's limit, in Ma (activations of full stages, e.g. 12) or bytes of "
                        "device memory with a unit (e.g. '40 GiB'), in place of --variant's")
    p.add_argument("--no-eager", action="store_true", help="all-reduce gradients at the end, not in bubbles")
    if plan is not None:
        p.add_argument("--plan", metavar="PLAN.json", help=plan)
    _declare(p, "layout")


def check_plan_args(args, *, applied: tuple[str, ...] = ()):
    """For commands with ``--plan``: the plan file, loaded (None without ``--plan``). With a plan
    every option it fixes (:data:`PLAN_FIXES`, less the dests in ``applied``, which the command
    applies itself) is refused, one line naming the first given, the plan's value and every such
    option to drop; without one -s/-D/-N are required and --dp/--tp take their defaults (set on
    ``args``)."""
    plan = load_plan_arg(args)
    if plan is not None:
        o, facts = vars(args), plan_facts(plan)
        facts.setdefault("schedule_file", facts["schedule"])
        given = [(d, what) for d, what in PLAN_FIXES
                 if d in facts and d not in applied and o.get(d) is not None and o.get(d) is not False]
        if given:
            (dest, what), name = given[0], Path(args.plan).name
            drop = ", ".join(_flag(d) for d, _ in given)
            raise ValueError(f"{_flag(dest)}: the plan file fixes {what} ({facts[dest]} in {name}); "
                             f"drop {drop} or plan again")
        return plan
    missing = [f"--{d}" for d in ("schedule", "devices", "microbatches") if vars(args).get(d, 0) is None]
    if missing and not vars(args).get("schedule_file"):
        raise ValueError(f"give {', '.join(missing)} (or --plan PLAN.json), or a --schedule-file FILE")
    for dest in ("dp", "tp"):
        if vars(args).get(dest) is None:
            setattr(args, dest, SCHEDULE_DEFAULTS[dest])
    return None


def _flag(dest: str) -> str:
    return f"--{dest.replace('_', '-')}"


def plan_facts(plan) -> dict[str, str]:
    """What a loaded plan file fixes, by option dest (:data:`PLAN_FIXES`), as a short phrase with
    its value: a whole-layout plan (:class:`planner.plan_io.LayoutPlan`, a job) or a DAPPLE plan
    (:class:`planner.plan_io.LoadedPlan`)."""
    from cost_models.memory import fmt_bytes
    from planner.plan_io import LayoutPlan
    costs = f"{plan.model.name if isinstance(plan, LayoutPlan) else plan.workload.name} on {plan.cluster.name}"
    facts = {"cluster": f"cluster {plan.cluster.name}", "nodes": f"{plan.cluster.nodes} nodes",
             "unit_costs": costs, "profile": costs, "stage_costs": costs, "profile_batch": costs}
    if isinstance(plan, LayoutPlan):
        f, lay, par = plan.job_fields, plan.job_fields["layout"], plan.job_fields["parallel"]
        limit = lay.memory_limit
        facts.update(schedule=f"schedule {lay.schedule}", devices=f"D {lay.devices}",
                     microbatches=f"N {lay.microbatches}", chunks=f"chunks {lay.chunks}",
                     variant=f"variant {lay.variant or 'default'}", dp=f"R {lay.replicas}", tp=f"T {par.tp}",
                     memory_limit="memory limit " + ("none" if limit is None else f"{limit[0]:g} {limit[1]}"),
                     model=f"model {plan.model.name}", seq_len=f"sequence length {plan.model.seq_len}",
                     micro_batch=f"micro-batch {par.micro_batch}", partition="the default split",
                     recompute=f"recompute {par.recompute}", zero=f"zero {par.zero}",
                     sequence_parallel="sequence parallel " + ("on" if par.sequence_parallel else "off"),
                     device_map=f"device map {f['device_map']}")
        if par.tp == 1:
            facts["tp_overlap"] = "T 1"
        return facts
    p, src, spec = plan.plan, plan.workload.source, plan.workload.spec
    facts.update(schedule=f"schedule {p.schedule}", devices=f"{p.num_stages} stages",
                 microbatches=f"M {p.microbatches}", chunks=f"chunks {p.chunks}", variant="the schedule's default",
                 dp=f"R {p.dp}" if p.uniform else "stage replicas " + ":".join(map(str, p.replicas)),
                 tp="T 1", memory_limit="memory limit " + ("the device's" if plan.memory_limit is None else
                                                           fmt_bytes(plan.memory_limit)),
                 model=f"model {plan.workload.name}", micro_batch=f"micro-batch {p.micro_batch}",
                 partition="layers " + "|".join(map(str, p.schedule_partition)),
                 recompute=f"recompute {src.get('recompute', 'none')}", zero="zero 0",
                 sequence_parallel="sequence parallel off", device_map="the planner's placement",
                 tp_overlap="T 1", cost_model=f"cost model {src.get('cost_model', 'linear')}")
    facts["seq_len"] = f"sequence length {spec.seq_len}" if spec is not None else facts["model"]
    return facts


def chunked() -> list[str]:
    """The schedule families whose ``chunks`` per device matter (the registry's ``takes_chunks``)."""
    return [n for n, f in families().items() if f.takes_chunks]


def check_chunks(chunks: int | None, schedules) -> None:
    """``--chunks`` given (not None) for ``schedules`` of which none takes chunks: refused, since it
    would change nothing."""
    if chunks is not None and not any(get(n).takes_chunks for n in schedules):
        raise ValueError(f"--chunks applies to {', '.join(chunked())} only; {', '.join(schedules)} "
                         f"{'has' if len(schedules) == 1 else 'have'} no chunks (drop --chunks)")


def add_cluster_shape_args(p):
    """--nodes / --fabric / --oversubscription / --nodes-per-leaf: any cluster preset resized and rewired."""
    p.add_argument("--nodes", type=positive_int, help="number of nodes of the cluster's kind (overrides the preset's)")
    p.add_argument("--fabric", choices=FABRICS, help="inter-node fabric: flat (one non-blocking switch), fat-tree "
                   "(leaves of --nodes-per-leaf nodes) or rail (rail-optimised: NIC k of a group on one switch)")
    p.add_argument("--oversubscription", type=float_in(1.0, 1e6), metavar="RATIO",
                   help="fat-tree / rail: a leaf's down / up bandwidth (1 = non-blocking, e.g. 2)")
    p.add_argument("--nodes-per-leaf", type=positive_int, help="fat-tree / rail: nodes under one leaf (rail) switch")


def add_cost_model_args(p) -> None:
    """``--cost-model`` and ``--profile-batch`` (shared with ``pipetwin plan``)."""
    p.add_argument("--cost-model", choices=list(COST_MODELS), default=None,
                   help="layer times: 'kernels' (GEMM tiles and waves, memory-bound kernels, launch overhead: costs "
                        "depend on the micro-batch; default where the device has the constants) or 'linear' (FLOPs "
                        "at a fixed efficiency; the default for --model FILE.txt profiles, as DAPPLE scaled them)")
    p.add_argument("--profile-batch", type=positive_int, metavar="B",
                   help="the batch a --model FILE.txt profile was measured at (default: the pbs-B in its name)")


def add_cost_args(p, *, per_run: bool = True):
    """Where the costs come from (see :mod:`cost_models.bind`): --unit-costs | --profile |
    --model x --cluster, with --cost-model, --device-map, --recompute and (``per_run``: one value
    per run, not a sweep's axis) --micro-batch and --partition."""
    p.add_argument("--unit-costs", action="store_true",
                   help="closed-form unit costs: F=1, B=2 per full stage, no communication, memory in Ma")
    p.add_argument("--model", "-m", default=None,
                   help=f"model preset, YAML file or Hugging Face config.json (Llama, Mistral, Qwen2, GPT-2; default "
                        f"{DEFAULT_MODEL}; 'pipetwin presets' lists them), a "
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
    p.add_argument("--stage-costs", metavar="FILE.yaml", type=input_file,
                   help="your own per-stage times (f, b, w seconds per stage, message seconds, optional "
                        "activation bytes; see the README): instead of --model/--cluster formulas")
    if per_run:
        p.add_argument("--partition", metavar="COUNTS|time",
                       help="layers per stage of a model copy, e.g. 3,2,2,3 (a transformer's embedding and head "
                            "count as layers), or 'time': balanced by the profile's measured layer times (default: "
                            "the executor's split)")
    p.add_argument("--device-map", default=None, choices=sorted(MAPPINGS),
                   help="how ranks are placed on the cluster's devices (copies-same-node: BitPipe's mapping; "
                        "megatron: TP, then DP, then PP; default megatron with --tp > 1, else sequential)")
    if per_run:
        p.add_argument("--recompute", default=None, choices=list(RECOMPUTE),   # None: not given (a --plan's own)
                       help="activation recomputation (default none): none keeps every activation; selective re-runs "
                            "the attention "
                            "core in the backward (keeps no score matrix); full keeps only each block's input and "
                            "re-runs its forward")
    else:
        p.add_argument("--recompute", default="none", metavar="LIST",
                       help="activation recomputations, comma-separated out of none, selective, full (default none; "
                            "see pipetwin simulate --help)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with --tp: norms and dropouts on 1/T of the sequence, reduce-scatter + all-gather in place "
                        "of the all-reduces (Korthikanti et al.)")
    p.add_argument("--tp-overlap", action="store_true",
                   help="with --tp: the tensor-parallel collectives overlap the layer's compute (default: on the "
                        "critical path, Megatron's default)")
    if per_run:
        p.add_argument("--zero", type=int, choices=list(ZERO_STAGES), default=None,   # None: not given
                       help="1: ZeRO-1, the optimizer state sharded over the --dp replicas (reduce-scatter + "
                            "all-gather in place of the gradient all-reduce; default 0)")
    else:
        p.add_argument("--zero", default="0", metavar="LIST",
                       help="ZeRO stages, comma-separated out of 0, 1 (default 0; 1: the optimizer state sharded "
                            "over the replicas)")
    if per_run:
        p.add_argument("--micro-batch", type=positive_int, help="micro-batch size (default: the model spec's)")
    p.add_argument("--memory-reserve", type=byte_size("--memory-reserve"), metavar="BYTES",
                   help="device memory kept back for the CUDA context, communicator buffers and fragmentation, "
                        "e.g. '4 GiB' (default 1 GiB + 5%% of the device's memory)")
    p.add_argument("--seq-len", type=positive_int, help="training sequence length (default: the model's; a Hugging "
                                                          "Face config's max_position_embeddings)")
    _declare(p, "costs")


def add_fault_args(p):
    """Stragglers, slow links, jitter and --exact (simulated runs)."""
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
    _declare(p, "faults")


# ---------------------------------------------------------------------- options -> job
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


def cluster_from_args(args) -> ClusterChoice:
    """The cluster options (``--cluster`` and :func:`add_cluster_shape_args`) as a :class:`ClusterChoice`."""
    return ClusterChoice(name=args.cluster, nodes=args.nodes, fabric=args.fabric,
                         oversubscription=args.oversubscription, nodes_per_leaf=args.nodes_per_leaf)


def layout_from_args(args, *, schedules=None, **overrides) -> Layout:
    """The layout options as a :class:`Layout` (``overrides``: its fields, for the commands whose
    options give a list where the layout has one value: ``compare``'s schedules, a sweep's axes;
    ``schedules``: the names a ``--chunks`` applies to, default the layout's one)."""
    o = vars(args)
    sf = schedule_file_arg(args)
    if sf is not None and "schedule" not in overrides:
        return file_layout(args, sf)
    fields = dict(schedule=o.get("schedule"), devices=o.get("devices"), microbatches=o.get("microbatches"),
                  replicas=o.get("dp") or SCHEDULE_DEFAULTS["dp"],
                  chunks=o.get("chunks") or SCHEDULE_DEFAULTS["chunks"], variant=o.get("variant"),
                  memory_limit=o.get("memory_limit"))
    if sf is not None:      # compare: the named schedules at the file's D and N unless given
        fields.update(devices=fields["devices"] or sf.schedule.num_devices,
                      microbatches=fields["microbatches"] or sf.schedule.num_microbatches)
    fields.update(overrides)
    missing = [f for f, d in (("--devices", "devices"), ("--microbatches", "microbatches")) if fields[d] is None]
    if missing:
        raise ValueError(f"give {', '.join(missing)} (or a --schedule-file FILE)")
    layout = Layout(**fields)
    check_chunks(o.get("chunks"), schedules or [layout.schedule])
    return layout


def schedule_file_arg(args):
    """The ``--schedule-file``, read and validated once (:func:`cost_models.files.load_schedule_file`),
    or None."""
    path = vars(args).get("schedule_file")
    if not path:
        return None
    if vars(args).get("_schedule_file") is None:
        from cost_models.files import load_schedule_file
        args._schedule_file = load_schedule_file(path)
    return args._schedule_file


def file_layout(args, sf, *, chunks: bool = True) -> Layout:
    """The layout of schedule file ``sf``: -D/-N (and ``chunks``: --chunks) given must agree with
    it, --dp and --tp apply; with --schedule too, refused."""
    o = vars(args)
    if o.get("schedule"):
        raise ValueError(f"give --schedule or --schedule-file, not both (the file {Path(sf.path).name} is the "
                         f"schedule)")
    given = {k: o.get(dest) for k, dest in (("devices", "devices"), ("microbatches", "microbatches"),
                                            ("variant", "variant"), ("memory_limit", "memory_limit"))}
    if chunks:
        given["chunks"] = o.get("chunks")
    return Layout.of_file(sf, replicas=o.get("dp") or SCHEDULE_DEFAULTS["dp"],
                          **{k: v for k, v in given.items() if v is not None})


def job_from_args(args, *, layout: Layout | None = None, plan=None, **overrides) -> Job:
    """The one job the options of a command describe: its layout (``layout``, else from the layout
    options; none with ``plan``, a loaded plan file), its cost source and its faults, read from the
    option groups the command added (a group it lacks leaves the job's defaults). ``overrides``:
    job fields the command sets itself."""
    o, groups = vars(args), vars(args).get("_job_groups", frozenset())
    fields: dict = {"plan": plan}
    if plan is None:
        fields["layout"] = layout if layout is not None else layout_from_args(args)
    par: dict = {}
    if "layout" in groups:
        fields["eager"] = not o["no_eager"]
        par["tp"] = o.get("tp") or SCHEDULE_DEFAULTS["tp"]
    if "costs" in groups:
        fields.update(model=o["model"], cluster=cluster_from_args(args), unit_costs=o["unit_costs"],
                      profile=o["profile"], stage_costs=o["stage_costs"],
                      cost_model=o["cost_model"], profile_batch=o["profile_batch"],
                      device_map=o["device_map"], memory_reserve=o["memory_reserve"])
        par.update(recompute=o["recompute"] or "none", sequence_parallel=o["sequence_parallel"],
                   tp_overlap=o["tp_overlap"], zero=0 if o["zero"] is None else o["zero"], seq_len=o["seq_len"])
        if "partition" in o:
            fields.update(partition=parse_partition(o["partition"]))
            par.update(micro_batch=o["micro_batch"])
    if "faults" in groups:
        fields.update(exact=o["exact"], faults=Faults(slowdown=tuple(o["slowdown"]), slow_links=tuple(o["slow_link"]),
                                                      jitter=o["jitter"], seed=o["seed"]))
    layout_over, par_over, own = route_fields(overrides)
    if layout_over:
        fields["layout"] = replace(fields["layout"], **layout_over)
    if plan is not None:     # the plan's record, with the what-if it takes (the options it fixes were refused)
        par = {**plan.parallel.record(), **({"tp_overlap": True} if o.get("tp_overlap") else {})}
    fields["parallel"] = Parallel(**{**par, **par_over})
    fields.update(own)
    return Job(**fields)


def _declare(p, group: str) -> None:
    """Record on the parser that it has option group ``group`` (read by :func:`job_from_args`)."""
    p.set_defaults(_job_groups=frozenset(p.get_default("_job_groups") or ()) | {group})


def load_plan_arg(args):
    """The ``--plan`` file, loaded (the planner's reader), or None."""
    if not vars(args).get("plan"):
        return None
    from planner.plan_io import load_plan
    return load_plan(args.plan)
