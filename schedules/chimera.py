"""Chimera (Li & Hoefler, SC 2021): two straight pipelines in opposite directions.

Requirements: D even, N = K*D micro-batches (K >= 1 basic units; ``forward-doubling`` and
``backward-halving`` need K even). Copy "down" places stage s on device s, copy "up" on device
D-1-s; each device holds two stages (weights 2 Mw, all-reduce of a stage's two copies by
lowering). The first D/2 micro-batches of each unit go down, the next D/2 up; every stage takes
its micro-batches first in first out.

The orders are those of the authors' released runtime (Shigangli/Chimera, branch ``ChimeraBk``:
``chimera/chimera_bert/bert/main_with_runtime_direct.py`` for direct concatenation,
``main_with_runtime_forward_doubling.py`` for forward doubling; the SC'21 paper, section 3.5,
"scale to more micro-batches"). With e = min(d, D-1-d), a = D/2 - e, "own" = the copy in which
device d is one of the first D/2 stages (down on d < D/2, up otherwise) and "other" = the other
copy, device d runs per unit:

  a x [B own (from the previous unit; none in the first unit), F own];
  e x [F other, F own];  a x [F other, B other];  e x [B own, B other];

and after the last unit a x B own. At N = D that is the basic unit of the paper's figure; for
N > D it is the paper's direct concatenation: the first unit's trailing backwards on the device
are interleaved with the next unit's first forwards, which fill the junction bubble.

Variants and closed forms (unit costs F = 1, B = 2, exact, tested for D = 2..16 even, K = 1..4):

- ``direct`` (default): makespan 3N + (K+1)(D-2), bubble (K+1)(D-2) per device, ratio
  (K+1)(D-2) / (3N + (K+1)(D-2)); at N = D the paper's (D-2)/(3N/2 + D-2) (4/16 at D = N = 4,
  12/36 at D = N = 8), and each junction costs D-2, half a unit's 2(D-2) (D = 8, N = 16:
  18/66 = 0.2727). Activation memory (F..B) on device d: D/2 + 1 + e Ma at every K (D/2 + 1 on
  the end devices to D in the middle, the paper's range).
- ``forward-doubling``: the released forward-doubling runtime: units of 2D micro-batches in which
  every forward of the order above becomes two forwards back to back (two micro-batches, the
  length of one backward), the third phase runs 2 x F other then B other, and the fourth has
  e + D/2 [B own, B other] pairs. Makespan 3N + 3(D-2)/2 whatever K: the intermediate bubbles are
  gone, ratio (D-2)/(2N + D-2) (D = 8, N = 16: 0.1579; N = 32: 0.0857). Memory cost: D/2 more
  micro-batches in flight per copy, 3D/2 + 1 + e Ma on device d (D Ma more than direct on every
  device; the peak doubles from D to 2D Ma, the paper's "two times activation memory"); the
  authors run it with activation recomputation (``--recompute_step`` in their job script), which
  pipetwin leaves to ``--recompute``.
- ``backward-halving``: the paper's alternative that keeps direct concatenation's peak memory:
  the forward-doubling order run on micro-batches of half the size, so that a pair of forwards
  costs one original forward and a backward half an original backward. The order is the
  forward-doubling one; give it twice the micro-batches at half the size (e.g. ``-N 32
  --micro-batch 2`` for 16 micro-batches of 4). Memory cost, in Ma of the original micro-batch:
  3D/4 + 1/2 + e/2 on device d, whose peak D Ma is direct's (the end devices hold more than
  direct's D/2 + 1); the bubble ratio is forward doubling's at 2N; the price is smaller, less
  efficient kernels (the cost model's per-op costs at the smaller micro-batch).

Decisions: (1) the paper names backward halving but the released code has no runtime for it;
pipetwin reads it as halving the micro-batch under the forward-doubling order (a reader's summary
of the paper says as much; it keeps direct's peak memory and the doubled order's bubble), so it is
the same order as ``forward-doubling`` with a different expected micro-batch size, stated in
``meta``. (2) The released runtimes sync gradients with their own early/late rule per stage;
pipetwin's lowering instead issues each stage's all-reduce after the op that finalises its
gradients, in one global order on every rank (the same rule for every schedule). (3) The newer
runtime on the main branch (``chimera_pipeline_rank.py``) derives its order from a lockstep
simulation in which a forward and a backward take one slot each; pipetwin follows the SC'21
runtimes, which spell the order out as loops and whose timing, like every closed form here, has
B = 2F.
"""
from .bidirectional import FifoStreams, pick_variant
from .common import check_units
from .ir import ScheduleError, make_schedule
from .placement import straight_placement

NAME = "chimera"
REQUIRES = "D even, N multiple of D"
VARIANTS = {"direct": "direct concatenation of units, the next unit's forwards in the junction (default)",
            "forward-doubling": "two forwards back to back, units of 2D micro-batches (the peak activation doubles)",
            "backward-halving": "forward-doubling's order for half-size micro-batches (direct's peak memory)"}


def released_order(D: int, N: int, d: int, doubling: bool) -> list[tuple[str, int, int, int]]:
    """Device d's compute order in the released Chimera runtime (see the module docstring)."""
    half = D // 2
    e = min(d, D - 1 - d)
    a = half - e
    own = 0 if d < half else 1
    other = 1 - own
    dev = FifoStreams(D, {0: (0, d), 1: (1, D - 1 - d)})
    n = 2 if doubling else 1          # forwards per forward slot
    units = N // (n * D)
    for u in range(units):
        for _ in range(a):
            if u:
                dev.b(own)
            for _ in range(n):
                dev.f(own)
        for _ in range(e):
            for _ in range(n):
                dev.f(other)
            for _ in range(n):
                dev.f(own)
        for _ in range(a):
            for _ in range(n):
                dev.f(other)
            dev.b(other)
        for _ in range(e + (half if doubling else 0)):
            dev.b(own)
            dev.b(other)
    for _ in range(a):
        dev.b(own)
    return dev.order


def build(num_devices: int, num_microbatches: int, *, variant: str | None = None, **_):
    D, N = num_devices, num_microbatches
    check_units(NAME, D, N)
    variant = pick_variant(NAME, variant, VARIANTS)
    doubling = variant != "direct"
    if doubling and N % (2 * D):
        raise ScheduleError(f"{NAME} variant {variant} needs the number of micro-batches to be a multiple of "
                            f"2D ({2 * D}); got {N} (try {N + D})")
    meta = {"variant": variant}
    if variant == "backward-halving":
        meta["micro_batch_scale"] = 0.5   # meant for micro-batches of half the size, twice as many
    order = [released_order(D, N, d, doubling) for d in range(D)]
    return make_schedule(NAME, D, N, straight_placement(D), order, meta=meta)
