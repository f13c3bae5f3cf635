"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1, handcrafted
schedule H1; PyTorch ships it as ``ScheduleInterleavedZeroBubble`` with one stage per rank).

Requirements: D >= 1, N >= 1. Stage s on device s (L/D layers). The backward is split into the
input-gradient B (needed by the previous stage, on the critical path) and the weight-gradient W
(needed by nobody but the optimizer), F = B = W = 1 under unit costs.

Order of device d: the 1F1B order (D-1-d warm-up forwards, then F/B pairs, then the remaining
B's) in which the j-th B is followed by the W of micro-batch j-d (device d starts issuing W's d
backwards late), and the d weight-gradients still owed come last. The late W's fill the
cool-down bubbles that 1F1B leaves on the devices near the input.

Bubble (unit costs, exact, every D and N): makespan 3N + D - 1 + max(0, D - N). For N >= D that
is a bubble of (D-1)(F + B - W) = D - 1 per device, a third of 1F1B's (D-1)(F + B + W) = 3(D-1);
ratio (D-1)/(3N+D-1). For N < D the makespan is 2N + 2D - 1.
Activation memory (N >= D): device d keeps at most D-d micro-batches between F and B (1F1B's
count; D Ma on device 0) plus the W-retained part of at most d+1 micro-batches whose W is
pending; even counting a pending W as a whole micro-batch, every device holds at most D (D Ma).
"""
from .common import check_positive
from .ir import B, F, W, make_schedule

NAME = "zb-h1"
REQUIRES = "D >= 1, N >= 1 (closed form 3N+D-1 for N >= D)"


def zbh1_device_order(D: int, d: int, N: int) -> list[tuple[str, int]]:
    warm = min(D - 1 - d, N)
    out = [(F, m) for m in range(warm)]
    w_next = 0

    def backward(j):
        nonlocal w_next
        out.append((B, j))
        if j >= d:
            out.append((W, w_next))
            w_next += 1

    for j in range(N - warm):
        out.append((F, warm + j))
        backward(j)
    for j in range(N - warm, N):
        backward(j)
    out += [(W, m) for m in range(w_next, N)]
    return out


def build(num_devices: int, num_microbatches: int, **_):
    D, N = num_devices, num_microbatches
    check_positive(NAME, D, N)
    order = [[(k, m, 0, d) for k, m in zbh1_device_order(D, d, N)] for d in range(D)]
    return make_schedule(NAME, D, N, [list(range(D))], order, split_backward=True)
