"""Checked command-line values: argparse types and the checks every command runs before long work.

Use them as ``type=`` of ``add_argument`` so a bad value is refused while parsing, before anything
is built, run or written, with one line that names the option (the parser prints
``pipetwin: error: argument --jitter: must be a finite number >= 0; got 'nan'`` and exits 2)::

    p.add_argument("--lr", type=positive_float, default=1e-3)
    p.add_argument("--steps", type=positive_int, default=3)
    p.add_argument("--plot", type=output_file, metavar="FILE.png")
    p.add_argument("--data", type=input_file)
    p.add_argument("--slowdown", type=factor_pair("RANK", int), action="append", default=[])

Numbers: ``finite_float`` (any finite), ``positive_float`` (> 0), ``nonneg_float`` (>= 0),
``positive_int`` (>= 1), ``nonneg_int`` (>= 0), ``int_in(lo, hi)``, ``float_in(lo, hi)``. NaN and inf
are refused everywhere. Files: ``input_file`` (exists, a file, not empty), ``output_file`` (its folder
exists or can be created, nothing in the way), ``output_dir``; the file checks themselves live in
:mod:`cost_models.files` (library code uses them too). Pairs: ``factor_pair(label, key)`` for
``KEY=FACTOR`` with a finite factor > 0.

:func:`check_run_size` is the cheap feasibility check (ranks, program size, cluster size,
layers >= stages) that runs before a schedule is built (building and validating are O(D^2)).
"""
from __future__ import annotations

import argparse
import math

from cost_models.files import FileError, check_output_dir, check_output_path, read_bytes
from schedules import registry


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (``pipetwin: error: ...``, status 2)."""

    def error(self, message):
        sub = self.prog.split(" ", 1)[1] if " " in self.prog else ""
        hint = f" (see pipetwin {sub} --help)" if sub else " (see pipetwin --help)"
        self.exit(2, f"pipetwin: error: {' '.join(message.split())}{hint}\n")


def _fail(what: str, text) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"must be {what}; got {text!r}")


def _float(text: str, what: str) -> float:
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise _fail(what, text) from None
    if not math.isfinite(v):
        raise _fail(what, text)
    return v


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise _fail(what, text) from None


def finite_float(text: str) -> float:
    return _float(text, "a finite number")


def positive_float(text: str) -> float:
    v = _float(text, "a finite number > 0")
    if v <= 0:
        raise _fail("a finite number > 0", text)
    return v


def nonneg_float(text: str) -> float:
    v = _float(text, "a finite number >= 0")
    if v < 0:
        raise _fail("a finite number >= 0", text)
    return v


def positive_int(text: str) -> int:
    v = _int(text, "an integer >= 1")
    if v < 1:
        raise _fail("an integer >= 1", text)
    return v


def nonneg_int(text: str) -> int:
    v = _int(text, "an integer >= 0")
    if v < 0:
        raise _fail("an integer >= 0", text)
    return v


def int_in(lo: int, hi: int):
    what = f"an integer in {lo}..{hi}"

    def check(text: str) -> int:
        v = _int(text, what)
        if not lo <= v <= hi:
            raise _fail(what, text)
        return v
    check.__name__ = f"int_in_{lo}_{hi}"
    return check


def float_in(lo: float, hi: float):
    what = f"a number in [{lo:g}, {hi:g}]"

    def check(text: str) -> float:
        v = _float(text, what)
        if not lo <= v <= hi:
            raise _fail(what, text)
        return v
    check.__name__ = "float_in"
    return check


def _file_type(check):
    def convert(text: str) -> str:
        try:
            check(text)
        except FileError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    convert.__name__ = check.__name__
    return convert


def _input(text: str):
    read_bytes(text, "file")


def _output(text: str):
    check_output_path(text, "file")


def _outdir(text: str):
    check_output_dir(text, "folder")


input_file = _file_type(_input)      # exists, is a file, is readable and not empty
output_file = _file_type(_output)    # can be written (checked at parse time; created at write time)
output_dir = _file_type(_outdir)     # can be created / written into


def factor_pair(label: str = "RANK", key=int, example: str = "3=1.5"):
    """``KEY=FACTOR`` -> (key, factor) with a finite factor > 0 (``--slowdown 2=1.5``)."""
    def parse(text: str):
        k, sep, v = str(text).partition("=")
        try:
            if not sep:
                raise ValueError
            kk = key(k.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects {label}=FACTOR, e.g. {example}; got {text!r}") from None
        return kk, positive_float(v.strip())
    parse.__name__ = "factor_pair"
    return parse


def pairs_dict(items, option: str) -> dict:
    """A list of (key, factor) pairs (from :func:`factor_pair`) as a dict; a key given twice is an error."""
    out = {}
    for k, v in items:
        if k in out:
            raise ValueError(f"{option} names {k} twice")
        out[k] = v
    return out


# ---------------------------------------------------------------- cheap feasibility, before any build
MAX_SIM_RANKS = 131_072     # ranks the simulator keeps per-rank records for (one replica simulated for all)

def check_run_size(*, devices: int, microbatches: int, replicas: int = 1, chunks: int = 1,
                   cluster_devices: int | None = None, cluster_name: str = "", layers: int | None = None,
                   model_name: str = "", one_replica: bool = False) -> None:
    """What can be refused without building a schedule: the size limits of the IR
    (:func:`schedules.registry.check_size`), a cluster too small for D x R ranks, a model with
    fewer layers than stages (every schedule has at least D stages per copy). One-line ValueErrors.
    ``one_replica``: the simulator builds, validates and (when the replicas are identical) simulates
    one replica, so the limits apply to one; a full simulation of every replica is bounded by the
    simulator itself (``sim.run(max_ops=...)``)."""
    ranks = devices * (1 if one_replica else replicas)
    if ranks > registry.MAX_RANKS:
        what = f"-D {devices}" if one_replica else f"-D {devices} x --dp {replicas} = {ranks} ranks"
        raise ValueError(f"{what} is beyond pipetwin's limit of {registry.MAX_RANKS} ranks; lower -D"
                         + ("" if one_replica else " or --dp"))
    if one_replica and devices * replicas > MAX_SIM_RANKS:
        raise ValueError(f"-D {devices} x --dp {replicas} = {devices * replicas:,} ranks is beyond the simulator's "
                         f"limit of {MAX_SIM_RANKS:,} ranks (its per-rank records); lower --dp")
    ops = registry.estimated_ops(devices, microbatches, 1 if one_replica else replicas, chunks)
    if ops > registry.MAX_OPS:
        most = max(1, registry.MAX_OPS * microbatches // ops)
        raise ValueError(f"-N {microbatches} micro-batches on {ranks} ranks is about {ops:,} ops per iteration, "
                         f"beyond pipetwin's limit of {registry.MAX_OPS:,} (memory and time grow with it); "
                         f"use -N {most:,} or fewer")
    ranks = devices * replicas
    if cluster_devices is not None and ranks > cluster_devices:
        raise ValueError(f"{ranks} ranks (D={devices} x R={replicas}) do not fit on cluster {cluster_name} with "
                         f"{cluster_devices} devices; pick a bigger --cluster or a smaller -D/--dp")
    if layers is not None and layers < devices:
        raise ValueError(f"model {model_name} has {layers} layers to split, fewer than the {devices} pipeline "
                         f"stages; lower -D or pick a deeper --model")

