"""Issue 47, items 2 and 6: sizes checked before work (the global batch in sequences or tokens),
progress on a terminal, and messages: lists shown short, one JSON reader that names the field of a
NaN and survives any nesting, symbolic link loops and broken links named as such, files of the
wrong kind named for what they are, a memory reserve that leaves nothing refused.
(The command-line refusals themselves are rows of tests/test_cli_errors.py's error table.)"""
import io
import json
import sys

import pytest

from cost_models import load_profile
from cost_models.files import (FileError, MissingFileError, check_input, check_kind, file_kind, parse_json,
                               read_text, short_list)
from cost_models.memory import check_reserve, default_reserve, memory_verdict, usable_memory
from experiments.checks import token_count
from experiments.cli import main
from planner.choose import MAX_TOKENS_PER_STEP, batch_in_sequences
from tests.test_cost_models_specs import PROFILE

GiB = 2 ** 30


# ----------------------------------------------------------------------------- short lists

def test_short_list_shows_ends_and_count_of_a_long_list():
    assert short_list(range(4000)) == "[0, 1, 2, 3, 4, 5, ..., 3998, 3999] (4,000 entries)"
    assert short_list([1] * 4000) == "[1, 1, 1, 1, 1, 1, ..., 1, 1] (4,000 entries)"
    assert short_list([1, 2, 3]) == "[1, 2, 3]"
    assert short_list(list(range(9))) == "[0, 1, 2, 3, 4, 5, 6, 7, 8]"         # head + tail + 1: whole
    assert short_list(list(range(10))) == "[0, 1, 2, 3, 4, 5, ..., 8, 9] (10 entries)"
    assert short_list((2, 1, 2), sep=":", bare=True) == "2:1:2"
    assert short_list([2] * 100, sep=":", bare=True) == "2:2:2:2:2:2:...:2:2 (100 entries)"
    assert short_list("x" * 200) == repr("x" * 200)[:77] + "..."              # not a list: its repr, cut
    assert short_list(7) == "7"


def test_a_4000_entry_partition_is_one_short_line():
    from cost_models.partition import check_counts
    with pytest.raises(ValueError) as e:
        check_counts([1] * 4000, 4000, 4)
    assert str(e.value) == ("the partition [1, 1, 1, 1, 1, 1, ..., 1, 1] (4,000 entries) has 4000 stage(s); the "
                            "schedule has 4 stages per model copy")


def test_an_echoed_value_of_thousands_of_characters_is_cut():
    from experiments.tables import one_line_message
    value = ",".join(["0"] * 3000)
    assert one_line_message(f"argument --device-map: invalid choice: '{value}' (choose from 'megatron')") == \
        f"argument --device-map: invalid choice: '{value[:60]}...' (5,999 characters) (choose from 'megatron')"
    short = "x" * 80
    assert one_line_message(f"got '{short}'\n  and more") == f"got '{short}' and more"


def test_unknown_field_among_many_names_the_nearest():
    from cost_models._spec import known_fields
    assert known_fields("x", ("a", "b")) == "known: a, b"
    many = [f"field_{i:02d}" for i in range(30)]
    # equal scores: difflib's order, the last name first
    assert known_fields("field_7", many) == ("did you mean 'field_27' or 'field_17' or 'field_07'? known: field_00, "
                                             "field_01, field_02, field_03, field_04, field_05, field_06, field_07, "
                                             "... (30 entries)")


# ----------------------------------------------------------------------------- JSON

def test_parse_json_names_the_field_of_nan_and_infinity():
    with pytest.raises(FileError) as e:
        parse_json('{"a": {"b": [1, NaN]}, "c": 1}', "x.json")
    assert str(e.value) == "x.json: field 'a.b[1]' is NaN, not a number; give a finite number"
    with pytest.raises(FileError, match=r"^x.json: field 'rope_theta' is Infinity, not a number"):
        parse_json('{"rope_theta": Infinity}', "x.json")
    with pytest.raises(FileError, match=r"^x.json: field '\(top level\)' is -Infinity"):
        parse_json("-Infinity", "x.json")


def test_parse_json_refuses_a_key_given_twice_and_bad_syntax_in_one_line():
    with pytest.raises(FileError) as e:
        parse_json('{"n_head": 12, "n_head": 16}', "c.json")
    assert str(e.value) == "c.json: key 'n_head' is given twice; keep one"
    with pytest.raises(FileError) as e:
        parse_json("{ nope", "c.json")
    assert str(e.value) == ("c.json: not valid JSON (Expecting property name enclosed in double quotes at line 1 "
                            "column 3)")


def test_parse_json_of_any_depth_is_data_or_one_line():
    assert parse_json('{"a": [1, 2.5, {"b": null}]}', "ok.json") == {"a": [1, 2.5, {"b": None}]}
    assert parse_json("[" * 500 + "]" * 500, "ok.json") == json.loads("[" * 500 + "]" * 500)
    for depth in (5_000, 200_000):
        with pytest.raises(FileError) as e:
            parse_json("[" * depth + "]" * depth, "deep.json")
        assert str(e.value).startswith("deep.json: not a usable JSON file: nested deeper than Python's parser allows")
        assert "\n" not in str(e.value)


