"""Multi-head latent attention's activations and a run's measured expert load against the ledger.

MLA (tiny-deepseek: h 32, a 4 heads, d_n 8 + d_r 4 = d_qk 12, d_v 8, q_r 24, kv_r 16; s 16, b 2,
fp32): the executor keeps what Megatron-LM's ``MLASelfAttention`` keeps with a kernel that takes
two head sizes (:class:`executor.mla._LatentCore`), and the ledger
(:func:`cost_models.transformer._attention_split_bytes`) counts exactly that; per block the
saved-tensor meter reads the ledger plus the 4 norms' 1/rms (ln1, ln2, q_norm, kv_norm: the
statistics the ledger leaves out, 4 x sb x 4 B = 512 B). Per rank the measured peak activation
bytes are within 1 % of the simulator's (D 2, N 4, dapple and zb-v; EP 1, and EP 2 with routing
balanced by construction, top-k = E, as tests/test_executor_ep.py's ledger test). Before: the
padded V and output (81,408 B a dense block against 67,584) put every rank 14-19 % over.

Uneven routing: a run records the tokens it routed to each expert
(``RunResult.extra["expert_load"]``); written with :func:`cost_models.moe.write_expert_load`,
``--expert-load`` prices the same load.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as Fn

from cost_models import load_model
from cost_models.bind import bind
from cost_models.job import Job
from cost_models.memory import peak_activation
from executor.config import RunConfig

DEEPSEEK = load_model("tiny-deepseek")
BALANCED = DEEPSEEK.replace(name="ds-balanced", experts=4, top_k=4)      # every token to every expert
BASE = dict(steps=1, optimizer="sgd", lr=0.05, timeout=120.0, devices=2, microbatches=4, collect_params=False)
SCHEDULES = ("dapple", "zb-v")
CASES = {2: {f"ep1-{s}": RunConfig.of(schedule=s, model=DEEPSEEK, **BASE) for s in SCHEDULES},
         4: {f"ep2-{s}": RunConfig.of(schedule=s, model=BALANCED, replicas=2, ep=2, **BASE) for s in SCHEDULES}}
CASES[4] |= {f"uneven-{s}": RunConfig.of(schedule=s, model=DEEPSEEK, replicas=2, ep=2, **dict(BASE, steps=2))
             for s in SCHEDULES}


def _ledger(cfg, parallel=None) -> list[int]:
    b = bind(Job(layout=cfg.layout, parallel=parallel or cfg.parallel, model=cfg.spec(), cluster="dgx-a100-1x8"))
    return [int(x) for x in peak_activation(b.lowered, b.costs)]


# ----------------------------------------------------------------------------- the attention core
@pytest.mark.parametrize("d_qk,d_v", [(12, 8), (8, 12), (12, 12)])
def test_latent_core_equals_attention_with_two_head_sizes(d_qk, d_v):
    """The padded flash kernel's output and q, k, v gradients equal PyTorch's unfused attention
    with the two head sizes (float64, 1e-12), the output in the projection's layout [b, s, a d_v]."""
    from executor.mla import _LatentCore
    torch.manual_seed(0)
    q, k = (torch.randn(2, 4, 16, d_qk, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 4, 16, d_v, dtype=torch.float64, requires_grad=True)
    y = _LatentCore.apply(q, k, v, d_qk ** -0.5)
    ref = Fn.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d_qk ** -0.5).transpose(1, 2) \
        .reshape(2, 16, 4 * d_v)
    g = torch.randn_like(y)
    assert torch.allclose(y, ref, rtol=0, atol=1e-12)
    for a, b in zip(torch.autograd.grad(y, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_sdpa_takes_two_head_sizes_only_unfused():
    """Why the kernel is padded (torch 2.13, CPU): the flash path refuses a value head size other
    than the query/key's; the math path takes it (and keeps the s^2 probabilities)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = torch.randn(1, 2, 8, 12), torch.randn(1, 2, 8, 12), torch.randn(1, 2, 8, 8)
    with sdpa_kernel([SDPBackend.MATH]):
        assert Fn.scaled_dot_product_attention(q, k, v, is_causal=True).shape == (1, 2, 8, 8)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), pytest.warns(UserWarning), \
            pytest.raises(RuntimeError, match="No available kernel"):
        Fn.scaled_dot_product_attention(q, k, v, is_causal=True)


# ----------------------------------------------------------------------------- one block
def test_mla_block_keeps_the_ledgers_bytes_plus_the_norm_statistics():
    """tiny-deepseek's dense block 0 (sb = 32 tokens, d = 4 B), closed form of the ledger:
    replicated 4 sbh d = 16,384; split sb (a d_qk + a d_qk + a d_v + a d_v + 2 q_r + 2 kv_r + r) d
    = 32 (48 + 48 + 32 + 32 + 48 + 32 + 4) 4 = 31,232; MLP 3 sb f d = 24,576; flash statistics
    4 a s b = 512: 72,704. The meter reads that plus 4 norms' 1/rms, 4 x 32 x 4 = 512: 73,216."""
    from cost_models.transformer import _attention_split_bytes, block_activation_bytes
    from executor.device import SavedTensorMeter
    from executor.model import full_model
    spec = DEEPSEEK
    sb, d = spec.seq_len * spec.micro_batch, spec.dtype_bytes
    assert _attention_split_bytes(spec) == sb * (48 + 48 + 32 + 32 + 2 * 24 + 2 * 16 + 4) * d == 31232
    assert block_activation_bytes(spec) == 16384 + 31232 + 24576 + 512 == 72704
    model = full_model(spec)
    meter = SavedTensorMeter(list(model.parameters()))
    x = torch.randn(spec.micro_batch, spec.seq_len, spec.hidden, requires_grad=True)
    with meter.capture():
        y = model.blocks["0"](x)      # noqa: F841 (its graph keeps the saved tensors)
    assert meter.live == 72704 + 4 * sb * 4 == 73216


# ----------------------------------------------------------------------------- per rank
@pytest.mark.slow
@pytest.mark.parametrize("world,case", [(w, k) for w, c in CASES.items() for k in c if not k.startswith("uneven")])
def test_mla_peaks_per_rank_equal_the_ledger(runs, world, case):
    """Measured peak activation bytes per rank within 1 % of the simulator's (measured here, in B:
    EP 1 dapple 319,552 / 189,380 vs 317,440 / 187,904; EP 2 dapple 383,520 / 253,348 vs
    381,440 / 251,904: 0.45-0.79 % over, the norms' statistics and the loss's targets)."""
    cfg, _, res = runs(world)[case]
    measured = [d["peak_activation_bytes"] for d in res.per_device]
    want = _ledger(cfg)
    assert len(measured) == len(want) == world
    for m, w in zip(measured, want):
        assert abs(m - w) <= 0.01 * w, (measured, want)
