"""experiments.bench_allreduce: its statistics, its refusals and one real (short) run on gloo; the
timings themselves are a benchmark, not a test."""
import re

import pytest

from experiments.bench_allreduce import CASES, main, summarize


def test_summary_is_the_median_and_quartiles_in_ms():
    s = summarize({"lone": [1e-3, 2e-3, 3e-3, 4e-3, 5e-3], "one": [2e-3]})
    assert s["lone"]["median"] == pytest.approx(3.0)
    assert s["lone"]["p25"] == pytest.approx(1.5) and s["lone"]["p75"] == pytest.approx(4.5)   # exclusive method
    assert s["one"] == {"p25": 2.0, "median": 2.0, "p75": 2.0}


@pytest.mark.parametrize("argv, says", [
    (["--bytes", "0"], "must be an integer >= 1; got '0'"),
    (["--bytes", "2"], "at least 4"),
    (["--compute-ms", "nan"], "must be a finite number > 0; got 'nan'"),
    (["--compute-ms", "-1"], "must be a finite number > 0; got '-1'"),
    (["--rounds", "x"], "must be an integer >= 1; got 'x'"),
    (["--ranks", "1"], "at least 2"),
])
def test_bad_input_exits_2_with_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.slow
def test_a_short_run_prints_every_case(capsys):
    assert main(["--rounds", "3", "--bytes", "4096", "--compute-ms", "0.5"]) == 0
    out = capsys.readouterr().out
    for case in CASES:
        m = re.search(re.escape(case) + r"\s+([0-9.]+)\s+\[([0-9.]+)-([0-9.]+)\]", out)
        assert m, case
        med, lo, hi = map(float, m.groups())
        assert 0 < lo <= med <= hi
    assert "the compute lost" in out
