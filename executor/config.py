"""What to run and what comes back: :class:`RunConfig`, :func:`plan`, :class:`RunResult`.

:func:`plan` turns a config into a lowered, validated schedule and checks that the model can be
split into its stages; it runs in the launching process, so every user error is reported before
any worker process starts.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from cost_models.model_spec import ModelSpec, load_model
from schedules import Schedule, build, lower, validate

from .model import partition_layers

OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class RunConfig:
    """One training run. ``replicas`` R copies the whole pipeline (ranks r*D + d); each step
    trains on R*N micro-batches of ``spec.micro_batch`` sequences; the loss is their mean."""

    schedule: str = "dapple"
    devices: int = 2
    microbatches: int = 4
    chunks: int = 2                 # chunks per device for schedules that take it (interleaved)
    replicas: int = 1
    model: str = "tiny"             # preset name or YAML path
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

    def with_(self, **changes) -> "RunConfig":
        return replace(self, **changes)

    def spec(self) -> ModelSpec:
        return load_model(self.model)

    @property
    def global_microbatches(self) -> int:
        return self.replicas * self.microbatches


def plan(config: RunConfig, schedule: Schedule | None = None, *, check: bool = True) -> Schedule:
    """The lowered schedule a config runs (``schedule`` overrides the named one), validated
    (``check=False`` skips the symbolic run: only for tests that run broken programs)."""
    if schedule is None:
        sched = build(config.schedule, config.devices, config.microbatches, chunks=config.chunks)
        low = lower(sched, replicas=config.replicas, eager=config.eager_allreduce)
    else:
        low = schedule if schedule.lowered else lower(schedule, replicas=config.replicas,
                                                      eager=config.eager_allreduce)
    if check:
        validate(low)
    spec = config.spec()
    if spec.kind != "gpt":
        raise ValueError(f"the executor trains GPT decoders; model {spec.name!r} is of kind {spec.kind!r}")
    partition_layers(spec.layers, low.num_stages)
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
        return {"engine": self.engine, "schedule": c.schedule, "devices": c.devices,
                "microbatches": c.microbatches, "replicas": c.replicas, "model": c.model,
                "steps": c.steps, "optimizer": c.optimizer, "lr": c.lr, "seed": c.seed,
                "losses": self.losses, "iteration_times": self.iteration_times,
                "throughput_seq_per_s": self.throughput, "ma_bytes": self.ma_bytes,
                "per_device": self.per_device, **self.extra}

