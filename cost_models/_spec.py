"""Shared YAML-spec plumbing: preset lookup, field checking and unit parsing.

Every spec loader (models, devices, clusters, calibration profiles) reads a mapping from a YAML
file and validates it field by field; a bad value raises :class:`SpecError` whose message names
the file (or preset) and the dotted field path, e.g. ``clusters/x.yaml: field 'inter.bandwidth'
must be a positive bandwidth (B/s or e.g. '25 Gb/s'); got 'fast'``.

Quantities accept plain numbers in SI base units (bytes, bytes/s, seconds, FLOP/s) or strings with
a unit, which keeps the presets readable: ``80 GiB``, ``141 GB``, ``200 Gb/s`` (bits),
``25 GB/s`` (bytes), ``5 us``, ``312 TFLOP/s``. YAML 1.1 reads ``125e12`` (no dot) as a string;
such numeric strings are accepted too.
"""
from __future__ import annotations

import math
import re
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

import yaml

from .files import FileError, check_kind, one_line, read_text, short_list


class SpecError(ValueError):
    """A malformed or unknown spec; the message names the file and field."""


_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40}
_NUM = r"(?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
_SIZE = re.compile(_NUM + r"\s*(?P<pre>Ki|Mi|Gi|Ti|k|K|M|G|T|P)?(?P<unit>B|bytes?)?")
_RATE = re.compile(_NUM + r"\s*(?:(?P<pre>k|K|M|G|T|P)?(?P<unit>B/s|b/s|bit/s|bps|Bps))?")
_TIME = re.compile(_NUM + r"\s*(?P<unit>s|ms|us|µs|ns)?")
_FLOPS = re.compile(_NUM + r"\s*(?P<pre>k|K|M|G|T|P)?(?:FLOP/s|FLOPS|flop/s|flops)?")
_TIME_SCALE = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _bad(source: str, field: str, what: str, value: Any) -> SpecError:
    return SpecError(f"{source}: field {field!r} must be {what}; got {value!r}")


def _plain_number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return None


def number(value: Any, source: str, field: str, *, positive: bool = True, allow_zero: bool = False) -> float:
    """A float from a YAML scalar (number or numeric string)."""
    v = _plain_number(value)
    if v is None and isinstance(value, str):
        try:
            v = float(value.strip())
        except ValueError:
            v = None
    what = "a positive number" if positive and not allow_zero else "a number >= 0" if positive else "a number"
    if v is None or not math.isfinite(v):
        raise _bad(source, field, what, value)
    if positive and (v < 0 or (v == 0 and not allow_zero)):
        raise _bad(source, field, what, value)
    return v


