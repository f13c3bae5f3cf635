"""Numeric precision of a run (``--dtype``): fp32, bf16 mixed precision, or fp8 linear layers.

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

``fp8`` is bf16 mixed precision whose linear layers run their three GEMMs in fp8, through
**torchao**'s float8 training (``torchao.float8.convert_to_float8_training``: each ``nn.Linear``
swapped for a ``Float8Linear`` holding the same weight, dynamic tensorwise scaling, i.e. the cost
model's ``--fp8-recipe tensorwise``). Why torchao and not Transformer Engine: it converts the
``nn.Linear`` layers the executor already builds in place (Transformer Engine needs its own
``te.Linear`` / ``te.TransformerLayer`` modules written into the model), it is the float8 path
torchtitan trains with, it is maintained by the PyTorch team against the torch it runs on and
needs no CUDA extension of its own (``torch._scaled_mm``). It is optional: imported only on the GPU
path, and a run without it is refused in one line before any process starts
(:func:`fp8_refusal`), as is a run on a device without fp8 (the CPU, or a GPU of compute
capability below 8.9: Ada and Hopper have fp8 tensor cores, the A100 has not), a tensor-parallel
run (torchao's swap would drop the executor's column/row-parallel forward; at T = 1 those layers
are plain linear layers) and a model file (its layers are the user's). The output head stays in
bf16, as Megatron-LM keeps it (and as the cost model prices it).
"""
from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass

import torch

from .choices import DTYPES

GRAD_BYTES = 4      # parameter gradients (and all-reduces) are fp32 in every precision: master weights
FP8_CAPABILITY = (8, 9)     # CUDA compute capability of the first GPUs with fp8 tensor cores (Ada; Hopper 9.0)
FP8_LIBRARY = "torchao"


def fp8_refusal(*, device: str, capability: tuple[int, int] | None, gpu: str = "", library: bool, tp: int = 1,
                model_file: bool = False) -> str | None:
    """Why ``--dtype fp8`` cannot run (one line), or None: ``device`` the run's device kind once
    resolved (cpu | cuda), ``capability`` the GPU's compute capability (None: no GPU), ``library``
    whether torchao is importable, ``tp`` the tensor-parallel size, ``model_file`` a user's layers."""
    if device != "cuda" or capability is None:
        return ("--dtype fp8 runs the linear layers on fp8 tensor cores: it needs a CUDA GPU of compute capability "
                "8.9 or newer (Ada, Hopper); this run is on the CPU (use --dtype bf16, or --device cuda on such a GPU)")
    if tuple(capability) < FP8_CAPABILITY:
        name = f"{gpu} " if gpu else ""
        return (f"--dtype fp8 needs a GPU with fp8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); this "
                f"{name}GPU has compute capability {capability[0]}.{capability[1]} (use --dtype bf16)")
    if tp > 1:
        return (f"--dtype fp8 swaps the linear layers for torchao's Float8Linear, which would drop the tensor-parallel "
                f"forward of --tp {tp}; use --tp 1 (simulate fp8 with tensor parallelism: pipetwin simulate "
                f"--precision fp8)")
    if model_file:
        return ("--dtype fp8 converts the built-in GPT's and Llama's linear layers; not a model file's "
                "(use --dtype bf16)")
    if not library:
        return ("--dtype fp8 trains the linear layers with torchao's float8 training "
                "(torchao.float8.convert_to_float8_training); install torchao on this GPU machine or use --dtype bf16")
    return None


def _fp8_layer(module, fqn: str) -> bool:
    """The layers converted: linear layers but the output head, whose sizes fp8 GEMMs take
    (``torch._scaled_mm``: both dimensions multiples of 16)."""
    return isinstance(module, torch.nn.Linear) and not fqn.split(".")[-1] == "head" and \
        module.in_features % 16 == 0 and module.out_features % 16 == 0


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
        return torch.bfloat16 if self.name in ("bf16", "fp8") else torch.float32

    @property
    def wire_dtype(self) -> torch.dtype:
        """dtype of the activations and gradients sent between stages."""
        return self.compute_dtype

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.name in ("bf16", "fp8") else 4

    def check_run(self, device: str, *, tp: int = 1, model_file: bool = False) -> None:
        """Refuse, before any process starts, a run this precision cannot make (:func:`fp8_refusal`):
        ``device`` the run's ``--device`` (auto is cuda where CUDA is available and the run is under
        torchrun, as :func:`executor.device.select_device` picks it)."""
        if self.name != "fp8":
            return
        import os
        cuda = torch.cuda.is_available() and (device == "cuda" or (device == "auto" and "TORCHELASTIC_RUN_ID" in
                                                                   os.environ))
        cap = torch.cuda.get_device_capability(0) if cuda else None
        why = fp8_refusal(device="cuda" if cuda else "cpu", capability=cap,
                          gpu=torch.cuda.get_device_name(0) if cuda else "",
                          library=importlib.util.find_spec(FP8_LIBRARY) is not None, tp=tp, model_file=model_file)
        if why:
            raise ValueError(why)

    def prepare(self, module: torch.nn.Module) -> torch.nn.Module:
        """A stage module as this precision trains it: at fp8 its linear layers (not the head)
        swapped for torchao's ``Float8Linear`` (the same weight tensors), else unchanged."""
        if self.name != "fp8":
            return module
        from torchao.float8 import convert_to_float8_training    # the GPU path only (check_run refused others)
        return convert_to_float8_training(module, module_filter_fn=_fp8_layer)

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
