"""ZeRO-2 / ZeRO-3 (FSDP) and HSDP in the cost model, the simulator and the layout search: the
memory ledger per GPU against hand counts, the collectives' bytes per step (per micro-batch vs
gathered once) as closed forms, their seconds where the pipeline runs them (behind each layer's
compute, or at the step's end), and ZeRO 0 / 1 unchanged."""
from __future__ import annotations

import pytest

from cost_models import load_cluster
from cost_models.bind import bind, data_parallel_groups
from cost_models.comm import allreduce_time
from cost_models.job import Job
from cost_models.model_spec import ModelSpec, SpecError
from cost_models.parallel import Parallel
from cost_models.transformer import DataParallelGroup, TransformerCostModel, transformer_layers
from sim import simulate_job
from tests.helpers import assert_search_is_the_brute_force

SMALL = ModelSpec(name="small-llama", kind="llama", layers=8, hidden=1024, heads=16, kv_heads=4, ffn_hidden=2816,
                  seq_len=1024, vocab=32000, micro_batch=1, dtype_bytes=2)
# the small Llama's parameters per layer (checked below): embedding 32000 x 1024, a block
# 1024 (1024 + 2 x 4 x 64) + 1024^2 + 3 x 1024 x 2816 + 2 x 1024, the head 1024 + 32000 x 1024
EMB, BLOCK, HEAD = 32_768_000, 11_274_240, 32_769_024


def _job(zero, R=4, **par):
    return Job.of(schedule="1f1b", devices=2, microbatches=4, replicas=R, model=SMALL,
                  cluster=f"dgx-h100-ib:{max(1, R // 4)}", zero=zero, **par)


def test_the_small_llamas_parameters():
    assert [l.params for l in transformer_layers(SMALL)] == [EMB] + [BLOCK] * 8 + [HEAD]


# per GPU, mixed precision with Adam: w = 2 (bf16 weights), g = 4 (fp32 main gradients), o = 12 (master
# weights and moments); S = 4 replicas (HSDP: S = 2); stage 0 = embedding + 4 blocks, stage 1 = 4 blocks + head
STAGE = (EMB + 4 * BLOCK, 4 * BLOCK + HEAD)


@pytest.mark.parametrize("zero, par, per_param, gathered", [
    (0, {}, 2 + 4 + 12, (0, 0)),
    (1, {}, 2 + 4 + 12 / 4, (0, 0)),
    (2, {}, 2 + 4 / 4 + 12 / 4, (0, 0)),
    (2, {"dp_shard": 2}, 2 + 4 / 2 + 12 / 2, (0, 0)),
    # ZeRO-3 gathered once per step: the stage's whole weights (2 bytes each) beside their shard
    (3, {}, 2 / 4 + 4 / 4 + 12 / 4, (2 * STAGE[0], 2 * STAGE[1])),
    # re-gathered per micro-batch: one layer and the next one prefetched, the two largest
    (3, {"reshard_after_forward": True}, 2 / 4 + 4 / 4 + 12 / 4, (2 * (EMB + BLOCK), 2 * (HEAD + BLOCK))),
])
def test_static_memory_per_gpu_is_the_hand_count(zero, par, per_param, gathered):
    R = 1 if zero == 0 else 4
    b = bind(_job(zero, R, **par))
    want = [STAGE[s] * per_param + gathered[s] for s in (0, 1)] * R
    assert list(b.costs.static_mem) == pytest.approx(want, rel=1e-15)
    assert b.costs.meta.get("memory_gathered", (0.0, 0.0) * R) == pytest.approx(list(gathered) * R)
    tcm_rows = _tcm(_job(zero, R, **par)).static_breakdown(b.lowered)
    assert [m.total for m in tcm_rows] == pytest.approx(want, rel=1e-15)
    assert [m.gathered for m in tcm_rows] == pytest.approx(list(gathered) * R)


def _tcm(job):
    from cost_models.bind import transformer_cost_model
    return transformer_cost_model(job, SMALL, job.cluster.load())


def test_zero_0_and_1_keep_their_step_end_all_reduce_and_zero_2_and_3_move_nothing_there():
    """ZeRO-1's engines all-reduce (g + w) / 2 = 2 bytes a parameter (its reduce-scatter and
    all-gather); ZeRO-2/3 reduce-scatter in the layers' times and gather at the step's end: the
    engine's all-reduce carries 0 bytes."""
    assert bind(_job(1)).costs.param_bytes == ((2 * STAGE[0], 2 * STAGE[1]),)
    assert bind(_job(0, 1)).costs.param_bytes == ((2 * STAGE[0], 2 * STAGE[1]),)
    for z, par in ((2, {}), (3, {}), (3, {"reshard_after_forward": True})):
        assert bind(_job(z, **par)).costs.param_bytes == ((0.0, 0.0),)


