"""Issue 44 item 1: --precision fp8 as Transformer Engine runs it (cost_models/fp8.py), refused where
the device has no fp8, and the executor's --dtype fp8 refusals and choice of library."""
import json

import pytest

from cost_models import load_cluster, load_device
from cost_models.fp8 import (WEIGHT_COPY_BYTES, amax_bytes, amax_reductions, gathered_weight_bytes,
                             linear_cast_bytes, quantize_bytes)
from cost_models.kernels import DeviceRates, block_kernels, block_shape, transformer_layer_times
from cost_models.model_spec import ModelSpec, SpecError
from cost_models.parallel import Parallel
from cost_models.transformer import (TensorParallelGroup, TransformerCostModel, _attention_core_flops,
                                     transformer_layers)
from experiments.cli import main

# a GEMM-bound layer: GPT-3 175B's block (h 12,288, s 2,048), flash attention
BIG = ModelSpec(name="g", kind="gpt", layers=2, hidden=12288, heads=96, seq_len=2048, vocab=51200, micro_batch=1)


def test_quantize_bytes_are_the_recipes_reads_and_writes():
    n = 1 << 20
    assert quantize_bytes(n, "delayed") == 2 * n + 2 * n              # one 16-bit read, two fp8 copies
    assert quantize_bytes(n, "tensorwise") == 2 * 2 * n + 2 * n       # the amax read, then the cast
    assert quantize_bytes(n, "blockwise") == 2 * n + 2 * (n + 4 * n / 128)   # + an fp32 scale per 128
    assert linear_cast_bytes(8, 3, 5, "delayed") == (quantize_bytes(8 * 5, "delayed"), quantize_bytes(8 * 3, "delayed"))
    assert amax_reductions("delayed", 1, False) == (0, 0)
    assert amax_reductions("delayed", 8, False) == (1, 1)
    assert amax_reductions("tensorwise", 8, False) == (0, 0)
    assert amax_reductions("tensorwise", 8, True) == (2, 2)
    assert amax_reductions("blockwise", 8, True) == (0, 0)
    assert gathered_weight_bytes(Parallel(precision="fp8", zero=3, fp8_gather=True), 2) == 1.0
    assert gathered_weight_bytes(Parallel(precision="fp8", zero=3), 2) == 2.0


def _linear_block_times(m, dev, precision, recipe="delayed"):
    """The linear model's closed form of one GPT block (F, B, W) at T = 1: the linear layers' FLOPs
    at the precision's rate, the attention core at the 16-bit rate, at fp8 the casts of the four
    linear layers' inputs (F) and output gradients (B) at the memory bandwidth."""
    r16 = dev.achievable_flops("bf16")
    r = dev.achievable_flops(precision)
    blk = transformer_layers(m)[1]
    core = _attention_core_flops(m)
    rows, h, f = m.micro_batch * m.seq_len, m.hidden, m.ffn
    casts = [linear_cast_bytes(rows, o, i, recipe) for o, i in ((3 * h, h), (h, h), (f, h), (h, f))]
    cf = sum(x for x, _ in casts) / dev.memory_bandwidth if precision == "fp8" else 0.0
    cb = sum(g for _, g in casts) / dev.memory_bandwidth if precision == "fp8" else 0.0
    return ((blk.flops_f - core) / r + core / r16 + cf, (blk.flops_b_input - 2 * core) / r + 2 * core / r16 + cb,
            blk.flops_w / r)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "blockwise"])
def test_fp8_is_between_1_3x_and_2x_faster_than_bf16_on_a_gemm_bound_layer(recipe):
    dev = load_device("h100")
    lc8 = TransformerCostModel(BIG, dev, parallel=Parallel(precision="fp8", fp8_recipe=recipe)).layer_costs()
    lc16 = TransformerCostModel(BIG, dev, parallel=Parallel(precision="bf16")).layer_costs()
    want8, want16 = _linear_block_times(BIG, dev, "fp8", recipe), _linear_block_times(BIG, dev, "bf16")
    assert (lc8.f[1], lc8.b_input[1], lc8.w[1]) == pytest.approx(want8, rel=1e-12)
    assert (lc16.f[1], lc16.b_input[1], lc16.w[1]) == pytest.approx(want16, rel=1e-12)
    speedup = sum(want16) / sum(want8)
    assert 1.3 <= speedup <= 2.0
    # the head stays in 16 bits (no Transformer Engine layer): the same seconds as at bf16
    assert lc8.f[-1] == pytest.approx(lc16.f[-1], rel=1e-12)
    # the kernel model: the same bounds on the block (8-bit GEMMs, 16-bit attention, quantize kernels)
    b16 = sum(transformer_layer_times(BIG, dev, "bf16")[1])
    b8 = sum(transformer_layer_times(BIG, dev, "fp8", fp8_recipe=recipe)[1])
    assert 1.3 <= b16 / b8 <= 2.0


def test_the_kernel_model_prices_fp8_gemms_at_the_fp8_peak_and_casts_as_kernels():
    dev = load_device("h100")
    rates = DeviceRates.of(dev, "fp8")
    assert (rates.peak, rates.peak_fp8) == (dev.peak("bf16"), dev.peak("fp8"))
    ks = block_kernels(block_shape(BIG, fp8="delayed"))
    quant = [k for k in ks if k.name.endswith("quantize")]
    assert [(k.name, k.phase) for k in quant] == [
        ("qkv.quantize", "F"), ("proj.quantize", "F"), ("fc1.quantize", "F"), ("fc2.quantize", "F"),
        ("fc2.dy.quantize", "B"), ("fc1.dy.quantize", "B"), ("proj.dy.quantize", "B"), ("qkv.dy.quantize", "B")]
    T, h = 2048, 12288
    assert quant[0].bytes == quantize_bytes(T * h, "delayed")
    assert quant[4].bytes == quantize_bytes(T * h, "delayed")          # fc2's output gradient, T x h
    fp8 = {k.name for k in ks if k.fp8}
    assert fp8 == {f"{n}{s}" for n in ("qkv", "proj", "fc1", "fc2") for s in ("", ".dx", ".dw")}
    fc1 = next(k for k in ks if k.name == "fc1")
    assert fc1.bytes == T * h + h * 4 * h + 2 * T * 4 * h              # 1-byte operands, a 16-bit result


