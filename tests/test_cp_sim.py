"""Context parallelism in the cost model and the simulator (issue 43, item 2): the causal load balance
of 2C chunks, FLOPs and the activation ledger at s/C against hand counts, the K/V exchange's bytes
and times as closed forms on known links (ring and all-gather), the gradient reduction over the C
GPUs, the T x C collapse of a rank, and the refusals."""
import pytest

from cost_models import load_cluster, load_device, load_model
from cost_models.bind import bind, transformer_cost_model
from cost_models.cluster import tensor_parallel_groups
from cost_models.job import Job
from cost_models.parallel import Parallel
from cost_models.transformer import (ContextParallelGroup, TransformerCostModel, block_activation_bytes, block_flops,
                                     boundary_bytes, cp_chunks, cp_kv_block_bytes, transformer_layers)

NVLINK4, NVLAT = 450e9, 3e-6          # dgx-h100-ib: per-GPU NVLink port, latency
NDR, IBLAT = 400e9 / 8, 5e-6          # one 400 Gb/s NIC per GPU
EFF = load_device("h100").efficiency   # the linear model's share of the peak (fitted: the h100 preset)


def llama(seq=8192, **kw):
    return load_model("llama3-8b").replace(seq_len=seq, **kw)


def tcm(model, cluster="dgx-h100-ib:4", **par):
    p = Parallel(**par)
    cl = load_cluster(cluster)
    job = Job.of(schedule="dapple", devices=1, microbatches=1, model=model, cluster=cluster, cost_model="linear",
                 parallel=p)
    return transformer_cost_model(job, model, cl)


