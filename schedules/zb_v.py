"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 6; and "Pipeline
Parallelism with Controllable Memory", NeurIPS 2024, which frames it as the V-shape building block).

Requirements: D >= 1, N >= 1. V placement of 2D stages (L/(2D) layers each, F/2 per chunk):
stage k < D on device k and stage k >= D on device 2D-1-k, so device d holds stages d and
2D-1-d and the V turn (stage D-1 -> D) is a local copy on device D-1. Backward is split into an
input-gradient B and a weight-gradient W (F = B = W = 1/2 per chunk under unit costs).

Order of device d (the paper's hand-crafted ZB-V, written in phases; c0 = stage d, c1 = stage
2D-1-d, counters per chunk advance through micro-batches 0, 1, ...): 2(D-d)-1 forwards of c0;
d times (F c1, F c0); D-d times (F c1, B c1, W c1); a steady state of (F c0, B c0, W c0, F c1,
B c1, W c1) until every forward is issued; a cool-down of d times (B c0, B c1), then D-d times
(B c0, W c0), then the remaining W of c1 and of c0. The phases are laid out for
max(N, 2D-1) micro-batches and ops of micro-batches >= N are dropped (as PyTorch's
``ScheduleZBVZeroBubble`` does), so any N works.

Bubble (unit costs, exact, pipetwin's definition = makespan - busy): every device is busy
3N; makespan 3N + (D-1)/2 for N >= 2D-1, i.e. a bubble of (D-1)/2 = (D-1) chunk-forwards,
which is exactly the staggered start of device D-1 (the first forward needs D-1 hops of F/2 to
reach it) and a lower bound for any schedule on this placement. Measured per device from its
own first op (the paper's metric) the bubble is 0: "zero bubble" when F = B = W. For every N:
makespan 3N + max((D-1)/2, 2D-1-N) (tested exactly in tests/test_schedules_zb.py).
Activation memory (N >= 2D): device d holds at most 2D chunk-activations between F and B
(D Ma, as 1F1B's first device) and at most 2d+1 pending W's; counting a pending W as a whole
chunk-activation the peak is still 2D chunks = D Ma on every device.
"""
from .common import check_positive
from .ir import B, F, W, make_schedule
from .placement import v_stages

NAME = "zb-v"
REQUIRES = "D >= 1, N >= 1 (closed form for N >= 2D-1)"


def zbv_device_order(D: int, d: int, n: int) -> list[tuple[str, int, int]]:
    """(kind, mb, chunk) of device d for n micro-batches (chunk 0 = stage d, 1 = stage 2D-1-d)."""
    cnt = {(k, c): 0 for k in (F, B, W) for c in (0, 1)}
    out: list[tuple[str, int, int]] = []

    def op(kind, c):
        out.append((kind, cnt[(kind, c)], c))
        cnt[(kind, c)] += 1

    for _ in range(2 * (D - d) - 1):
        op(F, 0)
    for _ in range(d):
        op(F, 1)
        op(F, 0)
    for _ in range(D - d):
        op(F, 1)
        op(B, 1)
        op(W, 1)
    while cnt[(F, 1)] < cnt[(F, 0)] or cnt[(F, 0)] < n:
        if cnt[(F, 0)] < n:
            op(F, 0)
        op(B, 0)
        op(W, 0)
        op(F, 1)
        op(B, 1)
        op(W, 1)
    for _ in range(d):
        op(B, 0)
        op(B, 1)
    for _ in range(D - d):
        op(B, 0)
        op(W, 0)
    while cnt[(W, 1)] < cnt[(B, 1)]:
        op(W, 1)
    while cnt[(W, 0)] < cnt[(B, 0)]:
        op(W, 0)
    return out


def build(num_devices: int, num_microbatches: int, **_):
    D, N = num_devices, num_microbatches
    check_positive(NAME, D, N)
    n = max(N, 2 * D - 1)
    order = []
    for d in range(D):
        stage = (d, 2 * D - 1 - d)
        order.append([(k, m, 0, stage[c]) for k, m, c in zbv_device_order(D, d, n) if m < N])
    return make_schedule(NAME, D, N, [v_stages(D)], order, split_backward=True)