def test_fp8_keeps_two_fp8_weight_copies_and_reduces_amaxes_on_the_tp_group():
    c = load_cluster("dgx-h100-ib:1")
    m = BIG.replace(heads=96)
    bf = TransformerCostModel(m, c.device, parallel=Parallel(precision="bf16"))
    f8 = TransformerCostModel(m, c.device, parallel=Parallel(precision="fp8"))
    assert WEIGHT_COPY_BYTES == 2.0
    assert sum(f8.static_split()) == sum(bf.static_split()) + 2.0 == 20.0
    assert f8.optim_time_per_param() == pytest.approx(bf.optim_time_per_param() + 2.0 / c.device.memory_bandwidth)
    group = TensorParallelGroup(c, 8)
    kw = dict(tp_group=group)
    plain = TransformerCostModel(m, c.device, parallel=Parallel(precision="fp8", fp8_recipe="blockwise", tp=8), **kw)
    delayed = TransformerCostModel(m, c.device, parallel=Parallel(precision="fp8", fp8_recipe="delayed", tp=8), **kw)
    one = group.time("all-reduce", amax_bytes(4))
    lp, ld = plain.layer_costs(), delayed.layer_costs()
    # delayed over blockwise: one amax all-reduce in F, and no block scales in the casts (per GPU's shapes)
    dcf = sum(linear_cast_bytes(2048, o, i, "delayed")[0] - linear_cast_bytes(2048, o, i, "blockwise")[0]
              for o, i in ((3 * 12288 // 8, 12288), (12288, 12288 // 8), (4 * 12288 // 8, 12288),
                           (12288, 4 * 12288 // 8)))
    assert ld.f[1] - lp.f[1] == pytest.approx(one + dcf / c.device.memory_bandwidth, rel=1e-9)


def test_a_precision_the_device_lacks_is_refused_in_one_line():
    a100 = load_device("a100")
    assert not a100.has("fp8") and load_device("h100").has("fp8")
    with pytest.raises(SpecError, match=r"^device 'a100' has no peak for precision 'fp8' \(has: fp16, bf16, tf32, "
                                        r"fp32\)$"):
        TransformerCostModel(BIG, a100, parallel=Parallel(precision="fp8"))
    with pytest.raises(ValueError, match="^--fp8-recipe sets how fp8 casts are scaled; give --precision fp8$"):
        Parallel(fp8_recipe="blockwise")
    with pytest.raises(ValueError, match="^--fp8-gather all-gathers ZeRO-3's weights in fp8; give --precision fp8 "
                                         "and --zero 3$"):
        Parallel(precision="fp8", fp8_gather=True)


def test_summary_and_json_name_the_precision(capsys):
    args = ["simulate", "-s", "dapple", "-D", "2", "-N", "4", "-m", "gpt3-1.3b", "-c", "dgx-h100-ib:1",
            "--cost-model", "linear"]
    assert main(args + ["--precision", "fp8", "--fp8-recipe", "blockwise"]) == 0
    assert "precision fp8 (blockwise scaling)" in capsys.readouterr().out
    assert main(args + ["--precision", "fp8", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["precision"] == "fp8 (delayed scaling)"
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "bf16"


# ---------------------------------------------------------------------------- the executor: --dtype fp8
def test_the_executor_refuses_fp8_where_it_cannot_run_in_one_line():
    from executor.precision import Precision, fp8_refusal
    ok = dict(device="cuda", capability=(9, 0), gpu="NVIDIA H100", library=True)
    assert fp8_refusal(**ok) is None
    assert fp8_refusal(**{**ok, "capability": (8, 9)}) is None                  # Ada
    assert "this run is on the CPU" in fp8_refusal(**{**ok, "device": "cpu", "capability": None})
    a100 = fp8_refusal(**{**ok, "capability": (8, 0), "gpu": "NVIDIA A100-SXM4-80GB"})
    assert a100 == ("--dtype fp8 needs a GPU with fp8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); "
                    "this NVIDIA A100-SXM4-80GB GPU has compute capability 8.0 (use --dtype bf16)")
    assert "--tp 2" in fp8_refusal(**{**ok, "tp": 2})
    assert "model file" in fp8_refusal(**{**ok, "model_file": True})
    assert "install torchao" in fp8_refusal(**{**ok, "library": False})
    assert all("\n" not in fp8_refusal(**{**ok, k: v}) for k, v in
               (("capability", (7, 0)), ("tp", 4), ("library", False), ("model_file", True)))
    p = Precision("fp8")      # bf16 around the fp8 linear layers: 2-byte activations and messages
    assert (p.dtype_bytes, str(p.wire_dtype), p.mixed) == (2, "torch.bfloat16", True)
    with pytest.raises(ValueError, match="^--dtype fp8 runs the linear layers on fp8 tensor cores.*this run is on "
                                         "the CPU"):
        p.check_run("cpu")
    Precision("bf16").check_run("cpu")          # nothing to refuse


def test_run_dtype_fp8_is_refused_on_this_host_in_one_line(capsys):
    assert main(["run", "-s", "dapple", "-D", "2", "-N", "2", "--steps", "1", "--dtype", "fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pipetwin: error: --dtype fp8 runs the linear layers on fp8 tensor")
