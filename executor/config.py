"""What to run and what comes back: :class:`RunConfig`, :func:`lowered_schedule`, :class:`RunResult`.

:func:`lowered_schedule` turns a config into a lowered, validated schedule and checks that the
model can be split into its stages; it runs in the launching process, so every user error is
reported before any worker process starts. A planner's plan file is a job too:
``RunConfig(job=plan.run_job(), placement=plan.placement)`` (:mod:`planner.plan_io`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from cost_models.files import check_input
from cost_models.model_spec import ModelSpec, load_model
from cost_models.moe import check_expert_parallel, moe_knobs_given
from cost_models.partition import block_ranges, blocks_from_layers
from cost_models.stack import is_model_ref
from schedules import Schedule, lower, validate

from .choices import OPTIMIZERS
from .device import check_device
from .faults import check_fault, parse_fault
from .model import KINDS
from .precision import Precision

# what each ZeRO stage shards (executor.zero), for the refusal of a model file
_ZERO_SHARDS = {1: "optimizer state", 2: "optimizer state and gradients", 3: "optimizer state, gradients and weights"}

# what a run takes when the flat constructor (:meth:`RunConfig.of`) is not told: the tiny GPT,
# DAPPLE on 2 pipeline devices with 4 micro-batches
RUN_DEFAULTS = {"schedule": "dapple", "devices": 2, "microbatches": 4, "model": "tiny"}

# the MoE options a training run acts on (executor.moe, executor.expert_parallel, executor.overlap: the
# F&B overlap on any model); the others price a mixture of experts in the simulator
RUN_MOE_KNOBS = ("--ep", "--etp", "--capacity-factor", "--overlap-fb")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One training run: a :class:`cost_models.job.Job` (what is trained, on which layout, with
    which parallelism: ``job.layout``, ``job.parallel``, ``job.model``, ``job.partition``,
    ``job.eager``, ``job.device_map``) plus the training options below. ``replicas`` R copies the
    whole pipeline (ranks r*D + d); each step trains on R*N micro-batches of ``spec().micro_batch``
    sequences; the loss is their mean.

    The job's ``model`` is a preset name, a YAML path or a ModelSpec of the built-in GPT / Llama,
    or a model file ``PATH.py:FUNC`` / ``package.module:FUNC`` (a layer stack:
    :mod:`executor.user_model`; None: :data:`RUN_DEFAULTS`' tiny); ``parallel.micro_batch``
    overrides the spec's sequences per micro-batch (a model file's samples per micro-batch;
    default :data:`executor.user_model.DEFAULT_MICRO_BATCH`); ``job.partition`` gives the layers
    per stage of a model copy as everywhere a job's partition does (a GPT's embedding and head
    count as layers; :attr:`blocks` is the GPT's transformer blocks per stage; default: the even
    split of :func:`cost_models.partition.block_ranges`, a model file's
    :func:`cost_models.partition.stack_partition`). The simulator's parts of a job (a cost source,
    a cluster, slow links, jitter) would do nothing in a run: they are refused; its stragglers
    (``--slowdown RANK=FACTOR``) slow that rank's F, B and W down by sleeping (executor.runtime).
    The reference uses the same model and G = R * N, so its global batch is the run's.

    ``placement``: an explicit rank -> global device map under torchrun (a DAPPLE plan's); None:
    the job's mapping (:attr:`cost_models.job.Job.mapping`). :meth:`of` builds a config from
    flat fields of the job's records and this one (``RunConfig.of(schedule="zb-v", tp=2, steps=5)``)."""

    job: Any = None
    steps: int = 3
    seed: int = 0
    lr: float = 1e-3
    optimizer: str = "adam"         # adam | sgd (momentum 0.9)
    timeout: float = 60.0           # seconds a receive / all-reduce may wait before the run fails
    data: str | None = None         # text file of byte tokens; None = synthetic stream
    device: str = "auto"            # auto | cpu | cuda (see executor.device)
    recv_lookahead: int | None = None  # receives posted ahead per peer (None = all at step start)
    measure_memory: bool = True     # saved-tensor hooks on the CPU (allocator counters on CUDA)
    meter_every_forward: bool = False  # CPU: meter every forward, not one per stage and run (executor.device)
    collect_params: bool = False    # return the final parameters (tests)
    fault: str | None = None        # fault injection: "RANK:TOKEN[:STEP]" raises there (executor.faults)
    probe: int = 0                  # host speed probe: timed F+B of one block, this many times before
                                    # and after the steps on every rank at once (0: off); see worker
    dtype: str = "fp32"             # fp32 | bf16 (autocast, fp32 master weights) | fp8 (GPU): executor.precision
    pin_cores: bool = False         # pin each rank to a core of its own where the host has one per rank
                                    # (executor.host.pin_to_core; otherwise the ranks float)
    placement: tuple[int, ...] | None = None  # under torchrun: rank -> global device (a plan's); None: the job's
    # a mixed --cluster emulated (set by __post_init__: cost_models.bind.PoolEmulation; the job then has none)
    emulation: object = field(default=None, compare=False)

    def __post_init__(self):
        from cost_models.job import Faults, Job
        if self.job is None:
            object.__setattr__(self, "job", Job.of(**RUN_DEFAULTS))
        job = self.job
        if not isinstance(job, Job):
            raise ValueError(f"RunConfig.job must be a cost_models.job.Job; got {job!r}")
        if job.model is None and job.plan is None:      # a plan is refused below
            object.__setattr__(self, "job", replace(job, model=RUN_DEFAULTS["model"]))
            job = self.job
        mixed = job.cluster.name is not None and job.plan is None and job.cluster.load().is_mixed
        sim_only = [f for f, v in (("--unit-costs", job.unit_costs), ("--profile", job.profile),
                                   ("--stage-costs", job.stage_costs),
                                   ("--plan", job.plan), ("--cost-model", job.cost_model),
                                   ("--profile-batch", job.profile_batch), ("--exact", job.exact),
                                   ("--slow-link, --jitter (simulated faults; a run takes --slowdown, --a2a-wire)",
                                    replace(job.faults, slowdown=(), a2a_wire=None) != Faults()),
                                   ("--precision (the run's is --dtype)", job.parallel.precision)) if v] + \
            (job.cluster.shape_options() if mixed else job.cluster.given()) + \
            [k for k in moe_knobs_given(job.parallel) if k not in RUN_MOE_KNOBS]
        if sim_only:
            raise ValueError(f"a training run takes a job's layout and model only; drop {', '.join(sim_only)}")
        if mixed:
            job = self._emulate_pools(job)
        par, lay = job.parallel, job.layout
        ranks = lay.devices * lay.replicas
        if job.faults.a2a_wire is not None and par.ep == 1:
            raise ValueError("--a2a-wire slows the expert all-to-alls down; this run has none (give --ep E > 1 with "
                             "a mixture of experts)")
        for r, _ in job.faults.slowdown:
            if not 0 <= r < ranks:
                raise ValueError(f"--slowdown {r}=...: the run has ranks 0..{ranks - 1} (D x R = {lay.devices} x "
                                 f"{lay.replicas}); a rank's T tensor-parallel processes slow down together")
        if par.tp_overlap:
            raise ValueError("the executor trains T x D x R layouts without --tp-overlap: simulated only "
                             "(pipetwin simulate); drop it to run")
        if job.partition == "time":
            raise ValueError("partition 'time' is resolved from a calibration profile before the run "
                             "(cost_models.bind.profile_partition)")
        if lay.memory_limit is not None:
            raise ValueError("--memory-limit orders zb-auto from simulated costs; the executor runs a --variant's "
                             "order (drop --memory-limit)")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be >= 1; got {self.steps!r}")
        for name in ("timeout", "lr"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a finite number > 0; got {v!r}")
        if self.fault is not None:
            parse_fault(self.fault)
        if self.recv_lookahead is not None and self.recv_lookahead < 1:
            raise ValueError(f"recv_lookahead must be >= 1 or None; got {self.recv_lookahead}")
        Precision(self.dtype)
        if self.is_model_file:
            self._check_model_file()
        if self.placement is not None:
            object.__setattr__(self, "placement", tuple(int(d) for d in self.placement))

    def _emulate_pools(self, job):
        """A mixed ``--cluster``: its pools emulated on this host by the ranks' slowdowns, placement
        and partition of :func:`cost_models.bind.pool_slowdowns` (the rule is there), as ``--slowdown``
        and ``--partition`` would; the job then runs without the cluster (:attr:`emulation` says how).
        Returns that job."""
        from cost_models.bind import pool_slowdowns
        from cost_models.job import ClusterChoice, Faults
        name = job.cluster.name
        if job.faults.slowdown or job.faults.a2a_wire is not None:
            raise ValueError(f"--cluster {name} emulates its pools with the ranks' slowdowns; drop --slowdown and "
                             f"--a2a-wire (or the cluster)")
        emu = pool_slowdowns(job)
        if not emu.slowdown:
            raise ValueError(f"the ranks of this run sit on pools {list(emu.pools)} of {name} (device map "
                             f"{emu.mapping}), which price its ops alike ({emu.cost_model} cost model): nothing to "
                             f"emulate; drop --cluster")
        job = replace(job, cluster=ClusterChoice(), faults=Faults(slowdown=emu.slowdown), partition=emu.partition)
        object.__setattr__(self, "job", job)
        object.__setattr__(self, "emulation", emu)
        return job

    def _check_model_file(self) -> None:
        """What the executor does to the built-in GPT only: a model file's layers are not split,
        sharded, recomputed or resized."""
        par, model = self.job.parallel, self.job.model
        if par.tp > 1:
            raise ValueError(f"--tp {par.tp} splits the built-in GPT's layers; a model file's layers are not split "
                             f"(use --tp 1 with {model})")
        if par.zero:
            raise ValueError(f"--zero {par.zero} shards the built-in GPT's {_ZERO_SHARDS[par.zero]}; not a model "
                             f"file's ({model}: use --zero 0)")
        if par.seq_len is not None:
            raise ValueError(f"--seq-len sets the built-in GPT's sequence length; model {model} brings its own")
        if par.recompute != "none":
            raise ValueError(f"--recompute {par.recompute} recomputes the GPT's transformer blocks; a model file's "
                             f"layers are not recomputed (use --recompute none with {model})")
        if par.cp > 1:
            raise ValueError(f"--cp {par.cp} splits the built-in GPT's sequence over its attention; a model file's "
                             f"layers are not split (use --cp 1 with {model})")

    @classmethod
    def of(cls, **fields) -> "RunConfig":
        """A run from flat fields: those of :class:`cost_models.job.Layout`, :class:`cost_models.parallel.Parallel`
        and :class:`cost_models.job.Job` build the job (:meth:`cost_models.job.Job.of`, with
        :data:`RUN_DEFAULTS` for the layout and model), the rest are this record's."""
        from cost_models.job import Job
        own = {f.name for f in dataclasses.fields(cls)} - {"job"}
        mine = {k: v for k, v in fields.items() if k in own}
        job_fields = {k: v for k, v in fields.items() if k not in own}
        defaults = {k: v for k, v in RUN_DEFAULTS.items() if k not in job_fields
                    and not (k != "model" and "layout" in job_fields)}     # a given layout is whole
        return cls(job=Job.of(**defaults, **job_fields), **mine)

    @classmethod
    def from_job(cls, job, **options) -> "RunConfig":
        """The run of a :class:`cost_models.job.Job` (its model None: the tiny GPT); ``options``:
        the training fields (steps, seed, lr, ...)."""
        return cls(job=job, **options)

    def with_(self, **changes) -> "RunConfig":
        """This run with flat changes, routed as :meth:`of` routes them (``tp=``, ``steps=``, ``schedule=`` ...)."""
        own = {f.name for f in dataclasses.fields(self)} - {"job"}
        mine = {k: v for k, v in changes.items() if k in own}
        rest = {k: v for k, v in changes.items() if k not in own}
        return replace(self, job=self.job.with_(**rest) if rest else self.job, **mine)

    @property
    def layout(self):
        """The job's :class:`cost_models.job.Layout`."""
        return self.job.layout

    @property
    def parallel(self):
        """The job's :class:`cost_models.parallel.Parallel`."""
        return self.job.parallel

    @property
    def model(self) -> str | ModelSpec:
        return self.job.model

    @property
    def device_map(self) -> str | tuple[int, ...]:
        """Where torchrun's processes run the ranks: :attr:`placement`, else the job's mapping name."""
        return self.placement if self.placement is not None else self.job.mapping

    @property
    def blocks(self) -> tuple[int, ...] | None:
        """The job's partition as the executor splits the model: a GPT's transformer blocks per
        stage (its embedding and head, counted as layers by the job, taken off), a model file's
        layers as given; None: the default split."""
        part = self.job.partition
        if part is None or self.is_model_file:
            return part
        try:
            return tuple(blocks_from_layers(part, self.spec().layers))
        except ValueError as e:
            raise ValueError(f"--partition: {e}") from None

    @property
    def is_model_file(self) -> bool:
        """The model is a user's layer stack (``PATH.py:FUNC``), not the built-in GPT."""
        return is_model_ref(self.model)

    @property
    def stage_layers(self) -> tuple[int, ...] | None:
        """The run's split as the cost models take it: layers per stage (a GPT's blocks plus its
        embedding and head; a model file's layers as given); None: the default split."""
        part = self.job.partition
        return None if part is None else tuple(part)

    def spec(self) -> ModelSpec:
        """The model as this run trains it: ``micro_batch`` applied, ``dtype_bytes`` that of the
        run's precision (2 for bf16: the activations and messages the cost model counts)."""
        spec = self.parallel.sized(self.model if isinstance(self.model, ModelSpec) else load_model(self.model))
        # experts (executor.moe) and latent attention (executor.mla, whose heads are of any size) are built
        beyond = [w for w in spec.beyond_dense if w not in ("experts", "latent attention")
                  and not (spec.is_mla and w.startswith("heads of"))]
        if beyond:
            raise ValueError(f"model {spec.name} has {beyond[0]}: the executor trains gpt and llama blocks (heads of "
                             f"hidden / heads, or latent attention), with or without experts; pipetwin simulate and "
                             f"plan price it")
        d = self.precision.dtype_bytes
        return spec if spec.dtype_bytes == d else spec.replace(dtype_bytes=d)

    def moe_run(self, groups=None):
        """How this run builds its MoE MLPs (:class:`executor.moe.MoeRun`): ``groups`` the rank's
        :class:`executor.expert_parallel.ExpertGroups` of the stage (None: EP 1, ETP 1), the job's
        capacity factor, the loss scale 1/G."""
        from .moe import MoeRun
        from .expert_parallel import NO_EP, NO_ETP
        ep = groups.ep if groups is not None else NO_EP
        etp = groups.etp if groups is not None and groups.etp is not None else NO_ETP
        return MoeRun(ep, float(self.parallel.capacity_factor), 1.0 / self.global_microbatches, etp)

    @property
    def precision(self) -> Precision:
        return Precision(self.dtype)

    @property
    def samples_per_microbatch(self) -> int:
        """Sequences (GPT) or samples (model file) per micro-batch."""
        if self.is_model_file:
            from .user_model import DEFAULT_MICRO_BATCH
            return int(self.parallel.micro_batch or DEFAULT_MICRO_BATCH)
        return self.spec().micro_batch

    def stack_layout(self, num_stages: int):
        """A model file's checked layout over ``num_stages`` stages (:func:`executor.user_model.stack_layout`)."""
        from .user_model import stack_layout
        return stack_layout(str(self.model), num_stages, micro_batch=self.samples_per_microbatch, seed=self.seed,
                            partition=self.blocks)

    @property
    def model_name(self) -> str:
        return self.model.name if isinstance(self.model, ModelSpec) else str(self.model)

    @property
    def global_microbatches(self) -> int:
        return self.layout.replicas * self.layout.microbatches


def lowered_schedule(config: RunConfig, schedule: Schedule | None = None, *, check: bool = True) -> Schedule:
    """The lowered schedule a config runs (``schedule`` overrides the named one), validated
    (``check=False`` skips the symbolic run: only for tests that run broken programs), after
    the cheap checks (sizes, the model's kind and depth, the device, the data file) and before
    the fault's (its token must be in its rank's program). A model file is imported, built and run
    on one micro-batch here (:func:`executor.user_model.stack_layout`): its errors come out before
    any rank starts."""
    stack = config.is_model_file
    spec = None if stack else config.spec()
    if spec is not None and spec.kind not in KINDS:
        raise ValueError(f"the executor trains GPT and Llama decoders; model {spec.name!r} is of kind {spec.kind!r}")
    if spec is not None and spec.kind == "gpt" and spec.kv != spec.heads:
        raise ValueError(f"the executor's GPT has no grouped-query attention; model {spec.name!r} has {spec.kv} "
                         f"key/value heads for {spec.heads} (simulate it, or train a llama-kind model)")
    lay, par = config.layout, config.parallel
    if spec is not None and par.tp > 1 and spec.is_mla and not spec.is_moe and not par.sequence_parallel:
        raise ValueError(f"latent attention (MLA) at --tp {par.tp} needs --sequence-parallel: the executor runs "
                         f"its replicated down-projections on each rank's 1/T of the tokens (Megatron-LM's layout)")
    if spec is not None and par.tp > 1 and spec.is_moe and par.capacity_factor:
        raise ValueError(f"--capacity-factor {par.capacity_factor} with --tp {par.tp}: each TP rank routes 1/T of a "
                         f"micro-batch's tokens and would drop over those, not the micro-batch's as the reference; "
                         f"drop --capacity-factor (dropless) or use --tp 1")
    if spec is not None and spec.is_moe and par.tp > 1 and par.cp > 1:
        raise ValueError(f"--tp {par.tp} with --cp {par.cp} for a mixture of experts: the executor routes the tokens "
                         f"split over one of them (its balance loss sums the load over that group); use --tp 1 "
                         f"or --cp 1")
    if spec is not None:    # the executor overlaps F&B pairs of dense models too (segments = blocks)
        check_expert_parallel(spec, replace(par, overlap_fb=False), lay.replicas)
    if spec is not None and par.tp > 1:
        check_tensor_parallel(spec, par.tp, par.sequence_parallel)
    if spec is not None and par.cp > 1 and spec.is_mla:
        raise ValueError(f"--cp {par.cp}: the executor's context-parallel attention takes one head width for Q, K and "
                         f"V; model {spec.name}'s latent attention has {spec.head_dim + spec.rope_head_dim}-wide "
                         f"query/key heads and {spec.v_head_dim}-wide value heads (nor does the simulator price MLA "
                         f"with CP); drop --cp")
    if spec is not None and par.cp > 1:     # the cost model's rule: 2C chunks (and s/C split by T with SP)
        spec.check_context_parallel(par.cp, par.tp, par.sequence_parallel)
        if spec.is_moe and par.capacity_factor:
            raise ValueError(f"--capacity-factor {par.capacity_factor:g} with --cp {par.cp}: each CP rank routes its "
                             f"s/C tokens and would drop over capacity among them, where the reference drops among "
                             f"the whole sequence's; the executor runs a mixture of experts dropless with --cp "
                             f"(--capacity-factor 0)")
    check_device(config.device)
    config.precision.check_run(config.device, tp=par.tp, model_file=stack)
    if stack and config.data is not None:
        raise ValueError(f"--data feeds the built-in GPT; model {config.model} brings its own sample()")
    if config.data is not None:
        check_input(config.data, "data file", min_bytes=spec.seq_len + 2)
    if schedule is None:
        if spec is not None and config.job.partition is None and spec.layers < lay.devices:
            block_ranges(spec.layers, lay.devices)   # every schedule has >= D stages: its error, before building
        low = config.job.build(one_replica=False, check=False)     # validated below, after the model's checks
    else:
        low = schedule if schedule.lowered else lower(schedule, replicas=lay.replicas, eager=config.job.eager)
        G = low.replicas * low.num_microbatches
        if G != config.global_microbatches:
            raise ValueError(f"schedule {low.name} runs {low.replicas} x {low.num_microbatches} micro-batches per "
                             f"step but the config says replicas={lay.replicas} x microbatches="
                             f"{lay.microbatches}; they must agree (the reference trains on the config's)")
    if stack:
        from .user_model import check_stack_fits
        check_stack_fits(config, low)           # counted on the meta device: too big is refused before building
        config.stack_layout(low.num_stages)     # imports, builds and checks the model: user errors here
    else:
        block_ranges(spec.layers, low.num_stages, config.blocks)
    if par.zero >= 2:
        check_zero_placement(low, par.zero)
    if par.ep * par.etp > 1:
        check_expert_run(config, spec, low)
    if check:
        validate(low)
    check_fault(config.fault, low, config.steps, ep=par.ep)
    return low


def check_expert_run(config: RunConfig, spec: ModelSpec | None, low: Schedule) -> None:
    """What the executor's expert parallelism trains (``--ep E``, ``--etp U``: :mod:`executor.expert_parallel`),
    after the simulator's rules (:func:`cost_models.moe.check_expert_parallel`: a mixture of experts,
    EP x ETP dividing the experts and folding onto the stage's T x C x R processes, sequence
    parallelism with T > 1): experts folded over the TP and CP ranks and replicas of a one-copy
    schedule (with ZeRO the routed experts' state shards over their EDP group, the dense over the
    stage's, :mod:`executor.zero`). One line each."""
    par = config.parallel
    if spec is None:
        what = f"--ep {par.ep}" if par.ep > 1 else f"--etp {par.etp}"
        raise ValueError(f"{what} splits a mixture of experts' routed experts; a model file's layers are not "
                         f"split ({config.model}: use --ep 1 --etp 1)")
    if low.num_copies > 1:
        raise ValueError(f"--ep {par.ep} with {low.name}: a two-copy schedule runs a stage's copies on two devices at "
                         f"different points of their programs, where their all-to-alls would not meet; use a "
                         f"one-copy schedule (dapple, interleaved, zb-v, dualpipe-v ...)")


def check_zero_placement(low: Schedule, zero: int) -> None:
    """ZeRO 2 and 3 issue a stage's collectives at every micro-batch's backward (and ZeRO 3 at its
    forwards): the ranks of a shard group must reach them at the same points of their programs,
    which holds for replicas (the same program) but not for a stage held on two devices of one
    replica (chimera's, bitpipe's model copies, a DAPPLE plan's stage replicas): refused in one line."""
    for s in range(low.num_stages):
        m = len(low.stage_group(s)) // low.replicas
        if m > 1:
            raise ValueError(f"--zero {zero} shards a stage over its data-parallel replicas at every micro-batch; "
                             f"{low.name} holds stage {s} on {m} devices of a replica, whose programs meet its "
                             f"collectives at different points (use --zero 1)")


def check_tensor_parallel(spec: ModelSpec, tp: int, sequence_parallel: bool = False) -> None:
    """Refuse a T that does not split the heads, KV heads, FFN size, the sequence with sequence
    parallelism (the simulator's check) or the vocabulary (the executor's vocabulary-parallel
    embedding and loss) evenly, with one line."""
    spec.check_tensor_parallel(tp, sequence_parallel=sequence_parallel)
    if spec.shared_ffn % tp:
        raise ValueError(f"--tp {tp} does not divide the shared experts' width ({spec.shared_ffn}) of model "
                         f"{spec.name}; pick a --tp that divides {spec.shared_ffn}")
    if spec.vocab % tp:
        raise ValueError(f"--tp {tp} does not divide the vocabulary ({spec.vocab}) of model {spec.name}; "
                         f"pick a --tp that divides {spec.vocab}")


@dataclass
class RunResult:
    """What a run reports: one loss and one iteration time per step, per-rank memory, the merged
    trace (executor runs) and, on request, the final parameters by global name: every copy on
    every replica as ``r{replica}.c{copy}/{name}`` for executor runs, ``{name}`` for the
    reference."""

    config: RunConfig
    losses: list[float]
    iteration_times: list[float]
    per_device: list[dict]
    ma_bytes: float
    engine: str
    trace: Any = None
    params: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    extra: dict = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        """Sequences per second over the steps after the first (all steps if only one)."""
        times = self.iteration_times[1:] or self.iteration_times
        seqs = self.config.global_microbatches * self.config.samples_per_microbatch
        return seqs * len(times) / sum(times) if sum(times) > 0 else float("nan")

    def to_dict(self) -> dict:
        c = self.config
        lay, par = c.layout, c.parallel
        return {"engine": self.engine, "schedule": lay.label, "variant": lay.variant, "devices": lay.devices,
                "microbatches": lay.microbatches, "replicas": lay.replicas, "tp": par.tp,
                "sequence_parallel": par.sequence_parallel, "zero": par.zero, "cp": par.cp, "cp_comm": par.cp_comm,
                "model": c.model_name,
                "micro_batch": c.samples_per_microbatch,
                "partition": list(c.blocks) if c.blocks is not None else None,
                "steps": c.steps, "optimizer": c.optimizer, "lr": c.lr, "seed": c.seed, "dtype": c.dtype,
                "recompute": par.recompute,
                "losses": self.losses, "iteration_times": self.iteration_times,
                "throughput_seq_per_s": self.throughput, "ma_bytes": self.ma_bytes,
                "per_device": self.per_device, **self.extra}

