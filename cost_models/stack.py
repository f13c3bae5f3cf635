"""A user's layer stack as the cost models see it: ``--model PATH.py:FUNC`` (or ``package.module:FUNC``).

A model file (see :mod:`executor.user_model` for the interface) has no formulas: everything the
cost models know about it was measured by ``pipetwin calibrate --model PATH.py:FUNC`` with the
executor's own code, per layer, at one micro-batch size. :class:`StackSpec` holds the
per-layer facts that are not times (those are the profile's ``per_layer`` timings):

- ``layer_names``: the layers' class names (for tables);
- ``params``: parameters of each layer (a parameter shared by two layers counts in both: each
  stage that holds one of them holds a copy);
- ``out_bytes``: bytes of each layer's output at the micro-batch (what a stage that ends there
  sends, and the gradient it receives back);
- ``act_first`` / ``act_w_first``: bytes a layer keeps for its backward (and, in a split
  backward, until W) when it is the *first* layer of a stage. The profile's per-layer activation
  bytes are the bytes each layer adds when it runs after the layer before it in one graph; a
  layer that saves its input (a pooling after a ReLU that saved the same tensor) adds less there
  than it keeps on its own, at the start of a stage, whose input is a fresh received tensor. A
  stage [a, b) keeps ``act_first[a] + sum(act[a+1:b])`` (:class:`cost_models.base.PerLayerCostModel`);
- ``flops``: per layer ``(f, b, b_input, w)`` FLOPs counted by ``torch.utils.flop_counter`` on the
  very calls that were timed (needed only to scale the times onto another device:
  :func:`cost_models.profile.scaled_layer_costs`).

The micro-batch is the one measured; ``dtype_bytes`` the bytes per parameter element of the
gradients that are all-reduced (4: the executor trains in fp32).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from . import _spec
from ._spec import SpecError

# PATH.py:FUNC or package.module:FUNC (a function name after the last colon)
MODEL_REF = re.compile(r"(?P<target>.+\.py|[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):(?P<func>[A-Za-z_]\w*)")


def is_model_ref(model) -> bool:
    """Whether ``model`` names a Python model file: ``PATH.py:FUNC`` or ``package.module:FUNC``."""
    return isinstance(model, str) and MODEL_REF.fullmatch(model.strip()) is not None


def absolute_model_ref(ref: str, base=None) -> str:
    """``PATH.py:FUNC`` with PATH absolute (relative: to ``base``, a folder, where the file is there,
    else to the working directory); ``package.module:FUNC`` and anything else as it is. What
    profiles and plan files store, so they work from any folder."""
    m = MODEL_REF.fullmatch(ref.strip()) if isinstance(ref, str) else None
    if m is None or not m["target"].endswith(".py"):
        return ref
    target = Path(m["target"]).expanduser()
    if not target.is_absolute() and base is not None and (Path(base) / target).is_file():
        target = Path(base) / target
    return f"{target.resolve()}:{m['func']}"


def same_model_ref(a: str, b: str) -> bool:
    """Whether two model references name the same function (paths compared resolved)."""
    def key(ref):
        m = MODEL_REF.fullmatch(ref.strip())
        if m is None:
            return ref
        t = m["target"]
        return (str(Path(t).expanduser().resolve()) if t.endswith(".py") else t, m["func"])
    return key(a) == key(b)


def model_ref_help(ref: str) -> str:
    """The sentence that tells a user how to get costs for a model file."""
    return (f"model {ref} is a Python model file: its costs are measured, not computed; run "
            f"'pipetwin calibrate --model {ref}' and pass the profile it writes (--profile FILE.yaml)")


@dataclass(frozen=True, kw_only=True)
class StackSpec:
    """The measured per-layer facts of a user's layer stack (see the module docstring)."""

    name: str                                   # the model reference, PATH.py:FUNC
    micro_batch: int
    layer_names: tuple[str, ...]
    params: tuple[float, ...]
    out_bytes: tuple[float, ...]
    act_first: tuple[float, ...]
    act_w_first: tuple[float, ...]
    flops: tuple[tuple[float, float, float, float], ...] | None = None   # (f, b, b_input, w) per layer
    dtype_bytes: int = 4

    def __post_init__(self):
        object.__setattr__(self, "name", absolute_model_ref(self.name))     # any folder can load its file
        n = len(self.layer_names)
        if n < 1:
            raise SpecError(f"model {self.name}: a layer stack needs at least one layer")
        for f in ("params", "out_bytes", "act_first", "act_w_first"):
            if len(getattr(self, f)) != n:
                raise SpecError(f"model {self.name}: field {f!r} has {len(getattr(self, f))} entries for {n} layers")
        if self.flops is not None and len(self.flops) != n:
            raise SpecError(f"model {self.name}: field 'flops' has {len(self.flops)} entries for {n} layers")

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def to_dict(self) -> dict:
        d = {"file": self.name, "micro_batch": self.micro_batch, "dtype_bytes": self.dtype_bytes,
             "layer_names": list(self.layer_names), "params": [float(x) for x in self.params],
             "out_bytes": [float(x) for x in self.out_bytes], "act_first": [float(x) for x in self.act_first],
             "act_w_first": [float(x) for x in self.act_w_first]}
        if self.flops is not None:
            d["flops"] = [dict(zip(("f", "b", "b_input", "w"), map(float, x))) for x in self.flops]
        return d


