"""Zero-bubble, DualPipe-V and BitPipe-ZB schedules: requirements, exact unit-cost closed forms,
memory peaks, bubble against N, and validation of every admissible configuration."""
from fractions import Fraction

import pytest

from schedules import B, ScheduleError, W, build, lower, names, validate
from schedules.analysis import activation_peaks, bubble_vs_n, fused_overlap_timing, unit_summary, unit_times
from tests.helpers import admissible

ZB = ["zb-h1", "zb-h2", "zb-v", "dualpipe-v", "bitpipe-zb"]
DS = (1, 2, 3, 4, 6, 8, 16)


def summary(name, D, N, **kw):
    return unit_summary(build(name, D, N, **kw))


def test_registered():
    assert set(ZB) <= set(names())


@pytest.mark.parametrize("name,D,N,msg", [
    ("zb-h1", 0, 4, "at least 1 device"),
    ("zb-v", 2, 0, "at least 1 micro-batch"),
    ("dualpipe-v", 4, 7, r"at least 2D = 8 micro-batches for 4 devices .*got 7"),
    ("bitpipe-zb", 5, 10, "even number of devices; got 5"),
    ("bitpipe-zb", 4, 6, r"multiple of the number of devices \(4\); got 6 \(try 4 or 8\)"),
])
def test_requirements_fail_fast(name, D, N, msg):
    with pytest.raises(ScheduleError, match=msg):
        build(name, D, N)


# ------------------------------------------------------------------------------------- ZB-H1
@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])   # the same makespan: ZB-H2 spends its memory on real costs
@pytest.mark.parametrize("D", DS)
def test_zb_h1_closed_form_every_n(D, name):
    for N in range(1, 4 * D + 1):
        s = summary(name, D, N)
        assert s["makespan"] == 3 * N + D - 1 + max(0, D - N), (D, N)
        assert s["busy"] == [3 * N] * D
        if N >= D:   # (D-1)(F + B - W) with F = B = W = 1
            assert s["bubble"] == D - 1
            assert Fraction(s["bubble_ratio"]).limit_denominator(10 ** 6) == Fraction(D - 1, 3 * N + D - 1)


def test_zb_h1_thirds_the_1f1b_bubble():
    for D, N in [(4, 4), (4, 16), (8, 8), (8, 32), (16, 64)]:
        assert summary("dapple", D, N)["bubble"] == 3 * summary("zb-h1", D, N)["bubble"] == 3 * (D - 1)


def test_zb_h1_exact_order_d4_n8():
    t = build("zb-h1", 4, 8).to_text().splitlines()
    assert t[0] == ("0: F0.s0 F1.s0 F2.s0 F3.s0 B0.s0 W0.s0 F4.s0 B1.s0 W1.s0 F5.s0 B2.s0 W2.s0 F6.s0 "
                    "B3.s0 W3.s0 F7.s0 B4.s0 W4.s0 B5.s0 W5.s0 B6.s0 W6.s0 B7.s0 W7.s0")
    assert t[3] == ("3: F0.s3 B0.s3 F1.s3 B1.s3 F2.s3 B2.s3 F3.s3 B3.s3 W0.s3 F4.s3 B4.s3 W1.s3 F5.s3 "
                    "B5.s3 W2.s3 F6.s3 B6.s3 W3.s3 F7.s3 B7.s3 W4.s3 W5.s3 W6.s3 W7.s3")


@pytest.mark.parametrize("D", [2, 4, 8])
def test_zb_h1_memory_as_1f1b_plus_w_retained(D):
    for N in (D, 2 * D, 4 * D):
        p = activation_peaks(build("zb-h1", D, N))
        assert list(p.fb_chunks) == [D - d for d in range(D)]          # 1F1B's in-flight count
        assert list(p.pending_w_chunks) == [d + 1 for d in range(D)]   # W-retained part
        assert list(p.fw_chunks) == [D] * D                            # never more than D Ma in all
        assert list(activation_peaks(build("dapple", D, N)).fb_chunks) == [D - d for d in range(D)]


