"""Your model: any stack of PyTorch layers, loaded from a model file and split into pipeline stages.

The interface. ``--model PATH.py:FUNC`` (or ``--model package.module:FUNC``) names a function
that takes no argument and returns an object with:

- ``layers``: a list of ``torch.nn.Module``; layer i's output is layer i+1's input (one tensor);
- ``loss(output, target)``: the scalar mean loss of one micro-batch;
- ``sample(generator, batch_size)``: one micro-batch ``(input, target)`` drawn with that
  ``torch.Generator``.

A ``types.SimpleNamespace`` is enough; :class:`LayerStack` is the same as a dataclass::

    # my.py  (pipetwin run --model my.py:build -s dapple -D 2 -N 4)
    import types

    import torch
    from torch import nn

    def build():
        layers = [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)]

        def sample(generator, batch_size):
            x = torch.randn(batch_size, 16, generator=generator)
            return x, (x[:, :4].sum(1) > 0).long()

        return types.SimpleNamespace(layers=layers, loss=nn.functional.cross_entropy, sample=sample)

How the executor uses it (:func:`build_rank`, :func:`reference_model`):

- **The model file** runs as a script would: its folder is first on ``sys.path`` while its code
  runs (importing it, ``FUNC()``, ``sample``, the layers' forward, the loss), so it imports the
  modules beside it (``from helpers import Block``); a ``package.module:FUNC`` is found on Python's
  own path. Its printing goes to standard error, so standard output holds pipetwin's results only
  (``--json``'s object parses); on spawned ranks it goes to the rank's log (:func:`user_code`).
- **Weights.** Every rank calls ``FUNC()`` after ``torch.manual_seed(seed)`` (on the CPU, the
  global generator restored afterwards) and keeps the layers of its stages, moved to its device;
  the single-process reference does the same and keeps all of them, so every rank's initial
  weights equal the reference's as long as ``FUNC()`` draws its random numbers from torch's
  global generator (``nn.Module`` initialisation does). Each rank builds the whole model once and,
  before step 0, checks its build against rank 0's (a checksum per layer of the parameters and
  buffers, :func:`check_same_weights`): a ``FUNC()`` that seeds from the process id or the time is
  refused with one line naming the rank and the first layer that differs.
- **Data.** The micro-batch of global index g in step k is ``sample(generator, b)`` with a fresh
  ``torch.Generator`` seeded from (seed, k, g) (:func:`executor.data.mix_seed`): the ranks that
  need it (first stage: the input, last stage: the target) draw it themselves, and a run and its
  ``--reference`` see the same batches. ``b`` is ``--micro-batch`` (default
  :data:`DEFAULT_MICRO_BATCH`). Every micro-batch must have the same shapes.
- **Stages.** A stage is consecutive layers (:class:`LayerStage`); the last one also computes
  the loss. A stage may hold no parameter (activations, pooling, a reshape), the first one too:
  a first stage's input needs no gradient, so its backward has nothing to do
  (:mod:`executor.runtime`). The default split balances the layers' parameter counts
  (:func:`cost_models.partition.stack_partition`: the lightest heaviest stage); ``--partition
  2,3,3,2`` gives layers per stage; balancing by measured time comes from a calibration profile
  (``pipetwin run --partition time --profile FILE``), a plan file brings the planner's.
- **Shared parameters** (the same ``nn.Parameter`` object in two layers, e.g. tied input and
  output embeddings) stay shared: on a rank that holds both layers they are one tensor; where the
  layers land on different ranks, each rank holds a copy with the same initial value, the
  parameter is left out of its stages' all-reduces, and before the optimizer step its gradient is
  summed over every rank that holds it (:class:`TiedGradients`, one all-reduce per set of ranks),
  so every copy gets the gradient the single process computes and stays equal to the others.
- **Checked before anything starts** (:func:`stack_layout`, in the launching process; each
  failure is a ValueError of one line naming the model and what to change): the reference parses
  and imports, ``FUNC()`` exists and runs, the object has the three attributes, ``layers`` is a
  list of modules, ``sample`` returns two tensors and draws only from its generator, each
  layer takes the previous layer's output and returns one tensor (one forward of a micro-batch),
  the loss is a scalar that depends on the parameters, the partition fits, and every stage
  boundary carries a floating-point tensor (gradients flow back through it).

Limits: one tensor between layers (pack several into one, or make them one layer); layers that
draw random numbers in forward (dropout) draw them from each rank's own generator, so they train
but do not equal the reference bit for bit; buffers (BatchNorm running statistics) are per model
copy and not synchronised (training losses in train mode do not depend on them).
"""
from __future__ import annotations

