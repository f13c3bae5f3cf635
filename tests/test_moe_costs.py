"""Mixtures of experts in the cost model (cost_models/moe.py, the MoE/MLA block formulas of
cost_models/transformer.py): closed forms of parameters, all-to-all bytes and times, memory per GPU,
and the rules joining the MoE knobs with the model and the layout."""
from __future__ import annotations

import pytest

from cost_models import load_cluster
from cost_models.job import Job
from cost_models.model_spec import ModelSpec
from cost_models.moe import ExpertGroup, check_expert_parallel, expert_data_parallel, moe_share
from cost_models.parallel import Parallel
from cost_models.transformer import (TransformerCostModel, active_params, attention_matrices, block_params,
                                     model_params)

MIXTRAL = dict(name="mixtral", kind="llama", layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
               vocab=32000, seq_len=4096, experts=8, top_k=2)
DEEPSEEK = dict(name="dsv3", kind="llama", layers=61, hidden=7168, heads=128, head_size=128, ffn_hidden=18432,
                vocab=129280, seq_len=4096, experts=256, top_k=8, expert_ffn=2048, shared_ffn=2048, dense_layers=3,
                router="sigmoid", kv_lora_rank=512, q_lora_rank=1536, rope_head_dim=64, v_head_size=128)
TINY = dict(name="tiny-moe", kind="llama", layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
            seq_len=32, experts=8, top_k=2, expert_ffn=32)


def spec(d, **kw):
    return ModelSpec(**{**d, **kw})


def test_mixtral_and_deepseek_parameter_counts_are_the_published_ones():
    # Mixtral-8x7B: per block attention 4096 x (4096 + 2 x 1024) + 4096^2 = 41,943,040, experts
    # 8 x 3 x 4096 x 14336 = 1,409,286,144, router 8 x 4096 = 32,768, two RMSNorms 8,192;
    # x 32 + embedding and head 2 x 32000 x 4096 + final norm 4096 = 46,702,792,704 (the safetensors total)
    m = spec(MIXTRAL)
    assert model_params(m) == 46_702_792_704
    # active: 6 of the 8 experts fewer per block: 46,702,792,704 - 32 x 6 x 176,160,768
    assert active_params(m) == 46_702_792_704 - 32 * 6 * 3 * 4096 * 14336 == 12_879_925_248
    # DeepSeek-V3 (without the MTP module): 671,026,419,200; 37.6 B active (the report's "37B")
    d = spec(DEEPSEEK)
    assert model_params(d) == 671_026_419_200
    assert active_params(d) == 37_552_297_472


def test_latent_attention_matrices_closed_form():
    d = spec(DEEPSEEK)
    h, a, qr, kr, r, e, v = 7168, 128, 1536, 512, 64, 128, 128
    want = h * qr + qr * a * (e + r) + h * (kr + r) + kr * a * (e + v) + a * v * h
    assert attention_matrices(d) == want == 187_105_280
    # grouped-query with a head size of its own (Qwen3-235B: 64 heads of 128 on h 4096, 4 kv heads)
    q = ModelSpec(name="q", kind="llama", layers=1, hidden=4096, heads=64, kv_heads=4, head_size=128, vocab=10,
                  seq_len=8, qk_norm=True)
    assert attention_matrices(q) == 4096 * (64 * 128 + 2 * 4 * 128) + 64 * 128 * 4096


def test_share_of_a_gpu_closed_form():
    m = spec(TINY, micro_batch=2)
    par = Parallel(ep=4, tp=2, sequence_parallel=True, expert_imbalance=1.5)
    s = moe_share(m, par)
    n = 2 * 32 / 2                             # tokens a GPU owns: b s / t
    pairs = n * 2 * 1.5                        # k copies, the busiest rank's 1.5 x
    assert s.dispatch_bytes == pairs * 64 * 2 == 12288
    assert s.combine_bytes == s.dispatch_bytes
    assert s.flops_expert == 2 * pairs * 3 * 64 * 32
    assert s.params_expert == 8 // 4 * 3 * 64 * 32
    assert moe_share(m, Parallel(ep=4, tp=2, sequence_parallel=True, fp8_dispatch=True)).dispatch_bytes == n * 2 * 64
    # a capacity factor caps the imbalance (dropping)
    capped = moe_share(m, Parallel(ep=4, expert_imbalance=3.0, capacity_factor=1.25))
    assert capped.dispatch_bytes == 2 * 32 * 2 * 1.25 * 64 * 2


def test_block_params_split_over_expert_parallel():
    m = spec(TINY)
    whole = block_params(m, 1, moe=True)
    per_gpu = block_params(m, 1, moe=True, parallel=Parallel(ep=4))
    assert whole - per_gpu == (8 - 2) * 3 * 64 * 32     # 6 of the 8 experts live elsewhere
    etp = block_params(m, 1, moe=True, parallel=Parallel(ep=4, etp=2))
    assert per_gpu - etp == 2 * 3 * 64 * 32 // 2


