"""A job: everything one simulation or run needs, as one typed record checked field by field.

A :class:`Job` says which schedule runs on which layout (:class:`Layout`: schedule, pipeline
devices D, micro-batches N, data-parallel replicas R, chunks, variant), whether gradients are
all-reduced eagerly in the bubbles (``eager``) or at the end, where its costs come from, and what
disturbs it (:class:`Faults`). The cost source is exactly one of

* the model x cluster formulas (the default): ``model`` (a preset, a YAML file, a
  :class:`~cost_models.model_spec.ModelSpec`, or a per-layer profile in PipeDream's graph format
  ``FILE.txt``) on ``cluster`` (:class:`ClusterChoice`: a preset or YAML file, resized and
  rewired), with ``cost_model``, ``partition``, ``device_map``;
* ``unit_costs``: the closed-form unit costs (F = 1, B = 2, no communication, memory in Ma);
* ``profile``: a calibration profile (``pipetwin calibrate``): measured costs on its own host, or
  scaled onto ``cluster`` when one is named;
* ``plan``: a planner plan file, loaded (:class:`PlanSource`), which brings its own layout, model,
  cluster and costs;
* ``stage_costs``: a user's per-stage times, FILE.yaml (:mod:`cost_models.stage_costs`).

``grad_accumulation`` (``--grad-accumulation``; the reproductions of published runs set it) says how
Megatron-LM's gpt block accumulates weight gradients over micro-batches in the kernel model
(:data:`cost_models.kernels.GRAD_ACCUMULATION`).

Constructing a job checks it: a value out of range or two cost sources that exclude each other
raise one ValueError whose message names the command-line option of the field (``--micro-batch``
for ``micro_batch``), so the command line reports it as it is. Checks that need a file read (a
profile's micro-batch, a model file matching its profile) run when the job is bound
(:func:`cost_models.bind.bind`), still before any schedule is built. :func:`check_run_size` is the
cheap feasibility check every engine runs before building a schedule.

Jobs are frozen and picklable (a sweep sends them to worker processes); ``with_layout`` and
``dataclasses.replace`` derive one from another.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from schedules import registry
from schedules.io import ScheduleFile

from .cluster import FABRICS, MAPPINGS, Cluster, load_cluster, with_fabric, with_nodes
from .kernels import COST_MODELS, GRAD_ACCUMULATION
from .model_spec import ModelSpec
from .moe import moe_knobs_given
from .stack import is_model_ref
from .parallel import Parallel, option_name
from .files import short_list

if TYPE_CHECKING:   # pragma: no cover - types only
    from .bind import Bound

DEFAULT_MODEL = "gpt-96"
DEFAULT_CLUSTER = "dgx-a100-4x8-ib"
MAX_JITTER = 1.0            # --jitter: at most a relative standard deviation of 100% per op
MEMORY_UNITS = ("Ma", "B")   # --memory-limit: activations of full stages, or bytes of device memory
MAX_SIM_RANKS = 131_072     # ranks the simulator keeps per-rank records for (one replica simulated for all)


def _whole(value, option: str, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{option} must be an integer >= {low}; got {value!r}")


def _finite(value, option: str, *, positive: bool) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise ValueError(f"{option} must be a finite number {'> 0' if positive else '>= 0'}; got {value!r}")


# how the user gave each cost source that is not the model's formulas (for refusals)
_SOURCE_FLAGS = {"unit": "--unit-costs", "profile": "--profile", "stage-costs": "--stage-costs",
                 "layer-profile": "a FILE.txt layer profile", "plan": "--plan"}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Which schedule runs on which T x D x R layout: ``schedule`` (a family name,
    :func:`schedules.names`) on ``devices`` D pipeline devices with ``microbatches`` N per
    iteration, ``replicas`` R data-parallel copies of the pipeline, ``chunks`` per device for the
    families that take it and the family's ``variant`` (None: its first) (the T of T x D x R is
    the job's ``parallel.tp``); ``memory_limit`` (value, ``"Ma"`` or ``"B"``) for the families
    that order their ops under one (zb-auto): each device's activation limit in Ma, or its whole
    memory in bytes (the costs' static memory, weights and optimizer state, taken off), in place
    of the variant's. ``schedule_file``: a schedule read from a file (:meth:`of_file`) in place of
    a family: it fixes the name, D, N and the chunks, and :meth:`build` lowers it.
    ``stage_replicas``: DAPPLE's non-uniform replication, stage s of the ``dapple`` pipeline on r_s
    of its D = sum(r_s) devices (:mod:`schedules.dapple_replicated`); ``microbatches`` then counts
    the sub-batches, M x lcm(r_s)."""

    schedule: str
    devices: int
    microbatches: int
    replicas: int = 1
    chunks: int = 2
    variant: str | None = None
    memory_limit: tuple[float, str] | None = None
    schedule_file: ScheduleFile | None = None
    stage_replicas: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.schedule_file is not None:
            self._check_file()
            return
        fam = registry.get(self.schedule)    # an unknown name: the registry's one line, with the names
        object.__setattr__(self, "schedule", fam.name)      # an upstream name (1f1b) -> the family's (dapple)
        for value, option in ((self.devices, "--devices"), (self.microbatches, "--microbatches"),
                              (self.replicas, "--dp"), (self.chunks, "--chunks")):
            _whole(value, option)
        if self.memory_limit is not None:
            self._check_memory_limit(fam)
        if self.stage_replicas is not None:
            self._check_stage_replicas()

    @property
    def label(self) -> str:
        """The schedule's name as reports print it (DAPPLE's stage replicas: ``dapple-replicated``)."""
        if self.stage_replicas is not None:
            from schedules.dapple_replicated import REPLICATED
            return REPLICATED
        return self.schedule

    def _check_stage_replicas(self) -> None:
        from schedules.dapple_replicated import sub_batches
        reps = tuple(self.stage_replicas)
        object.__setattr__(self, "stage_replicas", reps)
        for r in reps:
            _whole(r, "stage_replicas")
        if self.schedule != "dapple" or self.variant is not None:
            raise ValueError(f"stage replicas {short_list(reps, sep=':', bare=True)} run DAPPLE's schedule (dapple) "
                             f"only; got {self.schedule}" + (f" {self.variant}" if self.variant else ""))
        if sum(reps) != self.devices:
            raise ValueError(f"stage replicas {short_list(reps, sep=':', bare=True)} occupy {sum(reps)} devices; -D is "
                             f"{self.devices}")
        C = sub_batches(reps)
        if self.microbatches % C:
            raise ValueError(f"stage replicas {short_list(reps, sep=':', bare=True)} cut a micro-batch into {C} "
                             f"sub-batches; -N {self.microbatches} (sub-batches) is not a multiple of {C}")

    @classmethod
    def of_file(cls, sf: ScheduleFile, **fields) -> "Layout":
        """The layout of a schedule file (:func:`cost_models.files.load_schedule_file`): its name, D, N
        and chunks; ``fields``: the others (replicas, tp), or D/N/chunks given again (checked)."""
        s = sf.schedule
        return cls(**{"schedule": sf.name, "devices": s.num_devices, "microbatches": s.num_microbatches,
                      "chunks": sf.chunks, **fields, "schedule_file": sf})

    def _check_file(self) -> None:
        """A schedule file fixes the schedule, D, N and the chunks; it has no variant or memory limit."""
        sf = self.schedule_file
        s, fname = sf.schedule, Path(sf.path).name
        _whole(self.replicas, "--dp")
        for option, value, want, what in (("-D", self.devices, s.num_devices, "devices"),
                                          ("-N", self.microbatches, s.num_microbatches, "micro-batches"),
                                          ("--chunks", self.chunks, sf.chunks, "chunks on a device")):
            if value != want:
                raise ValueError(f"{option} {value} disagrees with schedule file {fname}, which has {want} {what}; "
                                 f"drop {option} (the file fixes it)")
        for option, value in (("--variant", self.variant), ("--memory-limit", self.memory_limit),
                              ("stage_replicas", self.stage_replicas)):
            if value is not None:
                raise ValueError(f"{option} picks a family's order; schedule file {fname} gives its own "
                                 f"(drop {option})")
        if self.schedule != sf.name:
            raise ValueError(f"a schedule file's layout is named after it ({sf.name!r}); got {self.schedule!r}")

    def _check_memory_limit(self, fam) -> None:
        value, unit = self.memory_limit
        if not fam.takes_memory_limit:
            takes = [n for n, f in registry.families().items() if f.takes_memory_limit]
            raise ValueError(f"--memory-limit applies to {', '.join(takes)} only; {self.schedule} has a fixed "
                             f"order (drop --memory-limit)")
        if unit not in MEMORY_UNITS:
            raise ValueError(f"--memory-limit unit must be one of {', '.join(MEMORY_UNITS)}; got {unit!r}")
        _finite(value, "--memory-limit", positive=True)
        if self.variant is not None:
            raise ValueError(f"--memory-limit replaces {self.schedule}'s variant (its limit); drop --variant")

    def family_options(self) -> dict:
        """The keyword arguments of :func:`schedules.build` (every family takes ``chunks``)."""
        out = {"chunks": self.chunks, **({} if self.variant is None else {"variant": self.variant})}
        if self.memory_limit is not None and self.memory_limit[1] == "Ma":
            out["memory_limit"] = self.memory_limit[0]      # unit costs: 1 Ma per micro-batch and full stage
        return out

    def check_size(self, *, one_replica: bool = True, **limits) -> None:
        """:func:`check_run_size` of this layout (``limits``: tp, cluster_devices, cluster_name,
        layers, model_name; ``one_replica``: as the simulator builds it, one replica standing for
        all, else as the executor runs every rank)."""
        check_run_size(devices=self.devices, microbatches=self.microbatches, replicas=self.replicas,
                       chunks=self.chunks, one_replica=one_replica, **limits)

    def build(self, *, eager: bool = True, family: dict | None = None, built=None, one_replica: bool = True,
              check: bool = True, overlap_fb: bool = False, **limits):
        """Build, lower (``eager``: gradient all-reduces in the bubbles) and validate the schedule
        (ScheduleError, a ValueError, names what to change) after :meth:`check_size` with
        ``limits``; ``family``: more keyword arguments of the family (zb-auto's ``costs``);
        ``built``: this layout's compute-only schedule when the caller built it already (the
        planner shares one among the candidates of a shape); ``check=False``: not validated (the
        executor validates after its own checks of the model); ``overlap_fb``: a schedule that
        lists no overlapped pairs of its own gets every F followed at once by a B of another
        micro-batch as one (:func:`schedules.overlap.pair_forward_backward`)."""
        from schedules import build, lower, validate
        self.check_size(one_replica=one_replica, **limits)
        if built is None and self.schedule_file is not None:
            built = self.schedule_file.schedule
        if built is None and self.stage_replicas is not None:
            from schedules.dapple_replicated import replicated_schedule, sub_batches
            built = replicated_schedule(self.stage_replicas, self.microbatches // sub_batches(self.stage_replicas))
        if built is None:
            built = build(self.schedule, self.devices, self.microbatches, **self.family_options(), **(family or {}))
        if overlap_fb and not built.meta.get("overlapped"):
            from schedules.overlap import pair_forward_backward
            built = pair_forward_backward(built)
        low = lower(built, replicas=self.replicas, eager=eager)
        if check:
            validate(low)
        return low

    def num_stages(self) -> int:
        """Stages of one model copy of the schedule (built, not lowered)."""
        if self.schedule_file is not None:
            return self.schedule_file.schedule.num_stages
        if self.stage_replicas is not None:
            return len(self.stage_replicas)
        from schedules import build
        return build(self.schedule, self.devices, self.microbatches, **self.family_options()).num_stages


@dataclass(frozen=True, kw_only=True)
class ClusterChoice:
    """A cluster as the options name it: ``name`` (a preset or YAML path, optionally sized
    ``NAME:NODES``; None: :data:`DEFAULT_CLUSTER`, or with a profile its own host), resized to
    ``nodes`` and rewired to ``fabric`` (flat, fat-tree, rail) with ``oversubscription`` and
    ``nodes_per_leaf`` (None keeps the preset's)."""

    name: str | None = None
    nodes: int | None = None
    fabric: str | None = None
    oversubscription: float | None = None
    nodes_per_leaf: int | None = None

    def __post_init__(self):
        if self.nodes is not None:
            _whole(self.nodes, "--nodes")
        if self.fabric is not None and self.fabric not in FABRICS:
            raise ValueError(f"--fabric must be one of {', '.join(FABRICS)}; got {self.fabric!r}")
        if self.oversubscription is not None:
            _finite(self.oversubscription, "--oversubscription", positive=True)
            if self.oversubscription < 1:
                raise ValueError(f"--oversubscription must be >= 1 (1 = non-blocking); got {self.oversubscription!r}")
        if self.nodes_per_leaf is not None:
            _whole(self.nodes_per_leaf, "--nodes-per-leaf")

    def shape_options(self) -> list[str]:
        """The shaping options given (``--nodes`` ...), for messages."""
        return [f for f, v in (("--nodes", self.nodes), ("--fabric", self.fabric),
                               ("--oversubscription", self.oversubscription),
                               ("--nodes-per-leaf", self.nodes_per_leaf)) if v is not None]

    def shape_report(self) -> dict:
        """The shaping options given, as a report's fields (``fabric``, ...)."""
        return {k: getattr(self, k) for k in ("nodes", "fabric", "oversubscription", "nodes_per_leaf")
                if getattr(self, k) is not None}

    def given(self) -> list[str]:
        """Every option given (``--cluster`` first), for messages."""
        return (["--cluster"] if self.name is not None else []) + self.shape_options()

    def load(self, loader=load_cluster, default: str = DEFAULT_CLUSTER) -> Cluster:
        """The cluster, shaped (``loader``: a name -> Cluster function, default the presets' and
        YAML files' :func:`cost_models.load_cluster`, which every command uses)."""
        return self.shape(loader(self.name or default))

    def shape(self, cluster: Cluster) -> Cluster:
        """``cluster`` resized and rewired as this choice says."""
        if self.nodes is not None:
            cluster = with_nodes(cluster, self.nodes)
        return with_fabric(cluster, self.fabric, self.oversubscription, self.nodes_per_leaf)


@dataclass(frozen=True, kw_only=True)
class Faults:
    """What disturbs a simulated run: stragglers (``slowdown``: rank -> factor >= 1 on its compute
    time), slow links (``slow_links``: link name, e.g. ``n1.nic0.out``, -> factor >= 1 dividing its
    bandwidth; the run must cross it), per-op compute noise (``jitter``: relative standard
    deviation in [0, :data:`MAX_JITTER`] of a mean-1 factor on each op, seeded by ``seed``), an
    emulated wire under the expert all-to-alls (``a2a_wire``: bytes/s, None = none; each exchange of
    a MoE block's rows, dispatch, combine and their gradients, ends no earlier than ``bytes /
    a2a_wire`` after its start, ``bytes`` what the rank puts into it, its own rows included, as the
    calibration's all-to-all fit counts them; :meth:`cost_models.profile.CalibrationProfile.a2a_times`
    prices it, a run sleeps the rest in the exchange's wait, :mod:`executor.expert_parallel`). A
    factor below 1 would make a "straggler" faster than the device (the simulator refuses ops
    faster than their FLOPs at its peak). Pairs are kept as tuples (a job is hashable); give a
    rank or a link once."""

    slowdown: tuple[tuple[int, float], ...] = ()
    slow_links: tuple[tuple[str, float], ...] = ()
    jitter: float = 0.0
    seed: int = 0
    a2a_wire: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "slowdown", _pairs(self.slowdown, "--slowdown", int))
        if self.a2a_wire is not None:
            _finite(self.a2a_wire, "--a2a-wire", positive=True)
        object.__setattr__(self, "slow_links", _pairs(self.slow_links, "--slow-link", str))
        _finite(self.jitter, "--jitter", positive=False)
        if self.jitter > MAX_JITTER:
            raise ValueError(f"--jitter is a relative standard deviation in [0, {MAX_JITTER:g}]; got {self.jitter!r}")
        _whole(self.seed, "--seed", 0)

    @property
    def slowdown_map(self) -> dict[int, float]:
        return dict(self.slowdown)

    @property
    def slow_link_map(self) -> dict[str, float]:
        return dict(self.slow_links)


