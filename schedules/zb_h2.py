"""ZB-H2 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1, handcrafted
schedule H2): ZB-H1 with twice 1F1B's activation memory, spent on extra warm-up forwards.

Requirements: D >= 1, N >= 1. Stage s on device s (L/D layers), a split backward (B = input
gradient, W = weight gradient), F = B = W = 1 under unit costs.

Order of device d: min(N, 2(D-1-d) + 1) warm-up forwards (as many as fit before the first backward
reaches it: F0 leaves device d at d + 1 and its B comes back at 2D - 1 - d), then for each
micro-batch j while forwards remain B(j), the W of micro-batch j - 2d (device d issues W's 2d
backwards late: twice ZB-H1's lag) and the next F; then the remaining B's, each followed by one
owed W once more W's are owed than B's remain, and last the W's still owed (they fill the
cool-down, where the backwards arrive one stage at a time).

Bubble (unit costs, exact, every D and N): makespan 3N + D - 1 + max(0, D - N), ZB-H1's: with
W = B the staggered start (D-1) F is the whole bubble of both. With real costs (W < B) ZB-H1's
bubble is (D-1)(F + B - W) while ZB-H2's full warm-up leaves about (D-1) F: with the Zero Bubble
paper's Table 9 stage times (1.5B, 8 stages, 24 micro-batches) 0.1083 against ZB-H1's 0.1585,
the paper's Table 5 values (``tests/test_schedules_zb.py``).
Activation memory: device d holds at most 2(D-1-d) + 1 micro-batches between F and B and, counting
a pending W as a whole micro-batch, at most 2D - 1 in all (twice 1F1B's D, less one).
"""
from .common import check_positive
from .ir import B, F, W, make_schedule

NAME = "zb-h2"
REQUIRES = "D >= 1, N >= 1 (closed form 3N+D-1 for N >= D)"


def zbh2_device_order(D: int, d: int, N: int) -> list[tuple[str, int]]:
    warm = min(2 * (D - 1 - d) + 1, N)
    out = [(F, m) for m in range(warm)]
    nf, w = warm, 0
    for j in range(N):
        out.append((B, j))
        if nf < N:
            if j >= 2 * d:
                out.append((W, w))
                w += 1
            out.append((F, nf))
            nf += 1
        elif N - w > N - 1 - j:     # cool-down: a W after each B once more W's are owed than B's remain
            out.append((W, w))
            w += 1
    out += [(W, m) for m in range(w, N)]
    return out


def build(num_devices: int, num_microbatches: int, **_):
    D, N = num_devices, num_microbatches
    check_positive(NAME, D, N)
    order = [[(k, m, 0, d) for k, m in zbh2_device_order(D, d, N)] for d in range(D)]
    return make_schedule(NAME, D, N, [list(range(D))], order, split_backward=True)
