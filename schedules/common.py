"""Shared requirement checks for schedule families (one clear error each)."""
from .ir import ScheduleError


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
