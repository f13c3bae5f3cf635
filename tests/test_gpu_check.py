"""experiments.gpu_check, run on the CPU (the same code a GPU machine runs with --device cuda)."""
import csv
import math
from dataclasses import replace
from pathlib import Path

import pytest

from cost_models import load_device, load_model
from cost_models.kernels import transformer_layer_times
from cost_models.layer_measurements import error_table, load_measurements
from experiments import gpu_check


TINY_LLAMA = str(Path(__file__).parent / "data" / "hf" / "tiny-llama" / "config.json")


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    rc = gpu_check.main(["--device", "cpu", "--model", "tiny", "--gpu", "v100", "--dtype", "fp32",
                         "--micro-batches", "1,2", "--repeats", "3", "--devices", "1,2", "--run-layers", "2",
                         "--steps", "2", "--zb-model", "none", "--llama", TINY_LLAMA, "--llama-layers", "2",
                         "--moe", "tiny-mixtral", "--out", str(out)])
    return rc, out


@pytest.mark.slow
def test_layers_measured_beside_the_kernel_model(checked):
    rc, out = checked
    assert rc == 0
    rows = _rows(out / "layers.csv")
    assert [int(r["micro_batch"]) for r in rows] == [1, 2]
    spec, gpu = load_model("tiny"), load_device("v100")
    for r in rows:
        # the kernel model asked directly, not through gpu_check: a block of the whole stack at this
        # micro-batch, without dropout (the executor's GPT block has none); the full backward is B_input + W
        f, b_input, w = transformer_layer_times(replace(spec, micro_batch=int(r["micro_batch"])), gpu, "fp32",
                                                dropout=False)[1]
        pred = {"f": f, "b_input": b_input, "w": w, "b": b_input + w}
        for k in gpu_check.KINDS:
            measured = float(r[f"{k}_measured_ms"])
            assert measured > 0
            assert float(r[f"{k}_model_ms"]) == pytest.approx(pred[k] * 1e3, rel=1e-9)
            assert float(r[f"{k}_error"]) == pytest.approx(pred[k] * 1e3 / measured - 1, rel=1e-9)


def test_each_micro_batch_is_priced_at_its_own_size():
    """The GPU's table (gpt3-1.3b in bf16 on an H200, the script's defaults), from given measured
    times: each row's model columns are the kernel model at that row's micro-batch (the tiny model
    above is launch-bound, the same at every micro-batch, so it cannot tell), the errors are
    model / measured - 1."""
    spec, gpu = load_model("gpt3-1.3b"), load_device("h200")
    measured = [{"micro_batch": mb, "f": 1e-3 * mb, "b_input": 1e-3 * mb, "w": 1e-3 * mb, "b": 2e-3 * mb}
                for mb in (1, 8)]
    rows = gpu_check.layer_table(spec, measured, gpu, "bf16")
    assert [r["micro_batch"] for r in rows] == [1, 8]
    for m, r in zip(measured, rows):
        f, b_input, w = transformer_layer_times(replace(spec, micro_batch=m["micro_batch"]), gpu, "bf16",
                                                dropout=False)[1]
        for k, want in {"f": f, "b_input": b_input, "w": w, "b": b_input + w}.items():
            assert r[f"{k}_measured_ms"] == pytest.approx(m[k] * 1e3, rel=1e-12)
            assert r[f"{k}_model_ms"] == pytest.approx(want * 1e3, rel=1e-12)
            assert r[f"{k}_error"] == pytest.approx(want / m[k] - 1, rel=1e-12)
    # 8 samples cost more than one and, the kernels fuller, less than 8 times one
    assert rows[0]["f_model_ms"] < rows[1]["f_model_ms"] < 8 * rows[0]["f_model_ms"]


