"""BitPipe and Chimera as their authors released them: exact orders, closed forms at
N = D and N = K*D, activation peaks, variants, validation, the CLI's --variant."""
from fractions import Fraction

import pytest

from schedules import ALLREDUCE, COPY, B, F, ScheduleError, build, lower, validate
from schedules.analysis import activation_peaks, unit_summary
from schedules.bidirectional import copy_microbatch
from tests.test_cli import run_cli

EVEN_D = (2, 4, 6, 8, 10, 12, 14, 16)
KS = (1, 2, 3, 4)


def frac(x) -> Fraction:
    return Fraction(x).limit_denominator(10 ** 6)


def summary(name, D, N, **kw):
    return unit_summary(build(name, D, N, **kw))


def ends(D, d):
    """e = distance of device d from the nearer end of the device line."""
    return min(d, D - 1 - d)


# ----------------------------------------------------------------------------- BitPipe, released
# The per-rank orders printed as comments in the released code (wuhouming/BitPipe,
# megatron/core/pipeline_parallel/bitpipe_schedule.py) for D = 4, N = 8: chunk-forward and
# chunk-backward ids, where chunk 0/1 hold ids 0,1,4,5 / 2,3,6,7 (down / up copy before the V
# turn) and chunk 2/3 hold 8,9,12,13 / 10,11,14,15 (down / up copy after it), first in first out.
RELEASED_D4_N8_FORWARD = [[0, 1, 2, 10, 3, 11, 8, 9, 4, 5, 6, 14, 7, 15, 12, 13],
                          [0, 2, 1, 3, 10, 8, 11, 9, 4, 6, 5, 7, 14, 12, 15, 13],
                          [2, 0, 3, 1, 8, 10, 9, 11, 6, 4, 7, 5, 12, 14, 13, 15],
                          [2, 3, 0, 8, 1, 9, 10, 11, 6, 7, 4, 12, 5, 13, 14, 15]]
RELEASED_D4_N8_BACKWARD = [[8, 9, 10, 2, 11, 3, 0, 1, 12, 13, 14, 6, 15, 7, 4, 5],
                           [8, 10, 9, 11, 2, 0, 3, 1, 12, 14, 13, 15, 6, 4, 7, 5],
                           [10, 8, 11, 9, 0, 2, 1, 3, 14, 12, 15, 13, 4, 6, 5, 7],
                           [10, 11, 8, 0, 9, 1, 2, 3, 14, 15, 12, 4, 13, 5, 6, 7]]


