"""Reading the user's files, with one-line errors: the one place every loader goes through.

:func:`read_bytes` / :func:`read_text` raise :class:`FileError` (a ValueError, so the CLI prints
``pipetwin: error: ...`` and exits 2) when the path does not exist, is a folder, cannot be read,
is empty (unless ``allow_empty``), is a symbolic link loop or a broken link, or, for text, is not
UTF-8. :func:`one_line` turns a parser's multi-line message (YAML's carets, JSON's positions) into
one line for such errors, :func:`short_list` shows a list in a message (a 4,000-entry partition is
its first and last entries and its length, not 12 KB), and :func:`parse_json` is the one JSON
reader of users' files (a syntax error, a key given twice, NaN or Infinity (naming the field) and
nesting too deep for Python's parser are one line each).
:func:`check_output_path` is the same for a file to be written (run it before long work: it also
refuses a name component over :data:`NAME_MAX` bytes); :func:`write_output` / :func:`output_file`
write one atomically (a temporary file in the same folder, then ``os.replace``: a reader, a crash
or a full disk never leaves a truncated file) and turn an ``OSError`` into one :class:`FileError`
line naming the path. A character device (``/dev/null``, a terminal) and this process's own
descriptors (``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``: a pipe there already has its reader)
are written in place: they cannot be replaced; a named pipe (FIFO: opening it waits for a reader,
maybe forever), a socket, a block device (a disk) or a folder is refused before any work, and so is
an output whose extension is not a format written there (``formats``: a figure's ``.png``, a
trace's ``.csv``).
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
import sys
import tempfile
from pathlib import Path

NAME_MAX = 255   # bytes in one name component (Linux, macOS and Windows file systems)


class FileError(ValueError):
    """A file that cannot be used as asked; the message names it and says why."""


class MissingFileError(FileError, FileNotFoundError):
    """The file does not exist (a FileError and a FileNotFoundError)."""


def _short_names(path, what: str) -> Path:
    """``path`` as a Path, refused when one of its names is longer than a file system allows."""
    p = Path(path)
    for part in p.parts:
        n = len(os.fsencode(part))
        if n > NAME_MAX:
            raise FileError(f"{what} {str(p)[:60]}...: the name {part[:24]}... has {n} bytes; a file system "
                            f"allows {NAME_MAX}")
    return p


def _link_problem(p: Path) -> str | None:
    """Why the symbolic link ``p`` (or a link on its path) leads nowhere: a loop or a broken link;
    None when ``p`` can be reached."""
    try:
        os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symbolic link loop (the links lead back to themselves); give the file itself"
        if p.is_symlink():
            return f"is a broken link (to {os.readlink(p)}, which does not exist)"
    return None


def _checked(path, what: str) -> Path:
    p = _short_names(path, what)
    if not p.exists():
        why = _link_problem(p)
        if why:
            raise MissingFileError(f"{what} {p} {why}")
        raise MissingFileError(f"{what} {p} does not exist")
    if p.is_dir():
        raise FileError(f"{what} {p} is a folder, not a file")
    if not p.is_file():     # /dev/zero, a pipe, a socket: reading may never end
        raise FileError(f"{what} {p} is not a regular file (a device, pipe or socket); give a file")
    if not os.access(p, os.R_OK):
        raise FileError(f"{what} {p} cannot be read (permission denied)")
    return p


def check_input(path, what: str = "file", *, min_bytes: int = 1) -> Path:
    """A file that will be read later (elsewhere, e.g. by every rank): exists, is a file, is
    readable and holds at least ``min_bytes`` bytes. Reads nothing."""
    p = _checked(path, what)
    size = p.stat().st_size
    if size == 0 and min_bytes > 0:
        raise FileError(f"{what} {p} is empty")
    if size < min_bytes:
        raise FileError(f"{what} {p} has {size} bytes; it needs at least {min_bytes}")
    return p


def read_bytes(path, what: str = "file", *, allow_empty: bool = False, min_bytes: int = 0) -> bytes:
    """The bytes of a file (``what`` names it in errors: 'data file', 'plan file', ...)."""
    p = _checked(path, what)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise FileError(f"{what} {p} cannot be read ({e.strerror or e})") from None
    if not data and not allow_empty:
        raise FileError(f"{what} {p} is empty")
    if len(data) < min_bytes:
        raise FileError(f"{what} {p} has {len(data)} bytes; it needs at least {min_bytes}")
    return data


def read_text(path, what: str = "file", *, allow_empty: bool = False) -> str:
    """The text of a UTF-8 file (see :func:`read_bytes`)."""
    data = read_bytes(path, what, allow_empty=allow_empty)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileError(f"{what} {path} is not a text (UTF-8) file: byte {e.start} is {data[e.start]:#04x}") from None


def one_line(message) -> str:
    """A parser's error message on one line (whitespace runs collapsed)."""
    return " ".join(str(message).split())