def _pairs(items, option: str, key_type) -> tuple:
    items = tuple((k, v) for k, v in (items.items() if isinstance(items, dict) else items))
    seen = set()
    for k, v in items:
        if key_type is int:
            _whole(k, f"{option} rank", 0)
        elif not isinstance(k, str) or not k:
            raise ValueError(f"{option}: a link name must be a non-empty string; got {k!r}")
        _finite(v, f"{option} {k} factor", positive=True)
        if v < 1:
            raise ValueError(f"{option} {k}={v:g}: a factor must be >= 1 (it slows down; 1 = no change)")
        if k in seen:
            raise ValueError(f"{option} names {k} twice")
        seen.add(k)
    return items


class PlanSource(Protocol):
    """A loaded plan file (:class:`planner.plan_io.LoadedPlan`): it brings the layout, model,
    cluster and costs of a job, and binds them itself; ``parallel`` is the plan's record."""

    path: str
    parallel: Parallel
    gpus: int

    def bind(self, job: "Job") -> "Bound":   # pragma: no cover - a protocol
        ...


@dataclass(frozen=True, kw_only=True)
class Job:
    """One simulation or run (the module docstring says what each field means and which exclude
    each other)."""

    layout: Layout | None = None
    model: str | ModelSpec | None = None
    cluster: ClusterChoice = field(default_factory=ClusterChoice)
    unit_costs: bool = False
    profile: str | None = None
    plan: PlanSource | None = None
    stage_costs: str | None = None
    cost_model: str | None = None
    profile_batch: int | None = None
    parallel: Parallel = field(default_factory=Parallel)
    partition: tuple[int, ...] | str | None = None
    device_map: str | None = None
    eager: bool = True
    grad_accumulation: str = "fused"
    memory_reserve: float | None = None
    faults: Faults = field(default_factory=Faults)
    exact: bool = False

    def __post_init__(self):
        if isinstance(self.cluster, str):
            object.__setattr__(self, "cluster", ClusterChoice(name=self.cluster))
        if not isinstance(self.parallel, Parallel):
            raise ValueError(f"Job.parallel must be a cost_models.parallel.Parallel; got {self.parallel!r}")
        if self.memory_reserve is not None:
            _finite(self.memory_reserve, "--memory-reserve", positive=False)
        if self.profile_batch is not None:
            _whole(self.profile_batch, "--profile-batch")
        if self.grad_accumulation not in GRAD_ACCUMULATION:
            raise ValueError(f"Job.grad_accumulation must be one of {', '.join(GRAD_ACCUMULATION)}; "
                             f"got {self.grad_accumulation!r}")
        if self.device_map is not None and self.device_map not in MAPPINGS:
            raise ValueError(f"--device-map must be one of {', '.join(sorted(MAPPINGS))}; got {self.device_map!r}")
        if self.cost_model is not None and self.cost_model not in COST_MODELS:
            raise ValueError(f"--cost-model must be one of {', '.join(COST_MODELS)}; got {self.cost_model!r}")
        object.__setattr__(self, "partition", _partition(self.partition))
        if self.plan is not None and self.parallel == Parallel():
            object.__setattr__(self, "parallel", self.plan.parallel)     # the plan's own, unless given
        if self.plan is not None:
            self._check_plan()
        else:
            if self.layout is None:
                raise ValueError("give --schedule, --devices, --microbatches (or --plan PLAN.json)")
            self._check_cost_source()
            self._check_parallel()

    @property
    def mapping(self) -> str:
        """How ranks are placed: ``device_map``, else Megatron's order (TP, then DP, then PP) with
        tensor or expert parallelism (an expert group is consecutive GPUs of a stage, as its
        all-to-all is costed: :class:`cost_models.moe.ExpertGroup`) and the sequential order (a
        pipeline on consecutive devices) without."""
        if self.device_map is not None:
            return self.device_map
        if self.plan is not None:       # the plan's own (a DAPPLE plan places its ranks itself)
            return getattr(self.plan, "mapping", "sequential")
        return "megatron" if self.parallel.tp > 1 or self.parallel.ep > 1 else "sequential"

    @property
    def gpus(self) -> int:
        """T x C x D x R (a plan's: the GPUs it uses)."""
        if self.layout is None:
            return self.plan.gpus
        return self.parallel.tp * self.parallel.cp * self.layout.devices * self.layout.replicas

    def _check_parallel(self) -> None:
        """The parallelism knobs against the layout and the cost source (each knob's own rules are
        :class:`Parallel`'s): ZeRO needs replicas; T, ZeRO, the sequence length, sequence
        parallelism and overlap act on a model's formulas only."""
        par = self.parallel
        R = self.layout.replicas
        if par.zero and R == 1:
            raise ValueError(f"--zero {par.zero} shards over the data-parallel replicas; give --dp > 1")
        if par.dp_shard and (par.dp_shard < 2 or R % par.dp_shard):
            raise ValueError(f"--dp-shard {par.dp_shard} must divide --dp {R} and be at least 2 (0: shard over all "
                             f"{R} replicas)")
        # a profile's TP layers were measured without sequence parallelism or overlap (all-reduces on F and B)
        given = [f for f, v in (("--tp", par.tp > 1 and self.source != "profile"), ("--zero", par.zero),
                                ("--seq-len", par.seq_len), ("--sequence-parallel", par.sequence_parallel),
                                ("--tp-overlap", par.tp_overlap), ("--precision", par.precision),
                                ("--cp", par.cp > 1), ("--dp-shard", par.dp_shard),
                                ("--reshard-after-forward", par.reshard_after_forward),
                                ("--cp-comm", par.cp_comm != "ring"), ("--p2p-scatter-gather", par.p2p_scatter_gather),
                                ("--grad-accumulation", self.grad_accumulation != "fused")) if v] + \
            [k for k in moe_knobs_given(par)     # a profile measured at --ep E prices E and the F&B overlap
             if not (self.source == "profile" and k in ("--ep", "--overlap-fb"))]
        if given and self.source != "transformer":
            verb = "acts" if len(given) == 1 else "act"
            raise ValueError(f"{' and '.join(given)} {verb} on a model's formulas: use --model/--cluster costs "
                             f"(not {_SOURCE_FLAGS.get(self.source, self.source)})")

    # ------------------------------------------------------------------ the cost source
    @property
    def source(self) -> str:
        """Where the costs come from: ``plan``, ``unit``, ``stage-costs``, ``profile``,
        ``layer-profile`` (a PipeDream-format ``model``) or ``transformer`` (a model spec's formulas)."""
        if self.plan is not None:
            return "plan"
        if self.stage_costs is not None:
            return "stage-costs"
        if self.unit_costs:
            return "unit"
        if self.profile is not None:
            return "profile"
        return "layer-profile" if str(self.model).endswith(".txt") else "transformer"

    def _formula_options(self) -> list[str]:
        """The options of the model x cluster formulas that are given, in the order they are named."""
        return [f for f, v in (("--model", self.model), ("--cluster", self.cluster.name),
                               ("--micro-batch", self.parallel.micro_batch), ("--cost-model", self.cost_model),
                               ("--profile-batch", self.profile_batch)) if v is not None] + \
            self.cluster.shape_options()

    def _check_cost_source(self) -> None:
        if self.cost_model and (self.unit_costs or self.profile):
            raise ValueError("--cost-model applies to --model/--cluster costs; drop it with --unit-costs / --profile")
        given = self._formula_options()
        if self.stage_costs is not None:
            other = given + [f for f, v in (("--unit-costs", self.unit_costs), ("--profile", self.profile),
                                            ("--partition", self.partition),
                                            ("--recompute", self.parallel.recompute != "none")) if v]
            if other:
                raise ValueError(f"--stage-costs gives every stage's times; drop {', '.join(other)}")
            return
        if self.unit_costs:
            if self.profile or given:
                raise ValueError(f"--unit-costs replaces every cost model; drop {', '.join(given or ['--profile'])}")
            if self.partition is not None:
                raise ValueError("--partition splits a model's layers; unit costs have none (F = 1 per full "
                                 "stage): drop --partition or --unit-costs")
            if self.parallel.recompute != "none":
                raise ValueError("--recompute changes a model's costs; unit costs have none: drop --recompute "
                                 "or --unit-costs")
            return
        if self.profile:
            # a model file (PATH.py:FUNC) is checked against the profile's model when bound; a
            # --cluster is where its measured times are scaled to; any other model option is a
            # second cost source
            shape = self.cluster.shape_options()
            if self.cluster.name is None and shape:
                raise ValueError(f"{', '.join(shape)} shape a --cluster; with --profile give the --cluster to scale "
                                 f"the measured times onto (or drop them)")
            other = [f for f in given if f not in ("--cluster", "--micro-batch", *shape)
                     and not (f == "--model" and is_model_ref(self.model))]
            if other:
                raise ValueError(f"--profile brings the measured model and network; drop {', '.join(other)}")
            return
        if self.partition == "time":
            raise ValueError("--partition time balances measured layer times: it needs --profile FILE.yaml")
        if self.source == "transformer" and self.profile_batch is not None:
            raise ValueError("--profile-batch applies to a profile file (--model FILE.txt) only")

    def _check_plan(self) -> None:
        if self.layout is not None:
            raise ValueError("--plan fixes the schedule and layout; drop --schedule, --devices, --microbatches")
        given = [f for f, v in (("--unit-costs", self.unit_costs), ("--profile", self.profile),
                                ("--stage-costs", self.stage_costs),
                                ("--model", self.model), ("--cluster", self.cluster.name),
                                ("--partition", self.partition)) if v]
        if given:
            raise ValueError(f"--plan brings its own model, cluster and costs; drop {', '.join(given)}")
        # the plan's parallel record, less the what-if a plan takes (--tp-overlap)
        mine, planned = replace(self.parallel, tp_overlap=False), replace(self.plan.parallel, tp_overlap=False)
        differ = [f"{option_name(f)} {getattr(planned, f)}" for f, v in mine.record().items()
                  if v != getattr(planned, f)]
        if differ:
            raise ValueError(f"--plan fixes the parallel record ({', '.join(differ)} in {self.plan.path}); give the "
                             f"plan's (Job(plan=p) or dataclasses.replace(p.parallel, tp_overlap=True)) or plan again")

    # ------------------------------------------------------------------ derived jobs
    def with_layout(self, **changes) -> "Job":
        """This job on another layout (``schedule=``, ``devices=``, ...: the :class:`Layout` fields)."""
        return replace(self, layout=replace(self.layout, **changes))

    def build(self, *, family: dict | None = None, built=None, one_replica: bool = True, check: bool = True,
              **limits):
        """The job's lowered, validated schedule (:meth:`Layout.build` with the job's eager
        all-reduce and T x D x R size checks); the simulator (:func:`cost_models.bind.bind`), the
        planner and the executor's run all lower through here."""
        return self.layout.build(eager=self.eager, family=family, built=built, one_replica=one_replica,
                                 check=check, overlap_fb=self.parallel.overlap_fb, tp=self.parallel.tp,
                                 cp=self.parallel.cp, **limits)

    @classmethod
    def of(cls, **fields) -> "Job":
        """A job from flat fields: those of :class:`Layout` build its layout, those of
        :class:`Parallel` its parallel record, the rest are the job's (``Job.of(schedule="zb-v",
        devices=4, microbatches=8, tp=2, model="tiny")``); an unknown name is one line."""
        layout, parallel, own = route_fields(fields)
        if layout:      # on top of a given layout record, else a new one
            own["layout"] = replace(own["layout"], **layout) if "layout" in own else Layout(**layout)
        if parallel:
            own["parallel"] = replace(own["parallel"], **parallel) if "parallel" in own else Parallel(**parallel)
        return cls(**own)

    def with_(self, **changes) -> "Job":
        """This job with flat changes, routed to its records as :meth:`of` routes them."""
        layout, parallel, own = route_fields(changes)
        if layout and self.layout is None:
            raise ValueError(f"the plan fixes the layout ({self.plan.path}); {', '.join(layout)} cannot change")
        if layout:
            own["layout"] = replace(own.get("layout", self.layout), **layout)
        if parallel:
            own["parallel"] = replace(own.get("parallel", self.parallel), **parallel)
        return replace(self, **own)

    def record(self) -> dict:
        """The job as plain data (JSON): what identifies the experiment."""
        def plain(v):
            if isinstance(v, ModelSpec):
                return v.to_dict()
            if isinstance(v, ScheduleFile):
                return v.path
            if isinstance(v, tuple):
                return [plain(x) for x in v]
            return v
        out = {}
        for name in self.__dataclass_fields__:
            v = getattr(self, name)
            if name == "plan":
                v = None if v is None else str(v.path)
            elif isinstance(v, (Layout, ClusterChoice, Faults, Parallel)):
                v = {k: plain(getattr(v, k)) for k in v.__dataclass_fields__}
            out[name] = plain(v)
        return out