def test_yaml_nested_200000_deep_is_one_line(tmp_path):
    from cost_models import SpecError, load_model
    p = tmp_path / "deep.yaml"
    p.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(SpecError) as e:
        load_model(str(p))
    assert str(e.value) == (f"{p}: not a usable YAML file: nested deeper than the YAML reader allows (about 1,000 "
                            f"levels)")


# ----------------------------------------------------------------------------- links

def test_symlink_loop_and_broken_link_are_named(tmp_path):
    a, b, broken = tmp_path / "a.yaml", tmp_path / "b.yaml", tmp_path / "broken.yaml"
    a.symlink_to(b)
    b.symlink_to(a)
    broken.symlink_to(tmp_path / "gone.yaml")
    for read in (lambda p: read_text(p, "model file"), lambda p: check_input(p, "model file")):
        with pytest.raises(MissingFileError) as e:
            read(a)
        assert str(e.value) == (f"model file {a} is a symbolic link loop (the links lead back to themselves); "
                                f"give the file itself")
        with pytest.raises(MissingFileError) as e:
            read(broken)
        assert str(e.value) == (f"model file {broken} is a broken link (to {tmp_path / 'gone.yaml'}, which does not "
                                f"exist)")
    with pytest.raises(MissingFileError) as e:
        read_text(tmp_path / "none.yaml", "model file")
    assert str(e.value) == f"model file {tmp_path / 'none.yaml'} does not exist"


# ----------------------------------------------------------------------------- kinds of files

