"""Tensor parallelism (with sequence parallelism) and expert tensor parallelism for mixtures of experts
and latent attention in the executor (gloo on the CPU), against the single-process reference and the
simulator's ledger.

One spawn of 4 processes runs the matrix. Training (SGD, 2 steps): tiny-mixtral at T 2 x D 2 with
EP 2 (the EP group folded from the stage's two TP ranks, ETP 1, EDP 1), with ETP 2 (EP 1: each
expert's w1/w3 column- and w2 row-split over the two TP ranks), with EP 1 and ETP 1 (every expert
whole on both TP ranks, its gradient summed over them: EDP 2), and ETP 2 under zb-v's split
backward; tiny-deepseek (latent attention split over the heads, a dense first block, a shared expert
split as a dense MLP, sigmoid routing) at T 2 x D 2 with EP 2 and with ETP 2; dualpipe-v with
--overlap-fb (tiny-mixtral EP 2, tiny-deepseek ETP 2: the TP and ETP collectives of a MoE block run
blocking inside its segments); and tiny-mixtral at
T 2 x D 1 x R 2 with EP 2 and ZeRO-1 (EDP 2: the experts' SGD state sharded over it). Every step's
loss equals the reference's within 1e-5 (relative), every final parameter -- TP shards and ETP
slices gathered, each routed expert from the process holding it -- within 1e-5, and the replicated
weights of the TP ranks bit-identical.

Memory (a wider tiny Mixtral whose routing is balanced by construction: top-k = E, Adam, one step):
weights, gradients and Adam state per rank equal the ledger's to the byte, and the measured peak
activation bytes per rank within 1 % of the ledger's (:func:`cost_models.moe.moe_share`), at T 2 with
EP 1, EP 2, ETP 2, and EP 2 with ZeRO-1 at D 1 x R 2.
"""
import pytest
import torch

from cost_models import load_model
from cost_models.job import Job
from cost_models.moe import expert_params
from executor.config import RunConfig
from tests.helpers import assert_losses_equal, assert_params_equal_reference, moe_blocks_on, reference_cache

BASE = dict(steps=2, optimizer="sgd", lr=0.05, collect_params=True, timeout=30.0, devices=2, microbatches=4,
            tp=2, sequence_parallel=True)
TRAIN = {
    "mixtral-dapple-T2-EP2": dict(model="tiny-mixtral", schedule="dapple", ep=2),
    "mixtral-dapple-T2-ETP2": dict(model="tiny-mixtral", schedule="dapple", etp=2),
    "mixtral-dapple-T2": dict(model="tiny-mixtral", schedule="dapple"),
    "mixtral-zb-v-T2-ETP2": dict(model="tiny-mixtral", schedule="zb-v", etp=2),
    "deepseek-dapple-T2-EP2": dict(model="tiny-deepseek", schedule="dapple", ep=2),
    "deepseek-dapple-T2-ETP2": dict(model="tiny-deepseek", schedule="dapple", etp=2),
    # --overlap-fb: the MoE block cut at its all-to-alls (executor.overlap), its TP/ETP collectives inside a segment
    "mixtral-dualpipe-v-overlap-T2-EP2": dict(model="tiny-mixtral", schedule="dualpipe-v", ep=2, overlap_fb=True),
    "deepseek-dualpipe-v-overlap-T2-ETP2": dict(model="tiny-deepseek", schedule="dualpipe-v", etp=2,
                                                overlap_fb=True),
    "mixtral-dapple-T2-EP2-zero-D1R2": dict(model="tiny-mixtral", schedule="dapple", ep=2, zero=1, devices=1,
                                            replicas=2),
}
CASES = {4: {k: RunConfig.of(**dict(BASE, **v)) for k, v in TRAIN.items()}}
# memory: balanced routing (top-k = E: each rank routes its n = b s / T tokens to every expert, so every EP
# rank receives n k rows and every ETP member gathers ETP n k), Adam, one step
BALANCED = load_model("tiny-mixtral").replace(name="mem-mixtral", hidden=256, ffn_hidden=384, experts=4, top_k=4,
                                              dropout=False, attention="flash")
MEM = dict(BASE, model=BALANCED, optimizer="adam", lr=1e-3, steps=1, collect_params=False, schedule="dapple")
for _k, _v in {"T2": {}, "T2-EP2": dict(ep=2), "T2-ETP2": dict(etp=2),
               "T2-EP2-zero-D1R2": dict(ep=2, zero=1, devices=1, replicas=2)}.items():
    CASES[4][f"mem-{_k}"] = RunConfig.of(**dict(MEM, **_v))
# latent attention's weights and Adam state per rank (its activations against the ledger: mla-mem's tests)
CASES[4]["deepseek-static-T2-EP2"] = RunConfig.of(**dict(MEM, model="tiny-deepseek", ep=2))
IDS = sorted(TRAIN)
MEM_IDS = sorted(k for k in CASES[4] if k.startswith("mem-"))


@pytest.fixture(scope="module")
def references():
    return reference_cache()


@pytest.mark.slow
@pytest.mark.parametrize("case", IDS)
def test_losses_and_parameters_equal_reference(runs, references, case):
    """Losses within 1e-5 of the reference's at every step, every gathered final parameter within 1e-5,
    and the copies of a replicated weight bit-identical: the TP ranks' (``tp_replica_drift`` 0) and the
    replicas' (one tensor per name and replica, all equal)."""
    cfg, sched, res = runs(4)[case]
    ref = references(cfg)
    assert_losses_equal(res, ref)
    by_name = assert_params_equal_reference(res, ref, sched)
    assert res.extra["tp_replica_drift"] == 0.0
    assert all(torch.equal(t, ts[0]) for ts in by_name.values() for t in ts)


