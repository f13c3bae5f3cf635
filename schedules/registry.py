"""Schedule families by name: ``build(name, D, N, chunks=...)`` and their requirements."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from .ir import Schedule, ScheduleError

_MODULES = ["gpipe", "dapple", "interleaved", "chimera", "bitpipe", "zb_h1", "zb_v", "dualpipe_v", "bitpipe_zb"]


@dataclass(frozen=True)
class Family:
    name: str
    requires: str
    doc: str
    build: Callable[..., Schedule]


def _load(mod: str) -> Family:
    m = importlib.import_module(f"schedules.{mod}")
    doc = (m.__doc__ or "").strip()
    return Family(m.NAME, m.REQUIRES, doc, m.build)


def families() -> dict[str, Family]:
    return {f.name: f for f in map(_load, _MODULES)}


def names() -> list[str]:
    return list(families())


def get(name: str) -> Family:
    fams = families()
    if name not in fams:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(fams)}")
    return fams[name]


def build(name: str, num_devices: int, num_microbatches: int, **kw) -> Schedule:
    """Build a compute-only schedule of a family (requirements checked up front)."""
    return get(name).build(num_devices, num_microbatches, **kw)
