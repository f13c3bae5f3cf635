"""What to run and what comes back: :class:`RunConfig`, :func:`lowered_schedule`, :class:`RunResult`.

:func:`lowered_schedule` turns a config into a lowered, validated schedule and checks that the
model can be split into its stages; it runs in the launching process, so every user error is
reported before any worker process starts. (Planner plan files become configs in the command
layer, :mod:`experiments.plan_files`.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from cost_models.files import check_input
from cost_models.model_spec import ModelSpec, load_model
from cost_models.partition import block_ranges, blocks_from_layers, layers_from_blocks
from cost_models.stack import is_model_ref
from schedules import Schedule, build, lower, validate
from schedules.registry import check_size

from .device import check_device
from .faults import check_fault, parse_fault
from .model import KINDS
from .precision import Precision
from .recompute import check_mode

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class RunConfig:
    """One training run. ``replicas`` R copies the whole pipeline (ranks r*D + d); each step
    trains on R*N micro-batches of ``spec.micro_batch`` sequences; the loss is their mean.

    ``model`` is a preset name, a YAML path or a ModelSpec of the built-in GPT, or a model file
    ``PATH.py:FUNC`` / ``package.module:FUNC`` (a layer stack: :mod:`executor.user_model`);
    ``micro_batch`` overrides the spec's sequences per micro-batch (a model file's samples per
    micro-batch; default :data:`executor.user_model.DEFAULT_MICRO_BATCH`); ``partition`` gives, per
    stage of a model copy, the GPT's transformer blocks (embedding in stage 0, head in the last;
    default: the even split of :func:`cost_models.partition.block_ranges`) or a model file's layers
    (default: :func:`cost_models.partition.stack_partition`). The reference uses the same model and
    G = R * N, so its global batch is the run's."""

    schedule: str = "dapple"
    devices: int = 2
    microbatches: int = 4
    chunks: int = 2                 # chunks per device for schedules that take it (interleaved)
    variant: str | None = None      # the schedule family's variant (None: its default)
    replicas: int = 1
    model: str | ModelSpec = "tiny"  # preset name, YAML path, ModelSpec, or a model file PATH.py:FUNC
    steps: int = 3
    seed: int = 0
    lr: float = 1e-3
    optimizer: str = "adam"         # adam | sgd (momentum 0.9)
    timeout: float = 60.0           # seconds a receive / all-reduce may wait before the run fails
    data: str | None = None         # text file of byte tokens; None = synthetic stream
    device: str = "auto"            # auto | cpu | cuda (see executor.device)
    eager_allreduce: bool = True    # all-reduce in the bubbles (lowering's eager placement)
    recv_lookahead: int | None = None  # receives posted ahead per peer (None = all at step start)
    measure_memory: bool = True     # saved-tensor hooks on the CPU (allocator counters on CUDA)
    meter_every_forward: bool = False  # CPU: meter every forward, not one per stage and run (executor.device)
    collect_params: bool = False    # return the final parameters (tests)
    fault: str | None = None        # fault injection: "RANK:TOKEN[:STEP]" raises there (executor.faults)
    micro_batch: int | None = None  # sequences per micro-batch (None: the spec's micro_batch)
    partition: tuple[int, ...] | None = None  # blocks (GPT) or layers (model file) per stage of a model copy
    probe: int = 0                  # host speed probe: timed F+B of one block, this many times before
                                    # and after the steps on every rank at once (0: off); see worker
    dtype: str = "fp32"             # fp32 | bf16 (autocast, fp32 master weights): executor.precision
    recompute: str = "none"         # none | selective | full activation recomputation: executor.recompute
    device_map: str | tuple[int, ...] = "sequential"  # under torchrun: a mapping name (cost_models MAPPINGS)
                                    # or an explicit rank -> global device map; see executor.launch
    pin_cores: bool = False         # pin each rank to a core of its own where the host has one per rank
                                    # (executor.host.pin_to_core; otherwise the ranks float)
    tp: int = 1                     # T processes per pipeline rank split every layer (executor.tensor_parallel)
    sequence_parallel: bool = False  # with tp > 1: norms and stage boundaries on 1/T of the sequence
    seq_len: int | None = None      # training sequence length (None: the model's)
    zero: int = 0                   # 1: ZeRO-1, the optimizer state sharded over a stage's ranks (executor.zero)
    schedule_file: Any = None       # a schedules.io.ScheduleFile: its schedule in place of the named one

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}")
        for name in ("devices", "microbatches", "replicas", "steps", "chunks", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in ("timeout", "lr"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a finite number > 0; got {v!r}")
        if self.fault is not None:
            parse_fault(self.fault)
        if self.recv_lookahead is not None and self.recv_lookahead < 1:
            raise ValueError(f"recv_lookahead must be >= 1 or None; got {self.recv_lookahead}")
        if self.micro_batch is not None and (isinstance(self.micro_batch, bool) or int(self.micro_batch) < 1
                                             or int(self.micro_batch) != self.micro_batch):
            raise ValueError(f"micro_batch must be a positive integer or None; got {self.micro_batch!r}")
        Precision(self.dtype)
        check_mode(self.recompute)
        if self.tp > 1 and self.is_model_file:
            raise ValueError(f"--tp {self.tp} splits the built-in GPT's layers; a model file's layers are not split "
                             f"(use --tp 1 with {self.model})")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"--sequence-parallel is a switch (true or false); got {self.sequence_parallel!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("--sequence-parallel acts on a tensor-parallel group; give --tp > 1")
        if self.zero not in (0, 1) or isinstance(self.zero, bool):
            raise ValueError(f"--zero must be 0 or 1; got {self.zero!r}")
        if self.zero and self.replicas == 1:
            raise ValueError("--zero 1 shards the optimizer state over the data-parallel replicas; give --dp > 1")
        if self.zero and self.is_model_file:
            raise ValueError(f"--zero 1 shards the built-in GPT's optimizer state; not a model file's ({self.model})")
        if self.seq_len is not None and self.is_model_file:
            raise ValueError(f"--seq-len sets the built-in GPT's sequence length; model {self.model} brings its own")
        if self.recompute != "none" and self.is_model_file:
            raise ValueError(f"--recompute {self.recompute} recomputes the GPT's transformer blocks; a model file's "
                             f"layers are not recomputed (use --recompute none with {self.model})")
        if not isinstance(self.device_map, str):
            object.__setattr__(self, "device_map", tuple(int(d) for d in self.device_map))
        if self.partition is not None:
            try:
                part = tuple(self.partition)
            except TypeError:
                raise ValueError(f"partition must be a list of block counts per stage; got {self.partition!r}") \
                    from None
            object.__setattr__(self, "partition", part)

    @classmethod
    def from_job(cls, job, **options) -> "RunConfig":
        """The run of a :class:`cost_models.job.Job`: its layout, its model (default ``tiny``), its
        micro-batch size, recompute, eager all-reduce and device map, and its partition in layers
        per stage (a GPT's embedding and head count as layers, as everywhere a job's partition
        does; converted here to the blocks per stage a GPT run takes). ``options``: the training
        fields (steps, seed, lr, ...). The simulator's parts of a job (a cost source, a cluster,
        faults) would do nothing in a run: they are refused, as is a plan (its run comes from
        :func:`experiments.plan_files.config_from_plan`) and ``partition="time"`` (resolve it with
        the profile first: :func:`cost_models.bind.profile_partition`)."""
        from cost_models.job import Faults
        sim_only = [f for f, v in (("--unit-costs", job.unit_costs), ("--profile", job.profile),
                                   ("--stage-costs", job.stage_costs),
                                   ("--plan", job.plan), ("--cost-model", job.cost_model),
                                   ("--profile-batch", job.profile_batch), ("--exact", job.exact),
                                   ("faults", job.faults != Faults())) if v] + job.cluster.given()
        if sim_only:
            raise ValueError(f"a training run takes a job's layout and model only; drop {', '.join(sim_only)}")
        if job.tp_overlap:
            raise ValueError("the executor trains T x D x R layouts without --tp-overlap: simulated only "
                             "(pipetwin simulate); drop it to run")
        if job.partition == "time":
            raise ValueError("partition 'time' is resolved from a calibration profile before the run "
                             "(cost_models.bind.profile_partition)")
        lay = job.layout
        if lay.memory_limit is not None:
            raise ValueError("--memory-limit orders zb-auto from simulated costs; the executor runs a --variant's "
                             "order (drop --memory-limit)")
        model = job.model or "tiny"
        partition = job.partition
        if partition is not None and not is_model_ref(model):
            spec = model if isinstance(model, ModelSpec) else load_model(model)
            try:
                partition = tuple(blocks_from_layers(partition, spec.layers))
            except ValueError as e:
                raise ValueError(f"--partition: {e}") from None
        return cls(schedule=lay.schedule, devices=lay.devices, microbatches=lay.microbatches, chunks=lay.chunks,
                   variant=lay.variant, replicas=lay.replicas, model=model, micro_batch=job.micro_batch,
                   partition=partition, recompute=job.recompute, eager_allreduce=job.eager,
                   device_map=job.mapping, tp=lay.tp, sequence_parallel=job.sequence_parallel, seq_len=job.seq_len,
                   zero=job.zero, schedule_file=lay.schedule_file, **options)

    def with_(self, **changes) -> "RunConfig":
        return replace(self, **changes)

    @property
    def is_model_file(self) -> bool:
        """The model is a user's layer stack (``PATH.py:FUNC``), not the built-in GPT."""
        return is_model_ref(self.model)

    @property
    def stage_layers(self) -> tuple[int, ...] | None:
        """The run's split as the cost models take it: layers per stage (a GPT's blocks plus its
        embedding and head; a model file's layers as given); None: the default split."""
        if self.partition is None:
            return None
        return tuple(self.partition) if self.is_model_file else tuple(layers_from_blocks(self.partition))

    def spec(self) -> ModelSpec:
        """The model as this run trains it: ``micro_batch`` applied, ``dtype_bytes`` that of the
        run's precision (2 for bf16: the activations and messages the cost model counts)."""
        spec = self.model if isinstance(self.model, ModelSpec) else load_model(self.model)
        changes = {"dtype_bytes": self.precision.dtype_bytes}
        if self.micro_batch is not None:
            changes["micro_batch"] = int(self.micro_batch)
        if self.seq_len is not None:
            changes["seq_len"] = int(self.seq_len)
        return spec.replace(**changes) if any(getattr(spec, k) != v for k, v in changes.items()) else spec

    @property
    def precision(self) -> Precision:
        return Precision(self.dtype)

    @property
    def samples_per_microbatch(self) -> int:
        """Sequences (GPT) or samples (model file) per micro-batch."""
        if self.is_model_file:
            from .user_model import DEFAULT_MICRO_BATCH
            return int(self.micro_batch or DEFAULT_MICRO_BATCH)
        return self.spec().micro_batch

    def stack_layout(self, num_stages: int):
        """A model file's checked layout over ``num_stages`` stages (:func:`executor.user_model.stack_layout`)."""
        from .user_model import stack_layout
        return stack_layout(str(self.model), num_stages, micro_batch=self.samples_per_microbatch, seed=self.seed,
                            partition=self.partition)

    @property
    def model_name(self) -> str:
        return self.model.name if isinstance(self.model, ModelSpec) else str(self.model)

    @property
    def global_microbatches(self) -> int:
        return self.replicas * self.microbatches


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
    if spec is not None and config.tp > 1:
        check_tensor_parallel(spec, config.tp, config.sequence_parallel)
    check_device(config.device)
    if stack and config.data is not None:
        raise ValueError(f"--data feeds the built-in GPT; model {config.model} brings its own sample()")
    if config.data is not None:
        check_input(config.data, "data file", min_bytes=spec.seq_len + 2)
    if schedule is None and config.schedule_file is not None:
        schedule = config.schedule_file.schedule
    if schedule is None:
        check_size(config.devices, config.microbatches, config.replicas, config.chunks)
        if spec is not None and config.partition is None and spec.layers < config.devices:
            block_ranges(spec.layers, config.devices)   # every schedule has >= D stages: its error, before building
        kw = {} if config.variant is None else {"variant": config.variant}
        sched = build(config.schedule, config.devices, config.microbatches, chunks=config.chunks, **kw)
        low = lower(sched, replicas=config.replicas, eager=config.eager_allreduce)
    else:
        low = schedule if schedule.lowered else lower(schedule, replicas=config.replicas,
                                                      eager=config.eager_allreduce)
        G = low.replicas * low.num_microbatches
        if G != config.global_microbatches:
            raise ValueError(f"schedule {low.name} runs {low.replicas} x {low.num_microbatches} micro-batches per "
                             f"step but the config says replicas={config.replicas} x microbatches="
                             f"{config.microbatches}; they must agree (the reference trains on the config's)")
    if stack:
        from .user_model import check_stack_fits
        check_stack_fits(config, low)           # counted on the meta device: too big is refused before building
        config.stack_layout(low.num_stages)     # imports, builds and checks the model: user errors here
    else:
        block_ranges(spec.layers, low.num_stages, config.partition)
    if check:
        validate(low)
    check_fault(config.fault, low, config.steps)
    return low


def check_tensor_parallel(spec: ModelSpec, tp: int, sequence_parallel: bool = False) -> None:
    """Refuse a T that does not split the heads, KV heads, FFN size, the sequence with sequence
    parallelism (the simulator's check) or the vocabulary (the executor's vocabulary-parallel
    embedding and loss) evenly, with one line."""
    spec.check_tensor_parallel(tp, sequence_parallel=sequence_parallel)
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
        return {"engine": self.engine, "schedule": c.schedule, "variant": c.variant, "devices": c.devices,
                "microbatches": c.microbatches, "replicas": c.replicas, "tp": c.tp,
                "sequence_parallel": c.sequence_parallel, "zero": c.zero,
                "model": c.model_name,
                "micro_batch": c.samples_per_microbatch,
                "partition": list(c.partition) if c.partition is not None else None,
                "steps": c.steps, "optimizer": c.optimizer, "lr": c.lr, "seed": c.seed, "dtype": c.dtype,
                "recompute": c.recompute,
                "losses": self.losses, "iteration_times": self.iteration_times,
                "throughput_seq_per_s": self.throughput, "ma_bytes": self.ma_bytes,
                "per_device": self.per_device, **self.extra}

