"""The backward pass as the runtime runs it: full, or split into its input-gradient and
weight-gradient halves (zero-bubble schedules). One implementation, used by the runtime
(:class:`executor.runtime.PipelineRuntime`) and by calibration, which times exactly these calls.

- :func:`full_backward`: ``autograd.backward`` from the stage's output (with the gradient that
  arrived for it); parameter gradients accumulate, the input's gradient lands in ``x.grad``.
- :func:`input_backward`: the gradient w.r.t. the stage's input only, keeping the graph for W.
- :func:`weight_backward`: the parameter gradients from the kept graph, accumulated into
  ``p.grad``; frees the graph. Gradients equal the full backward's (same kernels, same order),
  at the cost of re-running the activation-gradient chain inside W.
"""
from __future__ import annotations

import torch


def full_backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    torch.autograd.backward(out, grad)


def input_backward(out: torch.Tensor, x: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
    (gx,) = torch.autograd.grad(out, (x,), grad, retain_graph=True)
    return gx


def weight_backward(out: torch.Tensor, params: list[torch.Tensor], grad: torch.Tensor | None) -> None:
    if not params:      # a stage of parameter-free layers (a user's activation or pooling layers)
        return
    grads = torch.autograd.grad(out, params, grad, allow_unused=True)
    for p, g in zip(params, grads):
        if g is not None:
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
