"""``pipetwin reproduce megatron`` and ``pipetwin reproduce korthikanti`` in quick mode, end to end.

Both are held out (nothing is fitted on the published numbers; the ``a100`` preset's two fitted
kernel constants come from Zero Bubble Table 9 alone), so the tolerances below are what the preset
reaches: Megatron's rows within 2.5% but the interleaved 76.1B one, 9.6% fast (aim 10%);
Korthikanti's layer within 12.5% and iteration times within 7% (aims 15% and 10%). Memory is the
ledger's closed forms and lands within 5%."""
from __future__ import annotations

import pandas as pd
import pytest

from cost_models.transformer import block_flops
from experiments.cli import main
from experiments.reproduce import korthikanti, megatron


@pytest.fixture(scope="module")
def megatron_csv(tmp_path_factory):
    out = tmp_path_factory.mktemp("rep")
    assert main(["reproduce", "megatron", "--quick", "--out", str(out)]) == 0
    return out / "megatron"


@pytest.fixture(scope="module")
def korthikanti_csv(tmp_path_factory):
    out = tmp_path_factory.mktemp("rep")
    assert main(["reproduce", "korthikanti", "--quick", "--out", str(out)]) == 0
    return out / "korthikanti"


def test_eq3_is_four_forward_passes_of_the_blocks_plus_the_logits():
    """Eq. (3) = (F + B + the re-run F) of every block, 4 x (24bsh^2 + 4bs^2h), and the logits'
    F + B, 6 bshV: the ledger's block FLOPs give the same count to 0.1%."""
    B, l, h, a, b = 512, 24, 2304, 24, 16
    spec = megatron.gpt("g", l, h, a, b)
    f, _, _ = block_flops(spec)
    want = B / b * 4 * l * f + 6 * B * 2048 * h * 51200
    assert megatron.model_flops(B, l, h) == pytest.approx(want, rel=1e-3)
    assert megatron.model_flops(B, l, h) == pytest.approx(96 * B * 2048 * l * h * h * (1 + 2048 / (6 * h))
                                                          + 6 * B * 2048 * h * 51200, rel=1e-12)


@pytest.mark.slow
def test_megatron_quick(megatron_csv):
    t = pd.read_csv(megatron_csv / "megatron.csv")
    assert list(t.columns) == megatron.COLUMNS
    assert (megatron_csv / "report.md").exists() and (megatron_csv / "megatron.png").exists()
    report = (megatron_csv / "report.md").read_text()
    # what was fitted on what: the a100 constants on Table 9 (its four models shown), every row held out
    assert "Fitted (in sample)" in report and "## The fit set (in sample): Zero Bubble Table 9" in report
    assert report.count("| held out |") == 5 and "| 28.3B | 2 | 1 |" in report
    assert list(t.gpus) == [32, 64, 128, 256, 1024] and list(t.tp) == [1, 2, 4, 8, 8]
    assert list(t.schedule) == ["dapple"] * 4 + ["interleaved"]
    assert list(t.measured_tflops_per_gpu) == [137, 138, 142, 135, 140]
    # Megatron-LM of 2021 at the scripts' settings: autograd adds each micro-batch's 16-bit gradients
    assert list(t.grad_accumulation) == ["autograd"] * 5
    # and its scatter-gather of the pipeline's messages over the TP group (the one pipelined row here)
    assert list(t.p2p_scatter_gather) == [False] * 4 + [True]
    # the a100 preset: 139, 140.5, 144, 138 TFLOP/s per GPU for 1F1B, 153.5 interleaved (measured 135-142)
    assert list(t.predicted_tflops_per_gpu) == pytest.approx([139.0, 140.5, 144.3, 138.4, 153.5], rel=0.005)
    assert t.error.iloc[:4].between(0.0, 0.03).all() and t.error.iloc[4] == pytest.approx(0.096, abs=0.003)
    assert list(t.error) == pytest.approx(list(t.predicted_tflops_per_gpu / t.measured_tflops_per_gpu - 1))
    # one replica stands for all 32 (replica symmetry)
    assert (t.simulated_replicas == 1).all()


