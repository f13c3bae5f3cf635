"""BitPipe (Wu et al., 2024): two opposite V-shaped interleaved pipelines merged.

Requirements: D even, N = K*D micro-batches (K >= 1 basic units). Placement
(:func:`schedules.placement.v_placement`): each copy has 2D stages (L/(2D) layers, F/2 each);
device d holds down stages d and 2D-1-d and up stages D-1-d and D+d, so the V turn is a local
COPY and each device holds 4 chunks (weights 2 Mw). Micro-batches: the first D/2 of each unit go
down, the next D/2 up. Gradient all-reduce of a stage's two copies is placed eagerly where the
stage's gradients are final (lowering, ``eager=True``); ``--device-map copies-same-node`` keeps
both copies of a stage on one node.

Variant ``released`` (the default): the per-device order of the authors' released schedule,
``forward_backward_pipelining_with_BitPipe`` in wuhouming/BitPipe
``megatron/core/pipeline_parallel/bitpipe_schedule.py``. With e = min(d, D-1-d) (distance to the
nearer end of the device line) and a = D/2 - e, device d runs

- warm-up: 3D/2 + e chunk-forwards;
- steady: a pairs (forward, then backward);
- at each of the K-1 junctions between units: 3D/2 + e - a + 1 backwards of the unit, then
  a - 1 pairs (a forward of the next unit, a backward of this one), then the remaining
  3D/2 + e - a + 1 warm-up forwards of the next unit (this is how the next unit's first forwards
  are pulled into the junction bubble), then the next unit's a steady pairs;
- cool-down: the last unit's remaining 2D - a backwards.

Which chunk each forward belongs to follows the released per-unit order of the 2D chunk-forwards
of a device ("own" = the copy that enters the device on its first leg: down on d < D/2, up
otherwise; leg 0 = the device's stage before the V turn, leg 1 after): a x own leg 0;
(D/2 - a) x (other leg 0, own leg 0); a x (other leg 0, other leg 1); (D/2 - a) x (own leg 1,
other leg 1); a x own leg 1. The backward order is its mirror (leg 1 and leg 0 swapped). Every
chunk takes its micro-batches first in first out, as the released code's per-chunk queues do.

Closed forms (unit costs F = 1, B = 2 per full stage, exact, tested for D = 2..16 even, K = 1..4):
makespan 3N + (K+1)(D-2)/2, i.e. a bubble of (K+1)(D-2)/2 per device and a bubble ratio of
(K+1)(D-2) / (6N + (K+1)(D-2)). At N = D that is the paper's (D-2)/(3N+D-2) (2/14 at D = N = 4,
6/30 at D = N = 8); each junction costs (D-2)/2, half a unit's fill and drain (D = 8, N = 16:
9/57 = 0.1579). Activation memory (F..B) on device d: (3D+2)/4 + e/2 Ma at every K, i.e. from
(3D+2)/4 Ma on the end devices to D Ma on the middle ones, the paper's range.

Variant ``greedy``: pipetwin's earlier order, greedy list scheduling of each unit under unit
costs (:func:`schedules.bidirectional.build_bidirectional`: backward first, deepest forward
first), pulling the first two forwards of the next unit into the junction when that shortens two
units (:func:`junction_pull`: at D = 2, 4). Bubble per device: 0 at D = 2; (K+3)/2 at D = 4
(2, 2.5, 3, 3.5 for K = 1..4: better than ``released``'s K+1 for K >= 2, the reason it is kept);
K times its unit's bubble at D >= 6 (4K at D = 6, 6.5K at D = 8, 15K at D = 16: worse than
``released``). Activation memory (3D+2)/4 .. D Ma as ``released``'s, except at D = 4 for N > D,
where the two pulled forwards cost half a Ma more (4 .. 4.5 Ma): its gain has a memory price.

Decisions where the released code is not a general formula: (1) it has a special warm-up for
2N = D chunk-forwards, which cannot happen for N >= D, so only the general warm-up above exists
here. (2) Its eager sync all-reduces the after-the-turn chunks before a device's last backward
(the two middle devices: after it) and the others at the end; pipetwin's lowering instead issues
each stage's all-reduce after the op that finalises the stage's gradients, in one global order on
every rank (the same rule for every schedule). (3) It pairs each compute op with a combined
send/receive call; pipetwin keeps the compute order and lets lowering derive FIFO-safe SEND/RECV
from it, so only the compute order is the released one. (4) Which global micro-batch is a copy's
k-th is a numbering convention (the loss is their mean);
:func:`schedules.bidirectional.copy_microbatch` fixes it.
"""
from functools import lru_cache

