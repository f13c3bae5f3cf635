"""Mixtures of experts and multi-head latent attention in the executor (EP 1) against the
single-process reference, the routing against brute force, the memory against the ledger.

Two spawns run the matrix (processes reused across jobs): 2 processes hold dapple, interleaved,
zb-v and dualpipe-v at D = 2 for the tiny presets ``tiny-mixtral`` (8 experts top-2, softmax
router, GQA) and ``tiny-deepseek`` (MLA, 1 shared expert, 1 dense first block, sigmoid router
with DeepSeek's bias), with selective and full recomputation, capacity-factor dropping and bf16;
4 processes dapple at D = 2 x R = 2. Every per-step loss (cross-entropy + 0.01 x the blocks'
load-balancing losses) equals the reference's within 1e-5 (relative; bf16: 1e-3), every final
parameter within 1e-5 of the reference's. Memory (``mem-`` cases, a wider tiny Mixtral, Adam,
one step): the measured peak activation bytes per rank within 1% of the simulator's ledger
(:func:`cost_models.moe.moe_share`'s MoE terms at EP 1), the weights, gradients and Adam state per
rank equal to the ledger's.
"""
import math

import pytest
import torch

from cost_models import load_model
from cost_models.job import Job
from executor.config import RunConfig
from executor.model import full_model, stage_module
from executor.moe import MoeMLP, capacity, route_tokens
from tests.helpers import assert_losses_equal, assert_params_equal_reference, reference_cache

MIXTRAL, DEEPSEEK = load_model("tiny-mixtral"), load_model("tiny-deepseek")
BASE = dict(steps=3, optimizer="sgd", lr=0.05, collect_params=True, timeout=60.0)


def _cases_world2():
    cases = {}
    for spec in (MIXTRAL, DEEPSEEK):
        for s in ("dapple", "interleaved", "zb-v", "dualpipe-v"):
            cases[f"{spec.name}-{s}-D2"] = RunConfig.of(schedule=s, devices=2, microbatches=4, model=spec, **BASE)
        cases[f"{spec.name}-dapple-recompute-selective-D2"] = RunConfig.of(
            schedule="dapple", devices=2, microbatches=4, model=spec, recompute="selective", **BASE)
        cases[f"{spec.name}-zb-v-recompute-full-D2"] = RunConfig.of(
            schedule="zb-v", devices=2, microbatches=4, model=spec, recompute="full", **BASE)
        cases[f"{spec.name}-dualpipe-v-recompute-full-D2"] = RunConfig.of(
            schedule="dualpipe-v", devices=2, microbatches=4, model=spec, recompute="full", **BASE)
        cases[f"{spec.name}-zb-v-capacity-D2"] = RunConfig.of(
            schedule="zb-v", devices=2, microbatches=4, model=spec, capacity_factor=1.0, **BASE)
        cases[f"{spec.name}-dapple-capacity-recompute-full-D2"] = RunConfig.of(
            schedule="dapple", devices=2, microbatches=4, model=spec, capacity_factor=1.25, recompute="full", **BASE)
    cases["tiny-deepseek-zb-v-bf16-D2"] = RunConfig.of(schedule="zb-v", devices=2, microbatches=4, model=DEEPSEEK,
                                                       dtype="bf16", **BASE)
    for s in ("dapple", "zb-v"):
        cases[f"mem-adam-{s}-D2"] = RunConfig.of(schedule=s, devices=2, microbatches=4, **MEM)
    return cases


# memory against the ledger: a wider tiny Mixtral (the bytes the ledger leaves out, a norm's
# statistics and the loss's target indices, are then well under 1% of a rank's peak); Adam (16 bytes
# per fp32 parameter), one step
MEM_MOE = MIXTRAL.replace(name="mem-mixtral", hidden=256, ffn_hidden=384)
MEM = dict(BASE, model=MEM_MOE, optimizer="adam", lr=1e-3, steps=1, collect_params=False)
CASES = {2: _cases_world2(),
         4: {f"{spec.name}-dapple-D2R2": RunConfig.of(schedule="dapple", devices=2, microbatches=2, replicas=2,
                                                     model=spec, **dict(BASE, steps=2))
             for spec in (MIXTRAL, DEEPSEEK)}}
