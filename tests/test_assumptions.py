"""Issue 47, items 1 and 7: every assumption that changes a number is stated or refused (the
sequence, precision, cost model and where the device's constants were fitted, in the summary and
the JSON of simulate, compare, sweep and plan; a Hugging Face config's approximations; a device
without the field its cost model reads; a cluster file's leaf fields on a flat fabric), one
replica in a data-parallel timeline, the README's stage-costs file, reproductions written whole."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from cost_models import load_cluster, load_device
from cost_models.cluster import with_fabric
from cost_models.hf_config import config_notes
from experiments.cli import main

DATA = Path(__file__).parent / "data"
MINE = DATA / "assumptions"
HF = DATA / "hf"
ROOT = Path(__file__).resolve().parent.parent
TABLE9 = ROOT / "cost_models/presets/measurements/zero-bubble/table9-1.5b.yaml"

V100_FIT = "kernel constants: the V100 fit (Chimera's layers) with the {}'s SM count, not measured on an {}; " \
           "efficiency: not fitted"
FITTED = {
    "h100": "efficiency and kernels.gemm_efficiency fitted on Llama 3 Table 4's 8,192-GPU run only (bf16; fp8 at the "
            "fp8 peak with the same efficiencies); other kernel constants the V100 fit",
    "h200": "the h100 fit (efficiency and kernels.gemm_efficiency on Llama 3 Table 4's 8,192-GPU H100 run) with the "
            "H200's datasheet memory and bandwidth; not measured on an H200",
    "h800": V100_FIT.format("H800", "H800"),
    "a100": "kernel constants: GEMM and memory efficiencies fitted on Zero Bubble Table 9, the rest the V100 fit; "
            "efficiency: not fitted",
    "v100": "kernel constants: fitted on Chimera's V100 layer profiles (bert-large, opt-350m, t5-large); efficiency: "
            "typical Megatron-LM utilisation, not fitted",
}
SEQ_NOTE = ("sequence {:,} tokens from the config's {} (the longest it takes, not its training length): give "
            "--seq-len S")
FP32_NOTE = ("fp32 from the config's torch_dtype float32 (fp32 GEMMs, 4-byte weights and activations); for bf16 "
             "mixed precision set torch_dtype to bfloat16 (--precision bf16 changes the GEMMs only)")
WINDOW_NOTE = ("sliding_window 4,096: attention priced as full attention over the {:,}-token sequence, an upper "
               "bound (a token attends to at most 4,096)")
SIM = ["simulate", "-s", "dapple", "-D", "2", "-N", "2"]


def run(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def as_json(capsys, *argv) -> dict:
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


# ---------------------------------------------------------------------- devices
@pytest.mark.parametrize("name", sorted(FITTED))
def test_each_preset_says_where_its_constants_were_fitted(name):
    d = load_device(name)
    assert d.fitted == FITTED[name] and d.provenance() == f"{name}: {FITTED[name]}"


def test_presets_list_the_provenance(capsys):
    rc, out, _ = run(capsys, "presets", "devices")
    text = " ".join(out.split())        # the lines wrap at 120 columns
    assert rc == 0
    for name, fitted in FITTED.items():
        assert f"{name} " in text and f"; {fitted}" in text
    rc, out, _ = run(capsys, "presets", "devices", "--json")
    assert {d["name"]: d.get("fitted") for d in json.loads(out)["devices"]}["h200"] == FITTED["h200"]


def test_a_device_without_efficiency_is_refused_by_the_linear_model_naming_the_field(capsys):
    rc, _, err = run(capsys, *SIM, "-m", "gpt3-1.3b", "-c", str(MINE / "no-efficiency.yaml"))
    assert rc == 2 and err == ("pipetwin: error: device 'noeff' has no field 'efficiency' (the fraction of its peak a "
                               "layer reaches), which the linear cost model needs; add e.g. 'efficiency: 0.4' to its "
                               "YAML\n")
    rc, _, err = run(capsys, *SIM, "-m", "gpt3-1.3b", "-c", str(MINE / "kernels-no-efficiency.yaml"),
                     "--cost-model", "linear")
    assert rc == 2 and err.endswith("add e.g. 'efficiency: 0.4' to its YAML, or use --cost-model kernels\n")


def test_the_kernel_model_needs_no_efficiency_and_says_the_file_states_no_fit(capsys):
    """The h100's constants without 'efficiency': the kernel model prices it exactly as the h100 preset."""
    mine = as_json(capsys, *SIM, "-m", "gpt3-1.3b", "-c", str(MINE / "kernels-no-efficiency.yaml"))
    h100 = as_json(capsys, *SIM, "-m", "gpt3-1.3b", "-c", "dgx-h100-ib")
    assert mine["iteration_time"] == h100["iteration_time"] and mine["cost_model"] == "kernels"
    assert mine["device_fitted"] == "h100k: its file does not say where its constants come from (field fitted)"


