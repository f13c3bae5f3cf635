"""Training data for the executor: deterministic token batches addressed by (step, micro-batch).

Every rank that needs a batch (the ranks holding a first stage need the inputs, those holding a
last stage need the targets) computes it locally from the seed, so no data moves between ranks and
the single-process reference sees exactly the same batches.

Micro-batch numbering: a step has G = R * N global micro-batches; replica r's local micro-batch m
is global micro-batch ``r * N + m``.

Two sources:

- synthetic (default): each sequence follows a fixed random affine recurrence over the vocabulary
  (``x[t+1] = (a * x[t] + c) mod V``) with 10% of the tokens replaced by noise, from a generator
  seeded by (seed, step, micro-batch); it is learnable, so the loss visibly falls;
- a text file: its bytes are the tokens (modulo the vocabulary); a micro-batch takes consecutive
  windows of ``seq_len + 1`` bytes at a position that advances with (step, micro-batch) and wraps.
"""
from __future__ import annotations

import torch

from cost_models.files import read_bytes
from cost_models.model_spec import ModelSpec


def mix_seed(*xs: int) -> int:
    """A 63-bit seed from integers (seed, step, micro-batch, ...): the one rule the data sources use."""
    h = 0x243F6A8885A308D3
    for x in xs:
        h = (h * 0x100000001B3 ^ (x & 0xFFFFFFFFFFFF)) % (2 ** 63)
    return h


class TokenSource:
    """``batch(step, g)`` returns (inputs, targets), both int64 [micro_batch, seq_len]."""

    def __init__(self, spec: ModelSpec, seed: int = 0, text_file: str | None = None):
        self.spec = spec
        self.seed = seed
        self.text: torch.Tensor | None = None
        if text_file:
            data = read_bytes(text_file, "data file", min_bytes=spec.seq_len + 2)
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
            self.text = raw % spec.vocab
        g = torch.Generator().manual_seed(mix_seed(seed, 17))
        V = spec.vocab
        self._a = int(torch.randint(1, V, (1,), generator=g)) | 1
        self._c = int(torch.randint(0, V, (1,), generator=g))

    def batch(self, step: int, index: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Global micro-batch ``index`` of ``groups`` in optimizer step ``step``."""
        seq = self._text_rows(step * groups + index) if self.text is not None else self._synthetic(step, index)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def _synthetic(self, step: int, index: int) -> torch.Tensor:
        b, s, V = self.spec.micro_batch, self.spec.seq_len, self.spec.vocab
        g = torch.Generator().manual_seed(mix_seed(self.seed, step, index))
        first = torch.randint(0, V, (b,), generator=g)
        noise = torch.randint(0, V, (b, s + 1), generator=g)
        keep = torch.rand((b, s + 1), generator=g) >= 0.1
        seq = torch.empty((b, s + 1), dtype=torch.int64)
        prev = first
        for t in range(s + 1):
            cur = torch.where(keep[:, t], (self._a * prev + self._c) % V, noise[:, t]) if t else first
            seq[:, t] = cur
            prev = cur
        return seq

    def _text_rows(self, position: int) -> torch.Tensor:
        b, w = self.spec.micro_batch, self.spec.seq_len + 1
        n = self.text.numel() - w + 1
        starts = [((position * b + i) * self.spec.seq_len) % n for i in range(b)]
        return torch.stack([self.text[p:p + w] for p in starts])
