"""Cost-model formulas against hand-computed numbers: FLOPs, parameters, bytes, seconds, memory."""
import math

import pytest

import cost_models as cm
import schedules as S
from schedules.ir import B, F, W, make_schedule

GPT96 = cm.load_model("gpt-96")
A100 = cm.load_device("a100")


def small(**kw):
    d = dict(name="small", layers=4, hidden=16, heads=2, seq_len=8, vocab=32, micro_batch=2)
    d.update(kw)
    return cm.ModelSpec(**d)


# ----------------------------------------------------------------------------- block formulas
def test_block_flops_hand_values():
    # b=2, s=8, h=16: bsh = 256; F = 256 (24*16 + 4*8), B = 256 (24*16 + 8*8), W = 256 * 24*16
    f, b, w = cm.block_flops(small())
    assert (f, b, w) == (106496.0, 114688.0, 98304.0)
    assert b + w == 2 * f


def test_block_flops_gpt96():
    f, b, w = cm.block_flops(GPT96)
    sbh = 1024 * 3072
    assert f == sbh * (24 * 3072 + 4 * 1024) == 244_813_135_872
    assert b == sbh * (24 * 3072 + 8 * 1024) == 257_698_037_760
    assert w == 24 * 1024 * 3072 ** 2 == 231_928_233_984


def test_ffn_mult_generalises():
    f, b, w = cm.block_flops(small(ffn_mult=2))
    assert (f, b, w) == (256 * (16 * 16 + 32), 256 * (16 * 16 + 64), 256 * 16 * 16)
    assert cm.block_params(small(ffn_mult=2)) == 8 * 256 + 11 * 16


def test_block_params():
    assert cm.block_params(small()) == 12 * 16 ** 2 + 13 * 16 == 3280
    assert cm.block_params(GPT96) == 12 * 3072 ** 2 + 13 * 3072


def test_activation_bytes_korthikanti():
    sbh, as2b = 1024 * 3072, 5 * 32 * 1024 ** 2
    assert cm.block_activation_bytes(GPT96) == 34 * sbh + as2b == 274_726_912
    assert cm.block_activation_bytes(GPT96) == pytest.approx(sbh * (34 + 5 * 32 * 1024 / 3072))
    assert cm.block_activation_bytes(GPT96, "selective") == 34 * sbh
    assert cm.block_activation_bytes(GPT96, "full") == 2 * sbh
    assert cm.block_activation_bytes(GPT96, dropout=False) == 32 * sbh + 2 * 32 * 1024 ** 2
    assert cm.block_weight_grad_bytes(GPT96) == 32 * sbh
    assert cm.boundary_bytes(GPT96) == 2 * sbh == 6_291_456
    # fp32 (the tiny model): 4-byte elements, 1-byte masks
    t = cm.load_model("tiny").replace(dropout=True, attention="eager")
    sbh_t = 32 * 2 * 64
    assert cm.block_activation_bytes(t) == sbh_t * (16 * 4 + 2) + 4 * 32 ** 2 * 2 * 9
    # the tiny preset as the executor trains it: no dropout, fused attention (its log-sum-exp, 4asb)
    assert cm.block_activation_bytes(cm.load_model("tiny")) == sbh_t * 16 * 4 + 4 * 4 * 32 * 2


def test_recompute_flops():
    f, _, _ = cm.block_flops(GPT96)
    assert cm.recompute_flops(GPT96) == 0
    assert cm.recompute_flops(GPT96, "selective") == 4 * 1024 ** 2 * 3072
    assert cm.recompute_flops(GPT96, "full") == f
    with pytest.raises(ValueError, match="recompute"):
        cm.recompute_flops(GPT96, "some")


def test_embedding_and_head_layers():
    layers = cm.transformer_layers(GPT96)
    assert len(layers) == 98 and layers[0].kind == "embedding" and layers[-1].kind == "head"
    emb, head = layers[0], layers[-1]
    assert emb.params == 50257 * 3072 + 1024 * 3072
    assert emb.flops_f == emb.flops_b_input == emb.flops_w == 0
    assert emb.out_bytes == 6_291_456
    assert head.params == 50257 * 3072 + 2 * 3072
    assert head.flops_f == head.flops_b_input == head.flops_w == 2 * 1024 * 3072 * 50257
    assert head.out_bytes == 0
    assert head.act_bytes == 2 * 6_291_456 + 4 * 1024 * 50257
    bert = cm.load_model("bert-64")
    bh = cm.transformer_layers(bert)[-1]
    assert bh.params == 2560 ** 2 + 3 * 2560 + 30522 * 2560 + 30522
    assert bh.flops_f == 2 * 512 * 2560 ** 2 + 2 * 512 * 2560 * 30522