def route_fields(fields: dict) -> tuple[dict, dict, dict]:
    """Flat fields split into (the layout's, the parallel record's, the job's own); the three
    records' field names are distinct."""
    from dataclasses import fields as fields_of
    names = [{f.name for f in fields_of(r)} for r in (Layout, Parallel, Job)]
    out: tuple[dict, dict, dict] = ({}, {}, {})
    for k, v in fields.items():
        where = next((i for i, n in enumerate(names) if k in n), None)
        if where is None:
            raise ValueError(f"unknown job field {k!r}: a field of Layout, Parallel or Job "
                             f"({', '.join(sorted(set().union(*names)))})")
        out[where][k] = v
    return out


def _partition(value):
    """``partition``: None, ``"time"`` or a tuple of layer counts >= 0."""
    if value is None or value == "time":
        return value
    if isinstance(value, str):
        raise ValueError(f"--partition takes layer counts per stage (e.g. 3,2,2,3) or 'time'; got {value!r}")
    try:
        counts = tuple(value)
    except TypeError:
        raise ValueError(f"--partition takes layer counts per stage (e.g. 3,2,2,3) or 'time'; got {value!r}") from None
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts):
        raise ValueError(f"--partition: layer counts must be whole numbers >= 0; got {value!r}")
    return counts