# ---------------------------------------------------------------------- the summary and --json
def test_simulate_states_sequence_precision_cost_model_and_the_fit(capsys):
    rc, out, _ = run(capsys, *SIM, "-m", "gpt3-1.3b", "-c", "dgx-h100-ib")
    lines = out.splitlines()
    assert rc == 0 and lines[0].startswith("dapple: D=2 N=2 R=1  iteration ")
    assert lines[1] == "  assumed: sequence 2,048 tokens, precision bf16, cost model kernels"
    assert " ".join(" ".join(lines[2:4]).split()) == f"device h100: {FITTED['h100']}"
    assert not any(ln.startswith(("  cost_model:", "  seq_len:", "  precision:")) for ln in lines)
    rec = as_json(capsys, *SIM, "-m", "gpt3-1.3b", "-c", "dgx-h100-ib", "--precision", "fp8", "--seq-len", "1024",
                  "--cost-model", "linear")
    assert (rec["seq_len"], rec["precision"], rec["cost_model"], rec["device_fitted"], rec["assumptions"]) == \
        (1024, "fp8 (delayed scaling)", "linear", f"h100: {FITTED['h100']}", [])


def test_a_config_planned_at_max_position_embeddings_in_fp32_says_so(capsys):
    cfg = str(HF / "tiny-llama" / "config.json")
    rec = as_json(capsys, *SIM, "-m", cfg, "-c", "dgx-h100-ib")
    assert (rec["seq_len"], rec["precision"]) == (16, "fp32")
    assert rec["assumptions"] == [SEQ_NOTE.format(16, "max_position_embeddings"), FP32_NOTE]
    rc, out, _ = run(capsys, *SIM, "-m", cfg, "-c", "dgx-h100-ib")
    text = " ".join(out.split())
    assert "assumed: sequence 16 tokens, precision fp32, cost model kernels" in text
    assert f"note: {SEQ_NOTE.format(16, 'max_position_embeddings')}" in text and f"note: {FP32_NOTE}" in text
    # given, nothing is left to state
    given = as_json(capsys, *SIM, "-m", cfg, "-c", "dgx-h100-ib", "--seq-len", "16", "--precision", "bf16")
    assert (given["seq_len"], given["precision"], given["assumptions"]) == (16, "bf16", [])


def test_mistral_sliding_window_is_one_stated_line_only_where_it_approximates(capsys):
    cfg = str(HF / "Mistral-7B-v0.1" / "config.json")
    assert config_notes(cfg) == (SEQ_NOTE.format(32768, "max_position_embeddings"), WINDOW_NOTE.format(32768))
    assert config_notes(cfg, seq_len=8192) == (WINDOW_NOTE.format(8192),)
    assert config_notes(cfg, seq_len=4096) == ()                # within the window: exact
    assert config_notes(str(HF / "Qwen2-7B" / "config.json"), seq_len=65536) == ()   # use_sliding_window false
    assert config_notes(str(HF / "gpt2" / "config.json")) == (SEQ_NOTE.format(1024, "n_positions"),)
    rec = as_json(capsys, "compare", "-D", "2", "-N", "2", "--schedules", "dapple,zb-h1", "-m", cfg, "-c",
                  "dgx-h100-ib", "--seq-len", "8192")
    assert [r["assumptions"] for r in rec["schedules"]] == [[WINDOW_NOTE.format(8192)]] * 2


