"""The single-process reference: the same model, batches, loss and optimizer, no pipeline.

One process holds the whole GPT (:func:`executor.model.full_model`, the same initial weights as
every pipeline split; or a model file's whole layer stack, :func:`executor.user_model.reference_model`)
and, per step, runs forward and backward of each of the G = R * N global micro-batches in turn,
each loss divided by G so the accumulated gradient is that of the mean loss of the global batch,
then steps the optimizer. In bf16 (``config.dtype``) the forward runs under the same autocast as
the pipeline's stages (:mod:`executor.precision`); there are no stage boundaries, so no message is
rounded. A mixture of experts' load-balancing loss counts in the loss (:mod:`executor.moe`), each
block's gradient scaled by 1/G as the cross-entropy's. Recomputation does not change the
arithmetic, so the reference does not recompute. The executor must reproduce its losses and
final parameters; its peak activation memory is that of one micro-batch through the whole model,
measured with the same meter as the executor (so Ma = that / D).

It reads the model, the micro-batch size (``config.parallel.micro_batch`` overrides the spec's) and G from
the config exactly as the executor does, so a run of a planner plan (R x D or stage replicas
r_s, with an explicit partition: :meth:`planner.plan_io.LoadedPlan.run_job`) and its reference
train on the same global batch, cut into the same micro-batches; the partition does not matter here
(weights are seeded by global parameter name, so every split starts from the same values).

:class:`LossCheck` holds a run's losses against the reference's (``pipetwin run --check``): equal
where every step's relative difference |run - reference| / |reference| is at most
:data:`CHECK_TOLERANCE` of the precision: 1e-5 in fp32 (the order of the sums differs, nothing else),
1e-3 in bf16 (the pipeline rounds every message between stages to bf16, the reference has none:
at most 1e-4 over 5 steps on this CPU for the tiny GPT and both example model files).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from .config import RunConfig, RunResult
from .data import TokenSource
from .device import NullMeter, select_device
from .model import full_model, make_optimizer


def run_reference(config: RunConfig) -> RunResult:
    ctx = select_device("cpu" if config.device == "auto" else config.device)
    if config.is_model_file:    # a layer stack: all its layers as one stage (executor.user_model)
        from .user_model import reference_model
        model, data = reference_model(str(config.model), seed=config.seed, micro_batch=config.samples_per_microbatch)
        model = model.to(ctx.device)
    else:
        spec = config.spec()
        model = config.precision.prepare(full_model(spec, seed=config.seed, moe=config.moe_run()).to(ctx.device))
        data = TokenSource(spec, config.seed, config.data)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer = make_optimizer(params, config.optimizer, config.lr)
    meter = ctx.meter(params) if config.measure_memory else NullMeter()
    G = config.global_microbatches
    precision = config.precision
    losses, times, peak, ma = [], [], 0, 0.0
    for step in range(config.steps):
        meter.start_step()
        t0 = time.perf_counter()
        loss_sum = 0.0
        for g in range(G):
            x, y = (t.to(ctx.device) for t in data.batch(step, g, G))
            before = meter.current()
            with meter.capture(), precision.autocast(ctx.device):
                loss = model.loss(model(x), y)
                scaled = loss / G
            if step == 0 and g == 0:
                ma = (meter.current() - before) / config.layout.devices
            scaled.backward()
            loss_sum = loss_sum + loss.detach()
            if getattr(model, "aux_loss", None) is not None:    # a mixture of experts' balance loss
                loss_sum = loss_sum + model.aux_loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        ctx.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss_sum) / G)
        peak = max(peak, int(meter.peak))
    per_device = [{"device": 0, "peak_activation_bytes": peak, "peak_activation_ma": peak / ma if ma else None}]
    params_out = ({n: p.detach().cpu().clone() for n, p in model.named_parameters(remove_duplicate=False)}
                  if config.collect_params else None)
    return RunResult(config, losses, times, per_device, ma, "reference", params=params_out)


# relative, per step (see the module docstring); fp8: bf16's boundaries plus per-tensor fp8 scales of
# the same tensors on both sides (GPU only, not measured on this host)
CHECK_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3, "fp8": 1e-2}


@dataclass(frozen=True)
class LossCheck:
    """A run's per-step losses against the reference's, in ``dtype`` (see the module docstring);
    ``against`` names the losses compared with in the line (another engine's: ``pipetwin run
    --runtime torch`` holds torch's runtime against pipetwin's executor)."""

    losses: tuple[float, ...]
    reference: tuple[float, ...]
    dtype: str = "fp32"
    against: str = "the reference's"

    def __post_init__(self):
        if len(self.losses) != len(self.reference):
            raise ValueError(f"the run has {len(self.losses)} losses, the reference {len(self.reference)}")

    @property
    def tolerance(self) -> float:
        return CHECK_TOLERANCE[self.dtype]

    @property
    def tolerance_text(self) -> str:
        """The tolerance as the help writes it: 1e-5, 1e-3."""
        return f"{self.tolerance:.0e}".replace("e-0", "e-")

    @property
    def differences(self) -> tuple[float, ...]:
        """|run - reference| / |reference| per step (the absolute difference where the reference is 0;
        infinite where either is not finite)."""
        out = []
        for a, b in zip(self.losses, self.reference):
            d = abs(a - b) / abs(b) if b else abs(a - b)
            out.append(d if math.isfinite(d) else math.inf)
        return tuple(out)

    @property
    def first_step(self) -> int | None:
        """The first step whose difference is beyond the tolerance (None: all within)."""
        return next((k for k, d in enumerate(self.differences) if not d <= self.tolerance), None)

    @property
    def equal(self) -> bool:
        return self.first_step is None

    def line(self) -> str:
        """One line: equal within the tolerance and the largest difference, or the first step beyond it."""
        d, k = self.differences, self.first_step
        where = f"relative, {self.dtype}"
        if k is None:
            worst = max(range(len(d)), key=d.__getitem__)
            how = (f"identical at all {len(d)} steps" if d[worst] == 0 else
                   f"largest difference {d[worst]:.1e} at step {worst} of {len(d)}")
            return f"losses equal {self.against} within {self.tolerance_text} ({where}): {how}"
        return (f"losses differ from {self.against} at step {k}: {self.losses[k]:.6f} vs {self.reference[k]:.6f}, "
                f"a difference of {d[k]:.1e} > {self.tolerance_text} ({where})")

    def to_dict(self) -> dict:
        return {"reference_losses": list(self.reference), "tolerance": self.tolerance, "dtype": self.dtype,
                "relative_differences": list(self.differences), "first_step_beyond": self.first_step,
                "equal": self.equal}