# ---------------------------------------------------------------------------- load balance
@pytest.mark.parametrize("C", [1, 2, 3, 4, 8])
def test_every_cp_rank_gets_exactly_one_cth_of_the_causal_token_pairs(C):
    """Chunks i and 2C-1-i of m tokens: (2C-1) m^2 + m^2 + m = s(s+1)/(2C) query-key pairs with
    key <= query on every rank, counted one by one; a contiguous split would not balance."""
    m = 5
    s = 2 * C * m
    total = s * (s + 1) // 2
    for r in range(C):
        mine = [q for c in cp_chunks(r, C) for q in range(c * m, (c + 1) * m)]
        pairs = sum(q + 1 for q in mine)          # keys 0..q for query q
        assert pairs * C == total == C * s * (s + 1) // (2 * C)
    assert cp_chunks(0, 4) == (0, 7) and cp_chunks(3, 4) == (3, 4)
    if C > 1:
        last = sum(q + 1 for q in range(s - s // C, s))
        assert last * C == pytest.approx(total * (2 * C - 1) / C, rel=0.1)
    with pytest.raises(ValueError, match="CP rank 4 is not in 0..3"):
        cp_chunks(4, 4)


# ---------------------------------------------------------------------------- FLOPs and the ledger
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_block_flops_and_activations_at_cp2_are_the_formulas_at_s_over_c(tp, sp):
    """Llama-3-8B (flash attention, no dropout) at C = 2: each GPU's block is the linear layers at
    s/2 plus 1/2 of the whole attention core; its kept bytes are Korthikanti's at s/2:
    (s/C) b [4hd (/t with SP) + ((2h + 2ke) d + 3fd + 4a) / t]."""
    m = llama()
    C, s, b, h, a, k, e, f, d = 2, 8192, 1, 4096, 32, 8, 128, 14336, 2
    t = tcm(m, tp=tp, sequence_parallel=sp, cp=C)
    L = t.layers()
    blk = L[1]
    lin = 2 * (s // C) * b * (h * (h + 2 * k * e) + h * h + 3 * h * f) / tp
    core = 4 * b * s * s * h / (tp * C)
    assert blk.flops_f == pytest.approx(lin + core, rel=1e-12)
    assert blk.flops_b_input == pytest.approx(lin + 2 * core, rel=1e-12)
    assert blk.flops_w == pytest.approx(lin, rel=1e-12)
    # 1/C of the whole block's attention core, and the linear layers at s/C: 1/C of the unsplit block
    whole = block_flops(m, tp)
    assert blk.flops_f == pytest.approx(whole[0] / C, rel=1e-12)
    kept = (s // C) * b * (4 * h * d / (tp if sp else 1) + ((2 * h + 2 * k * e) * d + 3 * f * d + 4 * a) / tp)
    assert blk.act_bytes == kept
    if (tp, sp) == (1, False):
        assert kept == 4096 * 139392 == 570_949_632          # the number cp-exec's executor holds to
    assert blk.act_bytes == block_activation_bytes(m, tp=tp, sp=sp) / C
    assert blk.params == transformer_layers(m, tp=tp, sp=sp)[1].params
    assert blk.out_bytes == boundary_bytes(m) == s * b * h * d    # the whole T x C group's (1/(TC) a GPU)
    emb, head = L[0], L[-1]
    assert emb.act_bytes == 8 * b * s // C
    V = -(-m.vocab // tp)
    assert head.act_bytes == 2 * b * (s // C) * h * d / (tp if sp else 1) + b * (s // C) * V * 4
    assert head.flops_f == 2 * b * (s // C) * h * V


def test_eager_scores_are_one_cth_and_recomputation_reruns_the_split_core():
    """GPT with eager attention and dropout: the kept scores are (s/C) x s per head, a s^2 b (d + 1 + d) / C;
    selective recomputation drops them and re-runs 1/C of the core; the transient adds the K/V buffers."""
    m = load_model("gpt3-1.3b").replace(seq_len=2048)
    C, s, b, a, d = 4, 2048, m.micro_batch, m.heads, 2
    none = tcm(m, cp=C)
    sel = tcm(m, cp=C, recompute="selective")
    scores = a * s * s * b * (d + 1 + d) / C
    assert none.layers()[1].act_bytes - sel.layers()[1].act_bytes == scores
    assert sel.layers()[1].flops_recompute == 4 * b * s * s * m.hidden / C
    X = cp_kv_block_bytes(m, C)
    assert X == 2 * (s // C) * b * m.hidden * d                 # k = a heads of e: 2 (s/C) b h d
    # the recomputed layer's kept bytes (its scores at (s/C) x s), two boundary buffers, 4 X of ring buffers
    assert sel.transient_bytes() == scores + 2 * boundary_bytes(m) / C + 4 * X


# ---------------------------------------------------------------------------- the K/V exchange
def test_ring_exchange_inside_a_node_closed_forms():
    """T = 2, C = 2 inside a DGX H100 node: a ring step moves each GPU's X over its own NVLink port,
    p(n) = 3 us + n / 450 GB/s; F: (C-1) X, exposed (C-1) max(0, p(X) - a); B: 2 (C-1) X,
    (C-2) p(2X) + 2 p(X), exposed max(0, p(X) - 2a) + p(X) at C = 2."""
    m = llama(seq=32768)
    C, T = 2, 2
    t = tcm(m, tp=T, cp=C)
    X = cp_kv_block_bytes(m, C, T)
    assert X == 2 * (32768 // C) * 1 * (8 // T) * 128 * 2
    p = lambda n: NVLAT + n / NVLINK4  # noqa: E731
    a = 4 * 32768 ** 2 * 4096 / (T * C) / C / (989.4e12 * EFF)      # one ring step of attention core
    x = t.cp_exchange()
    assert x.f_bytes == (C - 1) * X and x.b_bytes == 2 * (C - 1) * X
    assert x.f_time == pytest.approx((C - 1) * p(X), rel=1e-12)
    assert x.f_exposed == pytest.approx((C - 1) * max(0.0, p(X) - a), rel=1e-12, abs=1e-15)
    assert x.b_time == pytest.approx(2 * p(X), rel=1e-12)
    assert x.b_exposed == pytest.approx(max(0.0, p(X) - 2 * a) + p(X), rel=1e-12)
    # the layer: linear + first block + (C-1) max(a, p) in F
    lc, L = t.layer_costs(), t.layers()
    rate = 989.4e12 * EFF
    tp_f = t.collective_times()[1][0]
    assert lc.f[1] == pytest.approx(L[1].flops_f / rate + tp_f + x.f_exposed, rel=1e-12)
    core = a * C
    assert lc.f[1] - tp_f == pytest.approx((L[1].flops_f / rate - core) + a + (C - 1) * max(a, p(X)), rel=1e-12)


@pytest.mark.parametrize("C,seq", [(4, 65536), (8, 4096)])
def test_ring_exchange_across_nodes_and_recomputation(C, seq):
    """T = 8: a CP rank is a node, every ring hop crosses the fabric, each GPU on its own NIC:
    p(n) = 5 us + n / 50 GB/s; (C-2) steps move K,V and dK,dV together; full recomputation adds
    F's exchange to B. At 4,096 tokens over C = 8 a step's attention (0.94 us) is shorter than a hop:
    the ring is exposed."""
    m = llama(seq=seq)
    T = 8
    t = tcm(m, cluster=f"dgx-h100-ib:{C}", tp=T, cp=C, recompute="full")
    X = cp_kv_block_bytes(m, C, T)
    p = lambda n: IBLAT + n / NDR  # noqa: E731
    a = 4 * seq ** 2 * 4096 / (T * C) / C / (989.4e12 * EFF)
    x = t.cp_exchange()
    f_exp = (C - 1) * max(0.0, p(X) - a)
    assert (f_exp > 0) == (seq == 4096)
    b_exp = (C - 2) * max(0.0, p(2 * X) - 2 * a) + max(0.0, p(X) - 2 * a) + p(X)
    assert x.f_bytes == (C - 1) * X and x.b_bytes == 3 * (C - 1) * X
    assert x.f_time == pytest.approx((C - 1) * p(X), rel=1e-12)
    assert x.f_exposed == pytest.approx(f_exp, rel=1e-12, abs=1e-15)
    assert x.b_time == pytest.approx((C - 2) * p(2 * X) + 2 * p(X) + (C - 1) * p(X), rel=1e-12)
    assert x.b_exposed == pytest.approx(b_exp + f_exp, rel=1e-12)


def test_allgather_exchange_is_exposed_and_moves_the_rings_bytes():
    """Llama 3's all-gather, C = 4 inside a node at T = 2: F all-gathers the C X of K,V (each GPU sends
    (C-1) X: (C-1) X / 450 GB/s + (C-1) x 3 us), B all-gathers them again and reduce-scatters dK,dV;
    nothing hidden."""
    m = llama(seq=16384)
    C, T = 4, 2
    t = tcm(m, tp=T, cp=C, cp_comm="allgather")
    X = cp_kv_block_bytes(m, C, T)
    ag = (C - 1) * X / NVLINK4 + (C - 1) * NVLAT
    x = t.cp_exchange()
    assert (x.f_bytes, x.b_bytes) == ((C - 1) * X, 2 * (C - 1) * X)
    assert x.f_time == pytest.approx(ag, rel=1e-12) and x.f_exposed == x.f_time
    assert x.b_time == pytest.approx(2 * ag, rel=1e-12) and x.b_hidden == 0
    assert t.transient_bytes() == 2 * boundary_bytes(m) / (T * C) + 2 * C * X


def test_gradients_reduce_over_the_cp_group_and_zero_shards_over_r_times_c():
    """The C GPUs of a pipeline device hold the same weights: the step's end reduce-scatters and
    all-gathers each GPU's gradients in the CP group (an all-reduce of params x 2 bytes, ring inside the
    node); the replicas' all-reduce is the engine's, T x the GPU's bytes on a T x C wide port. ZeRO-1
    shards the optimizer state over R x C."""
    m = llama()
    C, T = 2, 2
    t = tcm(m, tp=T, cp=C)
    lc, L = t.layer_costs(), t.layers()
    p = L[1].params
    ring = 2 * (C - 1) / C * p * 2 / NVLINK4 + 2 * (C - 1) * NVLAT
    assert lc.optim_time[1] == pytest.approx(p * t.optim_time_per_param() + ring, rel=1e-12)
    assert lc.grad_bytes_per_param == 2 * T
    z = TransformerCostModel(m, t.device, parallel=Parallel(tp=T, cp=C, zero=1), replicas=4, compute="linear",
                             tp_group=t.tp_group, cp_group=t.cp_group)
    assert z.static_split() == (2.0, 4.0, 12.0 / (4 * C))


# ---------------------------------------------------------------------------- placement and the job
def test_a_rank_collapses_t_times_c_gpus_as_t_alone_did():
    c = load_cluster("dgx-h100-ib:4")
    assert tensor_parallel_groups(c, 2, 2) == tensor_parallel_groups(c, 4)
    assert tensor_parallel_groups(c, 8, 4) == tensor_parallel_groups(c, 32)
    with pytest.raises(ValueError, match=r"--tp 2 x --cp 3 = 6 does not divide the 8 devices per node"):
        tensor_parallel_groups(c, 2, 3)


def test_a_cp_job_places_t_c_d_r_gpus_and_prices_one_rank_per_pipeline_device():
    job = Job.of(schedule="dapple", devices=2, microbatches=4, replicas=2, tp=2, cp=2, seq_len=8192,
                 model="llama3-8b", cluster="dgx-h100-ib:2", device_map="sequential")
    assert job.gpus == 16
    b = bind(job)
    assert b.report["gpus"] == 16 and b.report["cp"] == 2 and b.report["cost_model"] == "linear"
    assert b.network.num_devices == 4 and b.network.devices_per_node == 2      # 2 nodes of 2 ranks of 4 GPUs
    x = b.report["cp_exchange_per_layer"]
    X = cp_kv_block_bytes(llama(), 2, 2)
    assert (x["f_bytes"], x["b_bytes"]) == (X, 2 * X)
    # the step's exchange on the busiest device: N F and N B of its 16 blocks (llama3-8b's 32 over D = 2)
    assert b.report["cp_time"] == pytest.approx(4 * 16 * (x["f_time"] + x["b_time"]), rel=1e-12)
    # the replicas' all-reduce of a stage: T x a GPU's gradient bytes, on a port T x C GPUs wide (the
    # node's 8 NICs shared by its 2 ranks: 4 x 50 GB/s): each GPU's 1/C shard over its own NIC
    t = transformer_cost_model(job, job.parallel.sized(load_model("llama3-8b")), load_cluster("dgx-h100-ib:2"))
    stage0 = sum(x.params for x in t.layers()[:17])
    assert b.costs.param_bytes[0][0] == stage0 * 2 * 2
    assert b.network.inter.bandwidth == 4 * NDR
    with pytest.raises(ValueError, match=r"32 GPUs \(T=2 x C=2 x D=4 x R=2\) do not fit on cluster dgx-h100-ib:2"):
        bind(job.with_(devices=4))


@pytest.mark.parametrize("what,match", [
    (dict(cp=3, model="llama3-8b"), r"--cp 3 needs the sequence length \(8192\) divisible by 2 x 3 = 6"),
    (dict(cp=2, model="deepseek-v3"), r"--cp 2: context parallelism is priced for multi-head attention; model "
                                      r"deepseek-v3 has latent attention \(MLA\)"),
    (dict(cp=2, model="llama3-8b", cost_model="kernels"), r"--cp 2 is priced by --cost-model linear"),
    (dict(cp=4, tp=8, sequence_parallel=True, seq_len=8200, model="llama3-8b"), r"--cp 4 with --sequence-parallel "
                                                                                  r"needs each GPU's 2050 tokens"),
])
def test_refusals(what, match):
    job = Job.of(schedule="dapple", devices=1, microbatches=1, cluster="dgx-h100-ib:4", **what)
    with pytest.raises(ValueError, match=match):
        bind(job)


def test_cp1_changes_nothing():
    m = llama()
    one, plain = tcm(m, tp=2), tcm(m, tp=2, cp=1)
    assert one.layer_costs() == plain.layer_costs() and one.transient_bytes() == plain.transient_bytes()
    assert ContextParallelGroup(load_cluster("dgx-h100-ib:1"), 2, 4).ring_step(1e6) == pytest.approx(
        NVLAT + 1e6 / NVLINK4, rel=1e-12)


def test_simulate_and_compare_name_c_and_the_exchange(capsys):
    """simulate --json carries C, the exchange of a block (bytes, seconds, exposed) and the step's on the
    busiest device with its hidden part; the summary says them in one line; compare's table has them."""
    import json

    from experiments.cli import main
    argv = ["-D", "2", "-N", "4", "-m", "llama3-8b", "-c", "dgx-h100-ib:1", "--tp", "2", "--cp", "2",
            "--seq-len", "16384"]
    assert main(["simulate", "-s", "dapple", *argv, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    job = Job.of(schedule="dapple", devices=2, microbatches=4, tp=2, cp=2, seq_len=16384, model="llama3-8b",
                 cluster="dgx-h100-ib:1")
    b = bind(job)
    assert rec["cp"] == 2 and rec["cp_comm"] == "ring" and rec["gpus"] == 8
    assert rec["cp_exchange_per_layer"] == b.report["cp_exchange_per_layer"]
    x = b.report["cp_exchange_per_layer"]
    hidden = (x["f_time"] - x["f_exposed"]) + (x["b_time"] - x["b_exposed"])
    assert rec["cp_time"] == pytest.approx(4 * 16 * (x["f_time"] + x["b_time"]), rel=1e-12)
    assert rec["cp_hidden"] == pytest.approx(4 * 16 * hidden, rel=1e-12)
    assert main(["simulate", "-s", "dapple", *argv]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dapple: T=2 C=2 D=2 N=4 R=1")
    line = " ".join(ln.strip() for ln in out.split("context parallel:")[1].split("\n")[:2])
    assert f"C=2, a ring of P2P steps: {rec['cp_time']:.6g} s per device in the step" in line
    assert f"{rec['cp_hidden']:.6g} s ({rec['cp_hidden'] / rec['cp_time']:.0%}) hidden" in line
    assert main(["compare", "-s", "dapple,zb-v", *argv]) == 0
    out = capsys.readouterr().out
    assert out.startswith("T=2 C=2 (ring) D=2 N=4 R=1") and "cp_time" in out and "cp_hidden" in out