IDS = [(w, k) for w, cases in CASES.items() for k in cases if not k.startswith("mem-")]


@pytest.fixture(scope="module")
def references():
    return reference_cache()


@pytest.mark.slow
@pytest.mark.parametrize("world,case", IDS, ids=[k for _, k in IDS])
def test_losses_and_parameters_equal_reference(runs, references, world, case):
    cfg, sched, res = runs(world)[case]
    ref = references(cfg)
    if cfg.dtype == "bf16":       # the pipeline rounds its messages to bf16, the reference (same autocast) does not
        assert_losses_equal(res, ref, rel=1e-3)
        return
    assert_losses_equal(res, ref)
    assert_params_equal_reference(res, ref, sched)


def test_presets_are_what_they_imitate():
    """tiny-mixtral: every block 8 experts top-2 of a softmax router, no shared expert, 2 KV heads
    for 4; tiny-deepseek: MLA, the first block dense, 8 experts top-2 of sigmoid scores, 1 shared
    expert; both count the balance loss with weight 0.01."""
    m, d = MIXTRAL, DEEPSEEK
    assert (m.experts, m.top_k, m.router, m.shared_ffn, m.dense_layers, m.kv, m.heads, m.is_mla) == \
        (8, 2, "softmax", 0, 0, 2, 4, False)
    assert (d.experts, d.top_k, d.router, d.shared_ffn, d.dense_layers, d.is_mla, d.q_lora_rank) == \
        (8, 2, "sigmoid", 16, 1, True, 24)
    assert m.aux_loss_coeff == d.aux_loss_coeff == 0.01
    model = full_model(d)
    names = dict(model.named_parameters())
    assert "blocks.0.mlp.down.weight" in names and "blocks.1.mlp.experts.7.w2.weight" in names
    bias = names["blocks.1.mlp.router.bias"].detach()
    assert bias.shape == (8,) and float(bias.abs().sum()) == 0
    assert names["blocks.1.attn.kv_a.weight"].shape == (16 + 4, 32)           # kv_lora_rank + rope_head_dim
    assert names["blocks.1.attn.kv_b.weight"].shape == (4 * (8 + 8), 16)      # heads x (head_size + v_head_size)
    assert names["blocks.1.attn.q_b.weight"].shape == (4 * (8 + 4), 24)
    # the parameters the cost model counts, exactly
    from cost_models.transformer import model_params
    assert sum(p.numel() for p in model.parameters()) == model_params(d)
    assert sum(p.numel() for p in full_model(m).parameters()) == model_params(m)


def test_stages_hold_the_whole_models_weights():
    """Every split starts from the reference's weights (seeded by global name)."""
    whole = full_model(DEEPSEEK, seed=3).state_dict()
    for s in range(2):
        for name, value in stage_module(DEEPSEEK, 2, s, seed=3).state_dict().items():
            assert torch.equal(value, whole[name]), name


