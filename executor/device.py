"""Where a rank computes, and how its activation memory is measured: the one place that differs
between a CPU run (gloo) and a GPU run (NCCL). Everything else in the executor takes a
:class:`DeviceContext` and runs the same code.

Choice (:func:`select_device`): ``cpu`` gives CPU + gloo; ``cuda`` gives ``cuda:LOCAL_RANK`` +
NCCL (an error without CUDA); ``auto`` picks CUDA when it is available and the process was
started by ``torchrun`` (``TORCHELASTIC_RUN_ID`` is set: a ``LOCAL_RANK`` left in a shell decides
nothing, see :func:`executor.launch.check_launch_env`), else the CPU.

Activation memory (bytes alive that backward needs):

- CPU, :class:`SavedTensorMeter`: ``torch.autograd.graph.saved_tensors_hooks`` see every tensor
  autograd saves during a stage's forward. Each storage is counted once (views and tensors saved
  by several ops share one), parameters are not counted, and a storage stops counting when the
  last saved reference to it is released (backward frees the graph, or the graph is dropped).
  The hooks cost a few microseconds per saved tensor (a tiny GPT's stage saves ~100 per
  micro-batch; a metered forward + backward of it took 15% longer), so the runtime meters the
  first forward of each stage in the run this way and accounts every other micro-batch of that
  stage, in that step and the later ones, with the bytes it measured (same module, same shapes,
  same precision and recomputation: the same saved tensors), from their F to the backward that
  frees them (:class:`executor.runtime.PipelineRuntime`; ``RunConfig.meter_every_forward``
  meters every forward of every step, which tests compare op by op over several steps). Metering
  once per step instead cost tiny D=2 dapple 5% of its step time. What a split backward keeps for
  W is always counted exactly.
- CUDA, :class:`AllocatorMeter`: the caching allocator's ``memory_allocated`` minus its value at
  the start of the step (weights, gradients and optimizer state are allocated before), with the
  peak from ``max_memory_allocated`` (reset each step). It also counts received activation buffers
  and temporaries, i.e. what the device really holds (under ZeRO 2 and 3 that includes the
  unsharded gradients and the gathered weights, allocated during the step: :mod:`executor.zero`
  reports their peaks apart).
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch

from .choices import DEVICES


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
        synchronize(self.device)

    def meter(self, params) -> "SavedTensorMeter | AllocatorMeter":
        return AllocatorMeter(self.device) if self.is_cuda else SavedTensorMeter(params)


def check_device(kind: str) -> None:
    """Refuse a device choice this machine cannot honour (before any process starts)."""
    if kind not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {kind!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available on this machine "
                         "(use --device cpu or auto)")


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA kernel launch returns before the kernel
    ends); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` has finished: a time stamp
    that a GPU's queue does not run ahead of."""
    synchronize(device)
    return time.perf_counter()


def select_device(kind: str = "auto", local_rank: int | None = None) -> DeviceContext:
    """The device and process-group backend for this rank (see the module docstring)."""
    check_device(kind)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ and "PIPETWIN_WORKDIR" not in os.environ
    want_cuda = kind == "cuda" or (kind == "auto" and torchrun and torch.cuda.is_available())
    if not want_cuda:
        return DeviceContext(torch.device("cpu"), "gloo")
    count = torch.cuda.device_count()
    dev = torch.device("cuda", local_rank % count)
    torch.cuda.set_device(dev)
    return DeviceContext(dev, "nccl")


