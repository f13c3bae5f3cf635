"""The single-process reference: the same model, batches, loss and optimizer, no pipeline.

One process holds the whole GPT (:func:`executor.model.full_model`, the same initial weights as
every pipeline split; or a model file's whole layer stack, :func:`executor.user_model.reference_model`)
and, per step, runs forward and backward of each of the G = R * N global micro-batches in turn,
each loss divided by G so the accumulated gradient is that of the mean loss of the global batch,
then steps the optimizer. In bf16 (``config.dtype``) the forward runs under the same autocast as
the pipeline's stages (:mod:`executor.precision`); there are no stage boundaries, so no message is
rounded. Recomputation does not change the arithmetic, so the reference does not recompute. The
executor must reproduce its losses and
final parameters; its peak activation memory is that of one micro-batch through the whole model,
measured with the same meter as the executor (so Ma = that / D).

It reads the model, the micro-batch size (``config.parallel.micro_batch`` overrides the spec's) and G from
the config exactly as the executor does, so a run of a planner plan (R x D or stage replicas
r_s, with an explicit partition: :meth:`planner.plan_io.LoadedPlan.run_job`) and its reference
train on the same global batch, cut into the same micro-batches; the partition does not matter here
(weights are seeded by global parameter name, so every split starts from the same values).
"""
from __future__ import annotations

import time

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
        model = full_model(spec, seed=config.seed).to(ctx.device)
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
