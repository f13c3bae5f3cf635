"""Planner plan files in ``pipetwin run --plan``.

A plan file (:mod:`planner.plan_io`) holds a plan, the model's workload and the cluster. The
simulator takes it as a job's plan (:meth:`planner.plan_io.LoadedPlan.bind`); a run takes its job
(``RunConfig(job=plan.run_job(), placement=plan.placement)`` in the library); here the command
line's run of it, with what the command prints about it.
"""
from __future__ import annotations

import dataclasses

from executor.config import RunConfig, lowered_schedule
from planner.plan_io import LayoutPlan, LoadedPlan, load_plan
from schedules import Schedule

# what a plan's run takes besides the plan: the training options (a RunConfig's own fields, less its
# job, which the plan is) and a mapping name for torchrun (``device_map``)
TAKES = frozenset(f.name for f in dataclasses.fields(RunConfig)) - {"job"} | {"device_map"}


def config_from_plan(source, *, eager: bool = True, **options) -> tuple[RunConfig, Schedule, dict]:
    """A planner plan (a plan file path or a :class:`planner.plan_io.LoadedPlan`) as ``(config, lowered
    schedule, info)`` for :func:`executor.launch.run`: the plan's model, its per-replica micro-batch,
    its layer partition (converted to blocks per stage) and its layout, uniform (R x D: the named
    schedule with ``replicas`` R) or not (stage s on r_s devices: the planner's model-copy schedule,
    run as a custom schedule). ``options``: other RunConfig fields (steps, seed, lr, ...).
    ``info``: ``layout``, ``device_map`` (the config's, applied under torchrun: rank -> the plan
    cluster's device id, or the mapping named in ``options``), ``devices_per_node`` (of the plan's cluster),
    ``partition_layers`` (layers per stage as the plan counts them), ``global_batch`` and ``plan``
    (a one-line summary)."""
    bad = set(options) - TAKES
    if bad:
        raise ValueError(f"the plan fixes {', '.join(sorted(bad))}; do not pass them with a plan (a run of a "
                         f"plan takes {', '.join(sorted(TAKES))})")
    if options.get("placement") is not None and options.get("device_map") is not None:
        raise ValueError("give a plan's run a placement or a device map, not both")
    loaded = source if isinstance(source, (LoadedPlan, LayoutPlan)) else load_plan(source)
    if isinstance(loaded, LayoutPlan):
        return _layout_config(loaded, eager, options)
    ex = loaded.for_executor(eager=eager)
    info = {"layout": ex["layout"], "device_map": ex["device_map"], "partition_layers": list(ex["partition"]),
            "devices_per_node": loaded.cluster.devices_per_node,
            "global_batch": ex["global_batch"], "plan": loaded.plan.describe(), "model": ex["model"]}
    mapping = options.pop("device_map", None)     # a --device-map name run passes, else the plan's placement
    job = loaded.run_job(eager=eager, device_map=mapping)
    if mapping is None:
        options.setdefault("placement", tuple(ex["device_map"]))    # the plan's, unless one is given
    if not isinstance(job.model, str) and job.model.kind != "gpt":
        raise ValueError(f"the executor trains GPT decoders; the plan's model {job.model.name!r} is of kind "
                         f"{job.model.kind!r}")
    cfg = RunConfig(job=job, **options)
    info["device_map"] = cfg.device_map
    return cfg, lowered_schedule(cfg), info


def _layout_config(loaded: LayoutPlan, eager: bool, options: dict) -> tuple[RunConfig, Schedule, dict]:
    """A whole-layout plan (``pipetwin plan``'s layout search) as a run: its job (T x D x R, schedule,
    micro-batch, recompute, ZeRO-1, sequence parallelism) through :meth:`RunConfig.from_job`;
    ``options['device_map']`` overrides the job's placement (the plan's own otherwise)."""
    device_map = options.pop("device_map", None)
    job = loaded.run_job(eager=eager, device_map=device_map if isinstance(device_map, str) else None)
    cfg = RunConfig.from_job(job, **options)
    low = lowered_schedule(cfg)
    lay, par = job.layout, job.parallel
    info = {"layout": f"T={par.tp} x D={lay.devices} x R={lay.replicas}, {lay.microbatches} micro-batches of "
                      f"{par.micro_batch} per replica", "device_map": cfg.device_map,
            "partition_layers": None, "devices_per_node": loaded.cluster.devices_per_node,
            "global_batch": loaded.record.get("global_batch"), "model": loaded.model.name,
            "plan": f"{lay.schedule} T={par.tp} D={lay.devices} R={lay.replicas} N={lay.microbatches} "
                    f"micro-batch {par.micro_batch}, recompute {par.recompute}, ZeRO-{par.zero}"
                    + (", sequence parallel" if par.sequence_parallel else "")}
    return cfg, low, info
