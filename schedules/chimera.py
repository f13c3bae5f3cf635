"""Chimera (Li & Hoefler, SC 2021): two straight pipelines in opposite directions.

Requirements: D even, N a multiple of D. Copy "down" places stage s on device s, copy "up" on
device D-1-s; each device holds two stages (weights twice). Each unit of D micro-batches sends
half down and half up; N > D concatenates N/D units directly.
Bubble (unit costs, N = D): (D-2)/(3N/2+D-2); D = N = 4 gives 4/16.
Activation memory: between (D/2+1) Ma and D Ma per device; weights 2 Mw per device.
"""
from .bidirectional import build_bidirectional, straight_placement
from .common import check_units

NAME = "chimera"
REQUIRES = "D even, N multiple of D"


def build(num_devices: int, num_microbatches: int, **_):
    D, N = num_devices, num_microbatches
    check_units(NAME, D, N)
    return build_bidirectional(NAME, D, N, straight_placement(D), pull=0)