@pytest.mark.slow
def test_measurement_set_round_trips_and_the_fit_is_no_worse_than_the_preset(checked):
    rc, out = checked
    rows = _rows(out / "layers.csv")
    ms = load_measurements(out / "measurements")
    layer = ms.layer("block")
    assert layer.batches == (1, 2) and ms.protocol.input_grad and ms.protocol.passes == 1
    for r, f, b in zip(rows, layer.time_f, layer.time_b):
        assert f * 1e3 == pytest.approx(float(r["f_measured_ms"]), rel=1e-5)
        assert b * 1e3 == pytest.approx(float(r["b_measured_ms"]), rel=1e-5)
    text = (out / "fitted-constants.yaml").read_text()
    fitted_rms = float(text.split("rms log error ")[1].split()[0])
    start = error_table(ms)
    preset_rms = math.sqrt(sum(math.log1p(x["f_error"]) ** 2 + math.log1p(x["b_error"]) ** 2 for x in start)
                           / (2 * len(start)))
    assert fitted_rms <= preset_rms + 1e-3


@pytest.mark.slow
def test_runs_equal_the_reference(checked):
    rc, out = checked
    runs = _rows(out / "runs.csv")
    assert [int(r["devices"]) for r in runs] == [1, 2]
    for r in runs:
        assert float(r["max_loss_difference"]) <= 1e-5     # fp32: the same sums in another order
        assert float(r["step_ms_run"]) > 0 and float(r["step_ms_reference"]) > 0
    assert "## Runs" in (out / "report.md").read_text()


@pytest.mark.slow
def test_llama_runs_at_each_tp_equal_the_reference(checked):
    """The tiny Llama config (GQA, SwiGLU, RMSNorm, rotary, untied) at T = 1 and 2 (the CPU's
    default: 2 ranks) and T = 2 with sequence parallelism, in fp32: each run's losses are the
    reference's."""
    rc, out = checked
    rows = _rows(out / "llama-runs.csv")
    assert [(int(r["tp"]), r["sequence_parallel"]) for r in rows] == [(1, "False"), (2, "False"), (2, "True")]
    for r in rows:
        assert float(r["max_loss_difference"]) <= 1e-5
        assert float(r["loss_run"]) == pytest.approx(float(r["loss_reference"]), abs=1e-5)
        assert float(r["step_ms_run"]) > 0
    report = (out / "report.md").read_text()
    assert "## Llama runs" in report and "tiny-llama, 2 blocks, sequence 16" in report
    assert not (out / "zb-layer.csv").exists()       # --zb-model none


def test_zero_bubble_models_are_table_3_at_table_4_micro_batches():
    dims = {m: (s.layers, s.hidden, s.heads, s.seq_len, s.micro_batch)
            for m in ("1.5B", "6.2B", "14.6B", "28.3B") for s in [gpu_check.zb_spec(m)]}
    assert dims == {"1.5B": (22, 2304, 24, 1024, 6), "6.2B": (30, 4096, 32, 1024, 3),
                    "14.6B": (46, 5120, 40, 1024, 1), "28.3B": (62, 6144, 48, 1024, 1)}


@pytest.mark.slow
def test_zero_bubble_layer_is_measured_beside_the_kernel_model(monkeypatch, tmp_path):
    """The part's wiring, on a Zero Bubble model cut to CPU size (the 1.5B block takes minutes on
    this CPU): one row at the model's micro-batch, the kernel model of --gpu beside it."""
    small = gpu_check.zb_spec("1.5B").replace(hidden=48, heads=4, seq_len=32, micro_batch=3)
    monkeypatch.setattr(gpu_check, "zb_spec", lambda model: small)
    rc = gpu_check.main(["--device", "cpu", "--model", "tiny", "--gpu", "a100", "--dtype", "fp32",
                         "--micro-batches", "1", "--repeats", "3", "--devices", "1", "--run-layers", "1",
                         "--steps", "2", "--llama", "none", "--moe", "none", "--out", str(tmp_path)])
    assert rc == 0
    [row] = _rows(tmp_path / "zb-layer.csv")
    assert int(row["micro_batch"]) == 3
    f, b_input, w = transformer_layer_times(small, load_device("a100"), "fp32", dropout=False)[1]
    assert float(row["f_model_ms"]) == pytest.approx(f * 1e3, rel=1e-9)
    assert float(row["w_model_ms"]) == pytest.approx(w * 1e3, rel=1e-9)
    assert float(row["b_error"]) == pytest.approx((b_input + w) * 1e3 / float(row["b_measured_ms"]) - 1, rel=1e-9)
    assert "## Zero Bubble layer" in (tmp_path / "report.md").read_text()
    assert not (tmp_path / "llama-runs.csv").exists()


