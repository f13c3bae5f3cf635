"""A small CNN as a pipetwin model file: ``pipetwin run --model notebooks/models/cnn.py:build``.

Ten layers (two conv-ReLU-pool blocks, a flatten, a two-layer classifier) on 12 x 12 one-channel
images; the task is to say which quadrant holds a bright blob (4 classes), learnable in a few
steps. The whole interface is a function returning an object with ``layers``, ``loss`` and
``sample`` (here a ``types.SimpleNamespace``; see :mod:`executor.user_model`).
"""
import types

import torch
from torch import nn

SIZE, CLASSES = 12, 4


def sample(generator: torch.Generator, batch_size: int):
    """``batch_size`` noisy images with a blob in quadrant ``label``; every random number comes
    from ``generator``, so the executor's batches are reproducible."""
    label = torch.randint(0, CLASSES, (batch_size,), generator=generator)
    x = 0.5 * torch.randn(batch_size, 1, SIZE, SIZE, generator=generator)
    half = SIZE // 2
    for i, c in enumerate(label.tolist()):
        r, q = divmod(c, 2)
        x[i, 0, r * half + 2:r * half + 4, q * half + 2:q * half + 4] += 2.0
    return x, label


def build():
    layers = [
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),      # 8 x 6 x 6
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),     # 16 x 3 x 3
        nn.Flatten(),
        nn.Linear(16 * 3 * 3, 32), nn.ReLU(),
        nn.Linear(32, CLASSES),
    ]
    return types.SimpleNamespace(layers=layers, loss=nn.functional.cross_entropy, sample=sample)