import copy
import hashlib
import math
import importlib
import importlib.util
import signal
import sys
import threading
import traceback
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from cost_models.files import short_list
from cost_models.partition import ranges, stack_partition
from cost_models.stack import MODEL_REF
from schedules.ir import ACT, Op, Schedule, source_stage

from .data import mix_seed
from .host import PROCESS_BYTES, available_host_bytes

DEFAULT_MICRO_BATCH = 4
BUILD_SECONDS = 120.0   # importing the model file and FUNC(); then one forward of a micro-batch (each)
LAYER_SECONDS = 300.0   # pipetwin calibrate: measuring one layer
INTERFACE = ("it must return an object with layers (a list of torch.nn.Module), loss(output, target) and "
             "sample(generator, batch_size), e.g. types.SimpleNamespace(layers=..., loss=..., sample=...)")


@dataclass
class LayerStack:
    """The object a model function may return (a ``types.SimpleNamespace`` with the same three
    attributes is as good): ``layers``, ``loss(output, target)``, ``sample(generator, batch_size)``."""

    layers: list[nn.Module]
    loss: Callable[[torch.Tensor, Any], torch.Tensor]
    sample: Callable[[torch.Generator, int], tuple[torch.Tensor, Any]]


@dataclass
class Stack:
    """A model function's result, checked: the layers as a list, the loss and the sampler."""

    ref: str
    layers: list[nn.Module]
    loss: Callable
    sample: Callable
    folder: str | None = None       # a model file's folder (see user_code)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(type(m).__name__ for m in self.layers)


# ---------------------------------------------------------------------------- loading
class _Timeout(BaseException):
    """Raised by :func:`time_limit`'s alarm (a BaseException: the user's ``except Exception`` lets it by)."""


@contextmanager
def user_code(folder: str | None = None):
    """Around every call into a model's own code (importing it, ``FUNC()``, ``sample``, the layers'
    forward, the loss): its printing goes to standard error, so standard output holds pipetwin's
    results only (``--json``'s object parses), and ``folder`` (a model file's) is first on
    ``sys.path``, as Python puts a script's folder, so the file imports the modules beside it (then
    and later, from ``FUNC()`` or a forward). Only while the model's code runs: pipetwin's own imports
    never see the user's folder (a module there named like one of pipetwin's packages cannot shadow it)."""
    added = folder is not None and (not sys.path or sys.path[0] != folder)
    if added:
        sys.path.insert(0, folder)
    try:
        with redirect_stdout(sys.stderr):
            yield
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)


