"""The torch.distributed executor: trains a GPT, or a user's layer stack (``--model PATH.py:FUNC``,
:mod:`executor.user_model`), with any lowered schedule of the IR.

``run(RunConfig(job=..., steps=...))`` validates the schedule, starts T x C x D x R ranks (CPU + gloo, or one rank per
process under ``torchrun`` with NCCL) and returns a :class:`~executor.config.RunResult` (losses,
iteration times, per-rank activation memory, the merged trace); ``run_reference`` trains the same
model on the same batches in one process. Modules: ``model`` (GPT and its split into stages),
``user_model`` (a model file: loading, checks, its stages, shared parameters), ``tensor_parallel`` and
``context_parallel`` (a stage over T x C processes), ``mesh`` (where each process sits),
``data``, ``device`` (the CPU/GPU choice and memory meters), ``p2p`` (messages), ``runtime`` (the
interpreter), ``faults`` (fault injection), ``worker`` (one rank), ``launch`` (processes), ``reference``;
``torch_pipelining`` trains the same stages under ``torch.distributed.pipelining``'s own runtime from
a schedule's torch CSV (``run_torch``; ``pipetwin run --runtime torch``).
"""
from schedules._face import lazy_face

# module -> the names this package exports from it, imported on first use (schedules._face)
__all__, __getattr__, __dir__ = lazy_face(__name__, {
    "config": ("RunConfig", "RunResult", "lowered_schedule"),
    "launch": ("LaunchError", "run", "run_many"),
    "reference": ("run_reference",),
    "torch_pipelining": ("run_torch",),
})
