"""``pipetwin``: the command line.

Each subcommand lives in its own module ``experiments/cmd_<name>.py`` with ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``main(args) -> int``; the parsers of simulate, compare, run, sweep,
plan, validate and calibrate are generated from the option table (:mod:`experiments.options`). User
errors (bad schedule, impossible D/N, malformed config) print one line ``pipetwin: error: ...`` and
exit 2; no traceback. Parse errors do too (:class:`experiments.checks.Parser`): give every new
option (a row of the table) a checked type from :mod:`experiments.checks` (``positive_float``,
``positive_int``, ``input_file``, ``output_file``, ...) so a bad value is refused while parsing,
and run the cheap feasibility checks
(:func:`cost_models.job.check_run_size`) before building anything.
"""
from __future__ import annotations

import argparse
import errno
import importlib
import os
import pkgutil
import sys

import experiments
from cost_models.lifeline import Terminated, interrupt_on_termination

from .checks import Parser
from .options import check_files_apart, file_roles
from .tables import one_line_message

# what a user can cause and fix: bad values (ScheduleError, SpecError, OutOfMemory are ValueErrors)
# and missing files. Anything else (a KeyError included) is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError)


def _commands():
    mods = []
    for info in pkgutil.iter_modules(experiments.__path__):
        if info.name.startswith("cmd_"):
            mods.append(importlib.import_module(f"experiments.{info.name}"))
    order = ["schedules", "presets", "simulate", "compare", "run", "calibrate", "validate", "plan", "export",
             "reproduce", "demo"]
    mods.sort(key=lambda m: (order.index(m.NAME) if m.NAME in order else len(order), m.NAME))
    return mods


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version
    try:
        return dist_version("pipetwin")
    except PackageNotFoundError:
        return "unknown (not installed)"


class StdoutError(OSError):
    """Standard output could not be written (closed, a pipe whose reader left, a full disk)."""


class GuardedStdout:
    """``sys.stdout`` while the command runs: a write or flush that fails raises :class:`StdoutError`
    (so a lost output is an error exit, not status 0 having printed nothing); a closed descriptor
    (``>&-``: Python then has no ``sys.stdout``) fails at the first write."""

    def __init__(self, stream):
        self.stream = stream

    def _call(self, name, *a):
        if self.stream is None:
            raise StdoutError(errno.EBADF, "it is closed")
        try:
            return getattr(self.stream, name)(*a)
        except OSError as e:
            raise StdoutError(e.errno, "its reader has gone (broken pipe)" if isinstance(e, BrokenPipeError)
                              else e.strerror or str(e)) from None

    def write(self, text):
        return self._call("write", text)

    def writelines(self, lines):
        return self._call("writelines", lines)

    def flush(self):
        return self._call("flush")

    def isatty(self):
        return self.stream is not None and self.stream.isatty()

    def __getattr__(self, name):
        if self.stream is None:
            raise StdoutError(errno.EBADF, "it is closed")
        return getattr(self.stream, name)


def _drop_stdout(stream) -> None:
    """After a failed write: point descriptor 1 at /dev/null, so the interpreter's last flush of
    what is still buffered does not fail again (a second message) as it exits."""
    try:
        fd = stream.fileno()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except (AttributeError, OSError, ValueError):
        pass


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="pipetwin", description="Pipeline-parallel training lab: "
               "one schedule IR, a SimPy simulator and a torch.distributed executor.",
               epilog="'pipetwin presets' lists the model, cluster and device presets; "
                      "'pipetwin COMMAND --help' the options of a command.")
    p.add_argument("--version", action="version", version=f"pipetwin {version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for mod in _commands():
        sp = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(sp)
        sp.set_defaults(_main=mod.main, _files=file_roles(sp))
    return p


def main(argv=None) -> int:
    real = sys.stdout
    sys.stdout = GuardedStdout(real)
    try:
        return _main(argv)
    except StdoutError as e:
        print(f"pipetwin: error: standard output cannot be written: {e.strerror}; the output is lost",
              file=sys.stderr)
        _drop_stdout(real)
        return 2
    finally:
        if isinstance(sys.stdout, GuardedStdout):
            sys.stdout = real


def _main(argv) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:   # a bad option (one line printed), --help or --version
        sys.stdout.flush()
        return e.code if isinstance(e.code, int) else 2
    try:
        with interrupt_on_termination():        # SIGTERM / SIGHUP clean up as Ctrl-C does
            check_files_apart(args)
            from .jobs import apply_framework_file
            apply_framework_file(args)      # --from-megatron / --from-torchtitan: the file's job fills the options
            code = int(args._main(args) or 0)
            sys.stdout.flush()      # a full disk or a closed pipe shows here at the latest: an error
            return code
    except StdoutError:
        raise
    except USER_ERRORS as e:
        print(f"pipetwin: error: {one_line_message(e)}", file=sys.stderr)
        return 2
    except MemoryError:
        print("pipetwin: error: out of memory on this host; use a smaller -D/-N/--dp or model", file=sys.stderr)
        return 2
    except BrokenPipeError:  # standard error's reader has gone: nothing can be said
        return 2
    except Terminated as e:
        print(f"pipetwin: stopped by {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("pipetwin: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
