"""DualPipe-V: DeepSeek's DualPipe "cut in half" into one V-shaped pipeline
(DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 3.2.1 for DualPipe; the V variant is
the ``DualPipeV`` schedule of github.com/deepseek-ai/DualPipe, also shipped as PyTorch's
``ScheduleDualPipeV``).

Requirements: D >= 1, N >= 2D (the steady phase needs every device to hold forwards of both
chunks). Same V placement as ZB-V: 2D stages of L/(2D) layers (F/2 per chunk), device d holds
stages d and 2D-1-d; weights 1 Mw per device (DualPipe holds two copies, DualPipe-V one).

Order of device d (c0 = stage d, c1 = stage 2D-1-d), in DeepSeek's eight steps:
1. 2(D-d-1) x F c0;  2. d+1 x (F c0, F c1);  3. D-d-1 x (B c1, W c1, F c1) (zero-bubble split);
4. N-2D+d+1 x ([F c0 & B c1], [F c1 & B c0]), where "&" is an overlapped forward/backward
   pair (on the last device the very first pair is not overlapped);
5. D-d-1 x (B c1, [F c1 & B c0]);  6. d+1 x (B c1, B c0), the second half with W deferred;
7. D-d-1 x (W, B c0);  8. d+1 x W (the deferred weight gradients, oldest first).

Modelling choice: the IR runs one op at a time per device, so an overlapped pair ``F x & B y``
is the forward followed immediately by the backward (its F, then its B, then its W: a full
backward is an input-gradient B with its W right behind it). The pairs are listed in
``meta["overlapped"]`` ((kind, stage, mb) of both halves) and full backwards in
``meta["full_backward"]`` ((stage, mb)), so an engine that overlaps them, and the PyTorch export
(``OVERLAP_F_B`` / ``B`` tokens), can recover them. Under unit costs F&B = F + B(full) = 3/2 per
chunk pair: no overlap gain.

Bubble: DeepSeek states (PP/2-1)(F&B + B - 3W) with F, B (full), W and F&B chunk times and PP
the ranks of DualPipe. Under our serial unit model (F = 1/2, B(full) = 1, W = 1/2 per chunk,
F&B = F + B(full) = 3/2) the order gives exactly makespan 3N + (D-1)/2, bubble (D-1)/2 =
(D-1) chunk-forwards (the staggered start of device D-1), for every N >= 2D: the same as ZB-V.
With these values DeepSeek's formula gives D/2 - 1 for PP = D, half a unit less than our model,
and D - 1 for PP = 2D, (D-1)/2 more: the serial model runs F&B as F then B, so the formula, which
assumes an overlapped F&B, does not describe it. Timing the overlapped pairs
as fused ops of length F&B (``schedules.analysis.fused_overlap_timing``) with F = B = W, the
most idle device idles exactly (D-1)(F&B + B - 3W) for F&B in [2F, 3F]: DeepSeek's formula with
PP = 2D, i.e. the DualPipe on 2D ranks that DualPipe-V on D devices is cut from.
Activation memory: every device holds at most 2D+1 chunk-activations between F and B (D + 1/2
Ma; DeepSeek: PP+1 chunks) and at most d+1 pending W's; 2D+1 chunks counting those as whole.
"""
from __future__ import annotations

from .common import check_positive
from .ir import B, F, ScheduleError, W, make_schedule
from .placement import v_stages

NAME = "dualpipe-v"
REQUIRES = "D >= 1, N >= 2D"


def dualpipev_device_order(D: int, d: int, N: int):
    """(ops, overlapped pairs, full backwards) of device d; ops are (kind, mb, chunk)."""
    stage = (d, 2 * D - 1 - d)
    cnt = {(k, c): 0 for k in (F, B) for c in (0, 1)}
    ops: list[tuple[str, int, int]] = []
    pairs: list[tuple[tuple, tuple]] = []
    full: list[tuple[int, int]] = []
    wq: list[tuple[int, int]] = []  # deferred weight gradients (chunk, mb), oldest first

    def fwd(c):
        m = cnt[(F, c)]
        cnt[(F, c)] += 1
        ops.append((F, m, c))
        return (F, stage[c], m)

    def bwd(c, split: bool):
        m = cnt[(B, c)]
        cnt[(B, c)] += 1
        ops.append((B, m, c))
        if split:
            wq.append((c, m))
        else:
            ops.append((W, m, c))
            full.append((stage[c], m))
        return (B, stage[c], m)

    def wgt():
        if wq:
            c, m = wq.pop(0)
            ops.append((W, m, c))

    def overlapped(cf, cb):
        pairs.append((fwd(cf), bwd(cb, split=False)))

    for _ in range(2 * (D - d - 1)):
        fwd(0)
    for _ in range(d + 1):
        fwd(0)
        fwd(1)
    for _ in range(D - d - 1):
        bwd(1, split=True)
        wgt()
        fwd(1)
    for i in range(N - 2 * D + d + 1):
        if i == 0 and d == D - 1:
            fwd(0)
            bwd(1, split=False)
        else:
            overlapped(0, 1)
        overlapped(1, 0)
    for _ in range(D - d - 1):
        bwd(1, split=False)
        overlapped(1, 0)
    zb = False
    for i in range(d + 1):
        if i == (d + 1) // 2 and d % 2 == 1:
            zb = True
        bwd(1, split=zb)
        if i == (d + 1) // 2 and d % 2 == 0:
            zb = True
        bwd(0, split=zb)
    for _ in range(D - d - 1):
        wgt()
        bwd(0, split=zb)
    for _ in range(d + 1):
        wgt()
    if wq:
        raise ScheduleError(f"{NAME}: device {d} left weight gradients {wq} unscheduled")
    return ops, pairs, full


def build(num_devices: int, num_microbatches: int, **_):
    D, N = num_devices, num_microbatches
    check_positive(NAME, D, N)
    if N < 2 * D:
        raise ScheduleError(f"{NAME} needs at least 2D = {2 * D} micro-batches for {D} devices "
                            f"(every device must hold forwards of both chunks); got {N}")
    order, pairs, full = [], [], []
    for d in range(D):
        stage = (d, 2 * D - 1 - d)
        ops, p, f = dualpipev_device_order(D, d, N)
        order.append([(k, m, 0, stage[c]) for k, m, c in ops])
        pairs += p
        full += f
    return make_schedule(NAME, D, N, [v_stages(D)], order, split_backward=True,
                         meta={"overlapped": pairs, "full_backward": sorted(full)})
