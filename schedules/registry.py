"""Schedule families by name: ``build(name, D, N, chunks=..., variant=...)``, their requirements
and their variants (a family module's ``VARIANTS``: name -> one line, the first is the default)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from .common import gc_paused
from .ir import Schedule, ScheduleError

_MODULES = ["gpipe", "dapple", "interleaved", "chimera", "bitpipe", "zb_h1", "zb_v", "dualpipe_v", "bitpipe_zb"]


@dataclass(frozen=True)
class Family:
    name: str
    requires: str
    doc: str
    build: Callable[..., Schedule]
    variants: tuple[str, ...] = ()      # the first is the default; () = the family has none


def _load(mod: str) -> Family:
    m = importlib.import_module(f"schedules.{mod}")
    doc = (m.__doc__ or "").strip()
    return Family(m.NAME, m.REQUIRES, doc, m.build, tuple(getattr(m, "VARIANTS", ())))


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
    """Build a compute-only schedule of a family (requirements checked up front). ``variant``
    (None: the family's default) must be one of the family's variants."""
    fam = get(name)
    if kw.get("variant") is not None and not fam.variants:
        raise ScheduleError(f"{name} has no variants (got {kw['variant']!r}); leave the variant out "
                            f"(schedules with variants: {', '.join(n for n, f in families().items() if f.variants)})")
    with gc_paused():
        return fam.build(num_devices, num_microbatches, **kw)
