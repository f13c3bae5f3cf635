"""zb-auto, the automatic zero-bubble scheduler: valid orders for D = 2..16 and N <= 4D, within its
memory limit, never a bubble above ZB-H1's (1p) or ZB-H2's (2p) at that memory, and the job's own
stage costs reaching it through bind."""
import csv
from dataclasses import replace
from importlib import resources

import pytest

from cost_models import Job, Layout
from schedules import ScheduleError, build, lower, validate
from schedules.analysis import activation_peaks, unit_summary
from schedules.zb_auto import AutoCosts, auto_orders, candidates, makespan, timing
from sim import simulate_job

TABLE9_15B = "stages:\n  - {f: 0.018522, b: 0.018086, w: 0.009337}\nmessage: 0.000601\n"


@pytest.mark.parametrize("D", [2, 3, 4, 5, 8, 12, 16])
def test_valid_within_memory_and_never_above_the_handcrafted(D):
    for N in sorted({1, max(1, D // 2), D - 1 or 1, D, 2 * D, 3 * D, 4 * D}):
        for variant, hand, k in (("1p", "zb-h1", 1), ("2p", "zb-h2", 2)):
            s = build("zb-auto", D, N, variant=variant)
            validate(lower(s))
            assert max(activation_peaks(s).fw_chunks) <= k * D, (D, N, variant)
            mk = unit_summary(s)["makespan"]
            assert mk <= unit_summary(build(hand, D, N))["makespan"], (D, N, variant)
            assert mk <= unit_summary(build("zb-h1", D, N))["makespan"]
            assert mk == 3 * N + D - 1 + max(0, D - N)       # the staggered start is all that is left


def test_a_tight_limit_is_kept_and_costs_more():
    D, N = 4, 12
    tight = AutoCosts((1.0,) * D, (1.0,) * D, (1.0,) * D, 0.0, (1.0,) * D, (2.0,) * D)
    orders = auto_orders(D, N, tight)
    t = makespan(orders, tight)
    assert t is not None and t > 3 * N + D - 1
    loose = AutoCosts.unit(D, "1p")
    assert makespan(auto_orders(D, N, loose), loose) == 3 * N + D - 1
    with pytest.raises(ScheduleError, match="below one micro-batch"):
        auto_orders(D, N, AutoCosts((1.0,) * D, (1.0,) * D, (1.0,) * D, 0.0, (1.0,) * D, (0.5,) * D))


def test_variant_checked():
    with pytest.raises(ScheduleError, match="variant must be one of 1p, 2p"):
        build("zb-auto", 4, 8, variant="3p")


def _sim(path, schedule, D, N, variant=None):
    return simulate_job(Job(layout=Layout(schedule=schedule, devices=D, microbatches=N, variant=variant),
                            stage_costs=path)).result


def test_stage_costs_reach_the_scheduler(tmp_path):
    path = tmp_path / "t9.yaml"
    path.write_text(TABLE9_15B)
    h1 = _sim(str(path), "zb-h1", 8, 24).metrics().bubble_ratio
    h2 = _sim(str(path), "zb-h2", 8, 24).metrics().bubble_ratio
    p1 = _sim(str(path), "zb-auto", 8, 24, "1p")
    p2 = _sim(str(path), "zb-auto", 8, 24, "2p")
    assert p1.metrics().bubble_ratio <= h1 + 1e-9 and p1.metrics().bubble_ratio == pytest.approx(0.1585, abs=0.002)
    assert p2.metrics().bubble_ratio <= h2 + 1e-9 < h1
    assert max(p1.peak_activation) <= 8 and max(p2.peak_activation) <= 16


def test_uneven_stages_get_their_own_order():
    """A slow last stage: the scheduler's order differs from the unit-cost one and is no slower than ZB-H1's."""
    D, N = 4, 8
    c = AutoCosts((1.0, 1.0, 1.0, 2.0), (1.0, 1.0, 1.0, 2.0), (1.0, 1.0, 1.0, 2.0), 0.1, (1.0,) * D, (4.0,) * D)
    from schedules.zb_h1 import zbh1_device_order
    orders = auto_orders(D, N, c)
    assert makespan(orders, c) <= makespan([zbh1_device_order(D, d, N) for d in range(D)], c)


def test_memory_limit_in_ma_and_bytes():
    """--memory-limit: 2D Ma is ZB-2p's order; a byte limit keeps the peak under it; other schedules refuse it."""
    D, N = 4, 12
    lim = Layout(schedule="zb-auto", devices=D, microbatches=N, memory_limit=(8.0, "Ma"))
    two_p = Layout(schedule="zb-auto", devices=D, microbatches=N, variant="2p")
    assert simulate_job(Job(layout=lim, unit_costs=True)).result.metrics().iteration_time == \
        simulate_job(Job(layout=two_p, unit_costs=True)).result.metrics().iteration_time == 3 * N + D - 1
    tight = simulate_job(Job(layout=replace(lim, memory_limit=(2.0, "Ma")), unit_costs=True)).result
    assert max(tight.peak_activation) <= 2 and tight.metrics().iteration_time > 3 * N + D - 1
    gib = 2 ** 30
    for limit in (25 * gib, 40 * gib):
        job = Job(layout=replace(lim, memory_limit=(float(limit), "B")), model="gpt3-1.3b")
        bound, res = simulate_job(job)
        peak = max(p.peak_memory for p in res.metrics().per_device)
        assert peak <= limit and peak > limit - 8 * gib, (limit, peak / gib)
    with pytest.raises(ValueError, match="--memory-limit applies to zb-auto only"):
        Layout(schedule="dapple", devices=D, microbatches=N, memory_limit=(8.0, "Ma"))
    with pytest.raises(ValueError, match="drop --variant"):
        replace(two_p, memory_limit=(8.0, "Ma"))
    with pytest.raises(ValueError, match="activation bytes"):
        simulate_job(Job(layout=replace(lim, memory_limit=(1e9, "B")), unit_costs=True))


def test_w_keeping_less_lets_more_micro_batches_wait():
    """act_w: B frees all a micro-batch keeps but what W needs. Under a limit of 1.5 micro-batches, a W
    that keeps all of it must run before the next F (one micro-batch at a time, 9 each: 108); W's
    that keep 0.3 can wait while the next F runs (97)."""
    D, N = 4, 12
    base = dict(f=(1.0,) * D, b=(1.0,) * D, w=(1.0,) * D, message=0.0, act=(1.0,) * D, limit=(1.5,) * D)
    whole, part = AutoCosts(**base), AutoCosts(**base, act_w=(0.3,) * D)
    assert timing(auto_orders(D, N, whole), whole)[1] == 108
    assert timing(auto_orders(D, N, part), part)[1] == 97
    with pytest.raises(ScheduleError, match="act_w"):
        auto_orders(D, N, AutoCosts(**base, act_w=(1.5,) * D))


def _table9_rows():
    with resources.files("cost_models").joinpath("presets/measurements/zero-bubble/zero-bubble.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("row", _table9_rows(), ids=lambda r: f"{r['model']}-m{r['microbatches']}")
def test_table5_bubbles_of_zb1p_and_zb2p(row):
    """The paper's scheduler on its Table 9 stage times (posted messages, activation 34sbh + 5as^2b of
    which W keeps 32sbh, limits D and 2D micro-batches): Table 5's ZB-1p (= ZB-H1's) and ZB-2p bubble,
    (cost - N (F + B + W)) / cost with cost the longest device span, to 1e-3."""
    D, N = int(row["pipeline_stages"]), int(row["microbatches"])
    f, b, w, msg = (float(row[f"T_{k}_ms"]) for k in ("F", "B", "W", "comm"))
    s, h, a = 1024, int(row["hidden"]), int(row["heads"])
    kept = 32 * s * h / (34 * s * h + 5 * a * s * s)
    for k, col in ((1, "bubble_zbh1"), (2, "bubble_zb2p")):
        c = AutoCosts((f,) * D, (b,) * D, (w,) * D, msg, (1.0,) * D, (k * D,) * D, (kept,) * D)
        span = timing(auto_orders(D, N, c), c)[0]
        assert 1 - N * (f + b + w) / span == pytest.approx(float(row[col]), abs=1e-3), (k, col)


def test_d32_n256_within_the_refinement_budget():
    """The refinement stops at REFINE_OPS timed ops: at D = 32, N = 256 (24,576 ops a timing) it may
    time at most 16 orders."""
    D, N = 32, 256
    c = AutoCosts((1.0,) * D, (1.0,) * D, (1.0,) * D, 0.05, (1.0,) * D, (2.0 * D,) * D, (0.4,) * D)
    calls = []
    import schedules.zb_auto as za
    real = za.timing
    start = za.candidates(D, N, c)[0][1]
    try:
        za.timing = lambda o, cc: calls.append(1) or real(o, cc)
        orders = za.refine(start, c)[0]
    finally:
        za.timing = real
    assert len(calls) <= 1 + za.REFINE_OPS // (3 * N * D)
    assert timing(orders, c) is not None


def test_valid_under_uneven_costs_limits_and_w_shares():
    """Seeded random stage costs, message times, limits of 1 to 2.5D micro-batches and W shares of
    0 to all: every order is valid (lowered and validated) and within each device's limit."""
    import random

    from schedules.ir import make_schedule
    rng = random.Random(7)
    for _ in range(60):
        D, N = rng.randint(1, 12), rng.randint(1, 48)
        draw = lambda n: tuple(rng.uniform(0.2, 3) for _ in range(n))  # noqa: E731
        act = draw(D)
        c = AutoCosts(draw(D), draw(D), draw(D), rng.choice([0.0, 0.1, 1.0]), act,
                      tuple(a * rng.uniform(1, 2.5 * D) for a in act),
                      tuple(a * rng.choice([0.0, 0.3, 1.0, rng.random()]) for a in act))
        orders = auto_orders(D, N, c)
        assert timing(orders, c) is not None, (D, N)        # None: deadlock or a broken limit
        for cost, cand in candidates(D, N, c):              # the heuristic's own times are timing's
            assert timing(cand, c) == pytest.approx(cost), (D, N)
        s = make_schedule("zb-auto", D, N, [list(range(D))],
                          [[(k, m, 0, d) for k, m in orders[d]] for d in range(D)], split_backward=True)
        validate(lower(s))


def _brute(D, N, c, upper):
    """The cheapest per-device orders of cost below ``upper`` (None if there is none): every order of
    each device's N F's, B's and W's (each kind in micro-batch order, F_i before B_i before W_i, an F
    only where the limit keeps it), enumerated as a tree of next-op choices timed exactly as
    :func:`timing` times them, a branch cut where a device's span so far plus its remaining work
    reaches ``upper`` or the best found."""
    kept, dur = c.kept(), {"F": c.f, "B": c.b, "W": c.w}
    total = [N * (c.f[d] + c.b[d] + c.w[d]) for d in range(D)]
    end = {k: [[None] * N for _ in range(D)] for k in "FB"}
    cnt = [{"F": 0, "B": 0, "W": 0} for _ in range(D)]
    free, first, done, mem = [0.0] * D, [None] * D, [0.0] * D, [0.0] * D
    pend, orders, best = [None] * D, [[] for _ in range(D)], [upper, None]

    def ready(d, k, i):
        if k == "F" and d == 0:
            return 0.0
        if k == "W" or (k == "B" and d == D - 1):
            return end["F" if k == "B" else "B"][d][i]
        e = end["F"][d - 1][i] if k == "F" else end["B"][d + 1][i]
        return None if e is None else e + c.message

    def rec():
        for d in range(D):          # a device that finished its op picks its next
            n = cnt[d]
            if pend[d] is None and n["W"] < N:
                opts = ["W"] * (n["W"] < n["B"]) + ["B"] * (n["B"] < n["F"]) + \
                       ["F"] * (n["F"] < N and mem[d] + c.act[d] <= c.limit[d] + 1e-9)
                for k in opts:
                    pend[d] = k
                    rec()
                pend[d] = None
                return
        runs = [(d, k, cnt[d][k], r) for d, k in enumerate(pend) if k is not None
                and (r := ready(d, k, cnt[d][k])) is not None]
        if not runs:                # all done (a deadlock, else)
            if all(k is None for k in pend) and (cost := max(free[d] - first[d] for d in range(D))) < best[0] - 1e-9:
                best[:] = [cost, [list(o) for o in orders]]
            return
        saved = [(d, free[d], first[d], mem[d]) for d, *_ in runs]
        for d, k, i, r in runs:
            start = max(free[d], r)
            first[d] = start if first[d] is None else first[d]
            free[d] = start + dur[k][d]
            done[d] += dur[k][d]
            cnt[d][k] += 1
            if k != "W":
                end[k][d][i] = free[d]
            mem[d] += c.act[d] if k == "F" else -(c.act[d] - kept[d]) if k == "B" else -kept[d]
            orders[d].append((k, i))
            pend[d] = None
        if all(first[d] is None or free[d] + total[d] - done[d] - first[d] < best[0] - 1e-9 for d in range(D)):
            rec()
        for (d, k, i, _), (_, fr, fi, me) in zip(reversed(runs), reversed(saved)):
            cnt[d][k] -= 1
            done[d] -= dur[k][d]
            if k != "W":
                end[k][d][i] = None
            orders[d].pop()
            free[d], first[d], mem[d], pend[d] = fr, fi, me, k

    rec()
    return None if best[1] is None else (best[0], best[1])


def _pool_cases():
    """Two pools, the slow one's stages twice the fast one's (first or last), W = B = F or W = F/2,
    posted messages of 0 or 0.1, limits 1p and 2p, W keeping half the activation."""
    for D in (2, 3):
        for N in (2, 3, 4):
            for k in range(1, D):
                for slow_first in (True, False):
                    s = tuple(2.0 if (d < k) == slow_first else 1.0 for d in range(D))
                    for share in (1.0, 0.5):
                        if D == 3 and N == 4 and share == 0.5:
                            continue        # minutes of brute force each
                        for msg in (0.0, 0.1):
                            for lim in (D, 2 * D):
                                yield D, N, AutoCosts(s, s, tuple(x * share for x in s), msg, (1.0,) * D,
                                                      (float(lim),) * D, (0.5,) * D)


def test_brute_force_agrees_on_two_pools():
    """zb-auto's cost against an exhaustive search (:func:`_brute`) on 128 two-pool cases: no order is
    cheaper in 127; in one (D = 3, N = 4, stages 2, 2, 1, F = B = W, message 0.1, limit 3 Ma) the best
    order costs 26.4 and zb-auto's 26.6, two message times (0.76 %) more. (Before the fourth knob and
    the wider refinement it was exact in 124, 26 where 24 is best at stages 1, 2, 2.) The cost is never
    below the slowest device's work, max_d N (F + B + W)_d (its span holds all of it)."""
    exact = 0
    for D, N, c in _pool_cases():
        cost = timing(auto_orders(D, N, c), c)[0]
        assert cost >= max(N * (c.f[d] + c.b[d] + c.w[d]) for d in range(D)) - 1e-9
        better = _brute(D, N, c, cost - 1e-9)
        if better is None:
            exact += 1
            continue
        assert (D, N, c.f, c.w, c.message, c.limit[0]) == (3, 4, (2.0, 2.0, 1.0), (2.0, 2.0, 1.0), 0.1, 3.0)
        assert better[0] == pytest.approx(26.4) and cost == pytest.approx(26.6) == better[0] + 2 * c.message
        assert timing(better[1], c)[0] == pytest.approx(26.4)
    assert exact == 127