# ------------------------------------------------------------------------------------- ZB-H2
def test_zb_h2_exact_order_d4_n8():
    t = build("zb-h2", 4, 8).to_text().splitlines()
    assert t[0] == ("0: F0.s0 F1.s0 F2.s0 F3.s0 F4.s0 F5.s0 F6.s0 B0.s0 W0.s0 F7.s0 B1.s0 W1.s0 B2.s0 W2.s0 "
                    "B3.s0 W3.s0 B4.s0 W4.s0 B5.s0 W5.s0 B6.s0 W6.s0 B7.s0 W7.s0")
    assert t[1] == ("1: F0.s1 F1.s1 F2.s1 F3.s1 F4.s1 B0.s1 F5.s1 B1.s1 F6.s1 B2.s1 W0.s1 F7.s1 B3.s1 W1.s1 "
                    "B4.s1 W2.s1 B5.s1 W3.s1 B6.s1 W4.s1 B7.s1 W5.s1 W6.s1 W7.s1")


@pytest.mark.parametrize("D", [2, 4, 8, 16])
def test_zb_h2_memory_twice_1f1b(D):
    for N in (2 * D, 4 * D):
        p = activation_peaks(build("zb-h2", D, N))
        assert list(p.fb_chunks) == [2 * (D - 1 - d) + 1 for d in range(D)]     # the extra warm-up forwards
        assert list(p.fw_chunks) == [2 * D - 1] * D                              # < 2 x 1F1B's D Ma


# -------------------------------------------------------------------------------------- ZB-V
@pytest.mark.parametrize("D", DS)
def test_zb_v_closed_form_every_n(D):
    for N in range(1, 4 * D + 1):
        s = summary("zb-v", D, N)
        assert s["busy"] == [3 * N] * D
        assert s["makespan"] == 3 * N + max(Fraction(D - 1, 2), 2 * D - 1 - N), (D, N)
        if N >= 2 * D - 1:
            # (D-1) chunk forwards of staggered start on device D-1, and nothing else:
            # inside every device's own first..last op there is no idle time (the paper's metric)
            assert s["bubble"] == (D - 1) / 2
            assert s["span_bubble"] == [0.0] * D


def test_zb_v_lower_bound_is_the_staggered_start():
    for D in (2, 4, 8, 16):
        t = unit_times(build("zb-v", D, 4 * D))
        first = min(st for d, st, _ in t.values() if d == D - 1)
        assert first == (D - 1) / 2


@pytest.mark.parametrize("D", [2, 4, 8])
def test_zb_v_memory_as_1f1b(D):
    for N in (2 * D, 4 * D):
        p = activation_peaks(build("zb-v", D, N))
        assert list(p.fb_chunks) == [2 * D] * D
        assert list(p.pending_w_chunks) == [2 * d + 1 for d in range(D)]
        assert list(p.fw_chunks) == [2 * D] * D       # counting pending W's as whole: still D Ma
        assert list(p.fw_ma) == [D] * D


def test_zb_v_beats_zb_h1_and_interleaved_for_n_ge_2d():
    for D in (4, 8):
        for N in (2 * D, 4 * D):
            zbv = summary("zb-v", D, N)["bubble"]
            assert zbv == (D - 1) / 2 < summary("zb-h1", D, N)["bubble"] == D - 1
            assert zbv < summary("interleaved", D, N)["bubble"]


# -------------------------------------------------------------------------------- DualPipe-V
@pytest.mark.parametrize("D", DS)
def test_dualpipe_v_closed_form_unit_costs(D):
    for N in range(2 * D, 4 * D + 1):
        s = summary("dualpipe-v", D, N)
        assert s["busy"] == [3 * N] * D
        assert s["makespan"] == 3 * N + Fraction(D - 1, 2), (D, N)
        # the formula our serial model meets: a bubble of (D-1)/2 per device, the staggered start
        # of device D-1 (D-1 hops of F/2); DeepSeek's overlapped F&B is tested with fused ops below
        assert s["bubble"] == Fraction(D - 1, 2)


