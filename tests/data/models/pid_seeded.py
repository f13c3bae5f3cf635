"""A model file whose build() seeds from the process id: every rank builds other weights
(tests/test_model_files.py: refused before step 0)."""
import os
import types

import torch
from torch import nn


def build():
    torch.manual_seed(os.getpid())
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)]

    def sample(generator, batch_size):
        x = torch.randn(batch_size, 8, generator=generator)
        return x, (x[:, :4].sum(1) > 0).long()
    return types.SimpleNamespace(layers=layers, loss=nn.functional.cross_entropy, sample=sample)
