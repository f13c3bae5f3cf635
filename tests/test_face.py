"""Lazy package faces (schedules._face): every exported name as before, nothing heavy imported for
``cost_models.lifeline``, functions named like their module stay functions."""
import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest

from schedules._face import lazy_face

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("schedules", "cost_models", "sim", "executor", "planner", "calibration")
EXPORTED = {"schedules": 27, "cost_models": 100, "sim": 9, "executor": 8, "planner": 21, "calibration": 36}


def fresh(code: str) -> str:
    """Run ``code`` in a new interpreter (nothing imported yet) from the repository; its stdout."""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves_to_its_modules_object(package):
    pkg = importlib.import_module(package)
    assert len(pkg.__all__) == len(set(pkg.__all__)) == EXPORTED[package]
    star: dict = {}
    exec(f"from {package} import *", star)
    for name in pkg.__all__:
        value = getattr(pkg, name)
        assert star[name] is value
        home = getattr(value, "__module__", None)
        if home is not None and home.startswith(package + "."):
            assert getattr(sys.modules[home], name) is value, name
    assert set(pkg.__all__) <= set(dir(pkg))


def test_lifeline_imports_the_standard_library_only():
    out = fresh("import sys, cost_models.lifeline; "
                "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                "('schedules', 'cost_models', 'sim', 'executor', 'planner', 'calibration', 'experiments', "
                "'pandas', 'numpy', 'yaml', 'torch', 'simpy')))")
    assert out == "['cost_models', 'cost_models.lifeline', 'schedules', 'schedules._face']"


def test_a_function_named_like_its_module_stays_the_function():
    # the eager __init__ ran `from .bind import bind` after the import system set the module there
    out = fresh("import cost_models.bind, schedules.lower, schedules.validate, sys; "
                "import cost_models, schedules; "
                "print(cost_models.bind is sys.modules['cost_models.bind'].bind, "
                "schedules.lower is sys.modules['schedules.lower'].lower, "
                "schedules.validate is sys.modules['schedules.validate'].validate, "
                "type(sys.modules['cost_models.bind']).__name__)")
    assert out == "True True True module"


def test_a_submodule_is_an_attribute_as_before():
    assert fresh("import cost_models as cm; print(cm.cluster.megatron_map.__name__, cm.job.Job.__name__)") \
        == "megatron_map Job"


def test_an_unknown_name_is_an_attribute_error_naming_it():
    import cost_models
    with pytest.raises(AttributeError, match="module 'cost_models' has no attribute 'no_such_name'"):
        cost_models.no_such_name  # noqa: B018


def test_a_name_exported_twice_is_refused_naming_both_modules(monkeypatch):
    monkeypatch.setitem(sys.modules, "_face_probe", types.ModuleType("_face_probe"))
    with pytest.raises(ValueError, match=r"_face_probe exports 'x' from both \.a and \.b"):
        lazy_face("_face_probe", {"a": ("x",), "b": ("y", "x")})
