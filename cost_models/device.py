"""Device specs: what one accelerator can compute and hold.

A device YAML file (presets in ``cost_models/presets/devices``)::

    name: a100
    description: NVIDIA A100 SXM4 80GB
    peak_flops: {fp16: 312 TFLOP/s, bf16: 312 TFLOP/s, fp32: 19.5 TFLOP/s}   # dense, no sparsity
    memory: 80 GiB                 # bytes
    memory_bandwidth: 2039 GB/s    # bytes/s (optimizer step and local copies are memory-bound)
    efficiency: 0.5                # achievable fraction of peak for transformer layers (linear model)
    fitted: "kernel constants: ...; efficiency: not fitted"   # where the constants come from (one line)
    kernels:                       # constants of the kernel cost model (cost_models/kernels.py)
      {sms: 108, gemm_efficiency: 0.935, tile_intensity: 3.16, memory_efficiency: 0.616, kernel_latency: 6.7 us,
       dispatch_forward: 2 us, dispatch_backward: 25.3 us, module_overhead: 81.4 us}

A ``calibrated: true`` device (the ``cpu`` preset) has no datasheet peak: its layer times come
from a calibration profile measured on the machine (:mod:`cost_models.profile`).

Units: FLOP/s, bytes, bytes/s; ``efficiency`` is a fraction in (0, 1].

Each cost model reads the fields it needs and refuses a device without them, naming the field:
the linear model ``efficiency`` (:meth:`DeviceSpec.achievable_flops`; a device without it is no
longer taken to run at 100 % of its peak), the kernel model ``kernels`` and ``memory_bandwidth``
(:class:`cost_models.kernels.DeviceRates`). ``fitted`` (optional) says in one line where the
constants were fitted; the summaries of simulate, compare, sweep and plan show it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import _spec
from ._spec import SpecError
from .kernels import GpuConstants, constants_from_dict

PRECISIONS = ("fp16", "bf16", "fp32", "tf32", "fp8")


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator. ``peak_flops`` is a tuple of (precision, dense FLOP/s) pairs."""

    name: str
    peak_flops: tuple[tuple[str, float], ...] = ()
    memory_bytes: float | None = None          # None: unknown (never out of memory)
    memory_bandwidth: float | None = None      # bytes/s; None: memory-bound costs are 0
    efficiency: float | None = None            # None: not given (the linear cost model refuses the device)
    calibrated: bool = False
    description: str = ""
    kernels: GpuConstants | None = None        # the kernel cost model's constants (None: linear model only)
    fitted: str = ""                           # where the constants were fitted, one line ("": not stated)

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s at ``precision``; a SpecError says which precisions the device has."""
        for p, v in self.peak_flops:
            if p == precision:
                return v
        if self.calibrated:
            raise SpecError(f"device {self.name!r} has no datasheet FLOP/s: its costs come from a calibration "
                            f"profile (cost_models.profile.load_profile)")
        have = ", ".join(p for p, _ in self.peak_flops) or "none"
        raise SpecError(f"device {self.name!r} has no peak for precision {precision!r} (has: {have})")

    def has(self, precision: str) -> bool:
        return any(p == precision for p, _ in self.peak_flops)

    def achievable_flops(self, precision: str) -> float:
        """FLOP/s a transformer layer reaches: peak * efficiency (the linear cost model's rate; a
        device without ``efficiency`` is refused here, naming the field)."""
        peak = self.peak(precision)
        if self.efficiency is None:
            other = ", or use --cost-model kernels" if self.kernels is not None else ""
            raise SpecError(f"device {self.name!r} has no field 'efficiency' (the fraction of its peak a layer "
                            f"reaches), which the linear cost model needs; add e.g. 'efficiency: 0.4' to its "
                            f"YAML{other}")
        return peak * self.efficiency

    def notes(self) -> tuple[str, ...]:
        """One line per datasheet field left out whose absence changes a number (for the reports)."""
        if self.calibrated:
            return ()
        return tuple(line for missing, line in (
            (self.memory_bytes is None, f"device {self.name!r} gives no 'memory': nothing is out of memory"),
            (self.memory_bandwidth is None, f"device {self.name!r} gives no 'memory_bandwidth': the optimizer step "
                                            f"and local copies cost 0")) if missing)

    def provenance(self) -> str:
        """One line: where this device's constants come from (its ``fitted`` field)."""
        return f"{self.name}: " + (self.fitted or "its file does not say where its constants come from (field fitted)")

    def to_dict(self) -> dict:
        d = {"name": self.name, "description": self.description, "peak_flops": dict(self.peak_flops),
             "memory": self.memory_bytes, "memory_bandwidth": self.memory_bandwidth,
             "efficiency": self.efficiency, "calibrated": self.calibrated,
             "kernels": self.kernels.to_dict() if self.kernels is not None else None, "fitted": self.fitted or None}
        return {k: v for k, v in d.items() if v is not None}


_FIELDS = ("name", "description", "peak_flops", "memory", "memory_bandwidth", "efficiency", "calibrated",
           "kernels", "fitted")


def device_from_dict(d, source: str = "<dict>") -> DeviceSpec:
    d = _spec.mapping(d, source)
    _spec.check_fields(d, source, _FIELDS)
    calibrated = d.get("calibrated", False)
    if not isinstance(calibrated, bool):
        raise SpecError(f"{source}: field 'calibrated' must be true or false; got {calibrated!r}")
    peaks = []
    raw = d.get("peak_flops", {}) or {}
    _spec.mapping(raw, source, "peak_flops")
    for p, v in raw.items():
        if p not in PRECISIONS:
            raise SpecError(f"{source}: unknown field 'peak_flops.{p}' (known: {', '.join(PRECISIONS)})")
        peaks.append((p, _spec.flops(v, source, f"peak_flops.{p}")))
    if not peaks and not calibrated:
        raise SpecError(f"{source}: missing field 'peak_flops' (or set 'calibrated: true' for a device whose "
                        f"costs come from a calibration profile)")
    mem = d.get("memory")
    mem = None if mem is None else _spec.size_bytes(mem, source, "memory")
    bw = d.get("memory_bandwidth")
    bw = None if bw is None else _spec.bandwidth(bw, source, "memory_bandwidth")
    eff = None if d.get("efficiency") is None else _spec.number(d["efficiency"], source, "efficiency")
    if eff is not None and eff > 1:
        raise SpecError(f"{source}: field 'efficiency' must be in (0, 1]; got {eff!r}")
    name = d.get("name", Path(source).stem)
    desc = d.get("description", "")
    if not isinstance(name, str) or not isinstance(desc, str):
        raise SpecError(f"{source}: fields 'name' and 'description' must be strings")
    fitted = d.get("fitted", "") or ""
    if not isinstance(fitted, str) or "\n" in fitted.strip():
        raise SpecError(f"{source}: field 'fitted' must be one line of text (where the constants were fitted); "
                        f"got {fitted!r}")
    kern = None if d.get("kernels") is None else constants_from_dict(d["kernels"], source)
    return DeviceSpec(name=name, peak_flops=tuple(peaks), memory_bytes=mem, memory_bandwidth=bw, efficiency=eff,
                      calibrated=calibrated, description=desc, kernels=kern, fitted=fitted.strip())


def device_presets() -> list[str]:
    return _spec.presets("devices")


def load_device(name_or_path: str | Path) -> DeviceSpec:
    """A preset name (see :func:`device_presets`) or a path to a YAML file."""
    data, source = _spec.read_yaml(name_or_path, "devices", "device")
    return device_from_dict(data, source)