@pytest.mark.parametrize("D", [2, 4, 6, 8])
@pytest.mark.parametrize("fb", [2, 2.5, 3])
def test_dualpipe_v_fused_overlap_matches_deepseek_with_pp_2d(D, fb):
    """With F = B = W = 1 per chunk and each overlapped pair fused into one op of length F&B,
    the most idle device idles (D-1)(F&B + B_full - 3W) = DeepSeek's formula with PP = 2D (the
    DualPipe that DualPipe-V is cut from has twice the ranks)."""
    for N in (2 * D, 3 * D):
        r = fused_overlap_timing(build("dualpipe-v", D, N), f=1, b=1, w=1, fb=fb)
        assert max(r["idle"]) == pytest.approx((D - 1) * (fb + 2 - 3))


def test_dualpipe_v_pairs_are_consecutive_and_full_backwards_marked():
    s = build("dualpipe-v", 4, 12)
    pairs = s.meta["overlapped"]
    full = set(s.meta["full_backward"])
    for _d, prog in enumerate(s.compute_programs()):
        toks = [(o.kind, o.stage, o.mb) for o in prog]
        for a, b in pairs:
            if a in toks:
                i = toks.index(a)
                assert toks[i + 1] == b and toks[i + 2] == (W, b[1], b[2])   # F, then B, then its W
                assert (b[1], b[2]) in full
        for i, (kind, st, mb) in enumerate(toks):
            if kind == B and (st, mb) in full:
                assert toks[i + 1] == (W, st, mb)
    # per device: N-2D+d+1 pairs in step 4 (x2, minus the last device's first) + D-d-1 in step 5
    assert len(pairs) == sum(2 * (12 - 8 + d + 1) - (d == 3) + (4 - d - 1) for d in range(4))


@pytest.mark.parametrize("D", [2, 4, 8])
def test_dualpipe_v_memory(D):
    p = activation_peaks(build("dualpipe-v", D, 3 * D))
    assert list(p.fb_chunks) == [2 * D + 1] * D           # DeepSeek: PP + 1 chunks
    assert list(p.pending_w_chunks) == [d + 1 for d in range(D)]
    assert list(p.fw_chunks) == [2 * D + 1] * D


# -------------------------------------------------------------------------------- BitPipe-ZB
@pytest.mark.parametrize("D", [2, 4, 6, 8, 10, 12, 16])
def test_bitpipe_zb_bubble_constant_in_n(D):
    ratios = []
    for K in (1, 2, 3, 4):
        N = K * D
        s = summary("bitpipe-zb", D, N)
        assert s["busy"] == [3 * N] * D
        assert s["makespan"] == 3 * N + Fraction(D - 2, 4), (D, N)
        assert Fraction(s["bubble_ratio"]).limit_denominator(10 ** 6) == Fraction(D - 2, 12 * N + D - 2)
        ratios.append(s["bubble_ratio"])
    assert all(r <= ratios[0] for r in ratios)
    if D > 2:
        assert ratios == sorted(ratios, reverse=True) and ratios[3] < ratios[0]


def test_bitpipe_and_chimera_bubbles_grow_with_k():
    """Concatenated units: the released orders pay half a unit's bubble per junction (their ratio
    falls with K but their bubble time grows); BitPipe's greedy variant pays a whole unit's (flat
    ratio). BitPipe-ZB's bubble does not grow at all (above)."""
    assert [summary("chimera", 4, 4 * K)["bubble"] for K in (1, 2, 3, 4)] == [4, 6, 8, 10]
    assert [summary("chimera", 8, 8 * K)["bubble"] for K in (1, 2, 3, 4)] == [12, 18, 24, 30]
    assert [summary("bitpipe", 8, 8 * K)["bubble"] for K in (1, 2, 3, 4)] == [6, 9, 12, 15]
    greedy = [unit_summary(build("bitpipe", 8, 8 * K, variant="greedy")) for K in (1, 2, 3, 4)]
    assert [s["bubble"] for s in greedy] == [6.5, 13, 19.5, 26]
    assert [s["bubble_ratio"] for s in greedy] == pytest.approx([greedy[0]["bubble_ratio"]] * 4)


