"""A model file with dropout: it trains, but each rank draws its own masks, so its losses are not the
reference's (tests/test_model_files.py: ``run --check`` says so)."""
import types

import torch
from torch import nn


def build():
    layers = [nn.Linear(8, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 4)]

    def sample(generator, batch_size):
        x = torch.randn(batch_size, 8, generator=generator)
        return x, (x[:, :4].sum(1) > 0).long()
    return types.SimpleNamespace(layers=layers, loss=nn.functional.cross_entropy, sample=sample)
