"""Megatron-LM 1F1B-interleaved (Narayanan et al., SC 2021).

Requirements: D >= 2 (D = 1 degenerates to one device), v >= 1 chunks per device, N a multiple of
D. Device d holds stages d, d+D, ..., d+(v-1)D (each L/(vD) layers, F/v per chunk).
Micro-batches go through the chunks in groups of D; device d warms up with
(D-d-1)*2 + (v-1)*D chunk-forwards, then alternates, then drains.
Bubble (unit costs): (D-1)/(vN+D-1); D = N = 4, v = 2 gives 3/11.
Activation memory: device d keeps at most min(Nv, 2(D-1-d) + (v-1)D + 1) chunk-activations
between F and B (its warm-up forwards plus the one of its first steady pair), each 1/v Ma:
min(Nv, 2(D-1-d) + (v-1)D + 1)/v Ma; on device 0 with N > D that is D + (D-1)/v Ma (D = 4,
v = 2: 5.5 Ma against 1F1B's 4). Exact under unit costs (tests/test_schedules.py).

Variant ``a2a-overlap``: Megatron-LM's combined 1F1B for mixtures of experts
(``--overlap-moe-expert-parallel-comm``, virtual pipelines): every device warms up with one more
chunk-forward, so each steady step pairs the forward of one micro-batch with the backward of an
older one, listed in ``meta["overlapped"]`` (as DualPipe-V's pairs; an engine with phased costs
overlaps each one's expert all-to-alls with the other's compute, :mod:`sim.overlap`). Its price is
the extra warm-up forward: min(Nv, 2(D-1-d) + (v-1)D + 2)/v Ma on device d. Without phases the
pairs run serially and the order is that of a warm-up one longer.
"""
from .bidirectional import pick_variant
from .common import check_multiple, check_positive
from .dapple import one_f_one_b
from .ir import B, F, ScheduleError, make_schedule
from .overlap import META_KEY, forward_backward_pairs, unsafe_pairs

NAME = "interleaved"
REQUIRES = "N multiple of D, chunks v >= 1 (default 2)"
TAKES_CHUNKS = True     # the family's size depends on ``chunks`` (every other family ignores it)
VARIANTS = {"megatron": "Megatron-LM's interleaved 1F1B (default)",
            "a2a-overlap": "Megatron-LM's combined 1F1B (--overlap-moe-expert-parallel-comm): one more warm-up "
                           "chunk-forward, each steady forward overlapped with the backward after it"}
OVERLAP_VARIANTS = ("a2a-overlap",)     # pays only where phased costs have all-to-alls to hide


def build(num_devices: int, num_microbatches: int, chunks: int = 2, variant: str | None = None, **_):
    D, N, v = num_devices, num_microbatches, chunks
    variant = pick_variant(NAME, variant, VARIANTS)
    extra = 1 if variant == "a2a-overlap" else 0
    check_positive(NAME, D, N)
    if not isinstance(v, int) or v < 1:
        raise ScheduleError(f"{NAME} needs at least 1 chunk per device; got {v}")
    check_multiple(NAME, N, D)
    total = N * v

    def mb(i):
        return (i // (D * v)) * D + i % D

    order = []
    for d in range(D):
        def fwd(i, d=d):
            return (F, mb(i), 0, ((i // D) % v) * D + d)

        def bwd(i, d=d):
            return (B, mb(i), 0, (v - 1 - (i // D) % v) * D + d)

        order.append(one_f_one_b(total, (D - d - 1) * 2 + (v - 1) * D + extra, fwd, bwd))
    placement = [[s % D for s in range(D * v)]]
    sched = make_schedule(NAME, D, N, placement, order, meta={"chunks": v})
    if extra:
        # the steady steps: every F followed at once by a B (of an older micro-batch); none of their
        # fused blocks waits for itself (checked: a pair that would is an error in this order)
        pairs = forward_backward_pairs(sched)
        bad = unsafe_pairs(sched, pairs)
        if bad:
            raise ScheduleError(f"{NAME} {variant}: overlapped pairs {sorted(bad)[:3]} would wait for themselves")
        sched.meta[META_KEY] = pairs
    return sched