def test_model_sizes_match_papers():
    # GPT-3 XL 1.3 B (Brown et al.); Chimera's Bert-48 669 M; BitPipe's GPT-96 ~11 B
    assert cm.model_params(cm.load_model("gpt3-1.3b")) == pytest.approx(1.3e9, rel=0.02)
    assert cm.model_params(cm.load_model("bert-48")) == pytest.approx(669e6, rel=0.01)
    assert cm.model_params(GPT96) == pytest.approx(11.0e9, rel=0.01)
    # Megatron's closed form: 72 B s l h^2 (1 + s/6h + V/(12 h l)) FLOPs per iteration (fwd + bwd)
    m = cm.load_model("gpt3-1.3b")
    l, h, s, V = 24, 2048, 2048, 50257
    assert cm.model_flops(m) == pytest.approx(72 * s * l * h ** 2 * (1 + s / (6 * h) + V / (12 * h * l)))


def test_default_partition():
    assert cm.default_partition(96, 8) == (13,) + (12,) * 6 + (13,)
    assert cm.default_partition(10, 4) == (3, 3, 3, 3)       # extra blocks go to inner stages first
    assert cm.default_partition(13, 4) == (4, 4, 3, 4)
    assert cm.default_partition(15, 4) == (5, 4, 4, 4)       # then to stage 0, then to the last
    assert cm.default_partition(3, 2) == (3, 2)
    assert cm.default_partition(8, 1) == (10,)
    assert cm.default_partition(2, 3) == (1, 2, 1)     # fewer blocks than stages: the even rule over L + 2 layers


# ----------------------------------------------------------------------------- seconds
def test_device_presets():
    assert A100.peak("bf16") == 312e12 and A100.memory_bytes == 80 * 2 ** 30 and A100.efficiency == 0.5
    v100 = cm.load_device("v100")
    assert not v100.has("bf16") and v100.peak("fp16") == 125e12
    assert cm.load_device("h200").memory_bytes == 141e9
    assert cm.load_device("h100").peak("fp16") == pytest.approx(989.4e12)
    with pytest.raises(cm.SpecError, match="bf16"):
        v100.peak("bf16")
    with pytest.raises(cm.SpecError, match="calibration"):
        cm.TransformerCostModel(GPT96, cm.load_device("cpu"))


def test_layer_seconds():
    tm = cm.TransformerCostModel(GPT96, A100)
    assert tm.resolved_precision() == "bf16"
    lc = tm.layer_costs()
    rate = 312e12 * 0.5
    assert lc.f[1] == pytest.approx(244_813_135_872 / rate)
    assert lc.f[1] == pytest.approx(1.5693e-3, rel=1e-4)
    assert lc.b_input[1] == pytest.approx(257_698_037_760 / rate)
    assert lc.w[1] == pytest.approx(231_928_233_984 / rate)
    assert cm.TransformerCostModel(GPT96, cm.load_device("v100")).resolved_precision() == "fp16"
    full = cm.TransformerCostModel(GPT96, A100, parallel=cm.Parallel(recompute="full")).layer_costs()
    assert full.b_input[1] == pytest.approx(lc.b_input[1] + lc.f[1])
    assert full.act[1] == 2 * 1024 * 3072
    # Adam at 16 B/param touches 28 B/param at 2039 GB/s
    assert lc.optim_time_per_param == pytest.approx(28 / 2039e9)
    assert lc.copy_time == pytest.approx(2 * 6_291_456 / 2039e9)


def test_bind_dapple_stage_costs():
    tm = cm.TransformerCostModel(GPT96, A100)
    sched = S.build("dapple", 8, 8)
    c = tm.bind(sched)
    layer = tm.layer_costs()
    assert c.time_unit == "s" and c.mem_unit == "B"
    assert c.meta["partition"] == [13, 12, 12, 12, 12, 12, 12, 13]
    assert c.f[0][0] == pytest.approx(12 * layer.f[1])
    assert c.f[0][7] == pytest.approx(12 * layer.f[1] + layer.f[-1])
    assert c.b[0][3] == pytest.approx(12 * (layer.b_input[1] + layer.w[1]))
    assert c.w[0][3] == 0
    assert c.act_bytes[0][0] == 6_291_456 and c.grad_bytes[0][0] == 0 and c.grad_bytes[0][1] == 6_291_456
    p_mid = 12 * cm.block_params(GPT96)
    assert c.param_bytes[0][3] == 2 * p_mid
    assert c.static_mem[3] == 18 * p_mid       # Megatron mixed precision: 2 + 4 + 12
    assert c.static_mem[0] == 18 * (p_mid + 50257 * 3072 + 1024 * 3072)