def _plan_record(tmp_path) -> dict:
    out = tmp_path / "plan.json"
    assert main(["plan", "-m", "tiny", "-c", "v100-2x8-25gbe", "-G", "16", "--no-progress", "--no-baselines",
                 "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_file_kind_tells_each_kind_by_its_keys(tmp_path):
    import yaml
    from cost_models._spec import preset_dir
    hf = json.loads(open("tests/data/hf/Meta-Llama-3-8B/config.json").read())
    stage_costs = {"stages": [{"f": 1, "b": 1, "w": 1}], "message": 0}
    kinds = {"plan": _plan_record(tmp_path), "profile": yaml.safe_load(PROFILE), "stage-costs": stage_costs,
             "cluster": yaml.safe_load((preset_dir("clusters") / "dgx-h100-ib.yaml").read_text()),
             "model": yaml.safe_load((preset_dir("models") / "llama3-8b.yaml").read_text()), "hf-config": hf}
    assert {k: file_kind(d) for k, d in kinds.items()} == {k: k for k in kinds}
    assert file_kind(yaml.safe_load("0: F0.s0 B0.s0\n1: F0.s1 B0.s1\n")) == "schedule"   # the text form
    assert file_kind([1, 2]) is None and file_kind({"x": 1}) is None and file_kind(None) is None
    check_kind(hf, "c.json", "model")                  # a HF config where a model is wanted: the same option
    check_kind({"x": 1}, "x.yaml", "plan")            # unknown: left to the loader's own message
    with pytest.raises(FileError) as e:
        check_kind(kinds["plan"], "p.json", "stage-costs")
    assert str(e.value) == "p.json is a pipetwin plan file (pipetwin plan --out), not a stage-costs file; give it " \
                           "as --plan p.json"


def test_loaders_name_a_file_of_another_kind(tmp_path):
    from cost_models import SpecError, load_model
    from cost_models.stage_costs import load_stage_costs
    from planner.plan_io import load_plan
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps(_plan_record(tmp_path)))
    prof = tmp_path / "prof.yaml"
    prof.write_text(PROFILE)
    for load, path, message in (
            (load_model, plan, f"{plan} is a pipetwin plan file (pipetwin plan --out), not a Hugging Face config; "
                               f"give it as --plan {plan}"),
            (load_stage_costs, plan, f"{plan} is a pipetwin plan file (pipetwin plan --out), not a stage-costs file; "
                                     f"give it as --plan {plan}"),
            (load_profile, plan, f"{plan} is a pipetwin plan file (pipetwin plan --out), not a calibration profile "
                                 f"(pipetwin calibrate); give it as --plan {plan}"),
            (load_plan, prof, f"{prof} is a calibration profile (pipetwin calibrate), not a pipetwin plan file "
                              f"(pipetwin plan --out); give it as --profile {prof}"),
            (load_model, prof, f"{prof} is a calibration profile (pipetwin calibrate), not a model spec; give it as "
                               f"--profile {prof}")):
        with pytest.raises((SpecError, FileError)) as e:
            load(str(path))
        assert str(e.value) == message


# ----------------------------------------------------------------------------- memory reserve

def test_a_reserve_at_or_above_the_device_is_refused():
    cap = 80 * GiB
    check_reserve(79 * GiB, cap, "a100")
    assert usable_memory(cap, 79 * GiB) == GiB
    assert usable_memory(cap) == cap - default_reserve(cap) == cap - GiB - 4 * GiB
    for reserve in (80 * GiB, 100 * GiB):
        with pytest.raises(ValueError) as e:
            check_reserve(reserve, cap, "a100")
        shown = "80 GiB" if reserve == cap else "100 GiB"
        assert str(e.value) == (f"--memory-reserve {shown} is not below the a100's 80 GiB of memory: nothing would "
                                f"be usable; give less (default 5 GiB)")
    with pytest.raises(ValueError, match="--memory-reserve 100 GiB is not below the device's 80 GiB"):
        memory_verdict(GiB, GiB, cap, reserve=100 * GiB)


# ----------------------------------------------------------------------------- global batch: sequences or tokens

def test_global_tokens_are_whole_sequences():
    assert batch_in_sequences(None, 4 << 20, 8192) == 512               # Llama 3's 4M at 8K
    assert batch_in_sequences(None, 16 << 20, 8192) == 2048             # Llama 3 405B's 16M
    assert batch_in_sequences(None, 1 << 30, 8192) == 131072            # given in tokens: any size is taken
    with pytest.raises(ValueError) as e:
        batch_in_sequences(None, 4_000_000, 8192)
    assert str(e.value) == ("--global-tokens 4,000,000 is not a whole number of 8,192-token sequences; the nearest "
                            "is 3,997,696 tokens (-G 488)")
    with pytest.raises(ValueError, match=r"the nearest is 8,192 tokens \(-G 1\)"):
        batch_in_sequences(None, 100, 8192)


def test_a_batch_of_more_tokens_than_any_published_run_is_questioned():
    assert MAX_TOKENS_PER_STEP == 67_108_864
    assert batch_in_sequences(15360, None, 4096) == 15360        # DeepSeek-V3: 62,914,560 tokens
    assert batch_in_sequences(16384, None, 4096) == 16384        # exactly 64M
    with pytest.raises(ValueError) as e:
        batch_in_sequences(16385, None, 4096)
    assert str(e.value) == ("-G 16,385 sequences of 4,096 tokens is 67,112,960 tokens per step, more than any "
                            "published run (Llama 3 405B 16M, DeepSeek-V3 63M): -G counts sequences; to give tokens, "
                            "use --global-tokens 16385")
    with pytest.raises(ValueError, match=r"use --global-tokens 4M \(= -G 512\)$"):
        batch_in_sequences(4 << 20, None, 8192)
    assert batch_in_sequences(1 << 20, None, None) == 1 << 20    # no sequence length (a layer profile): no tokens


def test_token_count_reads_binary_suffixes():
    import argparse
    assert [token_count(t) for t in ("4194304", "4M", "4Mi", "64k", "64K", "1.5M", "1G", " 2 M ")] == \
        [4194304, 4194304, 4194304, 65536, 65536, 1572864, 1 << 30, 2 << 20]
    for bad in ("0", "1.5", "4.5x", "nan", "-4M", "", "M"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a token count >= 1"):
            token_count(bad)


def test_plan_in_tokens_equals_plan_in_sequences(capsys):
    """--global-tokens 1k of the tiny GPT (32-token sequences) is -G 32: the same plan."""
    base = ["plan", "-m", "tiny", "-c", "dgx-h100-ib:1", "--top", "2", "--json", "--no-progress"]
    got = []
    for batch in (["-G", "32"], ["--global-tokens", "1k"]):
        assert main(base + batch) == 0
        rec = json.loads(capsys.readouterr().out)
        rec["search"].pop("seconds")
        got.append(rec)
    assert got[0] == got[1] and got[1]["global_batch"] == 32


# ----------------------------------------------------------------------------- progress

class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_counter_draws_on_a_terminal_only(monkeypatch):
    from experiments.progress import counter
    for tty, show, drawn in ((True, True, True), (True, False, False), (False, True, False)):
        err = _Tty() if tty else io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        tick = counter("layouts judged", show=show)
        for i in range(1, 11):
            tick(i, 10)
        tick.close()
        text = err.getvalue()
        assert ("layouts judged" in text and "0/10 [" in text) == drawn, (tty, show, text)   # the bar, its total
        assert drawn or text == ""


def test_counter_clock_runs_while_one_item_takes_long(monkeypatch):
    """No tick for 2.5 s (one candidate simulated for seconds): the bar is still redrawn each second."""
    import time
    from experiments.progress import counter
    err = _Tty()
    monkeypatch.setattr(sys, "stderr", err)
    tick = counter("layouts judged")
    tick(1, 10)
    drawn = err.getvalue().count("\r")
    time.sleep(2.5)
    redrawn = err.getvalue().count("\r") - drawn
    tick.close()
    assert redrawn >= 2 and "[00:02<" in err.getvalue(), err.getvalue()
