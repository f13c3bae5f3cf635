"""Workloads by name: what ``--model`` means to the planner. A paper model (:mod:`cost_models.workloads.paper_models`),
a cost_models transformer preset, YAML path or :class:`ModelSpec`, or a profile file in PipeDream's
graph format (:mod:`cost_models.workloads.pipedream_workload`); and the inverse, a workload rebuilt from the ``source``
record a plan file stores."""
from __future__ import annotations

from ..device import DeviceSpec
from ..model_spec import ModelSpec, load_model, spec_from_dict

from .paper_models import PAPER_MODELS, calibrated_from_source, paper_workload
from .pipedream_workload import profile_workload
from .workload import Workload, check_cost_model, is_profile_path, transformer_workload


def workload_spec(model) -> ModelSpec | None:
    """The transformer spec :func:`load_workload` builds ``model``'s workload from (None for a
    profile file, a paper model or a ready :class:`Workload`): what picks its default cost model
    (:func:`cost_models.bind.cost_model_for`)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, Workload) or is_profile_path(model) or (isinstance(model, str) and model in PAPER_MODELS):
        return None
    return load_model(model)


def load_workload(model, device: DeviceSpec, recompute: str = "none", cost_model: str = "linear",
                  profile_batch: int | None = None) -> Workload:
    """``model``: a planner paper model name (see :func:`cost_models.workloads.paper_models.paper_models`),
    a cost_models model preset or YAML path, a :class:`ModelSpec`, or a profile file (``*.txt``, PipeDream's graph
    format; ``profile_batch``: the batch it was profiled at, default from its name).
    ``cost_model``: ``linear`` or ``kernels`` (see the module docstring)."""
    check_cost_model(cost_model)
    if profile_batch is not None and not is_profile_path(model):
        raise ValueError("--profile-batch applies to a profile file (--model FILE.txt) only")
    if is_profile_path(model):
        return profile_workload(model, device, profile_batch=profile_batch, cost_model=cost_model,
                                recompute=recompute)
    if isinstance(model, ModelSpec):
        return transformer_workload(model, device, recompute, cost_model=cost_model)
    if isinstance(model, str) and model in PAPER_MODELS:
        return paper_workload(model, device, recompute, cost_model=cost_model)
    spec = load_model(model)
    src = {"kind": "transformer", "name": str(model), "spec": spec.to_dict(), "recompute": recompute}
    return transformer_workload(spec, device, recompute, source=src, cost_model=cost_model)


def workload_from_source(source: dict, device: DeviceSpec) -> Workload:
    """Rebuild a workload from its ``source`` record (what plan files store)."""
    kind = source.get("kind")
    recompute = source.get("recompute", "none")
    cost_model = source.get("cost_model", "linear")
    check_cost_model(cost_model)
    if kind == "paper":
        return paper_workload(source["name"], device, recompute, cost_model=cost_model)
    if kind == "transformer":
        spec = spec_from_dict(dict(source["spec"]), f"plan model {source.get('name', '')}".strip())
        return transformer_workload(spec, device, recompute, source=source, cost_model=cost_model)
    if kind == "profile":
        return profile_workload(source["path"], device, profile_batch=source.get("profile_batch"),
                                cost_model=cost_model, activation_per_sample=source.get("activation_per_sample"))
    if kind == "calibrated":    # a calibration profile's measured costs, carried in the record
        return calibrated_from_source(source)
    raise ValueError(f"plan file: cannot rebuild model of kind {kind!r} (expected 'paper', 'transformer', "
                     f"'profile' or 'calibrated')")
