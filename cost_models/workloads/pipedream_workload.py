"""Workloads from measured per-layer profiles in PipeDream's graph format (DAPPLE's released profiles).

:func:`profile_workload` reads a file with :func:`cost_models.workloads.pipedream_profile.load_pipedream_profile`
(a DAG put in topological order, one layer per node; see there), merges the nodes without compute
or parameters into a neighbour (:meth:`~cost_models.workloads.pipedream_profile.PipeDreamProfile.merged`) and
turns it into a per-sample :class:`cost_models.workloads.workload.Workload`:

* ``cost_model="linear"`` (the default for profiles): times, activations and boundary bytes are the
  profile's divided by the profile batch, and a replica of q samples costs q x those, as DAPPLE's
  planner (HPGO) scales them;
* ``cost_model="kernels"``: the profile stays the anchor at its own batch, and the per-sample
  forward (backward) time of every layer at q samples is the profiled one times
  ``T(q) / T(pbs)``, the ratio of the kernel model's per-sample forward (backward) time of the same
  kind of model at q and at the profile batch (:data:`FAMILIES`: BERT and XLNet as a BERT-large
  block at sequence 512, VGG-19, GNMT-16 and AmoebaNet-36 as in :mod:`cost_models.workloads.paper_kernels`; all
  fp32, as the profiles are). The kind is told by the file name (``bert-48-pbs-2.txt`` -> bert);
  another name has no such curve and is refused for the kernel model.

The parameters are fp32 (4 bytes each, as in the profiles), kept with 16 bytes of weights,
gradients and Adam state per parameter; the optimizer step reads and writes 28 bytes per parameter
at the device's memory bandwidth. ``activation_per_sample`` rescales the activations a layer keeps
so that the whole model keeps that many bytes per sample (DAPPLE's planner overrides the profiles'
activation sizes with such a number for BERT, XLNet and AmoebaNet).
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from pathlib import Path

from ..device import DeviceSpec
from ..kernels import BlockShape, DeviceRates, block_kernels
from .pipedream_profile import ProfileError, load_pipedream_profile

from .workload import Workload, check_cost_model, from_layer_costs

FAMILIES = {"bert": "transformer", "xlnet": "transformer", "vgg": "vgg-19", "gnmt": "gnmt-16", "amoeba": "amoebanet-36"}
TRANSFORMER_BLOCK = dict(arch="bert", hidden=1024, heads=16, seq=512, ffn=4096, dtype_bytes=4)


def family(profile_name: str) -> str | None:
    """The model family of a profile from its name (``bert-48-pbs-2`` -> ``bert``), or None."""
    head = profile_name.split("-")[0].split("_")[0].lower()
    return head if head in FAMILIES else None


def _family_times(fam: str, device: DeviceSpec, q: int) -> tuple[float, float]:
    """Per-sample (forward, backward) seconds of the whole family model at q under the kernel model."""
    return _family_times_cached(fam, device, int(q))


@lru_cache(maxsize=1024)
def _family_times_cached(fam: str, device: DeviceSpec, q: int) -> tuple[float, float]:
    rates = DeviceRates.of(device, "fp32")
    what = FAMILIES[fam]
    if what == "transformer":
        f, b, w = rates.phases(block_kernels(BlockShape(micro_batch=q, **TRANSFORMER_BLOCK)))
        return f / q, (b + w) / q
    from .paper_models import kernel_curve
    fs, bs, ws = kernel_curve(what, device)(q)
    return sum(fs), sum(bs) + sum(ws)


def profile_workload(path, device: DeviceSpec, *, profile_batch: int | None = None, cost_model: str = "linear",
                     recompute: str = "none", activation_per_sample: float | None = None) -> Workload:
    """A profile file as a per-sample workload on ``device`` (see the module docstring)."""
    check_cost_model(cost_model)
    if recompute != "none":
        raise ValueError(f"a measured profile has no recomputation model; {Path(path).name} takes --recompute none")
    prof = load_pipedream_profile(path, profile_batch).merged()
    pbs = prof.profile_batch
    lc = prof.layer_costs(pbs)
    if device.memory_bandwidth:
        lc = dataclasses.replace(lc, optim_time_per_param=28.0 / device.memory_bandwidth)
    src = {"kind": "profile", "path": str(Path(prof.path).resolve()), "name": prof.model, "profile_batch": pbs,
           "cost_model": cost_model}
    if activation_per_sample is not None:
        if not (isinstance(activation_per_sample, (int, float)) and activation_per_sample > 0
                and activation_per_sample < float("inf")):
            raise ValueError(f"activation_per_sample must be a positive number of bytes; got {activation_per_sample!r}")
        total = sum(lc.act) / pbs
        if total <= 0:
            raise ProfileError(f"{prof.path}: no activation sizes to rescale")
        k = activation_per_sample / total
        lc = dataclasses.replace(lc, act=tuple(a * k for a in lc.act))
        src["activation_per_sample"] = float(activation_per_sample)
    wl = from_layer_costs(prof.model, lc, per=pbs, layer_names=prof.layer_names,
                          memory_capacity=device.memory_bytes, source=src)
    if cost_model == "linear":
        return wl
    fam = family(prof.name)
    if fam is None:
        raise ValueError(f"{prof.path}: the kernel cost model scales a profile by the curve of a known model kind "
                         f"({', '.join(FAMILIES)}: told by the file name); use --cost-model linear for this file")
    f0, b0 = _family_times(fam, device, pbs)
    base_f, base_b = wl.f, wl.b_input

    def curve(q: int):
        fq, bq = _family_times(fam, device, q)
        rf, rb = fq / f0, bq / b0
        return (tuple(x * rf for x in base_f), tuple(x * rb for x in base_b), (0.0,) * len(base_f))

    return dataclasses.replace(wl, cost_model=cost_model, per_sample_at=curve)
