"""What to run and what comes back: :class:`RunConfig`, :func:`lowered_schedule`, :class:`RunResult`.

:func:`lowered_schedule` turns a config into a lowered, validated schedule and checks that the
model can be split into its stages; it runs in the launching process, so every user error is
reported before any worker process starts. (Planner plan files become configs in the command
layer, :mod:`experiments.plan_files`.)
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from cost_models.model_spec import ModelSpec, load_model
from cost_models.partition import block_ranges
from schedules import Schedule, build, lower, validate

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class RunConfig:
    """One training run. ``replicas`` R copies the whole pipeline (ranks r*D + d); each step
    trains on R*N micro-batches of ``spec.micro_batch`` sequences; the loss is their mean.

    ``model`` is a preset name, a YAML path or a ModelSpec; ``micro_batch`` overrides the spec's
    sequences per micro-batch; ``partition`` gives the transformer blocks of each of the schedule's
    stages per model copy (embedding in stage 0, head in the last; default: the even split of
    :func:`cost_models.partition.block_ranges`). The reference uses the same spec and G = R * N, so its
    global batch is the run's."""

    schedule: str = "dapple"
    devices: int = 2
    microbatches: int = 4
    chunks: int = 2                 # chunks per device for schedules that take it (interleaved)
    variant: str | None = None      # the schedule family's variant (None: its default)
    replicas: int = 1
    model: str | ModelSpec = "tiny"  # preset name, YAML path or ModelSpec
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
    collect_params: bool = False    # return the final parameters (tests)
    fault: str | None = None        # fault injection for tests: "RANK:TOKEN[:STEP]" raises there
    micro_batch: int | None = None  # sequences per micro-batch (None: the spec's micro_batch)
    partition: tuple[int, ...] | None = None  # blocks per stage of a model copy (None: even split)
    probe: int = 0                  # host speed probe: timed F+B of one block, this many times before
                                    # and after the steps on every rank at once (0: off); see worker
    pin_cores: bool = False         # pin each rank to a core of its own where the host has one per rank
                                    # (executor.host.pin_to_core; otherwise the ranks float)

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}; got {self.optimizer!r}")
        for name in ("devices", "microbatches", "replicas", "steps", "chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive; got {self.timeout}")
        if self.recv_lookahead is not None and self.recv_lookahead < 1:
            raise ValueError(f"recv_lookahead must be >= 1 or None; got {self.recv_lookahead}")
        if self.micro_batch is not None and (isinstance(self.micro_batch, bool) or int(self.micro_batch) < 1
                                             or int(self.micro_batch) != self.micro_batch):
            raise ValueError(f"micro_batch must be a positive integer or None; got {self.micro_batch!r}")
        if self.partition is not None:
            try:
                part = tuple(self.partition)
            except TypeError:
                raise ValueError(f"partition must be a list of block counts per stage; got {self.partition!r}") \
                    from None
            object.__setattr__(self, "partition", part)

    def with_(self, **changes) -> "RunConfig":
        return replace(self, **changes)

    def spec(self) -> ModelSpec:
        spec = self.model if isinstance(self.model, ModelSpec) else load_model(self.model)
        return spec if self.micro_batch is None else spec.replace(micro_batch=int(self.micro_batch))

    @property
    def model_name(self) -> str:
        return self.model.name if isinstance(self.model, ModelSpec) else str(self.model)

    @property
    def global_microbatches(self) -> int:
        return self.replicas * self.microbatches


def lowered_schedule(config: RunConfig, schedule: Schedule | None = None, *, check: bool = True) -> Schedule:
    """The lowered schedule a config runs (``schedule`` overrides the named one), validated
    (``check=False`` skips the symbolic run: only for tests that run broken programs), after
    checking that the model can be split into its stages."""
    if schedule is None:
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
    if check:
        validate(low)
    spec = config.spec()
    if spec.kind != "gpt":
        raise ValueError(f"the executor trains GPT decoders; model {spec.name!r} is of kind {spec.kind!r}")
    block_ranges(spec.layers, low.num_stages, config.partition)
    return low


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
        seqs = self.config.global_microbatches * self.config.spec().micro_batch
        return seqs * len(times) / sum(times) if sum(times) > 0 else float("nan")

    def to_dict(self) -> dict:
        c = self.config
        return {"engine": self.engine, "schedule": c.schedule, "variant": c.variant, "devices": c.devices,
                "microbatches": c.microbatches, "replicas": c.replicas, "model": c.model_name,
                "micro_batch": c.spec().micro_batch,
                "partition": list(c.partition) if c.partition is not None else None,
                "steps": c.steps, "optimizer": c.optimizer, "lr": c.lr, "seed": c.seed,
                "losses": self.losses, "iteration_times": self.iteration_times,
                "throughput_seq_per_s": self.throughput, "ma_bytes": self.ma_bytes,
                "per_device": self.per_device, **self.extra}