@pytest.mark.parametrize("zero, par, per_mb, end", [
    # ring of S = 4: (S-1)/S p [N g_r + w] (ZeRO-2; ZeRO-3 gathered once), (S-1)/S p N (g_r + 2w) (re-gathered)
    (2, {}, 0.75 * 1000 * 2 * 8, 0.75 * 1000 * 2),
    (3, {}, 0.75 * 1000 * 2 * 8, 0.75 * 1000 * 2),
    (3, {"reshard_after_forward": True}, 0.75 * 1000 * (2 + 2 * 2) * 8, 0.0),
    # HSDP, R = 8 in 2 groups of S = 4: + the all-reduce of the g_r / S shard over the 2 groups, 2 (2-1)/2 p g_r / S
    (2, {"dp_shard": 4}, 0.75 * 1000 * 2 * 8, 0.75 * 1000 * 2 + 1000 * 2 / 4),
])
def test_collective_bytes_per_step_closed_forms(zero, par, per_mb, end):
    R = 8 if par.get("dp_shard") else 4
    tcm = _tcm(_job(zero, R, **par))
    assert tcm.fsdp_step_bytes(1000, 8) == {"per_microbatch": per_mb, "step_end": end}


def test_collectives_run_behind_each_layers_compute_and_at_the_step_end():
    """Per layer: the all-gather of p w and the reduce-scatter of p g_r over the shard group's links
    (a ring of S = 4 GPUs on one node, half an all-reduce); F and the input backward take
    max(compute, gather) when re-gathered, W max(compute, reduce-scatter); the step's end the
    optimizer on 1/S plus the gather of the updated weights; the op's first block waits for its gather."""
    cl = load_cluster("dgx-h100-ib:1")
    base = _tcm(_job(1))
    lc1 = base.layer_costs()
    group = DataParallelGroup(cl.with_device_map(None), 4, 2)
    # allreduce_time is affine in the bytes: the group finds its line once
    assert group.time("all-gather", 2 * BLOCK) == pytest.approx(allreduce_time(cl, (0, 2, 4, 6), 2 * BLOCK) / 2,
                                                                rel=1e-12)
    assert group.time("all-reduce", 7.0) == pytest.approx(allreduce_time(cl, (0, 2, 4, 6), 7.0), rel=1e-12)
    for z, every in ((2, False), (3, True)):
        tcm = _tcm(_job(z, reshard_after_forward=every))
        assert tcm.dp_group == group and tcm.replicate_group is None
        lc = tcm.layer_costs()
        f_c, b_c, w_c, end = tcm.fsdp_layer_times()
        L = transformer_layers(SMALL)
        gather = [group.time("all-gather", 2 * l.params) for l in L]
        rs = [group.time("reduce-scatter", 2 * l.params) for l in L]
        assert w_c == tuple(rs)
        assert f_c == b_c == (tuple(gather) if every else (0.0,) * 10)
        assert end == ((0.0,) * 10 if every else tuple(gather))
        assert lc.f == tuple(max(x, g) for x, g in zip(lc1.f, f_c))
        assert lc.b_input == tuple(max(x, g) for x, g in zip(lc1.b_input, b_c))
        assert lc.w == tuple(max(x, r) for x, r in zip(lc1.w, rs))
        per_param = tcm.optim_time_per_param()
        assert lc.optim_time == pytest.approx([l.params * per_param + e for l, e in zip(L, end)], rel=1e-15)
        assert dict(lc.op_overhead) == ({"F": gather[1], "B": gather[1]} if every else {})
    # the optimizer steps 1/S of the parameters: ZeRO-2 touches (g + w) / S + 2 o / S per parameter
    assert _tcm(_job(2)).optim_time_per_param() == base.optim_time_per_param()


def test_hsdp_groups_and_the_replicate_all_reduce():
    """R = 8 at S = 4: a shard group is 4 consecutive replicas (2 GPUs each: D = 2), the 2
    replicate groups 8 GPUs apart; the step's end all-reduces each layer's g_r / S over them."""
    job = _job(2, 8, dp_shard=4)
    cl = load_cluster("dgx-h100-ib:2").with_device_map(None)
    assert data_parallel_groups(job, cl) == {"dp_group": DataParallelGroup(cl, 4, 2),
                                             "replicate_group": DataParallelGroup(cl, 2, 8)}
    tcm = _tcm(job)
    end = tcm.fsdp_layer_times()[3]
    L = transformer_layers(SMALL)
    assert end == tuple(DataParallelGroup(cl, 2, 8).time("all-reduce", 2 * l.params / 4) +
                        DataParallelGroup(cl, 4, 2).time("all-gather", 2 * l.params) for l in L)
    assert data_parallel_groups(_job(1), cl) == {}