def integer(value: Any, source: str, field: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(source, field, f"an integer >= {minimum}", value)
    return value


def _with_unit(value: Any, source: str, field: str, pattern: re.Pattern, what: str, scale, allow_zero: bool) -> float:
    v = _plain_number(value)
    if v is None and isinstance(value, str):
        m = pattern.fullmatch(value.strip())
        if m:
            v = float(m["num"]) * scale(m)
    if v is None or not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise _bad(source, field, what, value)
    return v


def size_bytes(value: Any, source: str, field: str, *, allow_zero: bool = False) -> float:
    """Bytes: a number, or e.g. ``80 GiB`` (binary prefixes) / ``141 GB`` (decimal)."""
    return _with_unit(value, source, field, _SIZE, "a positive size in bytes (e.g. 80 GiB, 141 GB)",
                      lambda m: _PREFIX[m["pre"] or ""], allow_zero)


def bandwidth(value: Any, source: str, field: str) -> float:
    """Bytes per second: a number, or e.g. ``25 GB/s`` (bytes) / ``200 Gb/s`` (bits, divided by 8)."""
    def scale(m):
        bits = m["unit"] in ("b/s", "bit/s", "bps")
        return _PREFIX[m["pre"] or ""] / (8.0 if bits else 1.0)
    return _with_unit(value, source, field, _RATE, "a positive bandwidth in B/s (e.g. 25 GB/s, 200 Gb/s)",
                      scale, False)


def seconds(value: Any, source: str, field: str, *, allow_zero: bool = True) -> float:
    """Seconds: a number, or e.g. ``5 us``, ``1.5 ms``."""
    return _with_unit(value, source, field, _TIME, "a time in seconds >= 0 (e.g. 5 us)",
                      lambda m: _TIME_SCALE[m["unit"]], allow_zero)


def flops(value: Any, source: str, field: str) -> float:
    """FLOP/s: a number, or e.g. ``312 TFLOP/s``."""
    return _with_unit(value, source, field, _FLOPS, "a positive FLOP/s rate (e.g. 312 TFLOP/s)",
                      lambda m: _PREFIX[m["pre"] or ""], False)


def mapping(value: Any, source: str, field: str | None = None) -> dict:
    if not isinstance(value, dict):
        where = f"field {field!r}" if field else "the file"
        raise SpecError(f"{source}: {where} must be a mapping of fields; got {type(value).__name__}")
    return value


def known_fields(key: str, known) -> str:
    """The known fields for an unknown-field message: all of them when few, else the nearest names
    to ``key`` and how many there are (the line stays short)."""
    names = sorted(known)
    if len(", ".join(names)) <= 120:
        return f"known: {', '.join(names)}"
    import difflib
    near = difflib.get_close_matches(key, names, n=3, cutoff=0.4)
    first = f"did you mean {' or '.join(map(repr, near))}? " if near else ""
    return f"{first}known: {short_list(names, head=8, tail=0, bare=True)}"


def check_fields(d: dict, source: str, known: Iterable[str], required: Iterable[str] = (),
                 prefix: str = "") -> None:
    """Unknown fields and missing required fields are errors naming the field."""
    known = set(known)
    for k in d:
        if k not in known:
            raise SpecError(f"{source}: unknown field {prefix + str(k)!r} ({known_fields(str(k), known)})")
    for k in required:
        if k not in d:
            raise SpecError(f"{source}: missing field {prefix + k!r}")


def preset_dir(kind: str):
    """``cost_models/presets/<kind>`` as an importlib Traversable."""
    return resources.files("cost_models") / "presets" / kind


def presets(kind: str) -> list[str]:
    d = preset_dir(kind)
    if not d.is_dir():
        return []
    return sorted(p.name[:-5] for p in d.iterdir() if p.name.endswith(".yaml"))


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                twice = key in seen
            except TypeError:       # an unhashable key: the base loader's own error
                break
            if twice:
                raise SpecError(f"key {key!r} is given twice (line {key_node.start_mark.line + 1}); "
                                f"keep one") from None
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(text: str, source: str) -> Any:
    """The data of YAML ``text`` read from ``source`` (the one YAML reader of every spec and profile):
    invalid YAML or a key given twice in a mapping is a SpecError naming ``source``."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except SpecError as e:
        raise SpecError(f"{source}: {e}") from None
    except yaml.YAMLError as e:
        raise SpecError(f"{source}: not valid YAML ({one_line(e)})") from None
    except RecursionError:
        raise SpecError(f"{source}: not a usable YAML file: nested deeper than the YAML reader allows "
                        f"(about 1,000 levels)") from None


_KINDS = {"models": "model", "clusters": "cluster", "stage-costs": "stage-costs"}   # preset folder -> file kind


def _choices(name: str, kind: str, width: int = 200) -> str:
    """What an unknown preset's line offers: every preset of ``kind`` while they fit in ``width``
    characters, else the closest names and the command that lists them all (the line stays whole)."""
    names = presets(kind)
    if len(", ".join(names)) <= width:
        return f"choose one of {', '.join(names)}"
    import difflib
    close = difflib.get_close_matches(name, names, n=4, cutoff=0.4)
    near = f"nearest: {', '.join(close)}; " if close else ""
    return f"{near}`pipetwin presets {kind}` lists all {len(names)},"


def read_yaml(name_or_path: str | Path, kind: str, what: str) -> tuple[Any, str]:
    """Load a preset (by name) or a user's YAML file (by path); returns (data, source) where source
    names the file for error messages. ``kind`` is the preset folder, ``what`` a word for errors."""
    p = Path(name_or_path)
    if p.suffix == ".py":
        hint = (f"name the function that builds it: {p}:FUNC (FUNC() returns layers, loss and sample)"
                if kind == "models" else f"a {what} is a preset name or a YAML file")
        raise SpecError(f"{what} {p} is a Python file; {hint}")
    if p.suffix in (".yaml", ".yml") or p.is_file() or "/" in str(name_or_path):
        try:
            text, source = read_text(p, f"{what} file"), str(p)
        except FileError as e:   # a spec error like any other of the file
            raise SpecError(str(e)) from None
        data = parse_yaml(text, source)
        if kind in _KINDS:
            try:
                check_kind(data, source, _KINDS[kind])
            except FileError as e:
                raise SpecError(str(e)) from None
        return data, source
    else:
        f = preset_dir(kind) / f"{name_or_path}.yaml"
        if not f.is_file():
            raise SpecError(f"unknown {what} preset {str(name_or_path)!r}; {_choices(str(name_or_path), kind)} "
                            f"or pass a YAML file")
        text, source = f.read_text(), f"{kind}/{name_or_path}.yaml"
    return parse_yaml(text, source), source
