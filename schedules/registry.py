"""Schedule families by name: ``build(name, D, N, chunks=..., variant=...)``, their requirements
and their variants (a family module's ``VARIANTS``: name -> one line, the first is the default).

Size limits (:func:`check_size`, run by :func:`build` before anything is built): at most
``MAX_RANKS`` ranks (D x R) and an estimated ``MAX_OPS`` ops per iteration over all ranks after
lowering (about 7 per micro-batch, chunk and rank: F, B, W and the sends and receives). Building
and validating grow with D^2 and the simulator's trace with the op count: 4 million ops take about
a minute and a few GiB; beyond, the run is refused at once instead of running for minutes or
growing memory without bound."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from .common import gc_paused
from .ir import Schedule, ScheduleError

MAX_RANKS = 2048
MAX_OPS = 4_000_000
OPS_PER_MICROBATCH = 7      # per chunk and rank, after lowering (F, B, W, SEND/RECV of both directions)

# upstream names (torch.distributed.pipelining, Megatron-LM, DeepSeek) -> our family names
ALIASES = {"1f1b": "dapple", "interleaved-1f1b": "interleaved", "zbv": "zb-v", "dualpipev": "dualpipe-v"}

_MODULES = ["gpipe", "dapple", "interleaved", "chimera", "bitpipe", "zb_h1", "zb_h2", "zb_auto", "zb_v", "dualpipe_v",
            "bitpipe_zb"]


@dataclass(frozen=True)
class Family:
    name: str
    requires: str
    doc: str
    build: Callable[..., Schedule]
    variants: tuple[str, ...] = ()      # the first is the default; () = the family has none
    takes_chunks: bool = False          # ``chunks`` per device changes it (a module's TAKES_CHUNKS)
    takes_memory_limit: bool = False    # it orders its ops under a memory limit (a module's TAKES_MEMORY_LIMIT)
    # variants that pay only when overlapped pairs hide all-to-alls (phased MoE costs; a module's
    # OVERLAP_VARIANTS): a dense layout search leaves them out
    overlap_variants: tuple[str, ...] = ()


def _load(mod: str) -> Family:
    m = importlib.import_module(f"schedules.{mod}")
    doc = (m.__doc__ or "").strip()
    return Family(m.NAME, m.REQUIRES, doc, m.build, tuple(getattr(m, "VARIANTS", ())),
                  bool(getattr(m, "TAKES_CHUNKS", False)), bool(getattr(m, "TAKES_MEMORY_LIMIT", False)),
                  tuple(getattr(m, "OVERLAP_VARIANTS", ())))


def families() -> dict[str, Family]:
    return {f.name: f for f in map(_load, _MODULES)}


def names() -> list[str]:
    return list(families())


def aliases_of(name: str) -> list[str]:
    """The upstream names of family ``name`` (:data:`ALIASES`)."""
    return [a for a, n in ALIASES.items() if n == name]


def get(name: str) -> Family:
    """The family of ``name``: one of :func:`names`, or an upstream name of one (:data:`ALIASES`)."""
    fams = families()
    fam = fams.get(ALIASES.get(name, name))
    if fam is None:
        raise ScheduleError(f"unknown schedule {name!r}; choose one of {', '.join(fams)} (or an upstream name: "
                            f"{', '.join(f'{a} = {n}' for a, n in ALIASES.items())})")
    return fam


def estimated_ops(num_devices: int, num_microbatches: int, replicas: int = 1, chunks: int = 1) -> int:
    """An upper estimate of the ops of one lowered iteration (every schedule has at most two chunks
    per device unless ``chunks`` says more)."""
    return OPS_PER_MICROBATCH * num_devices * replicas * num_microbatches * max(2, chunks)


def check_size(num_devices: int, num_microbatches: int, replicas: int = 1, chunks: int = 1) -> None:
    """Refuse, in O(1), sizes beyond the limits of the module docstring (ScheduleError, one line).
    Values below 1 pass: each family's own requirements say what it needs."""
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1
           for v in (num_devices, num_microbatches, replicas, chunks)):
        return
    ranks = num_devices * replicas
    if ranks > MAX_RANKS:
        raise ScheduleError(f"D x R = {num_devices} x {replicas} = {ranks} ranks is beyond pipetwin's limit of "
                            f"{MAX_RANKS} (schedules.registry.MAX_RANKS)")
    ops = estimated_ops(num_devices, num_microbatches, replicas, chunks)
    if ops > MAX_OPS:
        raise ScheduleError(f"D={num_devices} x R={replicas} with N={num_microbatches} micro-batches is about "
                            f"{ops:,} ops per iteration, beyond pipetwin's limit of {MAX_OPS:,} "
                            f"(schedules.registry.MAX_OPS); use fewer micro-batches (N <= "
                            f"{max(1, MAX_OPS // (ops // num_microbatches)):,} here)")


def build(name: str, num_devices: int, num_microbatches: int, **kw) -> Schedule:
    """Build a compute-only schedule of a family (requirements and :func:`check_size` checked up
    front). ``variant`` (None: the family's default) must be one of the family's variants."""
    fam = get(name)
    check_size(num_devices, num_microbatches, 1, int(kw.get("chunks") or 1))
    if kw.get("variant") is not None and not fam.variants:
        raise ScheduleError(f"{name} has no variants (got {kw['variant']!r}); leave the variant out "
                            f"(schedules with variants: {', '.join(n for n, f in families().items() if f.variants)})")
    with gc_paused():
        return fam.build(num_devices, num_microbatches, **kw)
