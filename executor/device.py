"""Where a rank computes, and how its activation memory is measured: the one place that differs
between a CPU run (gloo) and a GPU run (NCCL). Everything else in the executor takes a
:class:`DeviceContext` and runs the same code.

Choice (:func:`select_device`): ``cpu`` gives CPU + gloo; ``cuda`` gives ``cuda:LOCAL_RANK`` +
NCCL (an error without CUDA); ``auto`` picks CUDA when it is available and the process was
started by ``torchrun`` (``LOCAL_RANK`` is set), else the CPU.

Activation memory (bytes alive that backward needs):

- CPU, :class:`SavedTensorMeter`: ``torch.autograd.graph.saved_tensors_hooks`` see every tensor
  autograd saves during a stage's forward. Each storage is counted once (views and tensors saved
  by several ops share one), parameters are not counted, and a storage stops counting when the
  last saved reference to it is released (backward frees the graph, or the graph is dropped).
- CUDA, :class:`AllocatorMeter`: the caching allocator's ``memory_allocated`` minus its value at
  the start of the step (weights, gradients and optimizer state are allocated before), with the
  peak from ``max_memory_allocated`` (reset each step). It also counts received activation buffers
  and temporaries, i.e. what the device really holds.
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceContext:
    device: torch.device
    backend: str

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def host_collectives(self) -> bool:
        """Collectives run on the host (gloo): a completed future means the result is there, so
        its completion time is the collective's end. (A NCCL future completes once the kernels
        are queued, which says nothing about when they end.)"""
        return not self.is_cuda

    def synchronize(self) -> None:
        """Wait for queued device work (so an op's end time is real); a no-op on the CPU."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def meter(self, params) -> "SavedTensorMeter | AllocatorMeter":
        return AllocatorMeter(self.device) if self.is_cuda else SavedTensorMeter(params)


def check_device(kind: str) -> None:
    """Refuse a device choice this machine cannot honour (before any process starts)."""
    if kind not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda; got {kind!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available on this machine "
                         "(use --device cpu or auto)")


def select_device(kind: str = "auto", local_rank: int | None = None) -> DeviceContext:
    """The device and process-group backend for this rank (see the module docstring)."""
    check_device(kind)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    want_cuda = kind == "cuda" or (kind == "auto" and "LOCAL_RANK" in os.environ and torch.cuda.is_available())
    if not want_cuda:
        return DeviceContext(torch.device("cpu"), "gloo")
    count = torch.cuda.device_count()
    dev = torch.device("cuda", local_rank % count)
    torch.cuda.set_device(dev)
    return DeviceContext(dev, "nccl")


def cpu_threads(local_world: int) -> int:
    """Intra-op threads per rank so that the ranks on one machine share its cores."""
    return max(1, (os.cpu_count() or 1) // max(1, local_world))


class _Saved:
    """What the pack hook stores instead of the tensor; releasing it releases the count."""

    __slots__ = ("tensor", "meter", "key", "__weakref__")

    def __init__(self, tensor: torch.Tensor, meter: "SavedTensorMeter", key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


class SavedTensorMeter:
    """Bytes of non-parameter tensors saved for backward that are alive (CPU; see module doc)."""

    def __init__(self, params):
        self._param_storages = {p.untyped_storage().data_ptr() for p in params}
        self._refs: dict[tuple, list] = {}  # storage key -> [refcount, nbytes]
        self._lock = threading.Lock()
        self.live = 0
        self.peak = 0

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._param_storages or ptr == 0:
            return t
        key = (ptr, t.device.type)
        with self._lock:
            ref = self._refs.get(key)
            if ref is None:
                n = storage.nbytes()
                self._refs[key] = [1, n]
                self.live += n
                if self.live > self.peak:
                    self.peak = self.live
            else:
                ref[0] += 1
        # detached: a saved output (ReLU, sigmoid, ...) must not hold its own grad_fn, which holds this
        # object (a reference cycle that keeps the graph alive until the garbage collector runs)
        return _Saved(t.detach(), self, key)

    @staticmethod
    def _unpack(x):
        return x.tensor if isinstance(x, _Saved) else x

    def _release(self, key) -> None:
        with self._lock:
            ref = self._refs.get(key)
            if ref is None:
                return
            ref[0] -= 1
            if ref[0] == 0:
                self.live -= ref[1]
                del self._refs[key]

    def capture(self):
        """Context manager to wrap a forward whose saved tensors should be counted."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def start_step(self) -> None:
        self.peak = self.live

    def current(self) -> int:
        return self.live


class AllocatorMeter:
    """Activation bytes from the CUDA caching allocator's counters (see module doc)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = torch.cuda.memory_allocated(device)
        self.peak = 0

    def capture(self):
        return contextlib.nullcontext()

    def start_step(self) -> None:
        torch.cuda.synchronize(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.peak = 0

    def current(self) -> int:
        cur = torch.cuda.memory_allocated(self.device) - self.base
        self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device) - self.base)
        return cur


class NullMeter:
    """Memory measurement switched off: everything reads 0."""

    live = peak = 0

    def capture(self):
        return contextlib.nullcontext()

    def start_step(self) -> None:
        pass

    def current(self) -> int:
        return 0
