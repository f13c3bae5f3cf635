"""The docstring reference check of ``make lint`` (experiments.check_refs): a dangling reference is
reported by name and line, a real one is not."""
from experiments.check_refs import Dangling, check_file, dangling, main, resolves

DOC = """Costs of a job.

See :func:`cost_models.bind.bind` and :class:`~cost_models.job.Job`, the
:func:`title <cost_models.job.check_run_size>` of a layout, and
:func:`cost_models.bind.no_such_function`, then :mod:`cost_models.no_such_module`.
"""


def test_a_dangling_reference_is_reported_by_name_and_line():
    assert dangling(DOC, "cost_models.bind", path="doc.py", line=10) == [
        Dangling("doc.py", 14, "func", "cost_models.bind.no_such_function"),
        Dangling("doc.py", 14, "mod", "cost_models.no_such_module")]
    assert str(dangling(DOC, "cost_models.bind", path="doc.py")[0]) == \
        "doc.py:5: :func:`cost_models.bind.no_such_function` does not resolve"


def test_names_resolve_relative_to_the_class_then_the_module_then_absolute():
    assert resolves("with_layout", "cost_models.job", ("Job",))          # a method of the docstring's class
    assert resolves("Layout", "cost_models.job", ("Job",))               # a name of the module
    assert resolves("bind", "cost_models")                               # through the package's lazy face
    assert resolves("schedules.ir.parse_op", "cost_models.job")          # absolute
    assert resolves("KeyboardInterrupt", "cost_models.lifeline")         # a builtin
    assert resolves("cost_models.cluster.Cluster.nodes", "x")            # a dataclass field (no class value)
    assert not resolves("with_layout", "cost_models.job")                # a method is not a module name
    assert not resolves("Job.no_such_method", "cost_models.job")


def test_a_reference_inside_an_inline_literal_is_text():
    assert dangling("Write ``:func:`a.b.c``` to refer; :data:`nope` is one.", "cost_models") == [
        Dangling("<docstring>", 1, "data", "nope")]


def test_a_file_with_a_dangling_reference_fails_the_check(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(tmp_path)       # names resolve by importing the file's module
    f = tmp_path / "refs_probe.py"
    f.write_text('"""Module: :func:`schedules.lower`."""\n\n\nclass A:\n    """Fine: :meth:`run`;\n'
                 '    broken: :meth:`walk`."""\n\n    def run(self):\n        pass\n')
    assert check_file(f) == [Dangling(str(f), 6, "meth", "walk")]
    assert main([str(f)]) == 1
    assert capsys.readouterr().out == f"{f}:6: :meth:`walk` does not resolve\n"


def test_the_packages_own_docstrings_pass():
    assert main(["schedules", "cost_models/job.py", "cost_models/workloads"]) == 0
