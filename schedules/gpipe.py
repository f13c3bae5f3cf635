"""GPipe (Huang et al., 2019): all forwards, then all backwards, then a flush.

Requirements: D >= 1, N >= 1. Stage s on device s, one chunk per device.
Bubble (unit costs, F=1, B=2): (D-1)/(N+D-1); D = N = 4 gives 3/7.
Activation memory: N Ma on every device (every micro-batch stays alive until its backward).
"""
from .common import check_positive
from .ir import B, F, make_schedule

NAME = "gpipe"
REQUIRES = "D >= 1, N >= 1"


def build(num_devices: int, num_microbatches: int, **_):
    D, N = num_devices, num_microbatches
    check_positive(NAME, D, N)
    order = [[(F, m, 0, d) for m in range(N)] + [(B, m, 0, d) for m in range(N)] for d in range(D)]
    return make_schedule(NAME, D, N, [list(range(D))], order)
