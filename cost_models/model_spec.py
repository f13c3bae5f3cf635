"""Model specs: the sizes of a GPT-style decoder (and of other layer stacks the papers use).

A spec is what both the executor (to build the real model) and the cost models (to compute
FLOPs and bytes, see :mod:`cost_models.transformer`) read. Presets ship as YAML files under
``cost_models/presets/models``; a user passes a preset name or a path to their own YAML file.

Fields: ``layers`` transformer blocks (embedding and output head come on top), ``hidden`` h,
``heads`` a, ``seq_len`` s, ``vocab`` V, ``micro_batch`` b (sequences per micro-batch),
``ffn_mult`` (MLP width = ffn_mult * h), ``kind`` gpt | bert, ``dtype_bytes`` (bytes per
activation / weight element: 2 for fp16/bf16, 4 for fp32).
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ._spec import SpecError, presets, read_yaml
from .stack import is_model_ref, model_ref_help

KINDS = ("gpt", "bert")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int                 # transformer blocks
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    micro_batch: int = 1
    ffn_mult: int = 4
    kind: str = "gpt"           # gpt | bert (encoder, same block cost)
    dtype_bytes: int = 2        # activations/weights in fp16/bf16 for cost models

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "seq_len", "vocab", "micro_batch", "ffn_mult", "dtype_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(f"model {self.name!r}: field {f!r} must be a positive integer; got {v!r}")
        if self.hidden % self.heads:
            raise SpecError(f"model {self.name!r}: field 'heads': hidden ({self.hidden}) must be divisible "
                            f"by heads ({self.heads})")
        if self.kind not in KINDS:
            raise SpecError(f"model {self.name!r}: field 'kind' must be one of {', '.join(KINDS)}; got {self.kind!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> "ModelSpec":
        """A copy with some fields changed (e.g. ``micro_batch=4``), validated again."""
        return dataclasses.replace(self, **changes)


def model_presets() -> list[str]:
    return presets("models")


def spec_from_dict(d: dict, source: str = "<dict>") -> ModelSpec:
    if not isinstance(d, dict):
        raise SpecError(f"{source}: expected a mapping of model fields")
    known = {f.name for f in fields(ModelSpec)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise SpecError(f"{source}: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
    for f in ("layers", "hidden", "heads", "seq_len", "vocab"):
        if f not in d:
            raise SpecError(f"{source}: missing field {f!r}")
    d = dict(d)
    d.setdefault("name", Path(source).stem)
    try:
        return ModelSpec(**d)
    except SpecError as e:
        raise SpecError(f"{source}: {e}") from None
    except TypeError as e:  # pragma: no cover - defensive
        raise SpecError(f"{source}: {e}") from None


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A preset name (see :func:`model_presets`) or a path to a YAML file. (A Python model file,
    ``PATH.py:FUNC``, has no spec: its costs come from a calibration profile.)"""
    if is_model_ref(str(name_or_path)):
        raise SpecError(model_ref_help(str(name_or_path)))
    data, source = read_yaml(name_or_path, "models", "model")
    return spec_from_dict(data, source)
