"""Activation recomputation in the executor (``--recompute none|selective|full``, the option
names of ``pipetwin simulate``), one transformer block at a time.

The unit is a layer of a stage (:func:`recompute_units`: the GPT's transformer blocks; the
embedding and the head keep their activations, as in the cost model's formulas and in
Megatron-LM). Saved-tensor hooks are pushed around each unit's forward by module hooks that the
runtime installs on the stage it built (:meth:`Recompute.install`); the model is not changed.

- ``full``: a unit keeps only its input. Every tensor autograd saves inside it becomes a
  placeholder; the first backward that unpacks one re-runs the unit's forward from the kept input
  (same autocast state, same RNG state) and fills all placeholders at once. Kept F -> B: the
  block input, ``sbh d`` per block.
- ``selective``: the attention core (the fused scaled-dot-product-attention kernels; on the
  unfused path softmax and the batched products) is recomputed, everything else is kept. A
  ``TorchDispatchMode`` active inside each unit notes the outputs of those ops; when autograd saves
  one, it is replaced by a recipe (the op and its inputs, which the attention backward saves
  anyway); unpacking it runs the op again. With a fused attention kernel (flash on CPU and CUDA)
  that drops the attention output and its log-sum-exp: fused kernels keep no ``s^2`` tensors to
  begin with, which is why selective recomputation saves little there.

Why not ``torch.utils.checkpoint``: a split backward unpacks some saved tensors twice, in B and
again for W (:mod:`executor.backward` takes a linear layer's saved input when its node runs in
B; an op the engine handles in W unpacks its saved tensors in a second backward call).
``torch.utils.checkpoint`` recomputes per backward call and clears a recomputed tensor once it
is unpacked, and its selective mode refuses a second backward outright. Here a recomputed value
lives as long as its placeholder, so any number of unpacks see it; the backward frees the
placeholders (and with them the values) as it goes.

Memory as the saved-tensor meter counts it (what is kept between ops): the kept inputs and the
unrecomputed saved tensors from F, and what a split backward keeps for W (counted by the
runtime). The recomputed values are transient inside one B and not counted (the simulator does
not model that transient either); only when an op needs the engine in W does the graph, and
with it the recomputed values, stay until W (uncounted).
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cost_models.parallel import RECOMPUTE as MODES      # the job's recompute modes, one list

_aten = torch.ops.aten
_CORE = {getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_softmax", "bmm", "baddbmm") if hasattr(_aten, name)}


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {', '.join(MODES)}; got {mode!r}")
    return mode


def recompute_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of a stage that are recomputed: a GPT stage's transformer blocks, a layer
    stack's layers; a module without either is one unit itself."""
    for name in ("blocks", "layers"):
        units = getattr(module, name, None)
        if isinstance(units, (torch.nn.ModuleDict, torch.nn.ModuleList)):
            return list(units.values() if isinstance(units, torch.nn.ModuleDict) else units)
    return [module]


class Recompute:
    """Recomputation of the units of the modules it is installed on (see the module docstring).
    ``meter``: the rank's activation meter (its pack/unpack store what is kept, ``hold`` counts
    held tensors); ``params``: tensors never recomputed (saved as they are)."""

    def __init__(self, mode: str, meter, params):
        self.mode = check_mode(mode)
        self.meter = meter
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self._recomputing = 0
        self._stack: list = []

    def install(self, module: torch.nn.Module) -> list:
        """Hook the units of ``module``; returns the hook handles."""
        if self.mode == "none":
            return []
        handles = []
        for unit in recompute_units(module):
            handles.append(unit.register_forward_pre_hook(self._enter))
            handles.append(unit.register_forward_hook(self._exit))
        return handles

    def run_unit(self, fn, *args):
        """``fn(*args)`` recomputed as a unit of its own (a segment of a block the overlapped F&B
        runtime cut at its all-to-alls, :mod:`executor.overlap`): a recomputation re-runs ``fn``
        only, from the args it kept."""
        if self.mode == "none":
            return fn(*args)
        self._enter(fn, args)
        try:
            return fn(*args)
        finally:
            self._exit(fn, args, None)

    # ------------------------------------------------------------------ forward hooks
    def _enter(self, unit, args):
        if self._recomputing or not torch.is_grad_enabled():
            self._stack.append(None)
            return
        if self.mode == "full":
            frame = _Frame(self, unit, args)
            ctx = torch.autograd.graph.saved_tensors_hooks(frame.pack, _unpack)
            ctx.__enter__()
            self._stack.append((ctx,))
        else:
            recorder = _CoreRecorder()
            ctx = torch.autograd.graph.saved_tensors_hooks(recorder.pack_with(self), _unpack_selective(self))
            ctx.__enter__()
            recorder.__enter__()
            self._stack.append((ctx, recorder))

    def _exit(self, unit, args, output):
        entry = self._stack.pop()
        if entry is None:
            return
        if len(entry) == 2:
            entry[1].__exit__(None, None, None)
        entry[0].__exit__(None, None, None)

    def param_storage_moved(self, old: int, new: int) -> None:
        """A parameter storage moved (ZeRO 3's gathered weights, :mod:`executor.zero`; ``new`` 0: freed)."""
        self._param_ptrs.discard(old)
        if new:
            self._param_ptrs.add(new)

    def is_param(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self._param_ptrs


# ---------------------------------------------------------------------------- full
class _Holder:
    """What autograd keeps instead of a tensor saved inside a fully recomputed unit."""

    __slots__ = ("frame", "k")

    def __init__(self, frame: "_Frame", k: int):
        self.frame, self.k = frame, k

    def __del__(self):
        self.frame.release(self.k)


class _Frame:
    """One forward of one unit: its kept input, and the recomputed values while placeholders live."""

    def __init__(self, owner: Recompute, unit, args):
        self.owner, self.unit = owner, unit
        self.args = tuple(a.detach() if torch.is_tensor(a) else a for a in args)
        self.grad_args = tuple(torch.is_tensor(a) and a.requires_grad for a in args)
        self.held = owner.meter.hold([a for a in self.args if torch.is_tensor(a)])
        self.device = next((a.device for a in self.args if torch.is_tensor(a)), torch.device("cpu"))
        dt = self.device.type
        self.autocast = (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt)) if dt in ("cpu", "cuda") \
            else (False, None)
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self.count = 0
        self.alive: set[int] = set()
        self.values: dict = {}
        self.recomputed = False

    def pack(self, t: torch.Tensor):
        if self.owner.is_param(t):
            return t
        k = self.count
        self.count += 1
        self.alive.add(k)
        return _Holder(self, k)

    def value(self, k: int) -> torch.Tensor:
        if not self.recomputed:
            self._recompute()
        return self.values[k]

    def _recompute(self) -> None:
        owner = self.owner
        counter = [0]

        def record(t):
            if owner.is_param(t):
                return None
            k = counter[0]
            counter[0] += 1
            if k in self.alive:
                self.values[k] = t.detach()
            return None

        args = tuple(a.detach().requires_grad_(g) if torch.is_tensor(a) else a
                     for a, g in zip(self.args, self.grad_args))
        owner._recomputing += 1
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.random.fork_rng(
                    devices=[self.device] if self.cuda_rng is not None else [], device_type=self.device.type))
                stack.enter_context(torch.enable_grad())
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(record, lambda _x: None))
                if self.autocast[1] is not None:
                    stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast[1],
                                                       enabled=self.autocast[0]))
                torch.set_rng_state(self.rng)
                if self.cuda_rng is not None:
                    torch.cuda.set_rng_state(self.cuda_rng, self.device)
                self.unit(*args)
        finally:
            owner._recomputing -= 1
        if counter[0] != self.count:
            raise RuntimeError(f"recomputing {type(self.unit).__name__} saved {counter[0]} tensors, the forward "
                               f"saved {self.count}: its forward is not deterministic")
        self.recomputed = True

    def release(self, k: int) -> None:
        self.alive.discard(k)
        self.values.pop(k, None)
        if not self.alive:      # nothing left to recompute for: drop the kept input
            self.args, self.held, self.values = (), None, {}


def _unpack(x):
    return x.frame.value(x.k) if isinstance(x, _Holder) else x


# ---------------------------------------------------------------------------- selective
class _Recipe:
    """An attention-core op as it ran in the forward: recomputed on demand, its outputs kept
    while placeholders for them live."""

    __slots__ = ("func", "args", "kwargs", "holders", "out")

    def __init__(self, func, args, kwargs):
        self.func, self.args, self.kwargs = func, args, kwargs
        self.holders, self.out = 0, None

    def output(self, i: int) -> torch.Tensor:
        out = self.out
        if out is None:
            args = tuple(a.resolve() if isinstance(a, _Ref) else a for a in self.args)
            with torch.no_grad():
                out = self.func(*args, **self.kwargs)
            out = out if isinstance(out, (tuple, list)) else (out,)
            if self.holders:
                self.out = out
        return out[i]

    def drop(self) -> None:
        self.holders -= 1
        if self.holders <= 0:
            self.out = None


class _Ref:
    """An input of a recipe that is itself an attention-core output (not kept: recomputed)."""

    __slots__ = ("recipe", "i")

    def __init__(self, recipe: _Recipe, i: int):
        self.recipe, self.i = recipe, i

    def resolve(self) -> torch.Tensor:
        return self.recipe.output(self.i)


class _RecipeHolder:
    __slots__ = ("recipe", "i")

    def __init__(self, recipe: _Recipe, i: int):
        self.recipe, self.i = recipe, i
        recipe.holders += 1

    def __del__(self):
        self.recipe.drop()


def _signature(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


class _CoreRecorder(TorchDispatchMode):
    """Inside a selectively recomputed unit: notes which tensors attention-core ops produced."""

    def __init__(self):
        super().__init__()
        self.made: dict = {}          # tensor signature -> (recipe, output index)

    def pack_with(self, owner: Recompute):
        pack = owner.meter.pack

        def hook(t):
            hit = self.made.get(_signature(t)) if t.data_ptr() else None
            if hit is None:
                return pack(t)
            return _RecipeHolder(*hit)
        return hook

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _CORE:
            made = self.made

            def arg(a):   # detached: a saved recipe must not hold the graph it belongs to
                if torch.is_tensor(a):
                    hit = made.get(_signature(a))
                    return _Ref(*hit) if hit is not None else a.detach()
                return a
            recipe = _Recipe(func, tuple(arg(a) for a in args), kwargs)
            for i, t in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
                if torch.is_tensor(t):
                    made[_signature(t)] = (recipe, i)
        return out


def _unpack_selective(owner: Recompute):
    unpack = owner.meter.unpack

    def hook(x):
        if isinstance(x, _RecipeHolder):
            return x.recipe.output(x.i)
        return unpack(x)
    return hook

