"""Model specs: the sizes of a GPT-style decoder (and of other layer stacks the papers use).

A spec is what both the executor (to build the real model) and the cost models (to compute
FLOPs and bytes) read. Presets ship as YAML files under ``cost_models/presets/models``; a user
passes a preset name or a path to their own YAML file.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path

import yaml


class SpecError(ValueError):
    """A malformed or unknown spec; the message names the file and field."""


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
            if not isinstance(v, int) or v < 1:
                raise SpecError(f"model {self.name!r}: field {f!r} must be a positive integer; got {v!r}")
        if self.hidden % self.heads:
            raise SpecError(f"model {self.name!r}: hidden ({self.hidden}) must be divisible by heads ({self.heads})")

    def to_dict(self) -> dict:
        return asdict(self)


def _preset_dir():
    return resources.files("cost_models") / "presets" / "models"


def model_presets() -> list[str]:
    return sorted(p.name[:-5] for p in _preset_dir().iterdir() if p.name.endswith(".yaml"))


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
    except TypeError as e:  # pragma: no cover - defensive
        raise SpecError(f"{source}: {e}") from None


def load_model(name_or_path: str) -> ModelSpec:
    """A preset name (see :func:`model_presets`) or a path to a YAML file."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise SpecError(f"model file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise SpecError(f"{p}: not valid YAML ({e})") from None
        return spec_from_dict(data, str(p))
    f = _preset_dir() / f"{name_or_path}.yaml"
    if not f.is_file():
        raise SpecError(f"unknown model preset {name_or_path!r}; choose one of {', '.join(model_presets())} "
                        f"or pass a YAML file")
    return spec_from_dict(yaml.safe_load(f.read_text()), name_or_path)
