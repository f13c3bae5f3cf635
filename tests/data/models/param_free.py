"""Model files whose first stage has no parameters (tests/test_model_files.py).

``build``: a reshape and a ReLU before the first linear layer (``--partition 2,3`` puts both in
stage 0); ``build_identity``: an ``nn.Identity`` first (its output is the very input tensor);
``build_pass``: a reshape, then an ``nn.Identity`` (``--partition 1,1,1,2``: a stage in the middle
whose output is its received input itself).
The task: the sign of the sum of the first four inputs, 4 classes of noise around it.
"""
import types

import torch
from torch import nn


class Flat(nn.Module):
    """(b, 2, 4) -> (b, 8): a view of its input, no parameters."""

    def forward(self, x):
        return x.reshape(len(x), -1)


def sample(generator, batch_size):
    x = torch.randn(batch_size, 2, 4, generator=generator)
    return x, (x[:, 0].sum(1) > 0).long() + 2 * (x[:, 1].sum(1) > 0).long()


def build():
    layers = [Flat(), nn.ReLU(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)]
    return types.SimpleNamespace(layers=layers, loss=nn.functional.cross_entropy, sample=sample)


def build_identity():
    layers = [nn.Identity(), Flat(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)]
    return types.SimpleNamespace(layers=layers, loss=nn.functional.cross_entropy, sample=sample)


def build_pass():
    layers = [Flat(), nn.Identity(), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)]
    return types.SimpleNamespace(layers=layers, loss=nn.functional.cross_entropy, sample=sample)