@pytest.mark.slow
def test_korthikanti_quick(korthikanti_csv):
    t = pd.read_csv(korthikanti_csv / "korthikanti.csv")
    assert list(t.columns) == korthikanti.COLUMNS
    assert (korthikanti_csv / "report.md").exists() and (korthikanti_csv / "korthikanti.png").exists()
    by = {q: g for q, g in t.groupby("quantity")}
    mem = by["activation memory"]
    assert len(mem) == 4 and mem.error.abs().max() < 0.03          # reached: 0.4% - 2.4%
    assert by["params + optimizer"].error.abs().max() < 0.04       # 22B counts its embedding: 3.4%
    v = mem.set_index(["model", "setting"]).predicted
    assert v["175B", "tp only"] == pytest.approx(67.2, abs=0.1) and v["175B", "sp + selective"] == pytest.approx(
        12.40, abs=0.02)
    fwd, bwd = by["layer forward"], by["layer backward"]
    assert len(fwd) == len(bwd) == 5
    assert fwd.error.between(-0.05, 0.0).all()                     # forward 1-4.5% fast
    assert bwd.error.between(0.0, 0.13).all()                      # backward 1.3-12.5% slow
    b = bwd.set_index("setting").predicted
    assert b["full recompute"] - b["baseline no recompute"] == pytest.approx(
        fwd.set_index("setting").predicted["full recompute"], rel=0.02)   # full recompute re-runs F
    it = by["iteration time"]
    assert len(it) == 4 and it.error.abs().max() < 0.07            # 0.5-6.9%
    s = it.set_index(["model", "setting"]).predicted
    assert s["175B", "full recompute"] == pytest.approx(18.02, rel=0.01)
    assert s["22B", "sp + selective"] < s["22B", "full recompute"]


@pytest.mark.parametrize("target", ["megatron", "korthikanti"])
def test_bad_out_exits_2(tmp_path, capsys, target):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["reproduce", target, "--quick", "--out", str(f)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_simulate_reproduces_every_table1_row_within_10_percent(tmp_path):
    """Issue 44 item 4: every row of Megatron-LM's Table 1 is the job ``pipetwin simulate`` builds from
    options a user can give (its parser, then job_from_args), equal to the reproduction's own record
    (megatron_job) but for the model, which the options name by file; each within 10 % of the
    published TFLOP/s per GPU (held out: nothing fitted on it). Reached: 0.9-9.6 %, the 76.1B row last."""
    from cost_models import load_model
    from sim import simulate_job
    rows = megatron.table("megatron-sc21-table1.csv")
    errors = []
    for _, r in rows.iterrows():
        argv = megatron.simulate_argv(r, megatron.model_file(r, tmp_path))
        job = megatron.simulate_job_of(argv)
        spec = megatron.row_spec(r)
        assert load_model(job.model) == spec
        want = megatron.megatron_job(spec, tp=int(r.tp), pp=int(r.pp), dp=int(r.dp), microbatches=int(r.microbatches),
                                     chunks=int(r.virtual_stages), recompute="full", grad_accumulation="autograd",
                                     p2p_scatter_gather=int(r.tp) > 1 and int(r.pp) > 1, precision="fp16")
        assert job == type(job)(**{**vars(want), "model": job.model})
        _, res = simulate_job(job)
        tflops = megatron.model_flops(int(r.global_batch), int(r.layers), int(r.hidden)) / res.iteration_time \
            / int(r.gpus) / 1e12
        errors.append(tflops / float(r.tflops_per_gpu) - 1)
    assert max(abs(e) for e in errors) <= 0.10
    assert errors[5] == pytest.approx(0.096, abs=0.003)       # 76.1B, interleaved v = 3: the largest
    assert all(e > 0 for e in errors)                          # every row a little fast: see the module docstring


@pytest.mark.parametrize("D,v,N", [(4, 3, 28), (8, 2, 48), (16, 2, 144), (35, 3, 280), (4, 2, 8), (4, 2, 4)])
def test_megatron_2021_blocking_p2p_adds_no_bubble_to_the_interleaved_schedule(D, v, N):
    """The event model of Megatron-LM's 2021 interleaved program (experiments/reproduce/megatron_p2p.py):
    with rendezvous sends or without, its step is the ideal N(F + B) + (D-1)/v (F + B) (F = 1, B = 3),
    Table 1's interleaved rows and two small cases (N = D: all forwards first); a per-call cost c adds
    c per round on the critical path: at most a device's rounds (about 2vN) plus one per hop of the
    fill (vD)."""
    from experiments.reproduce.megatron_p2p import makespan, rounds
    ideal = N * 4 + (D - 1) / v * 4
    assert makespan(D, v, N) == pytest.approx(ideal, rel=1e-12)
    assert makespan(D, v, N, rendezvous=False) == pytest.approx(ideal, rel=1e-12)
    n_rounds = max(len(rounds(D, d, v, N)) for d in range(D))
    assert ideal < makespan(D, v, N, comm=0.01) <= ideal + 0.01 * (n_rounds + v * D)
