"""The ``a100`` kernel constants are fitted on Zero Bubble Table 9 (and only there): the fit, run
from elsewhere, lands on the preset's numbers, and the preset reproduces its fit set."""
import pytest

from cost_models import load_device
from cost_models.kernels import block_kernels, block_shape
from cost_models.stage_time_fit import FITTED_TABLE9, fit_note, fit_table9, table9_errors, table9_points

A100 = load_device("a100")


def test_table9_points_are_the_middle_stages():
    pts = {p.model: p for p in table9_points()}
    assert list(pts) == ["1.5B", "6.2B", "14.6B", "28.3B"]
    # (L + 2) / D layers: 24/8, 32/8, 48/16, 64/32
    assert [p.layers for p in pts.values()] == [3, 4, 3, 2]
    assert [p.spec.micro_batch for p in pts.values()] == [6, 3, 1, 1]
    # the mean of the three micro-batch counts' profiles, seconds
    assert pts["1.5B"].measured[0] == pytest.approx((18.522 + 18.513 + 18.546) / 3e3)
    assert pts["28.3B"].measured[2] == pytest.approx((7.715 + 7.703 + 7.698) / 3e3)


def test_fit_from_the_v100_constants_lands_on_the_preset():
    """Started from the V100 fit's efficiencies (0.935, 0.616), the fit finds the preset's two
    numbers to the third digit; every other constant is left as it was."""
    start = A100.kernels.with_values(gemm_efficiency=0.935, memory_efficiency=0.616)
    c, rms = fit_table9(A100, start=start)
    assert c.gemm_efficiency == pytest.approx(A100.kernels.gemm_efficiency, abs=1e-3)
    assert c.memory_efficiency == pytest.approx(A100.kernels.memory_efficiency, abs=1e-3)
    for f in set(c.FIELDS) - set(FITTED_TABLE9):
        assert getattr(c, f) == getattr(A100.kernels, f)
    assert rms == pytest.approx(0.0786, abs=0.001)


def test_preset_reproduces_its_fit_set():
    rows = table9_errors(A100)
    # F + B + W (the per-micro-batch work of a stage) within 2.6% for every model
    assert max(abs(r["error_sum"]) for r in rows) < 0.026
    # W (the weight-gradient GEMMs alone) within 5.3%; F and B within 14.1%: the model's
    # forward is short and its input backward long by 3-14% (the split the kernels leave)
    assert max(abs(r["error_W"]) for r in rows) < 0.053
    assert all(-0.15 < r["error_F"] < -0.05 for r in rows)
    assert all(0.03 < r["error_B"] < 0.11 for r in rows)
    assert "gemm_efficiency = 0.811" in fit_note(A100) and "held out" in fit_note(A100)


def test_megatron_block_kernels():
    """The gpt block is Megatron-LM's: dropout on the attention probabilities and in the fused
    bias-dropout-add (1-byte masks), W = the four weight-gradient GEMMs accumulating into fp32."""
    spec = table9_points()[0].spec
    ks = block_kernels(block_shape(spec))
    w = [k for k in ks if k.phase == "W"]
    assert [k.name for k in w] == ["fc2.dw", "fc1.dw", "proj.dw", "qkv.dw"]
    b, s, h, a = 6, 1024, 2304, 24
    drop = {k.name: k for k in ks if "dropout" in k.name}
    assert drop["attn.dropout"].bytes == 5 * b * a * s * s                 # read 2, write 2, mask 1
    assert drop["residual1.dropout.bwd"].bytes == 5 * b * s * h
    assert {k.name: k.bytes for k in ks}["residual1"] == 7 * b * s * h     # x, residual, out, mask
    # the fp32 main gradient read and written by the weight-gradient GEMM
    fc2 = {k.name: k for k in w}["fc2.dw"]
    assert fc2.bytes == 2 * (h * b * s + b * s * 4 * h) + 8 * h * 4 * h
    # no dropout: no masks, the plain residual adds
    nd = block_kernels(block_shape(spec, dropout=False))
    assert not [k for k in nd if "dropout" in k.name]


def test_autograd_accumulation_adds_16_bit_gradients_after_the_gemm():
    """Megatron-LM before gradient-accumulation fusion, at its defaults: the weight-gradient GEMM
    writes a 16-bit gradient and autograd adds it into ``.grad``: 3 x 2 bytes per parameter in W."""
    from cost_models import ModelSpec, TransformerCostModel
    from cost_models.job import Job
    from cost_models.kernels import BlockShape
    from cost_models.transformer import block_params
    spec = table9_points()[0].spec
    fused = block_kernels(block_shape(spec))
    auto = block_kernels(block_shape(spec, grad_accumulation="autograd"))
    adds = [k for k in auto if k.name.startswith("grad.accum")]
    assert sum(k.bytes for k in adds) == 6 * block_params(spec)
    assert all(k.phase == "W" for k in adds)
    gf = {k.name: k.bytes for k in fused if k.gemm}
    ga = {k.name: k.bytes for k in auto if k.gemm}
    h = spec.hidden
    assert gf["proj.dw"] - ga["proj.dw"] == 6 * h * h          # fused: the fp32 result read and written
    assert [k.name for k in auto if not k.name.startswith("grad.accum")] == [k.name for k in fused]
    with pytest.raises(ValueError, match="grad_accumulation must be one of"):
        BlockShape("gpt", 64, 4, 16, 256, 2, 1, grad_accumulation="hook")
    with pytest.raises(ValueError, match="Megatron-LM's, priced for gpt"):
        BlockShape("llama", 64, 4, 16, 256, 2, 1, grad_accumulation="autograd")
    with pytest.raises(ValueError, match="in the kernel model"):
        TransformerCostModel(spec, A100, grad_accumulation="autograd")           # linear cost model
    llama = ModelSpec(name="l", kind="llama", layers=2, hidden=256, heads=4, seq_len=64, vocab=100)
    with pytest.raises(ValueError, match="llama model"):
        TransformerCostModel(llama, A100, compute="kernels", grad_accumulation="autograd")
    with pytest.raises(ValueError, match="Job.grad_accumulation must be one of"):
        Job(model=spec, grad_accumulation="fp32")