@contextmanager
def time_limit(seconds: float, what: str):
    """Run the block for at most ``seconds`` (wall clock; SIGALRM, so in the main thread only,
    elsewhere unbounded), else a ValueError of one line: ``what`` did not finish."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def alarm(signum, frame):
        raise _Timeout

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _Timeout:
        raise ValueError(f"{what} did not finish in {seconds:g} s; does it wait for something or loop "
                         f"forever?") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _where(e: BaseException, path: str | None) -> str:
    """' (FILE line N)': the innermost frame of the user's file in the exception's traceback."""
    if isinstance(e, SyntaxError) and e.lineno:
        return f" ({Path(e.filename or path or '?').name} line {e.lineno})"
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if path and Path(f.filename).resolve() == Path(path).resolve()] or frames[-1:]
    return f" ({Path(mine[-1].filename).name} line {mine[-1].lineno})" if mine else ""


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


_MODULES: dict[tuple, Any] = {}


def load_function(ref: str) -> tuple[Callable, str | None]:
    """The model function ``ref`` names (``PATH.py:FUNC`` or ``package.module:FUNC``) and the file
    it is defined in. A file is imported once per process (again when it changed), its folder first
    on ``sys.path`` (:func:`user_code`)."""
    m = MODEL_REF.fullmatch(ref.strip())
    if m is None:
        raise ValueError(f"--model {ref!r}: a model file is PATH.py:FUNC or package.module:FUNC")
    target, func = m["target"], m["func"]
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"model file {target} does not exist")
        key = (str(path), path.stat().st_mtime_ns)
        module = _MODULES.get(key)
        if module is None:
            name = "pipetwin_model_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                with time_limit(BUILD_SECONDS, f"model {ref}: importing {target}"), user_code(str(path.parent)):
                    spec.loader.exec_module(module)
            except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's code: one line, not a traceback
                del sys.modules[name]
                raise ValueError(f"model {ref}: importing {target} failed{_where(e, str(path))}: "
                                 f"{_first_line(e)}") from None
            _MODULES[key] = module
        where = str(path)
    else:
        try:
            with user_code():
                module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name and (target == e.name or target.startswith(e.name + ".")):
                raise ValueError(f"model {ref}: no module named {e.name!r} (a package.module on the Python path, "
                                 f"or PATH.py)") from None
            raise ValueError(f"model {ref}: importing {target} failed{_where(e, None)}: {_first_line(e)}") from None
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"model {ref}: importing {target} failed{_where(e, None)}: {_first_line(e)}") from None
        where = getattr(module, "__file__", None)
    fn = getattr(module, func, None)
    if fn is None:
        raise ValueError(f"model {ref}: {target} has no function {func!r}")
    if not callable(fn):
        raise ValueError(f"model {ref}: {target}.{func} is a {type(fn).__name__}, not a function")
    return fn, where


def _folder(ref: str, where: str | None) -> str | None:
    """The folder a model file's code runs with first on ``sys.path`` (None for a package.module,
    which Python finds on its own path)."""
    return str(Path(where).parent) if where and ref.strip().rsplit(":", 1)[0].endswith(".py") else None


def check_stack(obj, ref: str, folder: str | None = None) -> Stack:
    """The interface's checks on a model function's result (one ValueError line each)."""
    func = ref.rsplit(":", 1)[-1]
    missing = [a for a in ("layers", "loss", "sample") if not hasattr(obj, a)]
    if missing:
        raise ValueError(f"model {ref}: {func}() returned a {type(obj).__name__} without "
                         f"{', '.join(repr(a) for a in missing)}; {INTERFACE}")
    layers = obj.layers
    if isinstance(layers, nn.ModuleList):
        layers = list(layers)
    if not isinstance(layers, list):
        hint = " (pass list(...) of it)" if isinstance(layers, (tuple, nn.Sequential)) else ""
        raise ValueError(f"model {ref}: 'layers' must be a list of torch.nn.Module{hint}; got a "
                         f"{type(layers).__name__}")
    if not layers:
        raise ValueError(f"model {ref}: 'layers' is empty; a pipeline needs at least one layer per stage")
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ValueError(f"model {ref}: layers[{i}] is a {type(layer).__name__}, not a torch.nn.Module "
                             f"(wrap a function in a module whose forward calls it)")
    for a, sig in (("loss", "loss(output, target)"), ("sample", "sample(generator, batch_size)")):
        if not callable(getattr(obj, a)):
            raise ValueError(f"model {ref}: '{a}' must be a function {sig}; got a {type(getattr(obj, a)).__name__}")
    return Stack(ref.strip(), layers, obj.loss, obj.sample, folder)


def build_stack(ref: str, seed: int = 0) -> Stack:
    """Call the model function after ``torch.manual_seed(seed)`` (the CPU generator is restored
    afterwards) and check its result."""
    fn, where = load_function(ref)
    func = ref.rsplit(":", 1)[-1]
    folder = _folder(ref, where)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            with time_limit(BUILD_SECONDS, f"model {ref}: {func}()"), user_code(folder):
                obj = fn()
        except SystemExit as e:   # sys.exit() in the user's code ends nothing but the build
            raise ValueError(f"model {ref}: {func}() called sys.exit({e.code!r}){_where(e, where)}; it must "
                             f"return the model") from None
        except Exception as e:  # noqa: BLE001 - the user's code
            raise ValueError(f"model {ref}: {func}() failed{_where(e, where)}: {_first_line(e)}") from None
    return check_stack(obj, ref, folder)


def meta_params(ref: str, seed: int = 0) -> tuple[tuple[int, ...], float] | None:
    """(parameters per layer, bytes of the weights) of the model built on the meta device: every
    tensor the model function makes is a shape without memory, so a model of any size is counted
    in the time its Python takes. None where it cannot be built there (it reads a tensor's values
    while building, or fails): the real build then checks it."""
    fn, where = load_function(ref)
    func = ref.rsplit(":", 1)[-1]
    folder = _folder(ref, where)
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), \
                time_limit(BUILD_SECONDS, f"model {ref}: {func}() on the meta device"), user_code(folder):
            stack = check_stack(fn(), ref)
    except (Exception, SystemExit):  # noqa: BLE001 - the user's code; the real build says what is wrong
        return None
    layers = [list(layer.parameters()) for layer in stack.layers]
    unique = {id(p): p for ps in layers for p in ps}.values()
    return tuple(sum(p.numel() for p in ps) for ps in layers), float(sum(p.numel() * p.element_size() for p in unique))


def stack_host_bytes(params, sched: Schedule, out_bytes: float = 0.0) -> float:
    """Host memory a model of ``params`` parameters per layer needs on top of the ranks' processes,
    at least: every rank builds the whole model once (fp32 weights), every model copy and replica
    holds weights + gradients + Adam state (16 B per parameter), and min(N, D) micro-batches per
    pipeline keep ``out_bytes`` (about every layer's output)."""
    total = float(sum(params))
    inflight = min(sched.num_microbatches, sched.num_devices) * sched.replicas
    return sched.num_ranks * 4 * total + 16 * total * sched.num_copies * sched.replicas + inflight * out_bytes


def check_fits(ref: str, need: float, what: str, *, hint: str = "") -> None:
    """``what`` of model ``ref`` needs ``need`` bytes of host memory: refused (ValueError, one line)
    where this host has less available."""
    avail = available_host_bytes()
    if avail is not None and need > avail:
        gib = 2 ** 30
        raise ValueError(f"model {ref}: {what} needs at least {need / gib:.1f} GiB of memory on this host but "
                         f"{avail / gib:.1f} GiB is available; use {hint}a smaller model")


def check_stack_fits(config, low: Schedule) -> None:
    """A CPU run of a model file (``config``: its RunConfig), its parameters counted on the meta device
    (:func:`executor.user_model.meta_params`: no weights made) before the model is built: refused
    (ValueError) where ``low``'s ranks of it cannot fit in this host's available memory (building
    it once is :func:`executor.user_model.stack_layout`'s check)."""
    meta = None if config.device == "cuda" else meta_params(str(config.model), config.seed)
    if meta is not None:
        params = meta[0]
        check_fits(str(config.model), low.num_ranks * PROCESS_BYTES + stack_host_bytes(params, low),
                   f"running {low.num_ranks} ranks of its {sum(params):,} parameters", hint="fewer ranks (-D/--dp) or ")


def find_ties(layers: list[nn.Module]) -> tuple[tuple[tuple[int, str], ...], ...]:
    """Parameters shared between layers: per shared parameter (in order of first use) the
    (layer index, parameter name in that layer) of every layer that holds it."""
    seen: dict[int, list[tuple[int, str]]] = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            seen.setdefault(id(p), []).append((i, name))
    return tuple(tuple(v) for v in seen.values() if len({i for i, _ in v}) > 1)


# ---------------------------------------------------------------------------- the launcher's checks
@dataclass(frozen=True)
class StackLayout:
    """What the launching process learns from one build and one forward of the model, and every
    rank needs: the layers per stage, the shape and dtype of every layer's output at the
    micro-batch (the messages between stages), the shared parameters."""

    ref: str
    micro_batch: int
    counts: tuple[int, ...]                      # layers per stage of a model copy
    names: tuple[str, ...]                       # the layers' class names
    params: tuple[int, ...]                      # parameters per layer
    input_shape: tuple[int, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[torch.dtype, ...]
    ties: tuple[tuple[tuple[int, str], ...], ...]

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def stage_ranges(self) -> list[range]:
        return ranges(self.counts)

    def stage_of_layer(self) -> list[int]:
        return [s for s, rng in enumerate(self.stage_ranges()) for _ in rng]

    def host_bytes(self, sched: Schedule) -> float:
        """Host memory the model needs on top of the ranks' processes, at least (the launcher's
        check before spawning): every rank builds the whole model once (fp32 weights), every model
        copy and replica holds weights + gradients + Adam state (16 B per parameter), and min(N, D)
        micro-batches per pipeline keep about every layer's output."""
        outs = float(sum(math.prod(s) * torch.empty((), dtype=d).element_size()
                         for s, d in zip(self.out_shapes, self.out_dtypes)))
        return stack_host_bytes(self.params, sched, outs)

    def message_buffer(self, op: Op, device) -> torch.Tensor:
        """An empty tensor for the message of RECV ``op``: an activation is the output of the
        producing stage's last layer, a gradient has the shape of the producing stage's input."""
        p = source_stage(op)
        boundary = p if op.payload == ACT else p - 1
        i = self.stage_ranges()[boundary][-1]
        return torch.empty(self.out_shapes[i], dtype=self.out_dtypes[i], device=device)


def probe_forward(stack: Stack, micro_batch: int):
    """One micro-batch through every layer and the loss, with one-line errors; returns (input,
    target, outputs of every layer, loss)."""
    with user_code(stack.folder):
        return _probe_forward(stack, micro_batch)


def _probe_forward(stack: Stack, micro_batch: int):
    ref = stack.ref

    def draw():
        try:
            batch = stack.sample(torch.Generator().manual_seed(0), micro_batch)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"model {ref}: sample(generator, {micro_batch}) failed: {_first_line(e)}") from None
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(f"model {ref}: sample(generator, batch_size) must return (input, target); got a "
                             f"{type(batch).__name__}")
        for what, t in zip(("input", "target"), batch):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"model {ref}: sample(generator, batch_size) must return two tensors; the {what} "
                                 f"is a {type(t).__name__}")
        return batch

    x, y = draw()
    x2, y2 = draw()
    if x.shape != x2.shape or y.shape != y2.shape or not (torch.equal(x, x2) and torch.equal(y, y2)):
        raise ValueError(f"model {ref}: sample(generator, batch_size) returned different batches for equally "
                         f"seeded generators; draw every random number from the generator it is given")
    outs, h, prev = [], x, "the input from sample()"
    for i, layer in enumerate(stack.layers):
        name = type(layer).__name__
        version = h._version
        try:
            out = layer(h)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"model {ref}: layer {i} ({name}) cannot take {prev} (shape {list(h.shape)}, "
                             f"{str(h.dtype).replace('torch.', '')}): {_first_line(e)}") from None
        if h._version != version:
            raise ValueError(_in_place(ref, i, name))
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"model {ref}: layer {i} ({name}) returned a {type(out).__name__}; every layer must "
                             f"return one tensor, the next layer's input")
        outs.append(out)
        h, prev = out, f"the output of layer {i} ({name})"
    try:
        loss = stack.loss(h, y)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"model {ref}: loss(output, target) failed on the output of layer "
                         f"{len(outs) - 1} (shape {list(h.shape)}) and the target (shape {list(y.shape)}): "
                         f"{_first_line(e)}") from None
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
        raise ValueError(f"model {ref}: loss(output, target) must return a scalar tensor (the mean loss of the "
                         f"micro-batch); got {got}")
    return x, y, outs, loss