def test_compare_states_them_under_its_first_line(capsys):
    rc, out, _ = run(capsys, "compare", "-D", "2", "-N", "2", "--schedules", "dapple,zb-h1", "-m", "gpt3-1.3b", "-c",
                     "dgx-a100-1x8")
    lines = out.splitlines()
    assert rc == 0 and lines[0] == "D=2 N=2 R=1  (time in s, memory in GiB)"
    assert lines[1] == "  assumed: sequence 2,048 tokens, precision bf16, cost model kernels"
    assert " ".join(" ".join(lines[2:4]).split()) == f"device a100: {FITTED['a100']}"
    assert lines[4].split()[:3] == ["schedule", "iteration_time", "bubble_ratio"]


def test_sweep_states_them_and_records_them(tmp_path, capsys):
    out = tmp_path / "sw"
    rc, text, _ = run(capsys, "sweep", "-s", "dapple", "-D", "2", "-N", "2", "-m", "gpt3-1.3b", "-c",
                      "v100-2x8-25gbe", "--out", str(out), "--no-figures", "--no-progress", "--workers", "1")
    assert rc == 0
    assert text.splitlines()[1] == "  assumed: sequence 2,048 tokens, precision fp16, cost model kernels"
    said = {"seq_len": 2048, "precision": "fp16", "cost_model": "kernels", "device_fitted": f"v100: {FITTED['v100']}",
            "assumptions": []}
    assert json.loads((out / "sweep.json").read_text())["stated"] == said
    rec = json.loads((out / "sweep.jsonl").read_text().splitlines()[0])["record"]
    assert {k: rec[k] for k in said} == said


def test_plan_states_them(capsys):
    rec = as_json(capsys, "plan", "-m", str(HF / "tiny-llama" / "config.json"), "-c", "dgx-h100-ib", "-G", "8",
                  "--no-progress", "--top", "1")
    assert (rec["seq_len"], rec["precision"], rec["cost_model"], rec["device_fitted"]) == \
        (16, "fp32", "kernels", f"h100: {FITTED['h100']}")
    assert rec["assumptions"] == [SEQ_NOTE.format(16, "max_position_embeddings"), FP32_NOTE]
    rec = as_json(capsys, "plan", "-m", str(HF / "tiny-llama" / "config.json"), "-c", "dgx-h100-ib", "-G", "8",
                  "--no-progress", "--top", "1", "--seq-len", "8")
    assert (rec["seq_len"], rec["assumptions"]) == (8, [FP32_NOTE])
    dapple = as_json(capsys, "plan", "--search", "dapple", "-m", "gpt3-1.3b", "-c", "dgx-a100-1x8", "-G", "16",
                     "--no-progress", "--no-baselines")
    assert (dapple["seq_len"], dapple["precision"], dapple["cost_model"], dapple["device_fitted"]) == \
        (2048, "bf16", "kernels", f"a100: {FITTED['a100']}")


# ---------------------------------------------------------------------- clusters: one rule, two readers
def test_leaf_fields_on_a_flat_fabric_are_refused_in_the_file_as_on_the_command_line(tmp_path, capsys):
    rc, _, err = run(capsys, *SIM, "-m", "gpt3-1.3b", "-c", str(MINE / "flat-oversubscribed.yaml"))
    assert rc == 2 and err == (f"pipetwin: error: {MINE / 'flat-oversubscribed.yaml'}: field 'oversubscription' "
                               f"shapes the leaves of a fat-tree or rail fabric; the file's fabric is flat: add "
                               f"'fabric: fat-tree' (or rail), or remove it\n")
    rc, _, cli = run(capsys, *SIM, "-m", "gpt3-1.3b", "-c", "dgx-h100-4x8-ib", "--oversubscription", "4")
    assert rc == 2 and cli == ("pipetwin: error: --oversubscription shapes the leaves of a fat-tree or rail fabric; "
                               "cluster dgx-h100-4x8-ib is flat: add --fabric fat-tree (or rail)\n")
    with pytest.raises(ValueError, match="^--oversubscription and --nodes-per-leaf shape the leaves"):
        with_fabric(load_cluster("dgx-h100-4x8-ib"), oversubscription=2.0, nodes_per_leaf=1)
    ok = tmp_path / "fat-tree.yaml"      # the same field on a fat-tree: read, 4:1 as given
    ok.write_text((MINE / "flat-oversubscribed.yaml").read_text() + "fabric: fat-tree\n")
    c = load_cluster(str(ok))
    assert (c.fabric, c.oversubscription) == ("fat-tree", 4.0)