def test_bitpipe_zb_beats_everything_at_n_equals_kd():
    for D in (4, 8):
        for K in (1, 2, 4):
            df = bubble_vs_n(["gpipe", "dapple", "interleaved", "chimera", "bitpipe", "zb-h1", "zb-v",
                              "dualpipe-v", "bitpipe-zb"], D, [K * D]).dropna()
            best = df.sort_values("bubble_ratio").iloc[0]
            assert best.schedule == "bitpipe-zb"
    assert summary("bitpipe-zb", 4, 4)["bubble_ratio"] == pytest.approx(1 / 25)
    assert summary("bitpipe", 4, 4)["bubble_ratio"] == pytest.approx(2 / 14)


@pytest.mark.parametrize("D", [2, 4, 8, 16])
def test_bitpipe_zb_memory_bounds(D):
    for N in (D, 4 * D):
        p = activation_peaks(build("bitpipe-zb", D, N))
        assert p.fb_chunks.max() <= 2 * D and p.fw_chunks.max() <= 2 * D + D // 2
        assert p.fb_ma.max() <= D
    p = activation_peaks(build("bitpipe-zb", 8, 32))
    assert list(p.fb_chunks) == [16] * 8 and list(p.fw_chunks) == [20] * 8


def test_bitpipe_zb_uses_both_copies_evenly():
    s = build("bitpipe-zb", 4, 8)
    c = s.copy_of_microbatch()
    assert [c[m] for m in range(8)] == [0, 1] * 4
    assert s.num_copies == 2 and s.max_chunks == 4


# ------------------------------------------------------------------------------- bubble_vs_n
def test_bubble_vs_n_table():
    df = bubble_vs_n(["dapple", "bitpipe", "dualpipe-v"], 4, [4, 6, 8])
    assert list(df.columns) == ["schedule", "D", "N", "makespan", "mean_busy", "bubble", "bubble_ratio", "error"]
    assert len(df) == 9
    dap = df[df.schedule == "dapple"]
    assert list(dap.bubble_ratio) == pytest.approx([3 / 7, 3 / 9, 3 / 11])
    bad = df[df.bubble_ratio.isna()]
    assert set(zip(bad.schedule, bad.N)) == {("bitpipe", 6), ("dualpipe-v", 4), ("dualpipe-v", 6)}
    assert all(bad.error.str.len() > 0) and all(df.dropna().error == "")
    assert df[(df.schedule == "dualpipe-v") & (df.N == 8)].bubble.item() == 1.5


# ------------------------------------------------------------------------- validate everything
@pytest.mark.parametrize("name", ZB)
def test_every_admissible_config_lowers_and_validates(name):
    count = 0
    for D in (2, 4, 6, 8, 16):
        for _N, s in admissible(name, D):
            for R in (1, 2):
                low = validate(lower(s, replicas=R))
                assert low.num_ranks == R * D
                count += 1
    want = {"zb-h1": 2 * 144, "zb-h2": 2 * 144, "zb-v": 2 * 144,
            "dualpipe-v": 2 * sum(2 * D + 1 for D in (2, 4, 6, 8, 16)),
            "bitpipe-zb": 2 * 4 * 5}
    assert count == want[name]


def test_simulator_agrees_with_unit_timing():
    from cost_models import UnitCostModel
    from schedules.trace import step_metrics
    from sim import simulate

    for name in ZB:
        s = build(name, 4, 8)
        low = lower(s)
        m = step_metrics(simulate(low, UnitCostModel().bind(low)))
        assert m.iteration_time == pytest.approx(unit_summary(s)["makespan"])
        assert [p.peak_activation for p in m.per_device] == pytest.approx(list(activation_peaks(s).fw_ma))