def _in_place(ref: str, i: int, name: str) -> str:
    return (f"model {ref}: layer {i} ({name}) changes its input in place (e.g. x.relu_(), x += ...); a stage's "
            f"input is a received tensor that autograd needs as it was: compute a new tensor (x = x.relu())")


def check_gradient_flow(stack: Stack, outs: list[torch.Tensor], counts: tuple[int, ...]) -> None:
    """Every stage but the first gets its input from the stage before and must send a gradient back:
    run each such stage as a rank does, from a received leaf tensor that requires grad, and require
    every layer's output to depend on its input (a layer that returns an integer tensor, a constant or
    a detached one cuts the gradient; one that changes its input in place is refused by autograd)."""
    with user_code(stack.folder):
        _check_gradient_flow(stack, outs, counts)


def _check_gradient_flow(stack: Stack, outs: list[torch.Tensor], counts: tuple[int, ...]) -> None:
    ref = stack.ref
    for s, rng in enumerate(ranges(counts)):
        if s == 0 or not outs[rng[0] - 1].is_floating_point():     # integer boundaries: stack_layout's check
            continue
        h = outs[rng[0] - 1].detach().clone().requires_grad_(True)
        for i in rng:
            name = type(stack.layers[i]).__name__
            try:
                out = stack.layers[i](h)
            except RuntimeError as e:
                if "in-place" in str(e):
                    raise ValueError(_in_place(ref, i, name)) from None
                raise ValueError(f"model {ref}: layer {i} ({name}) fails on a received input: "
                                 f"{_first_line(e)}") from None
            cut = not out.requires_grad or torch.autograd.grad(
                out, h, torch.ones_like(out), allow_unused=True)[0] is None
            if cut:
                dtype = str(out.dtype).replace("torch.", "")
                what = (f"returns an integer tensor ({dtype})" if not out.is_floating_point()
                        else "returns a tensor that does not depend on its input")
                raise ValueError(f"model {ref}: layer {i} ({name}) {what}, so stage {s} (layers {rng[0]}-{rng[-1]}) "
                                 f"cannot send a gradient to stage {s - 1}; put it in the first stage (--partition, "
                                 f"now {short_list(counts)}) or make it differentiable")
            h = out.detach().requires_grad_(True)