def released_id(op, D):
    """The released code's id of a BitPipe chunk-op (D = 4, N = 8 numbering above)."""
    half = D // 2
    k = (op.mb // D) * half + op.mb % D - op.copy * half       # the op's index in its copy's FIFO
    assert copy_microbatch(op.copy, k, D) == op.mb
    chunk = op.copy + (2 if op.stage >= D else 0)
    ids = [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    return ids[chunk][k]


def test_bitpipe_order_is_the_released_codes_d4_n8():
    s = build("bitpipe", 4, 8)
    for d, prog in enumerate(s.programs):
        assert [released_id(o, 4) for o in prog if o.kind == F] == RELEASED_D4_N8_FORWARD[d]
        assert [released_id(o, 4) for o in prog if o.kind == B] == RELEASED_D4_N8_BACKWARD[d]
    # phases on device 0 (e = 0, a = 2, 6 warm-up forwards): warm-up, 2 pairs, junction
    # (5 B, 1 pair, 5 F of the next unit), 2 pairs, cool-down of 6 B
    kinds = "".join(o.kind for o in s.programs[0])
    assert kinds == "F" * 6 + "FB" * 2 + "B" * 5 + "FB" + "F" * 5 + "FB" * 2 + "B" * 6


@pytest.mark.parametrize("D", [2, 4, 8, 16])
def test_bitpipe_warmup_counts(D):
    """Warm-up: 3D/2 + e forwards on device d (the released code's), then the steady phase opens
    with a forward, so the first backward is op 3D/2 + e + 1."""
    for N in (D, 3 * D):
        for d, prog in enumerate(build("bitpipe", D, N).programs):
            kinds = [o.kind for o in prog]
            assert kinds.index(B) == 3 * D // 2 + ends(D, d) + 1
            assert kinds.count(F) == kinds.count(B) == 2 * N


@pytest.mark.parametrize("D", [2, 4, 6, 8, 10, 12, 16])
def test_bitpipe_n_equals_d_is_the_papers_closed_form(D):
    s = summary("bitpipe", D, D)
    assert frac(s["bubble_ratio"]) == Fraction(D - 2, 3 * D + D - 2)
    assert s["makespan"] == 3 * D + D - 2 and s["busy"] == [3 * D] * D


@pytest.mark.parametrize("D", EVEN_D)
def test_bitpipe_closed_form_at_k_units(D):
    """Each junction costs (D-2)/2: makespan 3N + (K+1)(D-2)/2 on every device count."""
    for K in KS:
        N = K * D
        s = summary("bitpipe", D, N)
        assert s["busy"] == [3 * N] * D
        assert frac(s["makespan"]) == 3 * N + Fraction((K + 1) * (D - 2), 2), (D, K)
        assert frac(s["bubble_ratio"]) == Fraction((K + 1) * (D - 2), 6 * N + (K + 1) * (D - 2))


def test_issue_table():
    """The issue's numbers: BitPipe D=8 N=8 0.2000, N=16 0.1579; Chimera D=8 N=16 0.2727."""
    assert frac(summary("bitpipe", 8, 8)["bubble_ratio"]) == Fraction(6, 30)
    assert summary("bitpipe", 8, 16)["bubble_ratio"] <= 0.1579
    assert frac(summary("bitpipe", 8, 16)["bubble_ratio"]) == Fraction(9, 57)
    assert round(summary("chimera", 8, 16)["bubble_ratio"], 4) <= 0.2727     # the issue's 4 decimals
    assert frac(summary("chimera", 8, 16)["bubble_ratio"]) == Fraction(18, 66)  # = 3/11 = 0.272727...
    # before (greedy): 0.2131 at both N for BitPipe, 0.3333 for Chimera
    assert summary("bitpipe", 8, 16, variant="greedy")["bubble_ratio"] == pytest.approx(13 / 61)


@pytest.mark.parametrize("name,variant", [("bitpipe", None), ("bitpipe", "greedy"), ("chimera", None)])
def test_bubble_ratio_at_k_units_no_larger_than_one_unit(name, variant):
    for D in EVEN_D:
        one = summary(name, D, D, variant=variant)["bubble_ratio"]
        for K in KS:
            assert summary(name, D, K * D, variant=variant)["bubble_ratio"] <= one + 1e-12, (name, variant, D, K)


@pytest.mark.parametrize("D", EVEN_D)
def test_bitpipe_activation_peaks(D):
    """(3D+2)/4 + e/2 Ma on device d at every K: the paper's range (3D+2)/4 .. D."""
    for K in (1, 2, 4):
        p = activation_peaks(build("bitpipe", D, K * D))
        want = [Fraction(3 * D + 2, 4) + Fraction(ends(D, d), 2) for d in range(D)]
        assert [frac(x) for x in p.fb_ma] == want
        assert frac(p.fb_ma.min()) == Fraction(3 * D + 2, 4) and p.fb_ma.max() == D


# ------------------------------------------------------------------------------ BitPipe, greedy
def test_bitpipe_greedy_variant_is_better_at_d4_only():
    """The greedy order pays (K+3)/2 per device at D = 4 (released: K+1) and more than released
    from D = 6 on; it is kept as a variant, the released order is the default."""
    assert [summary("bitpipe", 4, 4 * K, variant="greedy")["bubble"] for K in KS] == [2, 2.5, 3, 3.5]
    assert [summary("bitpipe", 4, 4 * K)["bubble"] for K in KS] == [2, 3, 4, 5]
    assert [summary("bitpipe", 6, 6 * K, variant="greedy")["bubble"] for K in KS] == [4, 8, 12, 16]
    assert [summary("bitpipe", 6, 6 * K)["bubble"] for K in KS] == [4, 6, 8, 10]
    assert [summary("bitpipe", 16, 16 * K, variant="greedy")["bubble"] for K in (1, 2)] == [15, 30]
    assert build("bitpipe", 4, 8).meta["variant"] == "released"
    assert build("bitpipe", 4, 8, variant="greedy").meta["variant"] == "greedy"
    assert build("bitpipe", 4, 8).programs == build("bitpipe", 4, 8, variant="released").programs
    assert build("bitpipe", 4, 8).programs != build("bitpipe", 4, 8, variant="greedy").programs
    for D in (4, 8, 16):
        for K in (1, 2, 4):
            p = activation_peaks(build("bitpipe", D, K * D, variant="greedy"))
            if D == 4 and K > 1:   # the two pulled forwards cost half a Ma
                assert (p.fb_ma.min(), p.fb_ma.max()) == (4, 4.5)
            else:
                assert (p.fb_ma.min(), p.fb_ma.max()) == ((3 * D + 2) / 4, D)


# ------------------------------------------------------------------------------------- Chimera
def test_chimera_direct_order_d4_n8():
    """The released direct-concatenation loop, device by device: (kind, copy) per op, d = down,
    u = up. Device 0 (own = down, a = 2, e = 0) and device 1 (a = 1, e = 1)."""
    def code(prog):
        return " ".join(f"{o.kind}{'du'[o.copy]}" for o in prog)
    s = build("chimera", 4, 8)
    assert code(s.programs[0]) == ("Fd Fd Fu Bu Fu Bu "            # unit 1: a x F own, a x (F, B) other
                                   "Bd Fd Bd Fd Fu Bu Fu Bu "      # unit 2 starts with (B own, F own) pairs
                                   "Bd Bd")                        # tail: a x B own
    assert code(s.programs[1]) == ("Fd Fu Fd Fu Bu Bd Bu "
                                   "Bd Fd Fu Fd Fu Bu Bd Bu "
                                   "Bd")
    assert code(s.programs[3]) == code(s.programs[0]).translate(str.maketrans("du", "ud"))
    # micro-batches: the first D/2 of each unit down, the next D/2 up, first in first out
    assert [o.mb for o in s.programs[0] if o.kind == F] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert s.copy_of_microbatch() == {0: 0, 1: 0, 2: 1, 3: 1, 4: 0, 5: 0, 6: 1, 7: 1}


def test_chimera_forward_doubling_order_d4_n8():
    s = build("chimera", 4, 8, variant="forward-doubling")
    code = " ".join(f"{o.kind}{'du'[o.copy]}" for o in s.programs[1])
    # a = 1, e = 1: F own x2; (F other x2, F own x2); (F other x2, B other); 3 x (B own, B other); B own
    assert code == "Fd Fd Fu Fu Fd Fd Fu Fu Bu Bd Bu Bd Bu Bd Bu Bd"


@pytest.mark.parametrize("D", [4, 6, 8, 10, 12, 16])
def test_chimera_n_equals_d_is_the_papers_closed_form(D):
    assert frac(summary("chimera", D, D)["bubble_ratio"]) == Fraction(D - 2, Fraction(3 * D, 2) + D - 2)


@pytest.mark.parametrize("D", EVEN_D)
def test_chimera_closed_forms_at_k_units(D):
    for K in KS:
        N = K * D
        s = summary("chimera", D, N)
        assert s["busy"] == [3 * N] * D
        assert s["makespan"] == 3 * N + (K + 1) * (D - 2), (D, K)     # direct: D-2 per junction
        if K % 2 == 0:
            fd = summary("chimera", D, N, variant="forward-doubling")
            assert frac(fd["makespan"]) == 3 * N + Fraction(3 * (D - 2), 2)   # flat in K
            assert frac(fd["bubble_ratio"]) == Fraction(D - 2, 2 * N + D - 2)
            assert fd["bubble_ratio"] <= s["bubble_ratio"]


@pytest.mark.parametrize("D", EVEN_D)
def test_chimera_activation_peaks_and_memory_costs(D):
    """direct: D/2 + 1 + e Ma on device d; forward doubling D more (3D/2 + 1 + e, the peak doubles
    from D to 2D); backward halving is the doubling order for half-size micro-batches: in the
    original micro-batch's Ma, 3D/4 + 1/2 + e/2, whose peak is direct's D."""
    for K in (2, 4):
        direct = activation_peaks(build("chimera", D, K * D))
        assert list(direct.fb_ma) == [D / 2 + 1 + ends(D, d) for d in range(D)]
        assert direct.fb_ma.min() == D / 2 + 1 and direct.fb_ma.max() == D
        fd = activation_peaks(build("chimera", D, K * D, variant="forward-doubling"))
        assert list(fd.fb_ma) == [3 * D / 2 + 1 + ends(D, d) for d in range(D)]
        assert fd.fb_ma.max() == 2 * D == 2 * direct.fb_ma.max()
        bh = build("chimera", D, 2 * K * D, variant="backward-halving")   # 2N micro-batches of half size
        half = [x / 2 for x in activation_peaks(bh).fb_ma]
        assert half == [3 * D / 4 + 0.5 + ends(D, d) / 2 for d in range(D)]
        assert max(half) == direct.fb_ma.max()
        assert bh.programs == build("chimera", D, 2 * K * D, variant="forward-doubling").programs
        assert bh.meta == {"variant": "backward-halving", "micro_batch_scale": 0.5}


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("name,D,N,kw,msg", [
    ("bitpipe", 4, 8, {"variant": "nope"},
     r"^bitpipe has no variant 'nope'; choose one of released, greedy \(default released\)$"),
    ("chimera", 4, 8, {"variant": "greedy"},
     r"^chimera has no variant 'greedy'; choose one of direct, forward-doubling, backward-halving \(default direct\)$"),
    ("chimera", 4, 4, {"variant": "forward-doubling"},
     r"^chimera variant forward-doubling needs the number of micro-batches to be a multiple of 2D \(8\); "
     r"got 4 \(try 8\)$"),
    ("chimera", 4, 12, {"variant": "backward-halving"}, r"multiple of 2D \(8\); got 12 \(try 16\)$"),
    ("gpipe", 4, 8, {"variant": "greedy"},
     r"^gpipe has no variants \(got 'greedy'\); leave the variant out "
     r"\(schedules with variants: interleaved, chimera, bitpipe, zb-auto\)$"),
    ("bitpipe", 4, 6, {"variant": "greedy"}, "multiple of the number of devices"),
])
def test_bad_variants_fail_with_one_line(name, D, N, kw, msg):
    with pytest.raises(ScheduleError, match=msg):
        build(name, D, N, **kw)


# ------------------------------------------------------------- validation, lowering features
VARIANT_CASES = [("bitpipe", None, 1), ("bitpipe", "greedy", 1), ("chimera", None, 1),
                 ("chimera", "forward-doubling", 2), ("chimera", "backward-halving", 2)]


@pytest.mark.parametrize("name,variant,step", VARIANT_CASES)
def test_every_variant_validates_up_to_4d(name, variant, step):
    """Symbolic run with FIFO point-to-point messages, eager and late all-reduce, D = 2..16."""
    count = 0
    for D in EVEN_D:
        for K in range(step, 5, step):
            s = build(name, D, K * D, variant=variant)
            for eager in (True, False):
                low = validate(lower(s, eager=eager))
                ars = [o for o in low.programs[0] if o.kind == ALLREDUCE]
                assert len(ars) == 4 if name == "bitpipe" else len(ars) == 2   # every stage a device holds
                count += 1
            if D <= 4:
                validate(lower(s, replicas=2))
    assert count == 2 * len(EVEN_D) * (4 // step)


def test_v_shape_turn_is_a_local_copy_and_sync_is_eager():
    low = lower(build("bitpipe", 8, 16))
    last = low.programs[7]
    copies = [o for o in last if o.kind == COPY]
    # device D-1 holds the down copy's turn (stage 7 -> 8): one activation and one gradient hand-off
    # per down micro-batch; device 0 holds the up copy's
    assert len(copies) == 2 * 8 and {o.stage for o in copies} == {7, 8}
    assert {o.copy for o in copies} == {0}
    compute = [i for i, o in enumerate(last) if o.is_compute]
    first_ar = next(i for i, o in enumerate(last) if o.kind == ALLREDUCE)
    assert first_ar < compute[-1]                     # an all-reduce starts before the device's last op


# ------------------------------------------------------------------------------------------ CLI
def test_cli_variant(capsys):
    rc, out, _ = run_cli(capsys, "simulate", "-s", "bitpipe", "-D", "4", "-N", "8", "--unit-costs",
                         "--variant", "greedy")
    assert rc == 0 and "iteration 26.5 F  bubble 0.0943" in out
    rc, out, _ = run_cli(capsys, "simulate", "-s", "bitpipe", "-D", "4", "-N", "8", "--unit-costs")
    assert rc == 0 and "iteration 27 F  bubble 0.1111" in out
    rc, out, _ = run_cli(capsys, "compare", "-D", "8", "-N", "16", "--unit-costs", "--schedules", "chimera,dapple",
                         "--variant", "forward-doubling")
    assert rc == 0 and "skipped dapple: dapple has no variants" in out
    assert [ln.split()[:3] for ln in out.splitlines() if ln.startswith("chimera")] == [["chimera", "57", "0.1579"]]


@pytest.mark.parametrize("argv,msg", [
    (["simulate", "-s", "bitpipe", "-D", "4", "-N", "8", "--unit-costs", "--variant", "nope"],
     "pipetwin: error: bitpipe has no variant 'nope'; choose one of released, greedy (default released)\n"),
    (["run", "-s", "chimera", "-D", "2", "-N", "2", "--variant", "forward-doubling"],
     "pipetwin: error: chimera variant forward-doubling needs the number of micro-batches to be a multiple of "
     "2D (4); got 2 (try 4)\n"),
])
def test_cli_bad_variant_exits_2_with_one_line(capsys, argv, msg):
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and err == msg