_FIELDS = ("file", "micro_batch", "dtype_bytes", "layer_names", "params", "out_bytes", "act_first", "act_w_first",
           "flops")


def stack_from_dict(d, source: str = "<dict>") -> StackSpec:
    """The ``model`` mapping of a layer-stack profile (the inverse of :meth:`StackSpec.to_dict`)."""
    d = _spec.mapping(d, source)
    _spec.check_fields(d, source, _FIELDS, ("file", "micro_batch", "layer_names", "params", "out_bytes",
                                            "act_first", "act_w_first"))
    ref = d["file"]
    if not is_model_ref(ref):
        raise SpecError(f"{source}: field 'file' must be PATH.py:FUNC or package.module:FUNC; got {ref!r}")
    names = d["layer_names"]
    if not isinstance(names, list) or not names or not all(isinstance(x, str) for x in names):
        raise SpecError(f"{source}: field 'layer_names' must be a non-empty list of strings")
    n = len(names)

    def nums(key: str) -> tuple[float, ...]:
        v = d[key]
        if not isinstance(v, list) or len(v) != n:
            raise SpecError(f"{source}: field {key!r} must list {n} numbers (one per layer)")
        return tuple(_spec.number(x, source, f"{key}[{i}]", allow_zero=True) for i, x in enumerate(v))

    flops = None
    if d.get("flops") is not None:
        fl = d["flops"]
        if not isinstance(fl, list) or len(fl) != n:
            raise SpecError(f"{source}: field 'flops' must list {n} mappings {{f, b, b_input, w}}")
        rows = []
        for i, x in enumerate(fl):
            _spec.mapping(x, source, f"flops[{i}]")
            _spec.check_fields(x, source, ("f", "b", "b_input", "w"), ("f", "b", "b_input", "w"), f"flops[{i}].")
            rows.append(tuple(_spec.number(x[k], source, f"flops[{i}].{k}", allow_zero=True)
                              for k in ("f", "b", "b_input", "w")))
        flops = tuple(rows)
    return StackSpec(name=ref.strip(), micro_batch=_spec.integer(d["micro_batch"], source, "micro_batch"),
                     dtype_bytes=_spec.integer(d.get("dtype_bytes", 4), source, "dtype_bytes"),
                     layer_names=tuple(names), params=nums("params"), out_bytes=nums("out_bytes"),
                     act_first=nums("act_first"), act_w_first=nums("act_w_first"), flops=flops)
