"""``pipetwin``: the command line.

Each subcommand lives in its own module ``experiments/cmd_<name>.py`` with ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``main(args) -> int``. User errors (bad schedule, impossible D/N,
malformed config) print one line ``pipetwin: error: ...`` and exit 2; no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import experiments

# what a user can cause and fix: bad values (ScheduleError, SpecError, OutOfMemory are ValueErrors)
# and missing files. Anything else (a KeyError included) is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError)


def _commands():
    mods = []
    for info in pkgutil.iter_modules(experiments.__path__):
        if info.name.startswith("cmd_"):
            mods.append(importlib.import_module(f"experiments.{info.name}"))
    order = ["schedules", "simulate", "compare", "run", "calibrate", "validate", "plan", "reproduce", "demo"]
    mods.sort(key=lambda m: (order.index(m.NAME) if m.NAME in order else len(order), m.NAME))
    return mods


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipetwin", description="Pipeline-parallel training lab: "
                                "one schedule IR, a SimPy simulator and a torch.distributed executor.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for mod in _commands():
        sp = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(sp)
        sp.set_defaults(_main=mod.main)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._main(args) or 0)
    except USER_ERRORS as e:
        print(f"pipetwin: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into head & co.
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("pipetwin: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