def test_the_cost_model_needs_the_groups_links():
    c = load_cluster("dgx-h100-ib:1")
    with pytest.raises(SpecError, match=r"ZeRO-2 over 4 replicas needs the shard group's links"):
        TransformerCostModel(SMALL, c.device, parallel=Parallel(zero=2), replicas=4)
    with pytest.raises(SpecError, match=r"HSDP with 2 replicate groups needs their links"):
        TransformerCostModel(SMALL, c.device, parallel=Parallel(zero=2, dp_shard=2), replicas=4,
                             dp_group=DataParallelGroup(c, 2, 2))


def test_simulated_step_shows_the_collectives():
    """The simulated step: ZeRO-2's static memory the ledger's; its summary line names the
    collectives; on a slow fabric (one GPU per node: the shard group crosses nodes) re-gathering per
    micro-batch makes every F at least its gathers."""
    bound, res = simulate_job(_job(2))
    assert res.attrs["static_mem"] == dict(enumerate(bound.costs.static_mem))
    assert bound.report["fsdp_collectives"].startswith("ZeRO-2 over 4 replicas: per micro-batch reduce-scatter")
    fsdp = bound.report["fsdp"]
    assert fsdp["stages"][0]["bytes_per_microbatch"] == 4 * 0.75 * STAGE[0] * 2
    assert fsdp["stages"][0]["bytes_step_end"] == 0.75 * STAGE[0] * 2
    slow = Job.of(schedule="1f1b", devices=2, microbatches=4, replicas=4, model=SMALL, cluster="dgx-h100-ib:8",
                  zero=3, reshard_after_forward=True, device_map="sequential")
    tcm = _tcm(slow)
    f_c = tcm.fsdp_layer_times()[0]
    b = bind(slow)
    assert b.costs.f[0][0] >= sum(f_c[:5])


