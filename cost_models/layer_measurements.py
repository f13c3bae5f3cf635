"""Measured per-layer GPU times (forward, backward against the batch size) and the kernel model's fit to them.

A measurement set is a folder with a ``layers.yaml`` (device, precision, the benchmark's protocol,
one entry per layer: its CSV file and shape, and which layers the constants are fitted on) and one
CSV per layer with columns ``bs``, ``time_f``, ``time_b`` (milliseconds per pass; other columns
are ignored). The shipped set is ``chimera-v100`` (Chimera's V100 profiles,
``cost_models/presets/measurements/chimera-v100``): :func:`load_measurements` with no argument.

:func:`predict` prices every measured point with the kernel model under the measurement's protocol
(:func:`cost_models.kernels.measured_layer_times`); :func:`fit_constants` fits the kernel constants
(all but the datasheet's SM count) by least squares on the log of the times of the fitted layers
(Nelder-Mead over the log of the constants, a few restarts; numpy only). :func:`error_table` is the
relative error per layer, batch and pass; :func:`speedups` the per-sample speed-up from the
smallest to the largest batch, measured and modelled.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from . import _spec
from ._spec import SpecError
from .device import DeviceSpec, load_device
from .kernels import BlockShape, DeviceRates, GpuConstants, Protocol, measured_layer_times

DEFAULT_SET = "chimera-v100"


@dataclass(frozen=True)
class LayerMeasurement:
    name: str
    shape: BlockShape                  # micro_batch is replaced per point
    batches: tuple[int, ...]
    time_f: tuple[float, ...]          # seconds per pass
    time_b: tuple[float, ...]


@dataclass(frozen=True)
class MeasurementSet:
    name: str
    device: DeviceSpec
    precision: str
    protocol: Protocol
    layers: tuple[LayerMeasurement, ...]
    fit: tuple[str, ...]
    held_out: tuple[str, ...]

    def layer(self, name: str) -> LayerMeasurement:
        for l in self.layers:
            if l.name == name:
                return l
        raise SpecError(f"measurement set {self.name!r} has no layer {name!r} (has: "
                        f"{', '.join(l.name for l in self.layers)})")


def _read_csv(path, source: str) -> tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"{source}: cannot read ({e})") from None
    rows = list(csv.DictReader(text.splitlines()))
    if not rows or not {"bs", "time_f", "time_b"} <= set(rows[0]):
        raise SpecError(f"{source}: expected CSV columns bs, time_f, time_b")
    bs, tf, tb = [], [], []
    for i, r in enumerate(rows, start=2):
        try:
            b, f, w = int(r["bs"]), float(r["time_f"]), float(r["time_b"])
        except (TypeError, ValueError):
            raise SpecError(f"{source}: line {i}: bs must be an integer and time_f, time_b numbers") from None
        if b < 1 or not (math.isfinite(f) and math.isfinite(w)) or f <= 0 or w <= 0:
            raise SpecError(f"{source}: line {i}: bs must be >= 1 and times positive and finite; got "
                            f"bs={r['bs']}, time_f={r['time_f']}, time_b={r['time_b']}")
        bs.append(b)
        tf.append(f * 1e-3)
        tb.append(w * 1e-3)
    if len(set(bs)) != len(bs):
        raise SpecError(f"{source}: a batch size appears twice")
    return tuple(bs), tuple(tf), tuple(tb)


def load_measurements(folder: str | Path | None = None) -> MeasurementSet:
    """A measurement folder (see the module docstring); None: the shipped ``chimera-v100`` set."""
    if folder is None:
        root = resources.files("cost_models") / "presets" / "measurements" / DEFAULT_SET
        name = DEFAULT_SET
    else:
        root = Path(folder)
        name = root.name
        if not root.is_dir():
            raise SpecError(f"measurement folder {root} does not exist (or is not a folder)")
    spec_file = root / "layers.yaml"
    if not spec_file.is_file():
        raise SpecError(f"{name}: missing layers.yaml")
    data, source = _spec.read_yaml(Path(str(spec_file)), "measurements", "measurement set")
    d = _spec.mapping(data, source)
    _spec.check_fields(d, source, ("device", "precision", "protocol", "layers", "fit", "held_out"),
                       ("device", "precision", "layers"))
    device = load_device(d["device"])
    precision = d["precision"]
    device.peak(precision)
    pr = _spec.mapping(d.get("protocol", {}) or {}, source, "protocol")
    _spec.check_fields(pr, source, ("passes", "input_grad"), prefix="protocol.")
    protocol = Protocol(passes=_spec.integer(pr.get("passes", 4), source, "protocol.passes"),
                        input_grad=bool(pr.get("input_grad", False)))
    layers = []
    for lname, ld in _spec.mapping(d["layers"], source, "layers").items():
        where = f"layers.{lname}"
        ld = _spec.mapping(ld, source, where)
        _spec.check_fields(ld, source, ("file", "arch", "hidden", "heads", "ffn", "seq", "pre_norm", "dropout"),
                           ("file", "arch", "hidden", "heads", "ffn", "seq"), prefix=where + ".")
        shape = BlockShape(ld["arch"], ld["hidden"], ld["heads"], ld["seq"], ld["ffn"],
                           4 if precision == "fp32" else 2, 1, bool(ld.get("dropout", True)), ld.get("pre_norm"))
        f = root / ld["file"]
        if not f.is_file():
            raise SpecError(f"{source}: {where}: file {ld['file']} does not exist")
        bs, tf, tb = _read_csv(f, f"{name}/{ld['file']}")
        layers.append(LayerMeasurement(str(lname), shape, bs, tf, tb))
    names = [l.name for l in layers]
    for key in ("fit", "held_out"):
        for n in d.get(key, []) or []:
            if n not in names:
                raise SpecError(f"{source}: field {key!r} names {n!r}, not a layer of the set")
    return MeasurementSet(name, device, precision, protocol, tuple(layers), tuple(d.get("fit", []) or names),
                          tuple(d.get("held_out", []) or ()))


# ---------------------------------------------------------------------------- prediction
def predict(ms: MeasurementSet, layer: LayerMeasurement, constants: GpuConstants | None = None
            ) -> list[tuple[float, float]]:
    """(forward, backward) seconds the kernel model gives for every batch of ``layer``."""
    from dataclasses import replace
    rates = DeviceRates.of(ms.device, ms.precision, constants)
    return [measured_layer_times(replace(layer.shape, micro_batch=b), rates, ms.protocol) for b in layer.batches]


def error_table(ms: MeasurementSet, constants: GpuConstants | None = None, layers=None) -> list[dict]:
    """One row per (layer, batch): measured and modelled F and B (seconds), relative errors
    (model / measured - 1) and whether the layer was fitted or held out."""
    rows = []
    for l in ms.layers:
        if layers is not None and l.name not in layers:
            continue
        for b, f, w, (pf, pw) in zip(l.batches, l.time_f, l.time_b, predict(ms, l, constants)):
            rows.append({"layer": l.name, "set": "fit" if l.name in ms.fit else "held-out", "batch": b,
                         "f_measured": f, "f_model": pf, "f_error": pf / f - 1,
                         "b_measured": w, "b_model": pw, "b_error": pw / w - 1})
    return rows


def speedups(ms: MeasurementSet, constants: GpuConstants | None = None) -> list[dict]:
    """Per layer: the per-sample speed-up of F, B and F + B from the smallest to the largest batch,
    measured and modelled (t(b_min) / b_min) / (t(b_max) / b_max)."""
    out = []
    for l in ms.layers:
        pred = predict(ms, l, constants)
        b0, b1 = l.batches[0], l.batches[-1]
        row = {"layer": l.name, "set": "fit" if l.name in ms.fit else "held-out", "from": b0, "to": b1}
        for key, meas, mod in (("f", l.time_f, [p[0] for p in pred]), ("b", l.time_b, [p[1] for p in pred]),
                               ("fb", [x + y for x, y in zip(l.time_f, l.time_b)], [p[0] + p[1] for p in pred])):
            sm = (meas[0] / b0) / (meas[-1] / b1)
            sp = (mod[0] / b0) / (mod[-1] / b1)
            row.update({f"{key}_measured": sm, f"{key}_model": sp, f"{key}_error": sp / sm - 1})
        out.append(row)
    return out


# ---------------------------------------------------------------------------- fitting
FITTED = ("gemm_efficiency", "tile_intensity", "memory_efficiency", "kernel_latency", "dispatch_forward",
          "dispatch_backward", "module_overhead")
_BOUNDS = {"gemm_efficiency": (0.2, 1.0), "tile_intensity": (0.01, 200.0), "memory_efficiency": (0.2, 1.0),
           "kernel_latency": (1e-7, 1e-4), "dispatch_forward": (2e-6, 2e-4), "dispatch_backward": (2e-6, 2e-4),
           "module_overhead": (1e-7, 2e-4)}


def _loss(ms: MeasurementSet, c: GpuConstants, layers) -> float:
    err = 0.0
    n = 0
    for l in ms.layers:
        if l.name not in layers:
            continue
        for f, w, (pf, pw) in zip(l.time_f, l.time_b, predict(ms, l, c)):
            err += math.log(pf / f) ** 2 + math.log(pw / w) ** 2
            n += 2
    return err / max(n, 1)


def _nelder_mead(fun, x0, step=0.3, iters=400, tol=1e-7):
    """``scipy.optimize.minimize`` by Nelder-Mead from a simplex of ``x0`` and ``x0 + step`` along
    each axis, until the simplex's values agree within ``tol`` (or ``iters`` iterations): the fits
    here are a few constants whose loss clamps them to bounds, so no gradient is at hand. Returns
    (x, value)."""
    import numpy as np
    from scipy.optimize import minimize
    x0 = np.asarray(x0, float)
    simplex = np.vstack([x0, x0 + step * np.eye(len(x0))])
    r = minimize(fun, x0, method="Nelder-Mead",
                 options={"initial_simplex": simplex, "maxiter": iters, "fatol": tol, "xatol": np.inf})
    return r.x, float(r.fun)


def fit_constants(ms: MeasurementSet, layers=None, start: GpuConstants | None = None,
                  restarts: int = 2) -> tuple[GpuConstants, float]:
    """Constants minimising the mean squared log error of F and B over ``layers`` (default: the set's
    ``fit`` list), starting from ``start`` (default: the device preset's); returns (constants, rms
    log error). The SM count stays the datasheet's."""
    layers = tuple(layers or ms.fit)
    c0 = start or ms.device.kernels
    if c0 is None:
        raise SpecError(f"device {ms.device.name!r} has no kernel constants to start the fit from")

    def build(x):
        vals = {}
        for name, v in zip(FITTED, x):
            lo, hi = _BOUNDS[name]
            vals[name] = min(hi, max(lo, math.exp(v)))
        return c0.with_values(**vals)

    def fun(x):
        return _loss(ms, build(x), layers)

    x = [math.log(getattr(c0, n)) for n in FITTED]
    best_x, best_v = x, fun(x)
    for r in range(restarts):
        xr, vr = _nelder_mead(fun, best_x, step=0.5 / (r + 1))
        if vr < best_v:
            best_x, best_v = list(xr), vr
    return build(best_x), math.sqrt(best_v)
