"""A model file that imports the module beside it and prints while building, drawing and in
forward (tests/test_model_files.py: --json still parses, the printing goes to stderr)."""
import types

import torch
from torch import nn

from widths import HIDDEN

print("model.py: imported")


class Loud(nn.Linear):
    def forward(self, x):
        print("model.py: forward")
        return super().forward(x)


def build():
    print(f"model.py: building with HIDDEN = {HIDDEN}")

    def sample(generator, batch_size):
        print("model.py: sample")
        x = torch.randn(batch_size, 8, generator=generator)
        return x, (x[:, :4].sum(1) > 0).long()
    layers = [Loud(8, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 4)]
    return types.SimpleNamespace(layers=layers, loss=nn.functional.cross_entropy, sample=sample)