_LAYOUTS: dict[tuple, StackLayout] = {}


def stack_layout(ref: str, num_stages: int, *, micro_batch: int = DEFAULT_MICRO_BATCH, seed: int = 0,
                 partition=None) -> StackLayout:
    """Build the model once, check it (see the module docstring), split it into ``num_stages``
    stages (``partition``: layers per stage; default :func:`cost_models.partition.stack_partition`)
    and record the shapes every rank needs. Cached per process (a model file that changes is
    loaded again)."""
    fn, where = load_function(ref)
    stamp = Path(where).stat().st_mtime_ns if where and Path(where).is_file() else None
    part = None if partition is None else tuple(partition)
    key = (ref.strip(), stamp, num_stages, int(micro_batch), int(seed), part)
    if key in _LAYOUTS:
        return _LAYOUTS[key]
    meta = meta_params(ref, seed)      # counted before any weight is made
    if meta is not None:
        check_fits(ref, meta[1], f"building its {sum(meta[0]):,} parameters")
    stack = build_stack(ref, seed)
    params = tuple(sum(p.numel() for p in layer.parameters()) for layer in stack.layers)
    try:
        counts = tuple(stack_partition(params, num_stages, part))
    except ValueError as e:
        raise ValueError(f"model {ref} ({len(stack.layers)} layers): {e}") from None
    with time_limit(BUILD_SECONDS, f"model {ref}: one forward of a micro-batch of {micro_batch}"):
        x, _, outs, loss = probe_forward(stack, int(micro_batch))
    if not loss.requires_grad:
        raise ValueError(f"model {ref}: the loss does not depend on any parameter that requires grad; "
                         f"nothing would train")
    layout = StackLayout(ref=ref.strip(), micro_batch=int(micro_batch), counts=counts, names=stack.names,
                         params=params, input_shape=tuple(x.shape), out_shapes=tuple(tuple(o.shape) for o in outs),
                         out_dtypes=tuple(o.dtype for o in outs), ties=find_ties(stack.layers))
    for s, rng in enumerate(layout.stage_ranges()[:-1]):
        i = rng[-1]
        if not layout.out_dtypes[i].is_floating_point:
            raise ValueError(f"model {ref}: the boundary between stages {s} and {s + 1} (after layer {i}, "
                             f"{layout.names[i]}) carries a {str(layout.out_dtypes[i]).replace('torch.', '')} "
                             f"tensor; gradients flow back only through floating-point tensors: choose a partition "
                             f"that does not cut there (--partition; layers per stage now {list(counts)})")
    with time_limit(BUILD_SECONDS, f"model {ref}: the gradient check of its stages"):
        check_gradient_flow(stack, outs, counts)
    _LAYOUTS[key] = layout
    return layout


# ---------------------------------------------------------------------------- stages and data
class LayerStage(nn.Module):
    """Consecutive layers of the stack (``layers.<global index>``, so parameter names are the
    same wherever a layer lives); the last stage also has the loss."""

    def __init__(self, layers: dict[int, nn.Module], loss: Callable | None = None, folder: str | None = None):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): m for i, m in layers.items()})
        self._loss = (loss,)     # a tuple: a loss that is an nn.Module must not become a submodule
        self.folder = folder     # the model file's (user_code)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with user_code(self.folder):
            for layer in self.layers.values():
                x = layer(x)
        return x

    def steps(self) -> list:
        """One step per layer (where the overlapped F&B runtime cuts the forward, :mod:`executor.overlap`)."""
        return [partial(self._layer, layer) for layer in self.layers.values()] or [self]

    def _layer(self, layer: nn.Module, x):
        with user_code(self.folder):
            return layer(x)

    def loss(self, output: torch.Tensor, target) -> torch.Tensor:
        with user_code(self.folder):
            return self._loss[0](output, target)


class StackData:
    """The executor's data source for a layer stack: ``batch(step, g, G)`` is the user's
    ``sample`` with a generator seeded from (seed, step, g) (see the module docstring)."""

    def __init__(self, stack: Stack, micro_batch: int, seed: int, input_shape: tuple[int, ...] | None = None):
        self.stack, self.micro_batch, self.seed, self.input_shape = stack, micro_batch, seed, input_shape

    def batch(self, step: int, index: int, groups: int):
        g = torch.Generator().manual_seed(mix_seed(self.seed, step, index))
        with user_code(self.stack.folder):
            x, y = self.stack.sample(g, self.micro_batch)
        if self.input_shape is not None and tuple(x.shape) != self.input_shape:
            raise ValueError(f"model {self.stack.ref}: sample() returned an input of shape {list(x.shape)} for "
                             f"micro-batch {index} of step {step}, the first was {list(self.input_shape)}; every "
                             f"micro-batch must have the same shapes")
        return x, y