def test_all_to_all_time_closed_forms():
    c = load_cluster("dgx-h100-ib:4")
    B, lat = c.intra.bandwidth, c.intra.latency
    nic = c.inter.bandwidth * c.nics_per_node / c.devices_per_node
    S = 1e8
    # inside one node: 7 of 8 eighths over NVLink
    assert ExpertGroup(c, 8, top_k=8).time(S) == pytest.approx(S * 7 / 8 / B + lat, rel=1e-12)
    # two nodes, flat: 7/16 on NVLink and 8/16 through the NIC at once; the NIC is slower
    flat = ExpertGroup(c, 16, top_k=8)
    assert flat.time(S) == pytest.approx(S * 8 / 16 / nic + c.inter.latency, rel=1e-12)
    # four nodes, hierarchical: a token crosses once per distinct remote node, capped by --route-nodes
    h = ExpertGroup(c, 32, hierarchical=True, top_k=8)
    distinct = 4 * (1 - (3 / 4) ** 8)
    assert h.remote_copies() == pytest.approx(distinct * 3 / 4)
    assert ExpertGroup(c, 32, hierarchical=True, route_nodes=2, top_k=8).remote_copies() == 2 * 3 / 4
    assert h.time(S) == pytest.approx(max(S * 3 / 32 / B + lat + S / 8 * distinct * 3 / 4 / B,
                                          S / 8 * distinct * 3 / 4 / nic + c.inter.latency), rel=1e-12)
    assert ExpertGroup(c, 1).time(S) == 0.0


def test_rules_joining_the_knobs_with_model_and_layout():
    m = spec(TINY)
    check_expert_parallel(m, Parallel(ep=4, tp=2, sequence_parallel=True), replicas=2)
    with pytest.raises(ValueError, match=r"a mixture of experts at --tp 2 needs --sequence-parallel"):
        check_expert_parallel(m, Parallel(ep=4, tp=2), replicas=2)
    with pytest.raises(ValueError, match=r"--ep 4 x --etp 1 must divide the stage's T x R = 1 x 2"):
        check_expert_parallel(m, Parallel(ep=4), replicas=2)
    with pytest.raises(ValueError, match=r"--ep 3 does not divide the 8 experts"):
        check_expert_parallel(m, Parallel(ep=3), replicas=3)
    with pytest.raises(ValueError, match=r"--etp 3 does not divide the expert width 32"):
        check_expert_parallel(m, Parallel(etp=3), replicas=3)
    dense = ModelSpec(name="dense", kind="llama", layers=2, hidden=64, heads=4, vocab=10, seq_len=8)
    with pytest.raises(ValueError, match=r"--ep acts on a mixture of experts; model dense is dense"):
        check_expert_parallel(dense, Parallel(ep=2), replicas=2)
    with pytest.raises(ValueError, match="--route-nodes limits the nodes of a hierarchical all-to-all"):
        Parallel(route_nodes=4)
    with pytest.raises(ValueError, match="--expert-imbalance must be a ratio >= 1"):
        Parallel(expert_imbalance=0.5)
    assert expert_data_parallel(Parallel(ep=4, tp=2), 8) == 4


def _tcm(model, ep, replicas, zero=0, cluster="dgx-h100-ib:4", **par):
    c = load_cluster(cluster)
    p = Parallel(ep=ep, zero=zero, **par)
    return TransformerCostModel(model, c.device, parallel=p, replicas=replicas,
                                expert_group=ExpertGroup(c, ep, top_k=model.top_k))


def test_static_memory_shards_expert_optimizer_state_over_edp():
    m = spec(TINY)
    R = 8
    tcm = _tcm(m, 4, R, zero=1)
    lc = tcm.layer_costs()
    # bf16 with Adam: 2 + 4 + 12 bytes; ZeRO-1: the dense part's 12 over R = 8, the experts' over EDP = 2
    experts = 2 * 3 * 64 * 32
    block = lc.params[1]
    assert lc.static_bytes[1] == pytest.approx((block - experts) * (2 + 4 + 12 / 8) + experts * (2 + 4 + 12 / 2))
    assert lc.reduced_params[1] == block - experts     # the pipeline's all-reduce carries the dense part
    assert lc.static_bytes[0] == pytest.approx(lc.params[0] * (2 + 4 + 12 / 8))


def test_all_to_alls_are_in_f_and_b_of_moe_blocks_only():
    m = spec({**TINY, "dense_layers": 1})
    tcm = _tcm(m, 8, 8)
    disp, comb = tcm.a2a_times()
    share = tcm.moe_share()
    assert disp == ExpertGroup(load_cluster("dgx-h100-ib:4"), 8, top_k=2).time(share.dispatch_bytes) > 0
    f, b = tcm.all_to_all_times()
    assert f == (0.0, 0.0, disp + comb, disp + comb, disp + comb, 0.0)     # embedding, dense block0, 3 MoE, head
    assert b == f
    full = _tcm(m, 8, 8, recompute="full")
    assert full.all_to_all_times()[1][2] == 2 * (disp + comb)             # the re-run forward's again


def _simulate(ep, nodes, model):
    from sim import simulate_job
    job = Job.of(schedule="1f1b", devices=2, microbatches=4, replicas=16, ep=ep, model=model,
                 cluster=f"dgx-h100-ib:{nodes}")
    return simulate_job(job)