def test_bidirectional_weights_twice():
    tm = cm.TransformerCostModel(GPT96, A100)
    uni = tm.bind(S.build("dapple", 8, 8))
    bi = tm.bind(S.build("chimera", 8, 8))
    # Chimera device 3 holds down stage 3 and up stage 4: two middle stages
    assert bi.static_mem[3] == 2 * uni.static_mem[3]
    br = tm.static_breakdown(S.build("chimera", 8, 8))
    assert br[3].params == 2 * 12 * cm.block_params(GPT96)
    assert (br[3].weights, br[3].grads, br[3].optimizer) == (2 * br[3].params, 4 * br[3].params, 12 * br[3].params)
    assert br[3].total == bi.static_mem[3]


# ----------------------------------------------------------------------------- memory
def test_gpipe_many_microbatches_is_out_of_memory():
    tm = cm.TransformerCostModel(GPT96, A100)
    gp = S.build("gpipe", 8, 64)
    rep = cm.memory_report(gp, tm.bind(gp))
    emb_act = 8 * 1024 + 1024 * 3072
    assert rep.activation[0] == 64 * (12 * 274_726_912 + emb_act)
    assert rep.capacity == 80 * 2 ** 30
    assert rep.oom and "OUT OF MEMORY" in rep.summary()
    with pytest.raises(cm.OutOfMemory, match="rank"):
        cm.check_memory(gp, tm.bind(gp))
    # DAPPLE keeps at most D micro-batches on device 0 and fits
    dp = S.build("dapple", 8, 64)
    rep = cm.check_memory(dp, tm.bind(dp))
    assert rep.activation[0] == 8 * (12 * 274_726_912 + emb_act)
    assert not rep.oom


def test_unit_model_memory():
    u = cm.UnitCostModel()
    for name, n, act0 in [("gpipe", 8, 8.0), ("dapple", 8, 4.0)]:
        s = S.build(name, 4, n)
        rep = cm.memory_report(s, u.bind(s), capacity=5.0)
        assert rep.activation[0] == act0 and rep.unit == "Ma"
    bp = S.build("bitpipe", 4, 4)
    assert cm.memory_report(bp, u.bind(bp)).static == (2.0,) * 4


def test_split_backward_walk():
    sched = make_schedule("split", 1, 2, [[0]], [[(F, 0, 0, 0), (F, 1, 0, 0), (B, 0, 0, 0), (W, 0, 0, 0),
                                                   (B, 1, 0, 0), (W, 1, 0, 0)]], split_backward=True)
    c = cm.PerLayerCostModel(cm.LayerCosts(f=(1.0,), b_input=(1.0,), w=(1.0,), act=(10.0,), act_w=(4.0,),
                                           out_bytes=(0.0,), params=(1.0,))).bind(sched)
    walk = cm.activation_walk(sched.programs[0], c, True)
    assert walk == [10, 20, 14, 10, 4, 0]
    assert cm.peak_activation(sched, c) == (20.0,)


# ----------------------------------------------------------------------------- presets round-trip
@pytest.mark.parametrize("name", cm.model_presets())
def test_model_presets_round_trip(name):
    m = cm.load_model(name)
    assert cm.spec_from_dict(m.to_dict()) == m


def test_required_presets_exist():
    assert {"gpt-96", "bert-64", "bert-48", "gpt3-1.3b", "tiny"} <= set(cm.model_presets())
    assert {"v100", "a100", "h100", "h200", "cpu"} <= set(cm.device_presets())
    assert {"dgx-a100-4x8-ib", "dgx-h100-4x8-ib", "v100-2x8-25gbe", "v100-16x1-25gbe"} <= set(cm.cluster_presets())
    t = cm.load_model("tiny")
    assert (t.layers, t.hidden, t.heads, t.seq_len, t.vocab, t.micro_batch, t.dtype_bytes) == (8, 64, 4, 32, 256, 2, 4)
    g = cm.load_model("gpt-96")
    assert (g.layers, g.hidden, g.heads, g.seq_len) == (96, 3072, 32, 1024)
    b = cm.load_model("bert-64")
    assert (b.layers, b.hidden, b.seq_len, b.kind) == (64, 2560, 512, "bert")


@pytest.mark.parametrize("name", cm.device_presets())
def test_device_presets_round_trip(name):
    d = cm.load_device(name)
    assert cm.device_from_dict(d.to_dict()) == d


@pytest.mark.parametrize("name", cm.cluster_presets())
def test_cluster_presets_round_trip(name):
    c = cm.load_cluster(name)
    assert cm.cluster_from_dict(c.to_dict()) == c
    for p in c.pools:       # a mixed preset's every pool (a one-pool preset's pool is its fields)
        assert math.isfinite(p.inter.bandwidth) and p.num_devices == p.nodes * p.devices_per_node
    assert c.num_devices == sum(p.num_devices for p in c.pools) and c.nodes == sum(p.nodes for p in c.pools)
