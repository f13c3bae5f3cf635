"""Tensor and sequence parallelism, ZeRO-1 and the Llama family in the cost models and the
simulator: closed forms of the activation ledger (Korthikanti et al. 2022, Table 2), the
collectives per layer, parameter counts of the presets against their published sizes, the
Hugging Face reader, the TP network and the refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import cost_models as cm
from cost_models.parallel import Parallel
from cost_models.bind import bind
from cost_models.cluster import megatron_map, tensor_parallel_groups
from cost_models.comm import reduce_scatter_time, ring_allreduce_time
from cost_models.model_spec import spec_from_hf_config
from cost_models.job import Job, Layout
from cost_models.kernels import block_kernels, block_shape, transformer_layer_times
from cost_models.memory import memory_report
from cost_models.transformer import (TensorParallelGroup, TransformerCostModel, block_activation_bytes, block_flops,
                                     block_params, layer_collectives, model_params, ring_bytes)
from schedules import build, lower

GiB = 2 ** 30
HF = Path(__file__).parent / "data" / "hf"
GPT3 = cm.load_model("gpt3-175b")


# ---------------------------------------------------------------------------- the activation ledger
@pytest.mark.parametrize("tp,sp,recompute,coeff,score", [
    (1, False, "none", 34, 5),          # sbh(34 + 5as/h)
    (8, False, "none", 10 + 24 / 8, 5 / 8),
    (8, True, "none", 34 / 8, 5 / 8),
    (8, False, "selective", 10 + 24 / 8, 0),
    (8, True, "selective", 34 / 8, 0),
    (1, False, "full", 2, 0),           # the block input only
    (8, True, "full", 2 / 8, 0),        # ... sequence-split with SP
])
def test_korthikanti_table2_per_layer(tp, sp, recompute, coeff, score):
    s, b, h, a = GPT3.seq_len, GPT3.micro_batch, GPT3.hidden, GPT3.heads
    sbh = s * b * h
    want = sbh * (coeff + score * a * s / h)
    assert block_activation_bytes(GPT3, recompute, tp=tp, sp=sp) == pytest.approx(want, rel=1e-12)


def test_ledger_without_dropout_and_with_flash_attention():
    s, b, h, a = GPT3.seq_len, GPT3.micro_batch, GPT3.hidden, GPT3.heads
    sbh = s * b * h
    # no masks: the two 1-byte dropout masks and the score mask and dropout output go
    assert block_activation_bytes(GPT3.replace(dropout=False)) == sbh * 32 + 2 * a * s * s * b
    # flash: only fp32 row statistics of the scores (4 a s b), split over t
    assert block_activation_bytes(GPT3.replace(attention="flash"), tp=8) == pytest.approx(
        sbh * (10 + 24 / 8) + 4 * a * s * b / 8, rel=1e-12)


def test_korthikanti_first_stage_gpt3_175b_tp8_pp8_interleaved():
    """GPT-3 175B at TP 8, PP 8, interleaved with 3 chunks, 64 micro-batches of 1: the first stage
    holds p (1 + (p-1)/(pm)) = 10.33 micro-batches of its 12 layers; about 66.8 GiB without SP or
    recompute, 12.4 GiB with SP and selective; weights, gradients and optimizer of a middle stage
    12 x 12h^2 / 8 parameters x 18 bytes = 45.6 GiB."""
    got = {}
    for sp, rc in ((False, "none"), (True, "selective")):
        job = Job.of(layout=Layout(schedule="interleaved", devices=8, microbatches=64, chunks=3), tp=8,
                     model="gpt3-175b", cluster="dgx-a100-ib:8", sequence_parallel=sp, recompute=rc)
        b = bind(job)
        got[sp] = memory_report(b.lowered, b.costs)
    s, h, a = GPT3.seq_len, GPT3.hidden, GPT3.heads
    held = 8 * (1 + 7 / 24) * 12
    assert got[False].activation[0] == pytest.approx(held * s * h * (13 + 5 * a * s / (8 * h)), rel=0.01)
    assert got[False].activation[0] / GiB == pytest.approx(66.8, rel=0.01)
    assert got[True].activation[0] / GiB == pytest.approx(12.4, rel=0.01)
    assert got[False].static[3] / GiB == pytest.approx(45.6, abs=0.05)
    assert got[False].static[3] == 18 * 12 * block_params(GPT3, 8)


# ---------------------------------------------------------------------------- FLOPs, parameters, collectives
def test_flops_and_params_split_over_t():
    f1, b1, w1 = block_flops(GPT3)
    f8, b8, w8 = block_flops(GPT3, 8)
    assert (f8, b8, w8) == (f1 / 8, b1 / 8, w1 / 8)
    h = GPT3.hidden
    assert block_params(GPT3) == 12 * h * h + 13 * h
    # matrices and column biases split; norms (4h) and row-parallel biases (2h) whole
    assert block_params(GPT3, 8) == (12 * h * h + 7 * h) // 8 + 6 * h


def test_llama_block_flops_gqa_swiglu():
    m = cm.load_model("llama3-70b")
    b, s, h, e, k, f = m.micro_batch, m.seq_len, m.hidden, m.head_dim, m.kv, m.ffn
    lin = 2 * b * s * (h * (h + 2 * k * e) + h * h + 3 * h * f)
    assert block_flops(m) == (lin + 4 * b * s * s * h, lin + 8 * b * s * s * h, lin)


@pytest.mark.parametrize("name,published,rel", [
    ("llama3-8b", 8.03e9, 1e-3), ("llama3-70b", 70.55e9, 1e-4), ("llama3-405b", 405.85e9, 1e-4),
    ("gpt3-175b", 175e9, 0.005)])
def test_preset_parameter_counts(name, published, rel):
    assert model_params(cm.load_model(name)) == pytest.approx(published, rel=rel)


def test_llama3_70b_exact():
    assert model_params(cm.load_model("llama3-70b")) == 70_553_706_496


@pytest.mark.parametrize("sp", [False, True])
def test_collective_bytes_per_layer(sp):
    out = GPT3.micro_batch * GPT3.seq_len * GPT3.hidden * GPT3.dtype_bytes
    cols = layer_collectives(GPT3, tp=8, sp=sp)
    block = cols[1]
    kinds = [k for k, _ in block.forward]
    assert kinds == (["all-gather", "reduce-scatter"] * 2 if sp else ["all-reduce"] * 2)
    assert all(n == out for _, n in block.forward + block.backward)
    # a ring moves 4 (t-1)/t bsh d per GPU per direction of the block, with SP or without
    for phase in (block.forward, block.backward):
        assert sum(ring_bytes(k, n, 8) for k, n in phase) == pytest.approx(4 * 7 / 8 * out)
    full = layer_collectives(GPT3, "full", tp=8, sp=sp)[1]
    assert len(full.backward) == 2 * len(full.forward)           # the re-run forward's collectives
    embed, head = cols[0], cols[-1]
    assert embed.forward == ((("reduce-scatter" if sp else "all-reduce"), out),) and embed.backward == ()
    assert head.backward == ((("reduce-scatter" if sp else "all-reduce"), out),)
    assert [k for k, _ in head.forward].count("all-reduce") == 3   # the loss's max, sum, target logit
    assert layer_collectives(GPT3, tp=1)[1].forward == ()


def test_layer_times_add_the_collectives_on_the_group_links():
    """Linear model: a block's F at t = 8 is its FLOPs / 8 at the device rate plus two ring
    all-reduces of bsh d over 8 GPUs on NVLink; --tp-overlap takes the larger of the two."""
    c = cm.load_cluster("dgx-a100-ib:8")
    group = TensorParallelGroup(c, 8)
    out = GPT3.seq_len * GPT3.hidden * 2
    ar = ring_allreduce_time(out, 8, c.intra.bandwidth, c.intra.latency)
    assert group.time("all-reduce", out) == pytest.approx(ar)
    assert group.time("reduce-scatter", out) == pytest.approx(reduce_scatter_time(out, 8, c.intra.bandwidth,
                                                                                  c.intra.latency))
    tm = TransformerCostModel(GPT3, c.device, parallel=Parallel(tp=8), tp_group=group)
    lc = tm.layer_costs()
    rate = tm.flop_rate()
    f, bi, _ = block_flops(GPT3, 8)
    assert lc.f[1] == pytest.approx(f / rate + 2 * ar)
    assert lc.b_input[1] == pytest.approx(bi / rate + 2 * ar)
    over = TransformerCostModel(GPT3, c.device, parallel=Parallel(tp=8, tp_overlap=True), tp_group=group).layer_costs()
    assert over.f[1] == pytest.approx(max(f / rate, 2 * ar))


def test_kernel_model_prices_the_split_gemms():
    sh = block_shape(GPT3, tp=8)
    gemms = {k.name: k.gemm for k in block_kernels(sh) if k.gemm}
    h, f, T = GPT3.hidden, GPT3.ffn, GPT3.seq_len
    assert gemms["qkv"] == (1, T, 3 * h // 8, h)
    assert gemms["proj"] == (1, T, h, h // 8)
    assert gemms["fc1"] == (1, T, f // 8, h) and gemms["fc2"] == (1, T, h, f // 8)
    assert gemms["qk"][0] == GPT3.heads // 8      # eager attention over a/t heads
    dev = cm.load_device("a100")
    one = transformer_layer_times(GPT3.replace(layers=1), dev, "bf16")[1]
    split = transformer_layer_times(GPT3.replace(layers=1), dev, "bf16", tp=8)[1]
    # smaller GEMMs run less efficiently, and the norms and residuals are not split
    assert sum(split) > sum(one) / 8


# ---------------------------------------------------------------------------- ZeRO-1
def test_zero1_shards_the_optimizer_state():
    dev = cm.load_device("a100")
    spec = cm.load_model("gpt3-1.3b")
    plain = TransformerCostModel(spec, dev)
    zero = TransformerCostModel(spec, dev, parallel=Parallel(zero=1), replicas=8)
    assert plain.static_split() == (2.0, 4.0, 12.0)
    assert zero.static_split() == (2.0, 4.0, 1.5)
    # reduce-scatter of 16-bit gradients + all-gather of 16-bit weights = an all-reduce of 2 bytes
    assert zero.grad_bytes == plain.grad_bytes == 2.0
    assert zero.optim_time_per_param() == pytest.approx(plain.optim_time_per_param() / 8)
    sched = lower(build("dapple", 4, 8), replicas=8)
    assert zero.bind(sched).static_mem[1] == pytest.approx(plain.bind(sched).static_mem[1] * 7.5 / 18)


# ---------------------------------------------------------------------------- network and placement
def test_tensor_parallel_groups_widen_the_links():
    c = cm.load_cluster("dgx-a100-4x8-ib")
    g2 = tensor_parallel_groups(c, 2)
    assert (g2.nodes, g2.devices_per_node, g2.nics_per_node) == (4, 4, 4)
    assert g2.intra.bandwidth == 2 * c.intra.bandwidth and g2.inter.bandwidth == 2 * c.inter.bandwidth
    g8 = tensor_parallel_groups(c, 8)
    assert (g8.nodes, g8.devices_per_node) == (4, 1) and g8.inter.bandwidth == 8 * c.inter.bandwidth
    g16 = tensor_parallel_groups(c, 16)
    assert (g16.nodes, g16.devices_per_node) == (2, 1) and g16.inter.bandwidth == 16 * c.inter.bandwidth
    with pytest.raises(cm.SpecError, match="--tp 3 does not divide the 8 devices"):
        tensor_parallel_groups(c, 3)


def test_megatron_rank_order():
    sched = lower(build("dapple", 4, 8), replicas=2)
    # rank = replica * D + device; slot = device * R + replica
    assert megatron_map(sched, cm.load_cluster("dgx-a100-4x8-ib")) == (0, 2, 4, 6, 1, 3, 5, 7)
    job = Job.of(schedule="dapple", devices=4, microbatches=8, replicas=2, tp=4, model="gpt3-1.3b")
    assert job.mapping == "megatron"
    assert Job(layout=Layout(schedule="dapple", devices=4, microbatches=8)).mapping == "sequential"


# ---------------------------------------------------------------------------- Hugging Face configs
@pytest.mark.parametrize("folder,kind,params,kv", [
    ("Meta-Llama-3-8B", "llama", 8_030_261_248, 8), ("Mistral-7B-v0.1", "llama", 7_241_732_096, 8),
    ("Qwen2-7B", "llama", 7_615_616_512, 4), ("gpt2", "gpt", 124_439_808, 12)])
def test_hf_configs(folder, kind, params, kv):
    spec = cm.load_model(str(HF / folder / "config.json"))
    assert (spec.name, spec.kind, spec.kv, spec.attention_kind) == (folder, kind, kv, "flash")
    assert model_params(spec) == params


def test_hf_config_equals_the_preset_and_takes_seq_len():
    spec = spec_from_hf_config(HF / "Meta-Llama-3-8B" / "config.json", seq_len=4096)
    preset = cm.load_model("llama3-8b")
    assert spec.seq_len == 4096
    assert block_flops(spec.replace(seq_len=8192)) == block_flops(preset)


def _write(tmp_path, data, name="config.json") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["BertForMaskedLM"]}, "field 'architectures': BertForMaskedLM is not supported; supported: "
                                             "Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2Moe, Qwen3Moe, "
                                             "DeepseekV3 ForCausalLM, GPT2LMHeadModel"),
    ({"hidden_size": None}, "missing field 'hidden_size'"),
    ({"num_hidden_layers": 0}, "field 'num_hidden_layers' must be a positive whole number"),
    ({"num_key_value_heads": 5}, "heads (32) must be a multiple of kv_heads (5)"),
    ({"architectures": None}, "missing field 'architectures'"),
])
def test_hf_config_refusals(tmp_path, change, message):
    data = json.loads((HF / "Meta-Llama-3-8B" / "config.json").read_text())
    data.update(change)
    with pytest.raises(cm.SpecError) as e:
        cm.load_model(str(_write(tmp_path, data)))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_hf_config_bad_files(tmp_path):
    text = (HF / "gpt2" / "config.json").read_text()
    for bad, message in ((text.replace('"n_embd": 768', '"n_embd": NaN'), "field 'n_embd' is NaN, not a number"),
                         (text.replace('"n_head": 12', '"n_head": 12, "n_head": 16'), "key 'n_head' is given twice"),
                         ("{ not json", "not valid JSON")):
        with pytest.raises(cm.SpecError, match=message):
            cm.load_model(str(_write(tmp_path, bad)))
    folder = tmp_path / "model.json"
    folder.mkdir()
    with pytest.raises(cm.SpecError, match="is a folder"):
        cm.load_model(str(folder))


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("kw,message", [
    (dict(model="gpt-96", tp=3), "--tp 3 does not divide heads (32) of model gpt-96"),
    (dict(model="llama3-8b", tp=16, cluster="dgx-h100-ib:8"), "--tp 16 does not divide kv_heads (8)"),
    (dict(model="gpt3-1.3b", tp=8, devices=8, replicas=2), "128 GPUs (T=8 x D=8 x R=2) do not fit on cluster "
                                                           "dgx-a100-4x8-ib with 32 devices"),
])
def test_tp_refusals(kw, message):
    lay = dict(schedule="dapple", devices=kw.pop("devices", 4), microbatches=8, replicas=kw.pop("replicas", 1))
    with pytest.raises(ValueError) as e:
        bind(Job.of(layout=Layout(**lay), **kw))
    assert message in str(e.value)


@pytest.mark.parametrize("kw,message", [
    (dict(sequence_parallel=True), "--sequence-parallel acts on a tensor-parallel group; give --tp > 1"),
    (dict(tp_overlap=True), "--tp-overlap acts on a tensor-parallel group"),
    (dict(zero=1), "--zero 1 shards over the data-parallel replicas; give --dp > 1"),
    (dict(unit_costs=True, tp=2), "--tp acts on a model's formulas: use --model/--cluster costs (not --unit-costs)"),
    (dict(stage_costs="s.yaml", tp=2), "--tp acts on a model's formulas: use --model/--cluster costs "
                                       "(not --stage-costs)"),
])
def test_parallel_option_refusals(kw, message):
    tp = kw.pop("tp", 1)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        Job.of(layout=Layout(schedule="dapple", devices=4, microbatches=8), tp=tp, **kw)


def test_executor_refuses_what_it_does_not_train_yet():
    from executor.config import RunConfig
    job = Job.of(layout=Layout(schedule="dapple", devices=2, microbatches=4), tp=2, model="tiny", tp_overlap=True)
    with pytest.raises(ValueError, match="--tp-overlap: simulated only"):
        RunConfig.from_job(job)
    cfg = RunConfig.from_job(job.with_(tp_overlap=False, sequence_parallel=True))
    assert cfg.parallel.tp == 2 and cfg.parallel.sequence_parallel


# ---------------------------------------------------------------------------- memory verdicts
def test_memory_verdict_counts_transients_and_keeps_a_reserve():
    from cost_models.memory import default_reserve, memory_verdict
    cap = 80 * GiB
    assert default_reserve(cap) == GiB + 0.05 * cap            # 5 GiB: 75 GiB usable
    assert memory_verdict(40 * GiB, 30 * GiB, cap).text.startswith("fits: peak 70 GiB")
    near = memory_verdict(40 * GiB, 32 * GiB, cap)                # 72 > 0.95 x 75
    assert near.fits and near.near and near.text.startswith("fits, near the limit")
    assert not memory_verdict(40 * GiB, 39.5 * GiB, cap).fits     # 79.5 of 80 GiB: no longer "fits"
    assert not memory_verdict(40 * GiB, 34 * GiB, cap, transient=2 * GiB).fits
    assert memory_verdict(40 * GiB, 39.5 * GiB, cap, reserve=0).fits


def test_transients_of_recomputation():
    c = cm.load_cluster("dgx-a100-ib:8")
    group = TensorParallelGroup(c, 8)
    out = GPT3.seq_len * GPT3.hidden * 2
    full = TransformerCostModel(GPT3, c.device, parallel=Parallel(tp=8, recompute="full"), tp_group=group)
    assert full.transient_bytes() == pytest.approx(block_activation_bytes(GPT3, tp=8) - out + 2 * out / 8)
    none = TransformerCostModel(GPT3, c.device, parallel=Parallel(tp=8), tp_group=group)
    assert none.transient_bytes() == 2 * out / 8


def test_simulate_reports_the_verdict(capsys):
    from experiments.cli import main
    assert main(["simulate", "-s", "interleaved", "-D", "8", "-N", "64", "-v", "3", "--tp", "8", "-m", "gpt3-175b",
                 "-c", "dgx-a100-ib:8", "--sequence-parallel", "--recompute", "selective", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert (rec["tp"], rec["gpus"], rec["parameters"], rec["device_map"]) == (8, 64, 174_615_846_912, "megatron")
    assert rec["out_of_memory"] is False and rec["memory_verdict"].startswith("fits")
    assert rec["per_device"][0]["peak_activation"] / GiB == pytest.approx(12.4, rel=0.01)


def test_sweep_takes_tp_as_an_axis(tmp_path, capsys):
    import csv

    from experiments.cli import main
    out = tmp_path / "sw"
    assert main(["sweep", "-s", "dapple", "-D", "4", "-N", "8", "--tp", "1,2", "-m", "gpt3-1.3b", "-c", "dgx-a100-ib:8",
                 "--out", str(out), "--no-figures", "--workers", "1", "--no-progress"]) == 0
    rows = {r["tp"]: r for r in csv.DictReader((out / "sweep.csv").open())}
    assert set(rows) == {"1", "2"}
    for tp, row in rows.items():
        capsys.readouterr()
        assert main(["simulate", "-s", "dapple", "-D", "4", "-N", "8", "--tp", tp, "-m", "gpt3-1.3b",
                     "-c", "dgx-a100-ib:8", "--json"]) == 0
        assert float(row["iteration_time"]) == json.loads(capsys.readouterr().out)["iteration_time"]
    assert float(rows["2"]["iteration_time"]) < float(rows["1"]["iteration_time"])