def test_mla_down_projections_are_whole_on_every_tp_rank():
    """tiny-deepseek (h 32, a 4, e 8, r 4, v 8, q_r 24, kv_r 16, dense f 64): its attention's matrices are
    Q 32 x 24 + 24 x 4 x 12 = 1920, KV 32 x 20 + 16 x 4 x 16 = 1664, output 4 x 8 x 32 = 1024, 4608 in all,
    of which the down-projections 32 x (24 + 16 + 4) = 1408 stay whole at T 2 (Megatron-LM duplicates
    them), so the dense block 0 holds (4608 - 1408) / 2 + 3 x 32 x 64 / 2 = 4672 parameters less at T 2."""
    from cost_models.transformer import attention_matrices, block_params
    spec = load_model("tiny-deepseek")
    assert attention_matrices(spec) == 4608
    assert block_params(spec, 1) - block_params(spec, 2) == 4672


@pytest.mark.slow
def test_latent_attention_weights_per_rank_equal_the_ledger(runs):
    """tiny-deepseek at T 2 x D 2 with EP 2, Adam: weights, gradients and Adam state per rank equal the
    ledger's to the byte (q_a, kv_a and the latent norms whole on each TP rank, q_b, kv_b column- and
    proj row-split, the shared expert split as a dense MLP, E / 2 routed experts whole)."""
    from cost_models.bind import bind
    cfg, _, res = runs(4)["deepseek-static-T2-EP2"]
    b = bind(Job(layout=cfg.layout, parallel=cfg.parallel, model=cfg.spec(), cluster="dgx-a100-1x8"))
    assert [d["static_bytes"] for d in res.per_device] == [int(x) for x in b.costs.static_mem]


@pytest.mark.slow
@pytest.mark.parametrize("case", MEM_IDS)
def test_memory_per_rank_equals_the_ledger(runs, case):
    """Weights, gradients and Adam state per rank (TP rank 0 of each pipeline rank) equal the ledger's to
    the byte: at T 2 without ZeRO a rank holds 16 bytes per parameter (fp32 weight, gradient, m, v) of
    h^2 (8 + 4 kv / heads) / T attention and the E / (EP ETP) routed experts' 3 h f_e each, so EP 2 and ETP 2
    hold the same bytes, 16 x 2 x 3 h f_e per MoE block less than EP 1. Peak activations within 1 % of
    the ledger's: the MoE block keeps per routed row 2 h d (dispatched input and combined output), with
    ETP the gathered input ETP h d instead of h d (cost_models.moe's formula)."""
    from cost_models.bind import bind
    from cost_models.memory import peak_activation
    cfg, sched, res = runs(4)[case]
    b = bind(Job(layout=cfg.layout, parallel=cfg.parallel, model=cfg.spec(), cluster="dgx-a100-1x8"))
    assert [op for prog in b.lowered.programs for op in prog] == [op for prog in sched.programs for op in prog]
    assert [d["static_bytes"] for d in res.per_device] == [int(x) for x in b.costs.static_mem]
    for got, want in zip(res.per_device, peak_activation(b.lowered, b.costs)):
        assert abs(got["peak_activation_bytes"] - want) <= 0.01 * want, (case, got["peak_activation_bytes"], want)
    if case in ("mem-T2-EP2", "mem-T2-ETP2"):
        _, _, one = runs(4)["mem-T2"]
        spec = cfg.spec()
        for r, (a, w) in enumerate(zip(res.per_device, one.per_device)):
            blocks = moe_blocks_on(cfg, sched, r)
            assert w["static_bytes"] - a["static_bytes"] == 16 * blocks * spec.experts // 2 * expert_params(spec)


@pytest.mark.slow
def test_etp_keeps_the_gathered_rows(runs):
    """ETP 2 keeps h d more per routed row than EP 2 (the expert input all-gathered over ETP): balanced
    routing gives each rank n k = (b s / T) E = 64 rows per MoE block and micro-batch, so the peaks
    differ by m x 2 blocks x (64 h d + the experts' row regrouping: two int64 indices per row grouped,
    2 ETP n k at ETP 2, 2 n k at EP 2, :func:`cost_models.moe.regroup_bytes`) on a rank whose dapple
    peak holds m = D - r micro-batches: measured and in the ledger, to the byte."""
    from cost_models.bind import bind
    from cost_models.memory import peak_activation
    peaks = {}
    for k in ("mem-T2-EP2", "mem-T2-ETP2"):
        cfg, _, res = runs(4)[k]
        b = bind(Job(layout=cfg.layout, parallel=cfg.parallel, model=cfg.spec(), cluster="dgx-a100-1x8"))
        peaks[k] = ([d["peak_activation_bytes"] for d in res.per_device], peak_activation(b.lowered, b.costs))
    spec = BALANCED
    rows = spec.micro_batch * spec.seq_len // 2 * spec.top_k
    (ep, ep_led), (etp, etp_led) = peaks["mem-T2-EP2"], peaks["mem-T2-ETP2"]
    for r in range(2):
        m = 2 - r
        assert etp_led[r] - ep_led[r] == m * 2 * (rows * spec.hidden * spec.dtype_bytes + 2 * 8 * (2 * rows - rows))
        assert etp[r] - ep[r] == m * 2 * (rows * spec.hidden * spec.dtype_bytes + 2 * 8 * (2 * rows - rows))
