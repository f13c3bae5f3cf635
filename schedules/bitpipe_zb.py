"""BitPipe-ZB: pipetwin's bidirectional V-shaped schedule with the backward split, whose bubble
does not grow with the number of micro-batches.

Builds on BitPipe (Wu et al., 2024: two opposite V-shaped copies merged, the V turn a local copy)
and on zero-bubble scheduling (Qi et al., ICLR 2024: B split into input-gradient B and
weight-gradient W, W used as filler). BitPipe and Chimera concatenate K = N/D units and fill
only part of each junction (half a unit's fill and drain stays idle), so their idle time grows
linearly with K. Here there are no units: all N micro-batches flow through one fill, one steady
state and one drain, and the W's fill what would be bubbles.

Requirements: D even, N a multiple of D (the bubble below is exact for those; other N are
refused). Placement: :func:`schedules.placement.v_placement` - each copy has 2D stages of
L/(2D) layers (F/2 per chunk); device d holds down stages d, 2D-1-d and up stages D-1-d, D+d
(4 chunks, weights 2 Mw, all-reduce of the two copies of a stage by lowering). Micro-batch m goes
"down" when m is even and "up" when odd, so both ends of the device line start at once.

Order: greedy list scheduling (:func:`schedules.timing.list_schedule`) under unit costs
(F = B = W = 1/2 per chunk): when a device is idle it runs a ready B (oldest micro-batch first),
else a ready F (deepest stage first, then oldest) if the device holds fewer than 2D
chunk-activations between F and B and fewer than 5D/2 between F and W, else the oldest ready W.

Bubble (unit costs, exact, tested for D in 2..20 even and N = K*D, K = 1..4): makespan
3N + (D-2)/4, bubble (D-2)/4 per device whatever N, ratio (D-2)/(12N + D-2): D = N = 4 gives
1/25 (BitPipe 2/14), D = 8 gives 1.5 (BitPipe 6 at N = 8 and 15 at N = 32). (D-2)/4 is the
time the first forward needs to reach the middle devices D/2-1 and D/2 from the nearer end, so
no schedule on this placement under unit costs can do better.
Activation memory: at most 2D chunk-activations between F and B per device (D Ma, as 1F1B's
first device) and at most 5D/2 counting the W-retained part as whole (5D/4 Ma).
"""
from __future__ import annotations

from .common import check_units
from .ir import B, F, W, make_schedule
from .placement import v_placement
from .timing import list_schedule

NAME = "bitpipe-zb"
REQUIRES = "D even, N multiple of D"


def build(num_devices: int, num_microbatches: int, **_):
    D, N = num_devices, num_microbatches
    check_units(NAME, D, N)
    P = v_placement(D)
    S = 2 * D
    ops: list[list[tuple]] = [[] for _ in range(D)]
    for m in range(N):
        c = m % 2
        for s in range(S):
            ops[P[c][s]] += [(k, m, c, s) for k in (F, B, W)]
    rank = {B: 0, F: 1, W: 2}
    fb_limit, fw_limit = 2 * D, 2 * D + D // 2

    def priority(d, op):
        kind, mb, c, s = op
        return (rank[kind], -s if kind == F else mb, mb)

    def admit(d, op, state):
        if op[0] != F:
            return True
        st = state["started"]  # on an idle device every started op has ended
        f, b, w = st.get((d, 0, F), 0), st.get((d, 0, B), 0), st.get((d, 0, W), 0)
        return f - b < fb_limit and f - w < fw_limit

    order = list_schedule(ops, S, lambda kind, c, s: 0.5, priority, admit=admit)
    return make_schedule(NAME, D, N, P, order, split_backward=True,
                         meta={"activation_limit_chunks": fb_limit, "retained_limit_chunks": fw_limit})