@pytest.mark.slow
def test_moe_block_measured_beside_the_kernel_model(checked):
    """The MoE row on the CPU: tiny-mixtral's block (EP 1) measured at each micro-batch beside the
    kernel model of --gpu at the rows its router sent each expert on that micro-batch."""
    from calibration.measure import moe_block
    from cost_models.kernels import moe_block_times
    rc, out = checked
    assert rc == 0
    rows = _rows(out / "moe-layer.csv")
    assert [int(r["micro_batch"]) for r in rows] == [1, 2]
    spec, gpu = gpu_check.moe_spec("tiny-mixtral"), load_device("v100")
    assert (spec.layers, spec.seq_len) == (1, 16)
    for r in rows:
        sp = replace(spec, micro_batch=int(r["micro_batch"]))
        counts = moe_block(sp)[1]
        assert sum(counts) == sp.micro_batch * sp.seq_len * sp.top_k     # dropless
        f, b_input, w = moe_block_times(sp, gpu, "fp32", counts)
        for k, want in {"f": f, "b_input": b_input, "w": w, "b": b_input + w}.items():
            assert float(r[f"{k}_model_ms"]) == pytest.approx(want * 1e3, rel=1e-9)
            assert float(r[f"{k}_error"]) == pytest.approx(want * 1e3 / float(r[f"{k}_measured_ms"]) - 1, rel=1e-9)
    assert "## MoE layer: tiny-mixtral block at EP 1" in (out / "report.md").read_text()


@pytest.mark.parametrize("model", ["tiny-mixtral", "tiny-deepseek"])
def test_the_moe_kernels_count_the_executors_flops(model):
    """The kernel model's MoE MLP has the GEMMs the executor's runs: the forward's FLOPs as
    ``torch.utils.flop_counter`` counts the executor's MoE MLP on the measured micro-batch equal
    the F kernels' and the closed form 2 T E h + 6 m h f_e + 6 T h f_s (+ 2 T h for Qwen2's gate;
    m = T k, dropless); the full backward's are twice that (each GEMM's input and weight
    gradients), the B and W kernels' together."""
    from calibration.measure import count_flops, layer_inputs, moe_block
    from cost_models.kernels import moe_mlp_kernels
    spec = load_model(model)
    blk, counts = moe_block(spec)
    hidden = layer_inputs(spec)[2]
    f, b, _, _ = count_flops(blk.mlp, lambda: (hidden.clone().requires_grad_(True), ()), True)
    T, h = spec.micro_batch * spec.seq_len, spec.hidden
    closed = 2 * T * spec.experts * h + 6 * T * spec.top_k * h * spec.expert_width + 6 * T * h * spec.shared_ffn \
        + (2 * T * h if spec.shared_gate else 0)
    assert sum(counts) == T * spec.top_k
    ks = moe_mlp_kernels(spec, counts)

    def gemm_flops(phases):
        return sum(2 * bt * m * n * k for x in ks if x.gemm and x.phase in phases for bt, m, n, k in [x.gemm])
    assert f == gemm_flops("F") == closed
    assert b == gemm_flops("BW") == 2 * closed


@pytest.mark.parametrize("argv, words", [
    (["--device", "cpu", "--zb-model", "2B"], "1.5B, 6.2B, 14.6B, 28.3B"),
    (["--device", "cpu", "--llama", "gpt3-1.3b"], "is a gpt model"),
    (["--device", "cpu", "--model", "tiny", "--llama", TINY_LLAMA, "--llama-tp", "3"], "--llama-tp 3 does not divide"),
    (["--device", "cpu", "--micro-batches", "1,x"], "--micro-batches"),
    (["--device", "cpu", "--moe", "tiny"], "not a llama-kind mixture of experts"),
    (["--device", "cpu", "--moe", "tiny-deepseek"], "latent attention"),
    (["--device", "cpu", "--gpu", "cpu"], "no datasheet"),
    (["--device", "cpu", "--model", "tiny", "--devices", "3", "--run-layers", "2"], "at least one per rank"),
])
def test_bad_input_fails_fast(argv, words, capsys, tmp_path):
    assert gpu_check.main(argv + ["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]
    assert not (tmp_path / "o" / "layers.csv").exists()