def test_expert_parallel_across_nodes_costs_more_than_inside(tmp_path):
    import yaml
    f = tmp_path / "m.yaml"
    f.write_text(yaml.safe_dump({**TINY, "hidden": 1024, "heads": 8, "kv_heads": 8, "ffn_hidden": 2048,
                                 "expert_ffn": 1024, "experts": 16, "seq_len": 2048, "layers": 4}))
    inside = _simulate(8, 4, str(f))
    across = _simulate(16, 4, str(f))
    assert across.bound.report["a2a_per_moe_layer"] > 2 * inside.bound.report["a2a_per_moe_layer"]
    assert across.result.iteration_time > inside.result.iteration_time


def test_fp8_runs_the_linear_layers_at_the_fp8_peak_and_the_attention_core_in_16_bits():
    from cost_models.transformer import _attention_core_flops, transformer_layers
    c = load_cluster("dgx-h100-ib:1")
    m = ModelSpec(name="d", kind="llama", layers=2, hidden=1024, heads=8, vocab=1000, seq_len=2048)
    fp8 = TransformerCostModel(m, c.device, parallel=Parallel(precision="fp8"))
    r8, r16 = c.device.achievable_flops("fp8"), c.device.achievable_flops("bf16")
    blk = transformer_layers(m)[1]
    core = _attention_core_flops(m)
    lc = fp8.layer_costs()
    # issue 44: + the quantize kernels of the four linear layers (delayed scaling) at the memory bandwidth
    from cost_models.fp8 import linear_cast_bytes
    h, f, bw, T = m.hidden, m.ffn, c.device.memory_bandwidth, 2048
    kv = m.kv * m.head_dim
    casts = [linear_cast_bytes(T, o, i, "delayed") for o, i in ((h + 2 * kv, h), (h, h), (2 * f, h), (h, f))]
    cf, cb = sum(x for x, _ in casts) / bw, sum(g for _, g in casts) / bw
    assert lc.f[1] == pytest.approx((blk.flops_f - core) / r8 + core / r16 + cf, rel=1e-12)
    assert lc.b_input[1] == pytest.approx((blk.flops_b_input - 2 * core) / r8 + 2 * core / r16 + cb, rel=1e-12)
    assert lc.w[1] == pytest.approx(blk.flops_w / r8, rel=1e-12)
    # the head is no Transformer Engine layer: 16 bits (issue 44)
    assert lc.f[-1] == pytest.approx(transformer_layers(m)[-1].flops_f / r16, rel=1e-12)
    with pytest.raises(ValueError, match="--precision must be one of"):
        Parallel(precision="int4")


def test_expert_load_sets_the_imbalance_from_the_experts_each_rank_holds(tmp_path):
    from cost_models.moe import effective_imbalance, read_expert_load
    m = spec(TINY)
    load = (100, 100, 100, 100, 300, 100, 100, 100)
    # EP 4: ranks hold experts (0,1) (2,3) (4,5) (6,7): 200 200 400 200 over a mean of 250
    assert effective_imbalance(m, Parallel(ep=4, expert_load=load)) == 1.6
    # EP 2: 400 600 over 500
    assert effective_imbalance(m, Parallel(ep=2, expert_load=load)) == 1.2
    # a capacity factor of 2 keeps at most 2 x the mean per expert (250): rank 2 holds 350 of 1000 / 4
    assert effective_imbalance(m, Parallel(ep=4, expert_load=load, capacity_factor=2)) == 350 / 250
    assert moe_share(m, Parallel(ep=4, expert_load=load)) == moe_share(m, Parallel(ep=4, expert_imbalance=1.6))
    f = tmp_path / "load.txt"
    f.write_text("[100, 100, 100,\n100 300 100 100 100]")
    assert read_expert_load(f) == tuple(float(x) for x in load)
    f.write_text("1, 2, many")
    with pytest.raises(ValueError, match=r"'many' is not a number; list tokens per expert"):
        read_expert_load(f)
    with pytest.raises(ValueError, match="lists 3 experts; tiny-moe has 8 per block"):
        check_expert_parallel(m, Parallel(expert_load=(1, 2, 3)), replicas=1)
    with pytest.raises(ValueError, match="give --expert-imbalance or --expert-load, not both"):
        Parallel(expert_load=load, expert_imbalance=2.0)


@pytest.mark.parametrize("argv, message", [
    (["--ep", "2", "--dp", "2"], "--ep acts on a mixture of experts; model gpt-96 is dense"),
    (["--overlap-fb"], "--overlap-fb acts on a mixture of experts"),
    (["--expert-imbalance", "0.5"], "argument --expert-imbalance: must be a number in [1, 1e+06]"),
    (["--precision", "fp4"], "argument --precision: invalid choice"),
    (["--route-nodes", "4"], "--route-nodes limits the nodes of a hierarchical all-to-all"),
])
def test_cli_refuses_moe_knobs_in_one_line(capsys, argv, message):
    from experiments.cli import main
    assert main(["simulate", "-s", "1f1b", "-D", "2", "-N", "4", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
