"""Shared requirement checks for schedule families (one clear error each), and the collector pause
the passes over whole schedules run under."""
import gc
from contextlib import contextmanager

from .ir import ScheduleError


@contextmanager
def gc_paused():
    """Pause the cyclic garbage collector for a pass that allocates one long-lived record per op
    and almost no cyclic garbage (building, lowering, validating, simulating a schedule): the
    collector would walk the growing heap again and again (measured: a third to a half of such a
    pass at 100k ops)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def check_positive(name: str, D: int, N: int) -> None:
    if not isinstance(D, int) or D < 1:
        raise ScheduleError(f"{name} needs at least 1 device; got {D}")
    if not isinstance(N, int) or N < 1:
        raise ScheduleError(f"{name} needs at least 1 micro-batch; got {N}")


def check_even_devices(name: str, D: int) -> None:
    if D % 2:
        raise ScheduleError(f"{name} needs an even number of devices; got {D}")


def check_multiple(name: str, N: int, D: int, what: str = "the number of devices") -> None:
    if N % D:
        raise ScheduleError(f"{name} needs the number of micro-batches to be a multiple of {what} ({D}); "
                            f"got {N} (try {max(D, N - N % D)} or {N - N % D + D})")


def check_units(name: str, D: int, N: int) -> None:
    """Bidirectional schedules built from units of D micro-batches: D even, N a multiple of D."""
    check_positive(name, D, N)
    check_even_devices(name, D)
    check_multiple(name, N, D)