# ----------------------------------------------------------------------------- routing
def _brute_routing(logits, k, router, bias, c):
    """route_tokens by loops over tokens and experts."""
    n, E = logits.shape
    pairs = []      # (token, slot, expert, selection score, weight)
    for t in range(n):
        p = torch.softmax(logits[t], -1) if router == "softmax" else torch.sigmoid(logits[t])
        choose = [float(p[e]) + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
        top = sorted(range(E), key=lambda e: -choose[e])[:k]
        total = sum(float(p[e]) for e in top)
        pairs += [(t, j, e, choose[e], float(p[e]) / total) for j, e in enumerate(top)]
    cap = math.ceil(c * n * k / E) if c else None
    kept = []
    for e in range(E):
        mine = sorted((x for x in pairs if x[2] == e), key=lambda x: (-x[3], x[0]))
        kept += sorted(mine[:cap] if cap is not None else mine, key=lambda x: x[0])
    return kept, len(pairs) - len(kept)


@pytest.mark.parametrize("router,with_bias,c", [("softmax", False, 0.0), ("softmax", False, 1.0),
                                                 ("sigmoid", True, 0.0), ("sigmoid", True, 1.25)])
def test_routing_equals_brute_force(router, with_bias, c):
    """Top-k of the scores (plus the bias with sigmoid scores: selection only), weights renormalised
    over the k, capacity ceil(c n k / E) per expert keeping the highest selection scores (ties to the
    lower token), pairs in expert-major, token order."""
    g = torch.Generator().manual_seed(7)
    n, E, k = 24, 6, 2
    logits = torch.randn(n, E, generator=g, dtype=torch.float64)
    logits[:, 0] += 1.5                                    # expert 0 oversubscribed: the capacity drops
    bias = torch.randn(E, generator=g, dtype=torch.float64) * 0.3 if with_bias else None
    r = route_tokens(logits, k, router, bias, c)
    kept, dropped = _brute_routing(logits, k, router, bias, c)
    assert r.expert.tolist() == [x[2] for x in kept]
    assert r.token.tolist() == [x[0] for x in kept]
    assert r.slot.tolist() == [x[1] for x in kept]
    assert torch.allclose(r.weight, torch.tensor([x[4] for x in kept], dtype=torch.float64), rtol=0, atol=1e-12)
    assert r.dropped == dropped and list(r.counts) == [sum(1 for x in kept if x[2] == e) for e in range(E)]
    if c:
        assert capacity(c, n, k, E) == math.ceil(c * 48 / 6) and dropped > 0
        assert max(r.counts) == capacity(c, n, k, E)
    if with_bias:   # the bias changed some choice (else the test would not test it)
        plain, _ = _brute_routing(logits, k, router, None, c)
        assert [x[:3] for x in plain] != [x[:3] for x in kept]


def test_aux_loss_by_hand():
    """Softmax, top-1 of 4 experts over 4 tokens whose probabilities are given: experts 0, 1, 0, 3
    chosen, f = (2, 1, 0, 1) / 4, P = the column means (1.3, 1.2, 0.5, 1.0) / 4, aux = 4 x sum f P =
    4 x (0.1625 + 0.075 + 0 + 0.0625) = 1.2. Sigmoid, top-1 of 3 over 2 tokens: scores (1/2, 3/4, 1/4)
    and (3/4, 1/2, 1/2); a bias of -0.3 on expert 1 moves token 0 to expert 0 (0.5 > 0.45), so
    f = (1, 0, 0); the scores normalised per token: P_0 = (1/3 + 3/7) / 2 = 8/21, aux = 3 x 8/21 = 8/7;
    the weights stay the scores' (1 with k = 1)."""
    p = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.1], [0.4, 0.3, 0.2, 0.1], [0.1, 0.1, 0.1, 0.7]],
                     dtype=torch.float64)
    r = route_tokens(p.log(), 1, "softmax")
    assert r.topk.view(-1).tolist() == [0, 1, 0, 3]
    assert float(r.aux) == pytest.approx(1.2, rel=1e-12)
    ln3 = math.log(3)
    logits = torch.tensor([[0.0, ln3, -ln3], [ln3, 0.0, 0.0]], dtype=torch.float64)
    r = route_tokens(logits, 1, "sigmoid", torch.tensor([0.0, -0.3, 0.0], dtype=torch.float64))
    assert r.topk.view(-1).tolist() == [0, 0] and r.weight.tolist() == [1.0, 1.0]
    assert float(r.aux) == pytest.approx(8 / 7, rel=1e-12)
    assert route_tokens(logits, 1, "sigmoid").topk.view(-1).tolist() == [1, 0]     # without the bias


