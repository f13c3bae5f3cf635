"""experiments.bench_executor's fairness rules: the order of the variants in a round and the
quiet-round ratio (the timing itself is a benchmark, not a test)."""
import pytest

from experiments.bench_executor import PAIRS, round_order, summarize


def _blocks(n):
    return [[f"p{i} ours", f"p{i} ours-nomem", f"p{i} torch"] for i in range(n)]


@pytest.mark.parametrize("n_pairs", [1, 2, 5])
def test_round_order_keeps_pairs_together_and_balances_who_goes_first(n_pairs):
    blocks = _blocks(n_pairs)
    rounds = 2 * n_pairs
    starts = {i: [] for i in range(n_pairs)}
    ours_first = {i: 0 for i in range(n_pairs)}
    for r in range(rounds):
        order = round_order(blocks, r)
        assert sorted(order) == sorted(x for b in blocks for x in b)     # every variant once per round
        for i, b in enumerate(blocks):
            pos = [order.index(x) for x in b]
            assert max(pos) - min(pos) == 2                              # a pair's three runs back to back
            assert pos[1] == min(pos) + 1                                # metering off sits between the two
            starts[i].append(min(pos) // 3)
            ours_first[i] += pos[0] < pos[2]
    for i in range(n_pairs):
        assert ours_first[i] == n_pairs                                  # pipetwin first in exactly half
        assert sorted(starts[i]) == sorted(list(range(n_pairs)) * 2)     # every slot of the round twice


def test_summarize_ratios_metering_and_quiet_rounds():
    ours, theirs = PAIRS[0][0], PAIRS[0][1]
    na, nc, nb = f"pipetwin {ours}", f"pipetwin {ours} (no memory metering)", f"torch {theirs}"
    times = {na: [1.0, 2.0, 1.0, 4.0], nc: [0.8, 2.0, 1.0, 2.0], nb: [1.2, 1.0, 1.1, 2.0]}
    foreign = {na: [0.0, 1.0, 0.1, 0.0], nc: [0.0] * 4, nb: [0.05, 0.0, 0.2, 0.0]}
    cpu = {na: [2.0, 2.0, 2.2, 2.0], nc: [2.0, 1.6, 2.0, 2.0], nb: [2.4, 3.0, 2.2, 2.6]}
    row, = summarize(times, 10, PAIRS[:1], foreign, max_foreign=0.15, cpu=cpu)
    assert row["ratio"] == pytest.approx((0.5 + 1.1) / 2)             # ratios 1.2, 0.5, 1.1, 0.5
    assert (row["ratio_min"], row["ratio_max"]) == (pytest.approx(0.5), pytest.approx(1.2))
    assert row["metering_cost"] == pytest.approx((0.0 + 0.25) / 2)    # 0.25, 0, 0, 1
    assert row["quiet_rounds"] == 2                                    # rounds 0 and 3 (1: ours busy, 2: torch)
    assert row["ratio_quiet"] == pytest.approx((1.2 + 0.5) / 2)
    assert row["foreign_cores"] == pytest.approx((0.05 + 0.2) / 2)    # per round the busier run: .05 1 .2 0
    assert row["pipetwin_seq_per_s"] == pytest.approx(10 / 1.5)
    assert row["spread_pipetwin"] == pytest.approx(3.0)
    assert row["cpu_ratio"] == pytest.approx((1.2 + 1.3) / 2)         # 1.2, 1.5, 1.0, 1.3
    assert row["metering_cpu"] == pytest.approx((0.0 + 0.1) / 2)      # 0, .25, .1, 0