def test_sweep_takes_zero_2_and_3(tmp_path, capsys):
    from experiments.cli import main
    assert main(["sweep", "-s", "1f1b", "-D", "2", "-N", "4", "--dp", "2", "--zero", "1,2,3", "-m", "tiny",
                 "-c", "dgx-h100-ib:1", "--out", str(tmp_path), "--workers", "1", "--no-figures", "--no-progress"]) == 0
    import json
    rows = [json.loads(x) for x in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert sorted(r["record"]["zero"] for r in rows) == [1, 2, 3]
    assert [r["record"]["fsdp"]["zero"] for r in rows if r["record"]["zero"] > 1] == [2, 3]


def test_moe_experts_shard_over_edp_as_the_dense_part_over_s():
    """A MoE block at ZeRO-2 (R = 8, EP = 4: EDP = 2): the dense part's gradients and optimizer
    state over S = 8, the routed experts' over EDP = 2; at ZeRO-3 the weights too, each layer's
    gather the dense part's over S plus the experts' over EDP."""
    from cost_models.moe import ExpertGroup
    m = ModelSpec(name="tiny-moe", kind="llama", layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128,
                  vocab=256, seq_len=32, experts=8, top_k=2, expert_ffn=32)
    c = load_cluster("dgx-h100-ib:1")
    experts = 2 * 3 * 64 * 32           # 8 experts / EP 4 = 2 on a GPU, 3 matrices of 64 x 32

    def tcm(zero, **par):
        return TransformerCostModel(m, c.device, parallel=Parallel(ep=4, zero=zero, **par), replicas=8,
                                    expert_group=ExpertGroup(c, 4, top_k=2), dp_group=DataParallelGroup(c, 8, 1))
    lc = tcm(2).layer_costs()
    block = lc.params[1]
    assert lc.static_bytes[1] == pytest.approx((block - experts) * (2 + 4 / 8 + 12 / 8) +
                                               experts * (2 + 4 / 2 + 12 / 2))
    assert lc.static_bytes[0] == pytest.approx(lc.params[0] * (2 + 4 / 8 + 12 / 8))
    t3 = tcm(3, reshard_after_forward=True)
    lc3 = t3.layer_costs()
    assert lc3.static_bytes[1] == pytest.approx((block - experts) * (2 / 8 + 4 / 8 + 12 / 8) +
                                                experts * (2 / 2 + 4 / 2 + 12 / 2))
    edp = allreduce_time(c, (0, 4), 2 * experts) / 2        # EDP = 2: GPUs EP x ETP = 4 apart
    assert t3.fsdp_layer_times()[0][1] == pytest.approx(
        DataParallelGroup(c, 8, 1).time("all-gather", 2 * (block - experts)) + edp, rel=1e-12)


def test_search_equals_brute_force_on_a_small_moe_at_zero_2_and_3():
    """The MoE twin of tests/test_planner_moe.py over ZeRO 2 and 3 (experts sharded over EDP, the
    dense part over R): the search's top 3 are the brute force's best 3, every bound below its truth."""
    from dataclasses import replace as _replace

    from cost_models import with_nodes
    from planner.layout import LayoutSpace
    moe = ModelSpec(name="small-moe", kind="llama", layers=4, hidden=1024, heads=16, kv_heads=4, ffn_hidden=2816,
                    seq_len=1024, vocab=32000, micro_batch=1, dtype_bytes=2, experts=8, top_k=2, expert_ffn=1024)
    cl = _replace(with_nodes(load_cluster("dgx-h100-ib"), 2), devices_per_node=4, nics_per_node=4)
    space = LayoutSpace(schedules=("dapple", "dualpipe-v"), micro_batches=(1,), recompute=("none",), tp=(1, 2),
                        sequence_parallel=(True,), zero=(2, 3))
    _, fits, _ = assert_search_is_the_brute_force(moe, cl, 16, space)
    # (R = 1 layouts take ZeRO 0: nothing to shard over)
    assert {x.job.parallel.zero for x in fits} == {0, 2, 3} and {x.job.parallel.ep for x in fits} >= {1, 2, 4}


def test_fsdp_with_context_parallelism_shards_over_s_times_c():
    """ZeRO-2/3 with --cp C: the C GPUs of a pipeline device hold the same weights, so the shard
    group is S replicas x C (torchtitan's dp_shard x cp): at R = 2, C = 2 every GPU keeps 1/4 of
    the weights, gradients and optimizer state; the group's members are the C GPUs T apart in each
    replica's T x C x D block and the same GPUs of the other replica; a ring of 4 sends 3/4 of each
    tensor; the CP group's own gradient reduction is left to the shard group (only the optimizer's
    pass at the step's end)."""
    job = Job.of(schedule="1f1b", devices=2, microbatches=4, replicas=2, model=SMALL, cluster="dgx-h100-ib:1",
                 zero=3, cp=2, cost_model="linear")
    cl = load_cluster("dgx-h100-ib:1").with_device_map(None)
    group = DataParallelGroup(cl, 2, 4, 2, 1)
    assert data_parallel_groups(job, cl) == {"dp_group": group, "replicate_group": None}
    assert group.members == 4
    b = bind(job)
    want = [STAGE[s] * (2 + 4 + 12) / 4 + 2 * STAGE[s] for s in (0, 1)] * 2
    assert list(b.costs.static_mem) == pytest.approx(want, rel=1e-15)
    tcm = _tcm(job)
    assert tcm.fsdp_step_bytes(1000, 8) == {"per_microbatch": 0.75 * 1000 * 2 * 8, "step_end": 0.75 * 1000 * 2}
    L = tcm.layers()
    per = tcm.optim_time_per_param()
    end = tcm.fsdp_layer_times()[3]         # the step end's gather, no CP-group all-reduce beside it
    assert tcm.layer_costs().optim_time == pytest.approx(tuple(l.params * per + e for l, e in zip(L, end)), rel=1e-12)
    # the members: GPUs 0 and 1 (C = 2 at T = 1) of replica 0, 4 and 5 of replica 1 (T x C x D = 4 apart)
    from cost_models.transformer import _allreduce_line
    fixed, per_byte = _allreduce_line(cl, 2, 4, 2, 1)
    assert fixed + per_byte * 1e9 == pytest.approx(allreduce_time(cl, [0, 1, 4, 5], 1e9), rel=1e-12)


def test_fp8_gathers_send_one_byte_a_parameter():
    """fp8 (two fp8 weight copies in the ledger) still gathers the 16-bit weights, w = 2 bytes a
    parameter; --fp8-gather sends them in fp8, w = 1: on a ring of S = 4, ZeRO-3 re-gathering per
    micro-batch sends 3/4 p N (g_r + 2w) a step, 3/4 x 1000 x 8 x (2 + 4) and (2 + 2)."""
    fp8 = dict(precision="fp8", reshard_after_forward=True, cluster="dgx-h100-ib:1")
    plain = _tcm(Job.of(schedule="1f1b", devices=2, microbatches=4, replicas=4, model=SMALL, zero=3, **fp8))
    one = _tcm(Job.of(schedule="1f1b", devices=2, microbatches=4, replicas=4, model=SMALL, zero=3, fp8_gather=True,
                      **fp8))
    assert (plain.gather_bytes, one.gather_bytes) == (2.0, 1.0)
    assert plain.fsdp_step_bytes(1000, 8) == {"per_microbatch": 0.75 * 1000 * 8 * (2 + 2 * 2), "step_end": 0.0}
    assert one.fsdp_step_bytes(1000, 8) == {"per_microbatch": 0.75 * 1000 * 8 * (2 + 2 * 1), "step_end": 0.0}
    f_plain, f_one = plain.fsdp_layer_times()[0], one.fsdp_layer_times()[0]
    assert all(b < a for a, b in zip(f_plain, f_one))
