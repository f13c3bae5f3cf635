"""BitPipe (Wu et al., 2024): two opposite V-shaped interleaved pipelines merged.

Requirements: D even, N a multiple of D. Each copy has 2D stages (L/(2D) layers, F/2 each);
device d holds down stages d and 2D-1-d and up stages D-1-d and D+d, so the V turn is a local
COPY and each device holds 4 chunks (weights 2 Mw). Each copy runs 1F1B-interleaved on half of
each unit's micro-batches. N > D concatenates K = N/D units; the first two forwards of the next
unit are pulled into the junction bubble when that shortens the schedule (see
:func:`junction_pull`; with our list-scheduled unit it does at D = 4 and not at D = 6, 8). Gradient all-reduce of a stage's two copies is placed
eagerly where the stage's gradients are final (lowering, ``eager=True``).
Bubble (unit costs, N = D): (D-2)/(3N+D-2); D = N = 4 gives 2/14 and D = 6 gives 4/22 exactly.
Known gap: the unit order comes from greedy list scheduling (backward first, deepest forward
first); at D = 8 and 10 it is half a unit F longer than the paper's closed form (30.5 vs 30).
Activation memory: between (3D+2)/4 Ma and D Ma per device.
"""
from functools import lru_cache

from .bidirectional import build_bidirectional, v_placement
from .analysis import unit_summary
from .common import check_units

NAME = "bitpipe"
REQUIRES = "D even, N multiple of D"


def build(num_devices: int, num_microbatches: int, **_):
    D, N = num_devices, num_microbatches
    check_units(NAME, D, N)
    return build_bidirectional(NAME, D, N, v_placement(D), pull=junction_pull(D))


@lru_cache(maxsize=None)
def junction_pull(D: int) -> int:
    """How many forwards of the next unit to pull into the junction bubble: 2 (the paper's
    choice) when that shortens two concatenated units under unit costs, else 0 (our greedy unit
    order leaves no gap long enough for them at some D, and pulling would then delay the tail)."""
    P = v_placement(D)

    def makespan(pull):
        return unit_summary(build_bidirectional(NAME, D, 2 * D, P, pull=pull))["makespan"]

    return 2 if makespan(2) <= makespan(0) else 0