from .analysis import unit_summary
from .bidirectional import FifoStreams, build_bidirectional, pick_variant
from .common import check_units
from .ir import make_schedule
from .placement import v_placement

NAME = "bitpipe"
REQUIRES = "D even, N multiple of D"
VARIANTS = {"released": "the per-device order of the authors' released code (default)",
            "greedy": "pipetwin's list-scheduled unit order (better at D = 4, N > D)"}


def released_order(D: int, N: int, d: int) -> list[tuple[str, int, int, int]]:
    """Device d's compute order in the released BitPipe schedule (see the module docstring)."""
    half, K = D // 2, N // D
    e = min(d, D - 1 - d)
    a = half - e
    warm = 3 * half + e
    own, other = (0, 1) if d < half else (1, 0)
    # (copy, leg) -> (copy, stage): leg 0 before the V turn, leg 1 after it
    stage = {(0, 0): d, (0, 1): 2 * D - 1 - d, (1, 0): D - 1 - d, (1, 1): D + d}
    dev = FifoStreams(D, {key: (key[0], s) for key, s in stage.items()})

    def unit_chunks(first, second, third, fourth):
        """The chunk of each of a unit's 2D chunk-ops, in the released per-unit order."""
        out = [first] * a
        for _ in range(half - a):
            out += [second, first]
        for _ in range(a):
            out += [second, third]
        for _ in range(half - a):
            out += [fourth, third]
        return out + [fourth] * a

    fwd = iter(unit_chunks((own, 0), (other, 0), (other, 1), (own, 1)) * K)
    bwd = iter(unit_chunks((own, 1), (other, 1), (other, 0), (own, 0)) * K)

    def forwards(n):
        for _ in range(n):
            dev.f(next(fwd))

    def backwards(n):
        for _ in range(n):
            dev.b(next(bwd))

    def pairs(n):
        for _ in range(n):
            forwards(1)
            backwards(1)

    forwards(warm)
    for _ in range(K - 1):
        pairs(a)
        backwards(warm - a + 1)
        pairs(a - 1)
        forwards(warm - a + 1)
    pairs(a)
    backwards(2 * D - a)
    return dev.order


def build(num_devices: int, num_microbatches: int, *, variant: str | None = None, **_):
    D, N = num_devices, num_microbatches
    check_units(NAME, D, N)
    variant = pick_variant(NAME, variant, VARIANTS)
    meta = {"variant": variant}
    if variant == "greedy":
        return build_bidirectional(NAME, D, N, v_placement(D), pull=junction_pull(D), meta=meta)
    order = [released_order(D, N, d) for d in range(D)]
    return make_schedule(NAME, D, N, v_placement(D), order, meta=meta)


@lru_cache(maxsize=None)
def junction_pull(D: int) -> int:
    """``greedy`` variant: how many forwards of the next unit to pull into the junction bubble: 2
    (the paper's choice) when that shortens two concatenated units under unit costs, else 0 (the
    greedy unit order leaves no gap long enough for them at some D, and pulling would then delay
    the tail)."""
    P = v_placement(D)

    def makespan(pull):
        return unit_summary(build_bidirectional(NAME, D, 2 * D, P, pull=pull))["makespan"]

    return 2 if makespan(2) <= makespan(0) else 0
