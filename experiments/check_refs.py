"""Dangling references in docstrings: every Sphinx-style reference (``:func:`a.b.c```, and the
roles ``class``, ``mod``, ``data``, ``meth``, ``attr``, ``exc``, ``obj``) in a docstring of
pipetwin's packages must name something real. ``make lint`` runs it::

    python -m experiments.check_refs            # every package: one line per dangling reference, exit 1
    python -m experiments.check_refs cost_models/bind.py sim

A reference resolves as Sphinx looks it up: a dotted path from a package (``cost_models.job.Job``;
the ``~`` and ``title <target>`` forms too), or a name relative to the docstring's class or module
(``:meth:`with_layout``` in a class of ``cost_models.job``, ``:func:`bind``` in ``cost_models``), or
a builtin. Resolving imports the module (the longest importable prefix of the path) and follows the
rest as attributes; a dataclass field or an annotated attribute of a class counts as its attribute.
A reference inside an ``inline literal`` is text, not a reference.

It lives in ``experiments`` because it imports every package's modules, which only the top layer
may do (``setup.cfg`` [importlinter]), and so that tests import it as any module.
"""
from __future__ import annotations

import argparse
import ast
import builtins
import importlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("schedules", "cost_models", "sim", "executor", "planner", "calibration", "experiments")
ROLES = ("func", "class", "mod", "data", "meth", "attr", "exc", "obj")
# :role:`target`, :role:`~target`, :role:`title <target>`
REF = re.compile(r":(?:py:)?(" + "|".join(ROLES) + r"):`(?:[^`<]*<)?~?\.?([\w.]+)>?`")
LITERAL = re.compile(r"``.+?``", re.S)      # ``inline literal``: text, not a reference
_MISSING = object()


@dataclass(frozen=True)
class Dangling:
    """A reference that names nothing: where it is and what it says."""

    path: str
    line: int
    role: str
    target: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: :{self.role}:`{self.target}` does not resolve"


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _attr(obj, name: str):
    value = getattr(obj, name, _MISSING)
    if value is _MISSING and isinstance(obj, type):
        for klass in obj.__mro__:
            if name in getattr(klass, "__dataclass_fields__", {}) or name in vars(klass).get("__annotations__", {}):
                return klass        # a field: it resolves (its value lives on the instances)
    return value


def resolve(path: str):
    """The object a dotted path names (``_MISSING`` where none): its longest importable module
    prefix, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        obj = _import(".".join(parts[:i]))
        if obj is None:
            continue
        for part in parts[i:]:
            obj = _attr(obj, part)
            if obj is _MISSING:
                return _MISSING
        return obj
    return getattr(builtins, path, _MISSING) if "." not in path else _MISSING


def resolves(target: str, module: str, scope: tuple[str, ...] = ()) -> bool:
    """Whether ``target`` names something seen from ``module`` inside classes ``scope``: innermost
    class first, then the module, then as an absolute path or a builtin."""
    for i in range(len(scope), -1, -1):
        if resolve(".".join((module, *scope[:i], target))) is not _MISSING:
            return True
    return resolve(target) is not _MISSING


def dangling(text: str, module: str, scope: tuple[str, ...] = (), *, path: str = "<docstring>",
             line: int = 1) -> list[Dangling]:
    """The references of a docstring ``text`` (starting at ``line`` of ``path``) that resolve to
    nothing from ``module`` (and classes ``scope`` in it)."""
    text = LITERAL.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)
    return [Dangling(path, line + text[:m.start()].count("\n"), m.group(1), m.group(2))
            for m in REF.finditer(text) if not resolves(m.group(2), module, scope)]


def _docstrings(tree: ast.Module):
    """(docstring, its first line, enclosing class names) of a module, its classes and functions."""
    def walk(node, scope):
        body = getattr(node, "body", [])
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            yield body[0].value.value, body[0].lineno, scope
        for child in body:
            if isinstance(child, ast.ClassDef):
                yield from walk(child, (*scope, child.name))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from walk(child, scope)
    yield from walk(tree, ())


def module_name(path: Path) -> str:
    """The dotted name of a module file of pipetwin (a file elsewhere: its stem)."""
    path = path.resolve()
    if not path.is_relative_to(ROOT):
        return path.stem
    rel = path.relative_to(ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def check_file(path: Path) -> list[Dangling]:
    """The dangling references in the docstrings of one module file."""
    path = Path(path)
    name = module_name(path)
    rel = str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else str(path)
    tree = ast.parse(path.read_text(), rel)
    return [d for text, line, scope in _docstrings(tree)
            for d in dangling(text, name, scope, path=rel, line=line)]


def modules(args: list[str]) -> list[Path]:
    """The module files named by ``args`` (files or package folders; none: every package),
    ``__main__`` modules left out (importing one runs the command)."""
    found = []
    for arg in args or PACKAGES:
        p = (ROOT / arg) if not Path(arg).is_absolute() else Path(arg)
        files = sorted(p.rglob("*.py")) if p.is_dir() else [p]
        found += [f for f in files if f.name != "__main__.py"]
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.check_refs", description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", help="module files or package folders (default: every package)")
    args = ap.parse_args(argv)
    bad = [d for f in modules(args.paths) for d in check_file(f)]
    for d in bad:
        print(d)
    if bad:
        print(f"{len(bad)} dangling docstring reference(s)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