# ---------------------------------------------------------------------- item 7
def _trace(capsys, *extra):
    from cost_models.job import Job
    from sim import simulate_job
    job = Job.of(schedule="dapple", devices=4, microbatches=4, unit_costs=True, **dict(extra))
    return simulate_job(job, trace=True)[1].trace()


def test_a_data_parallel_timeline_draws_one_replica(capsys):
    from experiments.plots import plt, draw_timeline, shown_replica
    from cost_models.job import Faults
    t = _trace(capsys, ("replicas", 8))
    assert shown_replica(t) == ([0, 1, 2, 3], "replica 0 of 8 drawn (--all-replicas: all)")
    assert shown_replica(t, all_replicas=True) == (list(range(32)), "")
    fig, ax = plt.subplots()
    draw_timeline(ax, t)
    assert [x.get_text() for x in ax.get_yticklabels()] == ["dev 0", "dev 1", "dev 2", "dev 3"]
    assert ax.get_title() == "dapple: iteration 21 F, bubble 0.429"
    assert ax.get_title(loc="left") == "replica 0 of 8 drawn (--all-replicas: all)"
    plt.close(fig)
    # replica 1 slowed (its rank 6 at half speed): the replica that sets the iteration is drawn
    slow = _trace(capsys, ("replicas", 2), ("faults", Faults(slowdown=((6, 2.0),))))
    assert shown_replica(slow) == ([4, 5, 6, 7], "replica 1 of 2 drawn (--all-replicas: all)")
    assert shown_replica(_trace(capsys))[1] == ""       # one replica: nothing to say


def test_all_replicas_is_refused_without_a_plot_and_draws_every_rank_with_one(tmp_path, capsys):
    rc, _, err = run(capsys, "simulate", "-s", "dapple", "-D", "2", "-N", "2", "--dp", "2", "--unit-costs",
                     "--all-replicas")
    assert rc == 2 and err == ("pipetwin: error: --all-replicas chooses the rows of the --plot timeline; give --plot "
                               "FILE.png (or drop it)\n")
    png = tmp_path / "all.png"
    rc, out, _ = run(capsys, "simulate", "-s", "dapple", "-D", "2", "-N", "2", "--dp", "2", "--unit-costs",
                     "--all-replicas", "--plot", str(png))
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_readmes_stage_costs_file_gives_table_5s_bubbles(capsys):
    rec = as_json(capsys, "compare", "-D", "8", "-N", "24", "--schedules", "dapple,zb-h1,zb-h2", "--stage-costs",
                  str(TABLE9))
    assert [round(r["bubble_ratio"], 4) for r in rec["schedules"]] == [0.2431, 0.1585, 0.1083]


def test_a_reproduction_keeps_its_old_csv_when_a_write_fails(tmp_path, monkeypatch):
    """megatron.save (megatron, korthikanti, deepseek-v3): a CSV whose write fails half way leaves
    the previous file whole and no temporary file beside it."""
    from experiments.reproduce import megatron
    old = "a,b\n1,2\n"
    (tmp_path / "x.csv").write_text(old)

    def half(self, fh, **kw):
        fh.write("a,b\n3,")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(pd.DataFrame, "to_csv", half)
    with pytest.raises(Exception, match="No space left"):
        megatron.save(tmp_path, "x", pd.DataFrame({"a": [3], "b": [4]}), lambda df, path: None)
    assert (tmp_path / "x.csv").read_text() == old and sorted(p.name for p in tmp_path.iterdir()) == ["x.csv"]


def test_a_device_without_memory_or_bandwidth_says_what_that_prices(capsys):
    """Optional datasheet fields left out change numbers (no out-of-memory verdict, a free optimizer
    step): each is one stated line."""
    rec = as_json(capsys, *SIM, "-m", "gpt3-1.3b", "-c", str(MINE / "bare-device.yaml"))
    assert rec["assumptions"] == ["device 'bare' gives no 'memory': nothing is out of memory",
                                  "device 'bare' gives no 'memory_bandwidth': the optimizer step and local copies "
                                  "cost 0"]
    assert "out_of_memory" not in rec and rec["cost_model"] == "linear"
