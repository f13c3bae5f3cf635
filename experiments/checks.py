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
exists or can be created, nothing in the way; no pipe, socket or folder), ``output_dir``, and the
outputs whose extension names their format: ``figure_file`` (:data:`FIGURE_FORMATS`),
``csv_file``, ``chrome_file`` (``.json``); the file checks themselves live in
:mod:`cost_models.files` (library code uses them too). Each file type carries its ``role``
(``"in"``, ``"out"``, ``"dir"``): the command line refuses an output that is one of the command's
inputs, or another output, before any work (:func:`experiments.options.check_files_apart`).
Pairs: ``factor_pair(label, key)`` for ``KEY=FACTOR`` with a finite factor > 0.

:func:`cost_models.job.check_run_size` is the cheap feasibility check (ranks, program size,
cluster size, layers >= stages) that commands run before a schedule is built (building and
validating are O(D^2)).
"""
from __future__ import annotations

import argparse
import math

from cost_models.files import FileError, check_output_dir, check_output_path, read_bytes
from .tables import one_line_message


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (``pipetwin: error: ...``, status 2)."""

    def error(self, message):
        sub = self.prog.split(" ", 1)[1] if " " in self.prog else ""
        hint = f" (see pipetwin {sub} --help)" if sub else " (see pipetwin --help)"
        self.exit(2, f"pipetwin: error: {one_line_message(message)}{hint}\n")


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


_TOKEN_UNITS = {"": 1, "k": 1 << 10, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def token_count(text: str) -> int:
    """A whole count >= 1 with an optional suffix k, M, G or T, powers of 1,024 as token budgets are
    counted (``4M`` = 4,194,304 = 512 x 8,192; ``Mi`` reads the same): ``--global-tokens``."""
    what = "a token count >= 1, e.g. 4194304 or 4M (k, M, G: powers of 1,024)"
    import re
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKMGT]?)i?\s*", str(text))
    if not m:
        raise _fail(what, text)
    from fractions import Fraction
    v = Fraction(m.group(1)) * _TOKEN_UNITS[m.group(2)]
    if v.denominator != 1 or v < 1:
        raise _fail(what, text)
    return int(v)


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


def _file_type(check, role: str):
    def convert(text: str) -> str:
        try:
            check(text)
        except FileError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    convert.__name__ = check.__name__
    convert.role = role
    return convert


def _input(text: str):
    read_bytes(text, "file")


def _output(text: str):
    check_output_path(text, "file")


def _outdir(text: str):
    check_output_dir(text, "folder")


# the formats matplotlib writes by the extension alone (pgf needs LaTeX, raw / rgba are bare pixels)
FIGURE_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp")


def output_as(what: str, formats: tuple[str, ...]):
    """An output file whose extension is one of ``formats`` (checked while parsing, not after the work)."""
    def check(text: str):
        check_output_path(text, what, formats)
    check.__name__ = f"{what.replace(' ', '_')}_file"
    return _file_type(check, "out")


input_file = _file_type(_input, "in")      # exists, is a file, is readable and not empty


class FileValues(tuple):
    """Values read from a file while parsing, with the file's ``path``: the file still counts as one
    of the command's inputs (no output may overwrite it)."""

    path: str = ""


def expert_load_file(text: str) -> tuple[float, ...]:
    """``--expert-load FILE``: the file's tokens per expert (:func:`cost_models.moe.read_expert_load`)."""
    from cost_models.files import FileError
    from cost_models.moe import read_expert_load
    try:
        values = FileValues(read_expert_load(input_file(text)))
    except FileError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    values.path = text
    return values


expert_load_file.role = "in"
output_file = _file_type(_output, "out")    # can be written (checked at parse time; created at write time)
output_dir = _file_type(_outdir, "dir")     # can be created / written into
figure_file = output_as("figure", FIGURE_FORMATS)
csv_file = output_as("trace", ("csv",))
chrome_file = output_as("Chrome trace", ("json",))


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


def memory_limit(text: str) -> tuple[float, str]:
    """An argparse type for ``--memory-limit``: Ma (``16``, ``16 Ma``) or bytes with a unit (``40 GiB``)."""
    t = text.strip()
    num = t[:-2].strip() if t.endswith("Ma") else t
    try:
        value = float(num)
    except ValueError:
        return (byte_size("--memory-limit")(t), "B")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"--memory-limit must be > 0 (Ma, e.g. 16, or bytes with a unit, e.g. "
                                         f"40 GiB); got {text!r}")
    return (value, "Ma")


def bandwidth(option: str):
    """An argparse type: bytes per second as a number or with a unit (``20 MB/s``, ``1 Gb/s``), > 0."""
    from cost_models._spec import SpecError, bandwidth as parse_rate

    def parse(text: str) -> float:
        try:
            return parse_rate(text.strip(), option, option.lstrip("-"))
        except SpecError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def byte_size(option: str):
    """An argparse type: bytes as a number or with a unit (``4 GiB``, ``80 GB``); 0 allowed."""
    from cost_models._spec import SpecError, size_bytes

    def parse(text: str) -> float:
        try:
            return size_bytes(text.strip(), option, option.lstrip("-"), allow_zero=True)
        except SpecError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse
