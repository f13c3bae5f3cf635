"""Shared test helpers."""
from schedules import ScheduleError, build


def admissible(name, D, max_n=None):
    """(N, schedule) for every N in 1..4D (or max_n) that the family accepts on D devices."""
    for N in range(1, (max_n or 4 * D) + 1):
        try:
            yield N, build(name, D, N)
        except ScheduleError:
            continue
