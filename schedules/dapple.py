"""DAPPLE early-backward schedule, i.e. 1F1B (Fan et al., PPoPP 2021; PipeDream-Flush).

Requirements: D >= 1, N >= 1. Stage s on device s. Stage s runs min(D-s, N) forwards before its
first backward, then alternates one forward and one backward, then drains the backwards.
Bubble (unit costs): (D-1)/(N+D-1), the same as GPipe (3/7 at D = N = 4).
Activation memory: min(D-s, N) Ma on stage s (D..1 Ma from first to last device at N >= D).
"""
from .common import check_positive
from .ir import B, F, make_schedule

NAME = "dapple"
REQUIRES = "D >= 1, N >= 1"


def one_f_one_b(n: int, warmup: int, fwd, bwd):
    """The 1F1B order of n items: ``warmup`` forwards, then F/B pairs, then the remaining B."""
    warmup = min(warmup, n)
    out = [fwd(i) for i in range(warmup)]
    for i in range(n - warmup):
        out += [fwd(warmup + i), bwd(i)]
    out += [bwd(i) for i in range(n - warmup, n)]
    return out


def build(num_devices: int, num_microbatches: int, **_):
    D, N = num_devices, num_microbatches
    check_positive(NAME, D, N)
    order = [one_f_one_b(N, D - d - 1, lambda m, d=d: (F, m, 0, d), lambda m, d=d: (B, m, 0, d))
             for d in range(D)]
    return make_schedule(NAME, D, N, [list(range(D))], order)
