"""experiments.bench_executor's fairness rules: the order of the variants in a round and the
quiet-round ratio (the timing itself is a benchmark, not a test)."""
import pytest

from experiments.bench_executor import PAIRS, op_rows, round_order, summarize, tp_pair_names, usage_rows


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


def test_usage_rows_medians_and_paired_differences():
    """Per variant the median per step; the paired rows are the round-by-round differences (not
    the difference of the medians): here torch - pipetwin = 1, 2, 3, 10 ms of CPU."""
    a = [{"cpu_ms": x, "minflt": 0} for x in (10.0, 20.0, 30.0, 40.0)]
    b = [{"cpu_ms": x, "minflt": f} for x, f in ((11.0, 4), (22.0, 0), (33.0, 8), (50.0, 4))]
    rows = usage_rows({"pipetwin dapple": a, "torch Schedule1F1B": b})
    paired = [f"{q} of paired torch - pipetwin" for q in ("median", "q1", "q3")]
    assert [r["variant"] for r in rows] == ["pipetwin dapple", "torch Schedule1F1B", *paired]
    assert rows[0]["cpu_ms"] == 25.0 and rows[1]["cpu_ms"] == 27.5
    assert rows[2]["cpu_ms"] == 2.5 and rows[2]["minflt"] == 4           # median of 1, 2, 3, 10; of 4, 0, 8, 4
    assert rows[3]["cpu_ms"] == pytest.approx(1.75) and rows[4]["cpu_ms"] == pytest.approx(4.75)


def test_op_rows_per_step_largest_first_and_ops_one_side_lacks():
    ours = {"aten::mm": (512, 9000.0), "aten::fill_": (100, 600.0)}
    theirs = {"aten::mm": (512, 8000.0), "aten::div_": (100, 800.0), "aten::t": (10, 1.0)}
    rows = op_rows(ours, theirs, steps=2, top=3)
    assert [r["op"] for r in rows] == ["aten::mm", "aten::div_", "aten::fill_"]
    assert rows[0] == {"op": "aten::mm", "pipetwin_ms": 4.5, "torch_ms": 4.0, "pipetwin_calls": 256, "torch_calls": 256}
    assert (rows[1]["pipetwin_ms"], rows[1]["torch_calls"]) == (0.0, 50)


def test_summarize_the_tp_pair_per_round():
    """The TP pair has no metering variant: its ratio is torch's time over pipetwin's per round."""
    na, nb = tp_pair_names()
    times = {na: [1.0, 2.0, 1.0], nb: [2.0, 2.0, 1.5]}
    foreign = {na: [0.0, 0.5, 0.0], nb: [0.1, 0.0, 0.0]}
    cpu = {na: [2.0, 2.0, 2.0], nb: [3.0, 4.0, 2.0]}
    row, = summarize(times, 10, [], foreign, max_foreign=0.15, cpu=cpu, tp=True)
    assert row["pair"] == "tp vs parallelize_module"
    assert (row["ratio"], row["ratio_min"], row["ratio_max"]) == (1.5, 1.0, 2.0)     # ratios 2, 1, 1.5
    assert row["ratio_nomem"] is None and row["metering_cost"] is None
    assert row["quiet_rounds"] == 2 and row["ratio_quiet"] == pytest.approx(1.75)     # round 1: pipetwin busy
    assert row["cpu_ratio"] == 1.5 and row["pipetwin_seq_per_s"] == 10.0


@pytest.mark.slow
def test_tp_pair_trains_the_same_blocks_on_both_sides():
    """pipetwin's TP blocks and torch's parallelize_module blocks (QKV rows in per-head order) give
    the same losses step after step (SGD at a large rate: the updates must agree too)."""
    from executor.config import RunConfig
    from executor.launch import launch
    cfg = RunConfig.of(schedule="dapple", devices=2, microbatches=2, model="tiny", steps=3, optimizer="sgd", lr=0.5,
                    device="cpu", timeout=120.0)
    out = launch("experiments.bench_executor:tp_check_rank", {"config": cfg, "steps": 3}, 2)
    ours, theirs = (out[n] for n in tp_pair_names())
    assert ours == pytest.approx(theirs, rel=1e-5, abs=0)
    assert len(set(ours)) == 3
