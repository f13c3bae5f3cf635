"""A small transformer language model with tied input and output embeddings, as a pipetwin model
file: ``pipetwin run --model notebooks/models/tied_lm.py:build``.

Six layers: the token + position embedding, four pre-norm decoder blocks (causal self-attention
and a GELU MLP), and the head (a LayerNorm and the output projection). The head's projection *is*
the embedding table (``head.proj.weight = embed.tok.weight``: one ``nn.Parameter`` in two layers).
When the two land on different ranks, pipetwin gives each rank a copy and sums their gradients
before every optimizer step, so the copies stay equal and training equals the single process.

The data is a learnable synthetic stream: each sequence follows ``x[t+1] = (5 x[t] + 3) mod V``
with 10% of the tokens replaced by noise. It returns :class:`executor.user_model.LayerStack` (the
optional dataclass; a ``types.SimpleNamespace`` with the same attributes works as well).
"""
import torch
import torch.nn.functional as F
from torch import nn

from executor.user_model import LayerStack

VOCAB, HIDDEN, HEADS, SEQ, BLOCKS = 64, 32, 4, 16, 4


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(SEQ, HIDDEN)

    def forward(self, tokens):
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.fc, self.out = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (t.view(b, s, HEADS, h // HEADS).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(h, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, table: nn.Parameter):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.proj = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.proj.weight = table          # tied: the embedding's own Parameter

    def forward(self, x):
        return self.proj(self.norm(x))


def loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def sample(generator: torch.Generator, batch_size: int):
    first = torch.randint(0, VOCAB, (batch_size,), generator=generator)
    noise = torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=generator)
    keep = torch.rand((batch_size, SEQ + 1), generator=generator) >= 0.1
    seq = torch.empty((batch_size, SEQ + 1), dtype=torch.int64)
    seq[:, 0] = first
    for t in range(1, SEQ + 1):
        seq[:, t] = torch.where(keep[:, t], (5 * seq[:, t - 1] + 3) % VOCAB, noise[:, t])
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def build():
    embed = Embed()
    for table in (embed.tok.weight, embed.pos.weight):   # GPT-2's scale: the tied logits start near uniform
        nn.init.normal_(table, std=0.02)
    blocks = [Block() for _ in range(BLOCKS)]
    return LayerStack(layers=[embed, *blocks, Head(embed.tok.weight)], loss=loss, sample=sample)
