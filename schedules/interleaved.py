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
"""
from .common import check_multiple, check_positive
from .dapple import one_f_one_b
from .ir import B, F, ScheduleError, make_schedule

NAME = "interleaved"
REQUIRES = "N multiple of D, chunks v >= 1 (default 2)"
TAKES_CHUNKS = True     # the family's size depends on ``chunks`` (every other family ignores it)


def build(num_devices: int, num_microbatches: int, chunks: int = 2, **_):
    D, N, v = num_devices, num_microbatches, chunks
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

        order.append(one_f_one_b(total, (D - d - 1) * 2 + (v - 1) * D, fwd, bwd))
    placement = [[s % D for s in range(D * v)]]
    return make_schedule(NAME, D, N, placement, order, meta={"chunks": v})
