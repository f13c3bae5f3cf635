"""Lazy package faces (PEP 562): a package's ``__init__`` says which names it exports from which of
its modules, and a module is imported the first time one of its names is asked for.

So ``import cost_models.lifeline`` (the first line of every executor rank and sweep worker) runs
the standard library only, not the seconds of pandas and torch that other modules of the package
import, and ``from cost_models import bind`` still gives what it always gave::

    __all__, __getattr__, __dir__ = lazy_face(__name__, {
        "bind": ("Bound", "bind"),          # module -> the names the package exports from it
        "cluster": ("Cluster", "load_cluster"),
    })

- ``package.NAME`` / ``from package import NAME`` imports NAME's module, keeps the value in the
  package (later look-ups are plain attributes) and returns it; ``from package import *`` gives
  ``__all__`` (the exported names, in table order).
- ``package.SUBMODULE`` for a module the table does not name imports it, as the eager
  ``__init__`` did (its imports left every module they touched as an attribute of the package).
- Where a function has its module's name (``cost_models.bind``, ``schedules.lower``), the package's
  attribute stays the function once that module is imported by anyone, as with the eager
  ``__init__`` (whose ``from .bind import bind`` came after the import system set the module there).

It lives in ``schedules``, the bottom layer, so that every pipetwin package may use it; it needs
the standard library only.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Callable, Mapping, Sequence


class _Face(types.ModuleType):
    """A package module whose exported names win over its submodules of the same name."""

    def __setattr__(self, name, value):
        # the import system attaches a submodule it loaded to its package: where the package exports a
        # name the submodule shares, the name's value (looked up lazily) stays the package's attribute
        if isinstance(value, types.ModuleType) and name in self.__dict__.get("__all__", ()) \
                and value.__name__ == f"{self.__name__}.{name}":
            return
        super().__setattr__(name, value)


def lazy_face(package: str, exports: Mapping[str, Sequence[str]]
              ) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """Make ``package`` (its ``__name__``, its ``__init__`` running) a lazy face over ``exports``
    (module name relative to the package -> the names exported from it); returns its ``__all__``,
    ``__getattr__`` and ``__dir__``. A name exported twice is a ValueError."""
    where: dict[str, str] = {}
    for mod, names in exports.items():
        for name in names:
            if name in where:
                raise ValueError(f"{package} exports {name!r} from both .{where[name]} and .{mod}")
            where[name] = mod
    face = sys.modules[package]
    face.__class__ = _Face

    def __getattr__(name: str):
        mod = where.get(name)
        if mod is None:
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(importlib.import_module(f"{package}.{mod}"), name)
        face.__dict__[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(face.__dict__) | set(where))

    return list(where), __getattr__, __dir__
