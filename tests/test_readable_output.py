"""Output a person can read: identical replicas summarised, tables within 120 columns, names escaped."""
from __future__ import annotations

from experiments.cli import main
from experiments.tables import fmt_table, group_rows, printable


def test_simulate_1024_gpus_summarises_identical_replicas(capsys):
    assert main(["simulate", "-s", "dapple", "-D", "8", "-N", "16", "--dp", "128", "-m", "gpt-96",
                 "-c", "dgx-a100-ib:128"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = out.index(next(line for line in out if line.startswith("device ")))
    rows = out[head + 2:-1]
    assert len(rows) == 8 and max(map(len, out)) <= 120          # one row per stage, not 1,024
    assert rows[0].split()[:4] == ["0,", "8,", "..,", "1016"] and rows[0].split()[-1] == "128"
    assert rows[7].split()[:4] == ["7,", "15,", "..,", "1023"]
    assert sum(int(r.split()[-1]) for r in rows) == 1024


def test_small_tables_keep_every_row(capsys):
    assert main(["simulate", "-s", "dapple", "-D", "2", "-N", "4", "--dp", "2", "-m", "tiny", "-c",
                 "dgx-a100-1x8"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = out.index(next(line for line in out if line.startswith("device ")))
    assert [r.split()[0] for r in out[head + 2:-1]] == ["0", "1", "2", "3"] and "count" not in out[head]


def test_group_rows_lists_members():
    rows = [{"device": d, "x": d % 2} for d in range(40)]
    g = group_rows(rows, "device", ["device", "x"])
    assert [(r["device"], r["count"]) for r in g] == [("0, 2, .., 38", 20), ("1, 3, .., 39", 20)]
    odd = [{"device": d, "x": int(d in (0, 1, 5, 7))} for d in range(40)]
    assert group_rows(odd, "device", ["device", "x"])[0]["device"] == "0, 1, .. (4)"
    assert len(group_rows(rows[:32], "device", ["device", "x"])) == 32       # small tables unchanged


def test_fmt_table_wraps_text_columns_to_120():
    rows = [{"name": "word " * 50, "t": 1.5}, {"name": "x" * 300, "t": 2.0}]
    text = fmt_table(rows, ["name", "t"])
    lines = text.splitlines()
    assert max(map(len, lines)) == 120 and len(lines) == 2 + 3 + 3
    assert "".join(line[:115].strip() for line in lines[5:]) == "x" * 300       # nothing lost
    assert lines[2].endswith("1.5") and lines[5].endswith("2.0")


def test_printable_escapes_control_characters():
    assert printable("a\x1b[31mb\x07\u200b") == "a\\x1b[31mb\\x07\\u200b"
    assert printable("two\nlines") == "two lines" and printable("plain-name_1.yaml") == "plain-name_1.yaml"
    assert "\\x1b" in fmt_table([{"m": "gpt\x1b"}], ["m"])


def test_pareto_compares_time_per_sample_in_gib():
    from experiments.sweep import pareto_front, pareto_points
    # N=8 runs 2x the samples of N=4 in 1.5x the time: slower per iteration, faster per sample
    rows = [{"throughput": 4 / 1.0, "peak_memory": 2 * 2 ** 30}, {"throughput": 8 / 1.5, "peak_memory": 3 * 2 ** 30}]
    pts = pareto_points(rows)
    assert pts == [(0.25, 2.0), (0.1875, 3.0)]
    assert sorted(pareto_front(pts)) == [0, 1]
    assert pareto_points([{"throughput": 2.0, "peak_memory": 5.0}], unit_costs=True) == [(0.5, 5.0)]