class NoOptimizer:
    """The optimizer of a rank whose stages have no parameters (torch's refuse an empty list)."""

    state: dict = {}

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = False) -> None:
        pass


def unique_parameters(modules) -> list[nn.Parameter]:
    """The parameters of ``modules``, each once (a parameter shared by two of them counts once)."""
    seen, out = set(), []
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


# ---------------------------------------------------------------------------- shared parameters
def tie_groups(layout: StackLayout, sched: Schedule) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Shared parameters whose layers land on different stages, grouped by the ranks that hold
    them: [(ranks, indices into ``layout.ties``)], in one order every rank computes alike. The
    ranks of a shared parameter are those holding any of its stages (every copy, every replica)."""
    stage_of = layout.stage_of_layer()
    groups: dict[tuple[int, ...], list[int]] = {}
    for t, tie in enumerate(layout.ties):
        stages = sorted({stage_of[i] for i, _ in tie})
        if len(stages) < 2:
            continue
        ranks = tuple(sorted({r for s in stages for r in sched.stage_group(s)}))
        groups.setdefault(ranks, []).append(t)
    return [(ranks, tuple(ts)) for ranks, ts in groups.items()]


class TiedGradients:
    """Sums the gradients of parameters shared across stages over the ranks that hold them, once
    per step before the optimizer (see the module docstring). ``excluded``: ids of this rank's
    copies of those parameters, which the stages' own all-reduces leave out. (The GPT's sequence-
    parallel norm gradients are summed over their TP group by this too: ``what`` names them.)"""

    def __init__(self, rank: int, groups: list[tuple[tuple[int, ...], object, list[nn.Parameter]]],
                 excluded: set[int], what: str = "shared parameters"):
        self.rank, self.what = rank, what
        self.groups = [(ranks, pg, params) for ranks, pg, params in groups if rank in ranks and len(ranks) > 1]
        self.excluded = frozenset(excluded)

    def sync(self, timeout: float, step: int) -> None:
        from .p2p import wait_work
        from .runtime import flatten, unflatten_into
        pending = []
        for ranks, pg, params in self.groups:
            grads = [p.grad for p in params]
            flat = flatten(grads)
            pending.append((ranks, grads, flat, dist.all_reduce(flat, group=pg, async_op=True)))
        for ranks, grads, flat, work in pending:
            wait_work(work, timeout, f"rank {self.rank} step {step}: all-reduce of {self.what} over ranks "
                                     f"{list(ranks)}")
            unflatten_into(flat, grads)


# ---------------------------------------------------------------------------- the same weights everywhere
class RanksDisagree(ValueError):
    """A user error found on the ranks, every rank alike (they all raise it): the launcher reports it
    as one line (``refusal``: :mod:`executor.launch`), the command line as ``pipetwin: error:``."""

    refusal = True


def layer_digests(layers: list[nn.Module]) -> tuple[str, ...]:
    """A checksum per layer: a hash of the names, dtypes, shapes and bytes of its parameters and
    buffers, in order (bit-equal weights give equal checksums; any other difference, another)."""
    out = []
    for layer in layers:
        h = hashlib.blake2b(digest_size=16)
        for name, t in (*layer.named_parameters(), *layer.named_buffers()):
            t = t.detach()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
        out.append(h.hexdigest())
    return tuple(out)


def check_same_weights(digests: tuple[str, ...], layout: StackLayout, world: int) -> None:
    """Every rank built the same weights (:func:`layer_digests` of its whole build against rank 0's,
    gathered on the default group; every rank calls this after building and before step 0): where
    not, every rank raises the same :class:`RanksDisagree` naming the first rank and layer that
    differ. Each rank builds the whole model after ``torch.manual_seed(seed)``, so a build that
    differs draws from something else: a seed from the process id or the time, most likely."""
    everyone: list = [None] * world
    dist.all_gather_object(everyone, digests)
    for r, theirs in enumerate(everyone[1:], 1):
        i = next((i for i, (a, b) in enumerate(zip(everyone[0], theirs)) if a != b), None)
        if i is not None:
            func = layout.ref.rsplit(":", 1)[-1]
            raise RanksDisagree(f"model {layout.ref}: rank {r} built other weights than rank 0 (first at layer {i}, "
                                f"{layout.names[i]}); does {func}() seed from the process id or the time? pipetwin "
                                f"seeds every rank's build alike (--seed): leave the seeding to it")


# ---------------------------------------------------------------------------- one rank
@dataclass
class RankModel:
    """One rank's part of a layer stack: its stage modules (copies of a stage share one), their
    parameters (each once), the data source, the message buffers, the shared-parameter groups
    (every rank's list, for process-group creation in one order) and a speed probe's work."""

    built: dict[int, LayerStage]
    modules: dict[tuple[int, int], LayerStage]
    params: list[nn.Parameter]
    data: StackData
    tie_groups: list[tuple[tuple[int, ...], list[nn.Parameter]]]
    excluded: set[int]
    probe: Callable[[], None] | None = None
    digests: tuple[str, ...] = ()       # layer_digests of this rank's whole build (check_same_weights)


def build_rank(layout: StackLayout, sched: Schedule, rank: int, *, seed: int, device, probe: bool = False
               ) -> RankModel:
    """Build the model (``FUNC()`` after ``torch.manual_seed(seed)``) and keep this rank's stages."""
    stack = build_stack(layout.ref, seed)
    if stack.names != layout.names:
        raise RuntimeError(f"rank {rank}: model {layout.ref} built layers {list(stack.names)} here but "
                           f"{list(layout.names)} in the launching process; FUNC() must build the same model "
                           f"every time")
    digests = layer_digests(stack.layers)      # as built, before anything moves or trains
    work = _probe_work(stack, layout, device) if probe else None
    last = sched.num_stages - 1
    built: dict[int, LayerStage] = {}
    modules = {}
    rngs = layout.stage_ranges()
    for c, s in sched.stages_on(sched.rank_device(rank)):
        if s not in built:
            built[s] = LayerStage({i: stack.layers[i] for i in rngs[s]}, stack.loss if s == last else None,
                                  stack.folder).to(device)
        modules[(c, s)] = built[s]
    stage_of = layout.stage_of_layer()
    groups, excluded = [], set()
    for ranks, ties in tie_groups(layout, sched):
        params = []
        for t in ties:
            held = [(i, name) for i, name in layout.ties[t] if stage_of[i] in built]
            if held:
                i, name = held[0]
                p = built[stage_of[i]].layers[str(i)].get_parameter(name)
                params.append(p)
                excluded.add(id(p))
        groups.append((ranks, params))
    return RankModel(built, modules, unique_parameters(built.values()),
                     StackData(stack, layout.micro_batch, seed, layout.input_shape), groups, excluded, work,
                     digests)


def _probe_work(stack: Stack, layout: StackLayout, device) -> Callable[[], None]:
    """Forward + backward of the whole model on one micro-batch, on a copy of it (the host speed
    probe of calibration and validation runs: every rank does the same work)."""
    layers = copy.deepcopy(nn.ModuleList(stack.layers)).to(device)
    with user_code(stack.folder):
        x, y = stack.sample(torch.Generator().manual_seed(1234), layout.micro_batch)
    x, y = x.to(device), y.to(device)

    def work() -> None:
        with user_code(stack.folder):
            h = x
            for layer in layers:
                h = layer(h)
            loss = stack.loss(h, y)
        loss.backward()
    return work


def reference_model(ref: str, *, seed: int, micro_batch: int) -> tuple[LayerStage, StackData]:
    """The whole stack as one stage (the single-process reference) and its data source."""
    layout = stack_layout(ref, 1, micro_batch=micro_batch, seed=seed)
    stack = build_stack(ref, seed)
    model = LayerStage(dict(enumerate(stack.layers)), stack.loss, stack.folder)
    return model, StackData(stack, micro_batch, seed, layout.input_shape)