def short_list(items, head: int = 6, tail: int = 2, sep: str = ", ", bare: bool = False) -> str:
    """``items`` for a message: all of them when there are at most ``head + tail + 1``, else the
    first ``head``, ``...``, the last ``tail`` and how many (``[3, 3, 3, 3, 3, 3, ..., 3, 3] (4,000
    entries)``; ``bare``: without the brackets): a list in a refusal never makes the line longer than a
    screen. Anything that is
    not a list, tuple or range (a string, a number, a mapping) is its ``repr``, cut at 80 characters."""
    if not isinstance(items, (list, tuple, range)):
        text = repr(items)
        return text if len(text) <= 80 else text[:77] + "..."
    items = list(items)
    a, b = ("", "") if bare else ("[", "]")
    if len(items) <= head + tail + 1:
        return a + sep.join(map(str, items)) + b
    last = "".join(sep + str(x) for x in items[len(items) - tail:])
    return f"{a}{sep.join(map(str, items[:head]))}{sep}...{last}{b} ({len(items):,} entries)"


class _NonFinite(float):
    """NaN or Infinity as JSON spells it (Python's parser accepts them): found after parsing, to
    name the field that holds it."""

    def __new__(cls, name: str):
        v = super().__new__(cls, {"NaN": math.nan, "Infinity": math.inf}.get(name, -math.inf))
        v.name = name
        return v


def _unique_keys(pairs):
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise FileError(f"key {k!r} is given twice; keep one")
        seen[k] = v
    return seen


def _first_nonfinite(data, path: str = ""):
    """(dotted field, spelling) of the first NaN or Infinity in ``data``, else None (iterative:
    any depth)."""
    stack = [(path, data)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, _NonFinite):
            return where or "(top level)", v.name
        if isinstance(v, dict):
            stack.extend((f"{where}.{k}" if where else str(k), x) for k, x in reversed(list(v.items())))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in reversed(list(enumerate(v))))
    return None


def parse_json(text: str, source: str):
    """The data of JSON ``text`` read from ``source`` (the one JSON reader of users' files): a
    syntax error, a key given twice, NaN / Infinity (naming the field that holds it) and nesting
    deeper than Python's parser goes are each one :class:`FileError` line naming ``source``."""
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_NonFinite)
    except FileError as e:
        raise FileError(f"{source}: {e}") from None
    except json.JSONDecodeError as e:
        raise FileError(f"{source}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise FileError(f"{source}: not a usable JSON file: nested deeper than Python's parser allows "
                        f"(about 1,000 levels)") from None
    bad = _first_nonfinite(data)
    if bad:
        raise FileError(f"{source}: field {bad[0]!r} is {bad[1]}, not a number; give a finite number")
    return data


def check_output_path(path, what: str = "output file", formats: tuple[str, ...] | None = None) -> Path:
    """A file that is about to be written: not a folder, a pipe, a socket or a disk (see the module
    docstring), its extension one of ``formats`` (lower case, without the dot; None: any) unless it
    is a device, and its folder exists or can be created (no part of the path is an existing file)
    and is writable: an empty file is created there and removed at once (:func:`_probe`); nothing
    else is created."""
    p = _short_names(path, what)
    if str(path) == "" or p.is_dir():
        raise FileError(f"{what} {p} is a folder; give a file name")
    mine = own_descriptor(path) is not None
    if mine or (p.exists() and not p.is_file()):   # a device (/dev/null), /dev/stdout: written in place
        kind = None if mine else _unwritable_kind(p)
        if kind is not None:
            raise FileError(f"{what} {p} is {kind}; give a regular file (or /dev/stdout, /dev/null)")
        if not os.access(p, os.W_OK):
            raise FileError(f"{what} {p} cannot be written (permission denied)")
        return p
    if formats:
        check_format(p, what, formats)
    if p.exists() and not os.access(p, os.W_OK):
        raise FileError(f"{what} {p} cannot be overwritten (permission denied)")
    _creatable(p, what)
    return p