def test_aux_loss_gradient_reaches_the_router_scaled():
    """The MLP's output passes the aux loss's gradient, alpha x loss_scale, into the router: with a
    zero output gradient the router's gradient is that of alpha / G x aux."""
    spec = MIXTRAL
    torch.manual_seed(0)
    mlp = MoeMLP(spec, loss_scale=0.25)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, spec.hidden)
    y = mlp(x)
    y.backward(torch.zeros_like(y))
    got = mlp.router.weight.grad.clone()
    r = route_tokens(mlp.router(x.reshape(-1, spec.hidden)), spec.top_k)
    want, = torch.autograd.grad(0.01 * 0.25 * r.aux, mlp.router.weight)
    assert torch.allclose(got, want, rtol=1e-6, atol=0) and float(want.abs().max()) > 0
    assert float(mlp.aux_value) == pytest.approx(0.01 * float(r.aux.detach()), rel=1e-6)


@pytest.mark.parametrize("shared_gate,c", [(False, 0.0), (True, 1.0)])
def test_moe_mlp_equals_the_per_token_sum(shared_gate, c):
    """y_t = sum over t's kept pairs of w x expert_e(x_t) + shared(x_t) (x sigmoid(g x_t) with
    Qwen2's gate), token by token."""
    spec = DEEPSEEK.replace(shared_gate=shared_gate)
    torch.manual_seed(1)
    mlp = MoeMLP(spec, capacity_factor=c)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 6, spec.hidden, dtype=torch.float32)
    y = mlp(x).reshape(-1, spec.hidden)
    flat = x.reshape(-1, spec.hidden)
    r = mlp.route(x).routing
    assert (r.dropped > 0) == bool(c)
    want = torch.zeros_like(y)
    for e, t, w in zip(r.expert.tolist(), r.token.tolist(), r.weight.tolist()):
        want[t] += w * mlp.experts[str(e)](flat[t:t + 1])[0]
    shared = mlp.shared(flat)
    want += shared * torch.sigmoid(mlp.shared_gate(flat)) if shared_gate else shared
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- memory
MEMORY_IDS = [k for k in CASES[2] if k.startswith("mem-")]


@pytest.mark.slow
@pytest.mark.parametrize("case", MEMORY_IDS)
def test_memory_per_rank_equals_the_simulators_ledger(runs, case):
    """Measured peak activation bytes per rank (the saved-tensor meter) within 1% of the
    simulator's ledger walked along the rank's program (the MoE block's terms of
    :func:`cost_models.moe.moe_share` at EP 1: fp32 scores 4E, the routing's indices and weights,
    2h + 3 f_e per pair), dapple and zb-v (what waits from B to W); weights, gradients and Adam
    state per rank equal to the ledger's."""
    from cost_models.bind import bind
    from cost_models.memory import peak_activation
    cfg, sched, res = runs(2)[case]
    ledger = bind(Job(layout=cfg.layout, parallel=cfg.parallel, model=cfg.spec(), cluster="dgx-a100-1x8"))
    act = peak_activation(ledger.lowered, ledger.costs)
    measured = [d["peak_activation_bytes"] for d in res.per_device]
    assert len(measured) == len(act) == 2
    for m, want in zip(measured, act):
        assert abs(m - want) <= 0.01 * want, (measured, act)
    assert [d["static_bytes"] for d in res.per_device] == [int(x) for x in ledger.costs.static_mem]


@pytest.mark.parametrize("spec", [MIXTRAL, DEEPSEEK.replace(shared_gate=True)], ids=["softmax", "sigmoid-shared"])
def test_moe_mlp_gradients_are_the_derivatives(spec):
    """The MLP's hand-written backwards (gate weights, balance loss, weighted sum) against finite
    differences, in float64: of the output with alpha 0, and of alpha x aux (the loss term) alone."""
    torch.manual_seed(2)
    mlp = MoeMLP(spec.replace(aux_loss_coeff=0.0)).double()
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 3, spec.hidden, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(mlp, (x,), fast_mode=True)
    w = mlp.router.weight
    logits = lambda weight: x.reshape(-1, spec.hidden) @ weight.T      # noqa: E731
    assert torch.autograd.gradcheck(lambda weight: route_tokens(logits(weight), spec.top_k, spec.router).aux, (w,),
                                    fast_mode=True)