def check_run_size(*, devices: int, microbatches: int, replicas: int = 1, chunks: int = 1,
                   cluster_devices: int | None = None, cluster_name: str = "", layers: int | None = None,
                   model_name: str = "", one_replica: bool = False, tp: int = 1, cp: int = 1) -> None:
    """What can be refused without building a schedule: the size limits of the IR
    (:func:`schedules.registry.check_size`), a cluster too small for D x R ranks, a model with
    fewer layers than stages (every schedule has at least D stages per copy). One-line ValueErrors.
    ``one_replica``: the simulator builds, validates and (when the replicas are identical) simulates
    one replica, so the limits apply to one; a full simulation of every replica is bounded by the
    simulator itself (``sim.run(max_ops=...)``)."""
    ranks = devices * (1 if one_replica else replicas)
    if ranks > registry.MAX_RANKS:
        what = f"-D {devices}" if one_replica else f"-D {devices} x --dp {replicas} = {ranks} ranks"
        raise ValueError(f"{what} is beyond pipetwin's limit of {registry.MAX_RANKS} ranks; lower -D"
                         + ("" if one_replica else " or --dp"))
    if one_replica and devices * replicas > MAX_SIM_RANKS:
        raise ValueError(f"-D {devices} x --dp {replicas} = {devices * replicas:,} ranks is beyond the simulator's "
                         f"limit of {MAX_SIM_RANKS:,} ranks (its per-rank records); lower --dp")
    ops = registry.estimated_ops(devices, microbatches, 1 if one_replica else replicas, chunks)
    if ops > registry.MAX_OPS:
        most = max(1, registry.MAX_OPS * microbatches // ops)
        raise ValueError(f"-N {microbatches} micro-batches on {ranks} ranks is about {ops:,} ops per iteration, "
                         f"beyond pipetwin's limit of {registry.MAX_OPS:,} (memory and time grow with it); "
                         f"use -N {most:,} or fewer")
    ranks = devices * replicas
    if cluster_devices is not None and ranks * tp * cp > cluster_devices:
        what = f"{ranks} ranks (D={devices} x R={replicas})" if tp * cp == 1 else \
            f"{ranks * tp:,} GPUs (T={tp} x D={devices} x R={replicas})" if cp == 1 else \
            f"{ranks * tp * cp:,} GPUs (T={tp} x C={cp} x D={devices} x R={replicas})"
        smaller = "-D/--dp" if tp * cp == 1 else "--tp/-D/--dp" if cp == 1 else "--tp/--cp/-D/--dp"
        raise ValueError(f"{what} do not fit on cluster {cluster_name} with {cluster_devices:,} devices; pick a "
                         f"bigger --cluster (or --nodes) or a smaller " + smaller)
    if layers is not None and layers < devices:
        raise ValueError(f"model {model_name} has {layers} layers to split, fewer than the {devices} pipeline "
                         f"stages; lower -D or pick a deeper --model")