def check_format(path, what: str, formats: tuple[str, ...]) -> None:
    """``path``'s extension names one of ``formats`` (case aside), else one :class:`FileError` line."""
    p = Path(path)
    ext = p.suffix.lower().lstrip(".")
    if ext in formats:
        return
    listed = ", ".join("." + f for f in formats)
    got = f"its extension is {p.suffix!r}" if p.suffix else "it has no extension"
    raise FileError(f"{what} {p}: {got}; a {what} is written as {listed}")


_OWN_FD = re.compile(r"/dev/(stdout|stderr|fd/(\d+))|/proc/self/fd/(\d+)")


def own_descriptor(path) -> int | None:
    """The descriptor ``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N`` or ``/proc/self/fd/N`` names
    when this process holds it open (whatever it is: a pipe there has its reader, writing does not
    wait), else None."""
    m = _OWN_FD.fullmatch(os.fspath(path))
    if m is None:
        return None
    fd = {"stdout": 1, "stderr": 2}.get(m.group(1) or "")
    fd = int(m.group(2) or m.group(3)) if fd is None else fd
    try:
        os.fstat(fd)
    except OSError:
        return None
    return fd


def _unwritable_kind(p: Path) -> str | None:
    """What ``p`` is when it is no file pipetwin may write (None: a character device, e.g. /dev/null)."""
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return None
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO): writing it waits for a reader, maybe forever"
    if stat.S_ISSOCK(mode):
        return "a socket, not a file"
    if stat.S_ISBLK(mode):
        return "a block device (a disk)"
    if stat.S_ISCHR(mode):
        return None
    return "not a regular file"


