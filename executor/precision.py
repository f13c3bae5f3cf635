"""Numeric precision of a run (``--dtype``): fp32, or bf16 mixed precision.

``bf16`` is what GPU users run: the weights, their gradients and the optimizer state stay fp32
(the master copy the optimizer updates), and every stage's forward runs under
``torch.autocast(device_type, dtype=torch.bfloat16)`` -- matrix products and attention in bf16,
reductions, norms and the loss in fp32, as autocast decides (CUDA and CPU alike). The backward
follows the forward's dtypes, so weight gradients are computed in bf16 and accumulated into the
fp32 ``.grad``. The residual stream between layers stays fp32 (an fp32 tensor plus a bf16 one is
fp32), so every stage runs its layers the same way.

Messages between stages (activations and their gradients, SEND/RECV and the same-rank COPY alike)
travel in the compute dtype, bf16: half the bytes, as in Megatron-LM. The sender rounds its
output, the receiver turns the message back into an fp32 leaf; the backward of that rounding is
the identity, so it is a straight-through cast at every stage boundary. The single-process
reference has no boundaries, so it differs from a pipeline run only by those roundings (its
losses agree to ~1e-3). ``dtype_bytes`` of the model spec follows the flag (2 for bf16): message
sizes and the cost model's activation formulas use it; the executor's gradients and all-reduces
stay fp32 (:data:`GRAD_BYTES`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .choices import DTYPES

GRAD_BYTES = 4      # parameter gradients (and all-reduces) are fp32 in every precision: master weights


@dataclass(frozen=True)
class Precision:
    name: str = "fp32"

    def __post_init__(self):
        if self.name not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.name!r}")

    @property
    def mixed(self) -> bool:
        return self.name != "fp32"

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.name == "bf16" else torch.float32

    @property
    def wire_dtype(self) -> torch.dtype:
        """dtype of the activations and gradients sent between stages."""
        return self.compute_dtype

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.name == "bf16" else 4

    def autocast(self, device: torch.device):
        """The context a stage's forward runs in."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)

    def to_wire(self, t: torch.Tensor) -> torch.Tensor:
        """A boundary tensor as it is sent (detached; rounded to the compute dtype)."""
        t = t.detach()
        return t.to(self.wire_dtype) if self.mixed and t.is_floating_point() and t.dtype != self.wire_dtype else t

    @staticmethod
    def from_wire(t: torch.Tensor) -> torch.Tensor:
        """A received boundary tensor as the stage uses it: fp32."""
        return t.float() if t.is_floating_point() and t.dtype != torch.float32 else t
