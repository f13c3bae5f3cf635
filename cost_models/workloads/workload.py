"""What the planner plans for: a model's per-layer costs on one device, per sample.

A :class:`Workload` holds, for every layer of the model (index i = layer i of the whole stack,
embedding and head included for transformers), the forward, input-backward and weight-backward
seconds, the activation bytes kept for the backward, the bytes of the layer's output (sent when a
stage ends there) and the parameter count, all **per sample**. With the linear cost model every
cost is linear in the micro-batch (transformer FLOPs and activations are ``b x`` the per-sequence
ones), so a stage replica that processes ``q`` samples of a micro-batch costs ``q x`` these
numbers. With the kernel cost model (``cost_model="kernels"``, :mod:`cost_models.kernels`) the
per-sample *times* depend on q (a GPU is less efficient on small micro-batches):
:meth:`Workload.at` gives the per-sample times at q (``q x`` those is what a replica of q samples
costs), :meth:`Workload.floor` the smallest per-sample times over a set of q (the search's lower
bounds); activations, boundary bytes and parameters stay linear.

:meth:`Workload.layer_costs` gives a :class:`cost_models.LayerCosts` at a micro-batch size (what
:class:`cost_models.PerLayerCostModel` binds to a schedule); for a transformer it is computed by
:class:`cost_models.TransformerCostModel` at exactly that micro-batch, so a plan simulated through
the planner and through ``pipetwin simulate`` sees the same numbers.

:func:`cost_models.workloads.workload_sources.load_workload` resolves a model name: a paper model of
DAPPLE's (:mod:`cost_models.workloads.paper_models`: vgg-19, gnmt-16, amoebanet-36, xlnet-36), a cost_models
preset (gpt-96, bert-48, ...) or a YAML path, or a profile in PipeDream's graph format (DAPPLE's
released profiles, ``*.txt``: :mod:`cost_models.workloads.pipedream_workload`), on a device spec.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import accumulate
from pathlib import Path
from typing import Callable

from ..base import LayerCosts
from ..device import DeviceSpec
from ..model_spec import ModelSpec
from ..parallel import Parallel
from ..transformer import TransformerCostModel


@dataclass(frozen=True)
class Workload:
    """Per-sample, per-layer costs of a model on a device (seconds, bytes, parameter counts)."""

    name: str
    layer_names: tuple[str, ...]
    f: tuple[float, ...]
    b_input: tuple[float, ...]
    w: tuple[float, ...]
    act: tuple[float, ...]
    act_w: tuple[float, ...]
    out_bytes: tuple[float, ...]
    params: tuple[float, ...]
    bytes_per_param_static: float = 16.0
    grad_bytes_per_param: float = 2.0
    optim_time_per_param: float = 0.0
    copy_time: float = 0.0                   # per sample
    memory_capacity: float | None = None     # the device's memory (bytes)
    source: dict = field(default_factory=dict, compare=False)   # how to rebuild it (plan files)
    spec: ModelSpec | None = field(default=None, compare=False)
    device: DeviceSpec | None = field(default=None, compare=False)
    recompute: str = "none"
    cost_model: str = "linear"
    # q -> per-sample (f, b_input, w) at micro-batch q (None: the same at every q)
    per_sample_at: Callable[[int], tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]] | None = \
        field(default=None, compare=False, repr=False)

    def __post_init__(self):
        n = len(self.f)
        for name in ("b_input", "w", "act", "act_w", "out_bytes", "params", "layer_names"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"workload {self.name!r}: {name} has {len(getattr(self, name))} entries, "
                                 f"f has {n}")
        if n < 1:
            raise ValueError(f"workload {self.name!r} has no layers")
        pre = lambda xs: (0.0, *accumulate(xs))  # noqa: E731
        object.__setattr__(self, "_cf", pre(self.f))
        object.__setattr__(self, "_cb", pre(b + w for b, w in zip(self.b_input, self.w)))
        object.__setattr__(self, "_ca", pre(self.act))
        object.__setattr__(self, "_cp", pre(self.params))
        object.__setattr__(self, "_at", {})

    # ---------------------------------------------------------------- micro-batch dependence
    @property
    def varies(self) -> bool:
        """Whether per-sample times depend on the micro-batch (kernel cost model)."""
        return self.per_sample_at is not None

    def at(self, q: int) -> "Workload":
        """This workload with the per-sample times of a micro-batch of ``q`` samples (itself when
        the costs are linear)."""
        if self.per_sample_at is None:
            return self
        q = int(q)
        if q < 1:
            raise ValueError(f"micro-batch must be >= 1 sample; got {q}")
        got = self._at.get(q)
        if got is None:
            f, b, w = self.per_sample_at(q)
            got = self._at[q] = replace(self, f=tuple(f), b_input=tuple(b), w=tuple(w), per_sample_at=None)
        return got

    def floor(self, qs) -> "Workload":
        """Per-layer smallest per-sample forward and backward times over the micro-batches ``qs``
        (a lower bound on the cost of any of them)."""
        if self.per_sample_at is None:
            return self
        ws = [self.at(q) for q in sorted(set(int(q) for q in qs))]
        f = tuple(min(w.f[i] for w in ws) for i in range(self.num_layers))
        bw = tuple(min(w.b_input[i] + w.w[i] for w in ws) for i in range(self.num_layers))
        return replace(self, f=f, b_input=bw, w=(0.0,) * self.num_layers, per_sample_at=None)

    @property
    def num_layers(self) -> int:
        return len(self.f)

    # ---------------------------------------------------------------- range sums (per sample)
    def fwd(self, i: int, j: int) -> float:
        """Forward seconds of layers [i, j) for one sample."""
        return self._cf[j] - self._cf[i]

    def bwd(self, i: int, j: int) -> float:
        """Full backward (input + weight gradient) seconds of layers [i, j) for one sample."""
        return self._cb[j] - self._cb[i]

    def activation(self, i: int, j: int) -> float:
        return self._ca[j] - self._ca[i]

    def param_count(self, i: int, j: int) -> float:
        return self._cp[j] - self._cp[i]

    @property
    def total_params(self) -> float:
        return self._cp[-1]

    # ---------------------------------------------------------------- prefix sums (per sample)
    # Entry i of each is the sum over layers [0, i) (L + 1 entries, the first 0.0), so the sum over
    # layers [i, j) is ``sums[j] - sums[i]``: what the range sums above compute, for loops (the
    # planner's search) that take many such differences and read the tuple once.
    @property
    def forward_prefix_sums(self) -> tuple[float, ...]:
        """Forward seconds of layers [0, i) for one sample, by i (see :meth:`fwd`)."""
        return self._cf

    @property
    def backward_prefix_sums(self) -> tuple[float, ...]:
        """Full backward (input + weight gradient) seconds of layers [0, i) for one sample, by i (see
        :meth:`bwd`)."""
        return self._cb

    @property
    def activation_prefix_sums(self) -> tuple[float, ...]:
        """Activation bytes layers [0, i) keep for the backward of one sample, by i (see :meth:`activation`)."""
        return self._ca

    @property
    def param_prefix_sums(self) -> tuple[float, ...]:
        """Parameter count of layers [0, i), by i (see :meth:`param_count`)."""
        return self._cp

    # ---------------------------------------------------------------- binding
    def layer_costs(self, micro_batch: int) -> LayerCosts:
        """Per-layer costs at ``micro_batch`` samples per micro-batch."""
        if self.spec is not None and self.device is not None:
            tm = TransformerCostModel(self.spec.replace(micro_batch=int(micro_batch)), self.device,
                                      parallel=Parallel(recompute=self.recompute), compute=self.cost_model)
            return tm.layer_costs()
        q = float(micro_batch)
        t = self.at(int(micro_batch)) if self.varies else self
        sc = lambda xs: tuple(x * q for x in xs)  # noqa: E731
        return LayerCosts(sc(t.f), sc(t.b_input), sc(t.w), sc(self.act), sc(self.act_w),
                          sc(self.out_bytes), tuple(self.params), self.bytes_per_param_static,
                          self.grad_bytes_per_param, self.optim_time_per_param, self.copy_time * q)


def from_layer_costs(name: str, lc: LayerCosts, *, per: int = 1, layer_names=None, memory_capacity=None,
                     source: dict | None = None) -> Workload:
    """A workload from :class:`LayerCosts` measured or computed at ``per`` samples per micro-batch."""
    d = float(per)
    sc = lambda xs: tuple(x / d for x in xs)  # noqa: E731
    names = tuple(layer_names) if layer_names is not None else tuple(f"layer{i}" for i in range(lc.num_layers))
    return Workload(name, names, sc(lc.f), sc(lc.b_input), sc(lc.w), sc(lc.act), sc(lc.act_w), sc(lc.out_bytes),
                    tuple(float(p) for p in lc.params), lc.bytes_per_param_static, lc.grad_bytes_per_param,
                    lc.optim_time_per_param, lc.copy_time / d, memory_capacity, dict(source or {"kind": "inline"}))


def transformer_workload(spec: ModelSpec, device: DeviceSpec, recompute: str = "none",
                         source: dict | None = None, cost_model: str = "linear") -> Workload:
    """A transformer (cost_models formulas, or the kernel model) at one sequence per sample."""
    tm = TransformerCostModel(spec.replace(micro_batch=1), device, parallel=Parallel(recompute=recompute),
                              compute=cost_model)
    names = tuple(l.name for l in tm.layers())
    src = dict(source or {"kind": "transformer", "name": spec.name, "spec": spec.to_dict(), "recompute": recompute})
    src["cost_model"] = cost_model
    wl = from_layer_costs(spec.name, tm.layer_costs(), layer_names=names, memory_capacity=device.memory_bytes,
                          source=src)
    def curve(q: int):
        lc = TransformerCostModel(spec.replace(micro_batch=q), device, parallel=Parallel(recompute=recompute),
                                  compute="kernels").layer_costs()
        return tuple(x / q for x in lc.f), tuple(x / q for x in lc.b_input), tuple(x / q for x in lc.w)
    return Workload(**{**{f: getattr(wl, f) for f in _FIELDS}, "spec": spec, "device": device,
                       "recompute": recompute, "cost_model": cost_model,
                       "per_sample_at": curve if cost_model == "kernels" else None})


WORKLOAD_FIELDS = ("name", "layer_names", "f", "b_input", "w", "act", "act_w", "out_bytes", "params",
                   "bytes_per_param_static", "grad_bytes_per_param", "optim_time_per_param", "copy_time",
                   "memory_capacity", "source")
_FIELDS = WORKLOAD_FIELDS


def check_cost_model(cost_model: str) -> None:
    from cost_models.kernels import COST_MODELS
    if cost_model not in COST_MODELS:
        raise ValueError(f"cost model must be one of {', '.join(COST_MODELS)}; got {cost_model!r}")


def is_profile_path(model) -> bool:
    """A PipeDream/DAPPLE profile file is given by a path ending in .txt."""
    return isinstance(model, (str, Path)) and str(model).endswith(".txt")