def _creatable(p: Path, what: str) -> None:
    """``p``'s nearest existing folder is a folder in which a file can be created."""
    ancestor = p.parent if str(p.parent) else Path(".")
    while not ancestor.exists():
        if ancestor.is_symlink():
            raise FileError(f"{what} {p}: {ancestor} is a broken link")
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise FileError(f"{what} {p} cannot be written: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise FileError(f"{what} {p} cannot be written: folder {ancestor} is not writable")
    _probe(ancestor, p, what)


def _probe(folder: Path, p: Path, what: str) -> None:
    """Create and remove an empty file in ``folder``: the permission bits do not tell (root may
    write anywhere they allow, yet not in /proc or on a read-only mount)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".pipetwin-probe-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise FileError(f"{what} {p} cannot be written: a file cannot be created in {folder} "
                        f"({e.strerror or e})") from None


def check_output_dir(path, what: str = "output folder") -> Path:
    """A folder that is about to be written into (created if needed): see :func:`check_output_path`."""
    p = _short_names(path, what)
    if p.exists() and not p.is_dir():
        kind = "a file" if p.is_file() else _unwritable_kind(p) or "a device"
        raise FileError(f"{what} {p} is {kind.split(':')[0]}, not a folder")
    if p.is_dir():
        if not os.access(p, os.W_OK | os.X_OK):
            raise FileError(f"{what} {p} is not writable")
        _probe(p, p, what)
        return p
    _creatable(p, what)
    return p


def prepare_output(path, what: str = "output file") -> Path:
    """:func:`check_output_path`, then create its folder: call right before writing."""
    p = check_output_path(path, what)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _write_error(p, what, e) from None
    return p


def _write_error(p: Path, what: str, e: OSError) -> FileError:
    return FileError(f"{what} {p} could not be written: {e.strerror or e}")


@contextlib.contextmanager
def output_file(path, what: str = "output file", mode: str = "w", **open_args):
    """``with output_file(path) as fh: ...``: ``fh`` is a temporary file next to ``path`` that
    replaces it when the block ends without an error (else it is removed and ``path`` is left as it
    was). ``mode`` "w" or "wb"; an OSError, in the block or in the write itself, becomes one
    :class:`FileError` line naming ``path``."""
    p = prepare_output(path, what)
    fd = own_descriptor(path)
    if fd is not None:      # /dev/stdout & co.: written through the descriptor itself, after what is
        _flush_std(fd)      # printed there already (opening the path would truncate a file there)
        try:
            with os.fdopen(os.dup(fd), mode, **open_args) as fh:
                yield fh
            _flush_std(fd)
        except OSError as e:
            raise _write_error(p, what, e) from None
        return
    if p.is_symlink() and p.exists():       # write the file the link names; the link stays
        p = p.resolve()
    if p.exists() and not p.is_file():      # a device: no folder entry to replace
        try:
            with open(p, mode, **open_args) as fh:
                yield fh
        except OSError as e:
            raise _write_error(p, what, e) from None
        return
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name[:40]}.", suffix=".tmp")
        with os.fdopen(fd, mode, **open_args) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        if p.exists():
            os.chmod(tmp, p.stat().st_mode & 0o7777)
        else:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
        tmp = None
    except OSError as e:
        raise _write_error(p, what, e) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _flush_std(fd: int) -> None:
    stream = {1: sys.stdout, 2: sys.stderr}.get(fd)
    if stream is not None:
        stream.flush()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_output(path, data: str | bytes, what: str = "output file") -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically (see :func:`output_file`)."""
    with output_file(path, what, "wb") as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(path)


# A user's file of the wrong kind is named for what it is. What each kind is called and the option
# that takes it; :func:`file_kind` tells them apart by their top-level keys (cheap: the data is parsed
# already).
FILE_KINDS = {
    "plan": ("a pipetwin plan file (pipetwin plan --out)", "--plan"),
    "profile": ("a calibration profile (pipetwin calibrate)", "--profile"),
    "stage-costs": ("a stage-costs file", "--stage-costs"),
    "cluster": ("a cluster spec", "--cluster"),
    "model": ("a model spec", "--model"),
    "hf-config": ("a Hugging Face config", "--model"),
    "schedule": ("a schedule file", "--schedule-file"),
}
_SAME = ({"model", "hf-config"},)       # kinds one option takes alike


def file_kind(data) -> str | None:
    """Which kind of :data:`FILE_KINDS` parsed file ``data`` is, by its top-level keys (None: none)."""
    if not isinstance(data, dict):
        return None
    fmt = str(data.get("format", ""))
    if fmt == "pipetwin-plan":
        return "plan"
    if fmt.startswith("pipetwin-calibration") or ("p2p" in data and "allreduce" in data):
        return "profile"
    if "stages" in data and "message" in data:
        return "stage-costs"
    if "devices_per_node" in data:
        return "cluster"
    if "architectures" in data or "model_type" in data:
        return "hf-config"
    if "layers" in data and "hidden" in data and "heads" in data:
        return "model"
    if data and list(data) == list(range(len(data))) and all(isinstance(v, str) for v in data.values()):
        return "schedule"       # pipetwin's text form, 'DEVICE: OPS' per line, read as YAML
    return None


def check_kind(data, source, expected: str) -> None:
    """Refuse file ``source`` (parsed as ``data``) where a file of kind ``expected`` is wanted but
    ``data`` is recognisably another kind: one line naming what it is and the option that takes it."""
    got = file_kind(data)
    if got is None or got == expected or any({got, expected} <= s for s in _SAME):
        return
    words, option = FILE_KINDS[got]
    want = FILE_KINDS[expected][0]
    raise FileError(f"{source} is {words}, not {want}; give it as {option} {source}")


def load_schedule_file(path):
    """A schedule file (:mod:`schedules.io`: torch.distributed.pipelining's CSV or pipetwin's text
    form), read, checked and validated: a :class:`schedules.io.ScheduleFile`; one-line errors (a
    plan, profile or spec given instead is named as one, :func:`check_kind`)."""
    from schedules.io import parse_schedule_file
    text = read_text(path, "schedule file")
    try:
        return parse_schedule_file(text, str(path))
    except ValueError:
        check_kind(data_or_none(text), str(path), "schedule")
        raise


def data_or_none(text: str):
    """``text`` parsed as YAML (JSON is YAML), or None when it is not."""
    import yaml
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError):
        return None