def cpu_threads(local_world: int) -> int:
    """Intra-op threads per rank so that the ranks on one machine share its cores."""
    return max(1, (os.cpu_count() or 1) // max(1, local_world))


class _Saved(tuple):
    """What the pack hook stores instead of the tensor: (tensor, count record); releasing it
    releases the count. A tuple subclass: made by C code, nothing but the finalizer in Python."""

    __slots__ = ()

    def __del__(self):
        ref = self[1]                # [references, bytes, meter, storage key]
        ref[0] -= 1
        if not ref[0]:
            meter = ref[2]
            meter.live -= ref[1]
            del meter._refs[ref[3]]


_new_saved = tuple.__new__


class SavedTensorMeter:
    """Bytes of non-parameter tensors saved for backward that are alive (CPU; see module doc).

    Every saved tensor passes through :meth:`_pack` and back through :meth:`_unpack`, so they are
    kept lean (the meter's cost is a measured part of every metered run; see
    ``experiments/bench_executor.py``): a storage is keyed by its base address, computed from the
    tensor's own pointer and offset (no storage object is made after the first sight), and the
    hooks take no lock -- the autograd engine runs a CPU graph's backward on the thread that
    called it, which is the one that ran the forward."""

    def __init__(self, params):
        self._param_storages = {p.untyped_storage().data_ptr() for p in params}
        self._refs: dict[int, list] = {}  # storage address -> [references, bytes, meter, address]
        self.live = 0
        self.peak = 0

    def param_storage_moved(self, old: int, new: int) -> None:
        """A parameter storage moved from address ``old`` to ``new`` (0: freed): ZeRO 3's gathered
        weights (:mod:`executor.zero`) are still parameters, not activations."""
        self._param_storages.discard(old)
        if new:
            self._param_storages.add(new)

    def _pack(self, t: torch.Tensor):
        ptr = t.data_ptr() - t.storage_offset() * t.element_size()
        if ptr in self._param_storages or ptr == 0:
            return t
        if self.off:          # inside an unmetered forward (for hooks nested in one: executor.recompute)
            return t.detach()
        ref = self._refs.get(ptr)
        if ref is None:
            n = t.untyped_storage().nbytes()
            ref = self._refs[ptr] = [1, n, self, ptr]
            self.live += n
            if self.live > self.peak:
                self.peak = self.live
        else:
            ref[0] += 1
        # detached: a saved output would otherwise hold its own grad_fn, a cycle through C++ that
        # keeps a retained graph alive after its last reference is dropped (the unpacked tensor
        # gets its autograd metadata back from the saved variable)
        return _new_saved(_Saved, (t.detach(), ref))

    @staticmethod
    def _unpack(x):
        return x[0] if type(x) is _Saved else x

    samples = True   # the runtime may meter one forward per stage and account the others

    def capture(self, measure: bool = True):
        """Context manager to wrap a forward whose saved tensors should be counted; with
        ``measure=False`` nothing inside it is counted (the runtime accounts it)."""
        if measure:
            return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        return self._quiet()

    @contextlib.contextmanager
    def _quiet(self):
        self.off = True
        try:
            yield
        finally:
            self.off = False

    off = False

    # the hook pair itself, for code that installs its own saved-tensor hooks inside a capture
    # (executor.recompute) and still wants the tensors it keeps counted
    pack, unpack = _pack, _unpack

    def hold(self, tensors) -> list:
        """Count ``tensors`` as kept activation memory while the returned handles live (e.g. the
        gradients a split backward keeps from B to W, a recomputed layer's input)."""
        if self.off:
            return None
        return [self._pack(t) for t in tensors]

    def start_step(self) -> None:
        self.peak = self.live

    def current(self) -> int:
        return self.live


class _NoHooks:
    """A meter that needs no saved-tensor hooks: they pass tensors through, hold nothing."""

    samples = False  # nothing sampled per stage: nothing to account for the other micro-batches

    def capture(self, measure: bool = True):
        return contextlib.nullcontext()

    @staticmethod
    def pack(t):
        return t

    @staticmethod
    def unpack(t):
        return t

    def hold(self, tensors) -> None:
        return None


class AllocatorMeter(_NoHooks):
    """Activation bytes from the CUDA caching allocator's counters (see module doc); the
    allocator sees every micro-batch and every live tensor, so the hooks do nothing."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base = torch.cuda.memory_allocated(device)
        self.peak = 0

    def start_step(self) -> None:
        torch.cuda.synchronize(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.peak = 0

    def current(self) -> int:
        cur = torch.cuda.memory_allocated(self.device) - self.base
        self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device) - self.base)
        return cur


class NullMeter(_NoHooks):
    """Memory measurement switched off: everything reads 0."""

    live = peak = 0

    def start_step(self) -> None:
        pass

    def current(self) -> int:
        return 0
