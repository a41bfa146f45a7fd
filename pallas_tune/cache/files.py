"""Cache files on disk: their names, the winners file's layout, strict JSON, atomic replacement.

A winners file (schema 2) is standard JSON, laid out one entry per line::

    {"schema": 2, "kernel": "pkg.mod.fn", "chip": "tpu_v6e", "kind": "measured", ..., "entries": {
    "x=1024x1024:bfloat16,y=1024x1024:bfloat16": {"config": {...}, "median_ms": 0.41, ...},
    "x=2048x2048:bfloat16,y=2048x2048:bfloat16": {"config": {...}, "median_ms": 2.9, ...}
    }}

so that a reader indexes the keys without parsing the entries (a process that needs one config
parses one line; a damaged line costs only its own entry), a new shape is a one-line diff, and
any JSON tool (``JSON.parse`` included: no NaN, no Infinity) reads the file whole. A file in any
other layout (hand-edited, pretty-printed, schema 1) is parsed whole instead. Nothing here ever
raises anything but :class:`OSError` or :class:`CacheFormatError` on file content.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import secrets
import socket
import time
from collections.abc import Iterator, Mapping
from typing import Any, Final

from pallas_tune.errors import CacheFormatError

__all__ = ["SCHEMA_VERSION", "WinnersFile", "kernel_filename", "parse_winners", "render_winners",
           "sanitize"]

SCHEMA_VERSION: Final = 2
READABLE_SCHEMAS: Final = (1, 2)
KINDS: Final = ("measured", "estimate")

_SAFE: Final = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_.-")
# A stem's last dot-component may not start with these: they mark the other files of a stem.
_RESERVED: Final = ("estimate", "trials", "recovered")
_MAX_STEM: Final = 180
_CANONICAL_HEAD: Final = re.compile(r'^\{"schema": 2, .*"entries": \{$')
_scanstring = json.decoder.scanstring  # type: ignore[attr-defined]


# ---- names ---------------------------------------------------------------------------------

def kernel_filename(kernel: str) -> str:
    """The file stem of a kernel name: an injective map, even on case-insensitive file systems.

    Lower-case letters, digits, ``_``, ``.`` and ``-`` stay as they are (so
    ``pallas_tune.kernels.matmul.matmul`` is its own stem); every other character, capitals
    included, becomes ``%XX`` per UTF-8 byte, like a URL. A leading ``.`` and a final
    ``.estimate``/``.trials``/``.recovered`` component are escaped too, so that a stem never
    looks like another stem's estimate, ledger or side file. Stems longer than 180 characters
    end in ``~`` and a SHA-256 prefix of the name.
    """
    if not isinstance(kernel, str) or not kernel:
        raise ValueError(f"kernel name {kernel!r} must be a non-empty string")
    out = "".join(ch if ch in _SAFE else "".join(f"%{b:02X}" for b in ch.encode("utf-8", "replace"))
                  for ch in kernel)
    if out.startswith("."):
        out = "%2E" + out[1:]
    head, dot, last = out.rpartition(".")
    if dot and last.startswith(_RESERVED):
        out = f"{head}%2E{last}"
    if len(out) > _MAX_STEM:
        out = out[:160] + "~" + hashlib.sha256(kernel.encode("utf-8", "replace")).hexdigest()[:16]
    return out


def legacy_filename(kernel: str) -> str:
    """The stem pallas-tune 0.1 used (not injective: ``a/b`` and ``a_b`` met); read-only."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", kernel).strip("._") or "kernel"


def winners_name(stem: str, kind: str) -> str:
    return stem + (".json" if kind == "measured" else f".{kind}.json")


def recovered_name(stem: str, kind: str, unique: str = "") -> str:
    base = stem if kind == "measured" else f"{stem}.{kind}"
    return f"{base}.recovered{'-' + unique if unique else ''}.json"


def ledger_name(stem: str, kind: str) -> str:
    return (stem if kind == "measured" else f"{stem}.{kind}") + ".trials.jsonl"


_RECOVERED_RE: Final = re.compile(r"\.recovered(-[A-Za-z0-9_-]+)?\.json$")


def classify(name: str) -> tuple[str, str] | None:
    """(role, kind) of a file in a chip directory: role ``winners``, ``recovered`` or
    ``ledger``; None for anything else (temp files, locks, dot files)."""
    if name.startswith(".") or name.endswith(".lock"):
        return None
    if name.endswith(".trials.jsonl"):
        return "ledger", "estimate" if name.endswith(".estimate.trials.jsonl") else "measured"
    m = _RECOVERED_RE.search(name)
    if m:
        return "recovered", "estimate" if name[: m.start()].endswith(".estimate") else "measured"
    if name.endswith(".json"):
        return "winners", "estimate" if name.endswith(".estimate.json") else "measured"
    return None


# ---- strict JSON ---------------------------------------------------------------------------

def sanitize(value: Any, _depth: int = 0) -> Any:
    """``value`` as strict JSON data: non-finite floats become None, tuples and sets lists,
    numpy scalars Python numbers, mapping keys strings, anything else its repr."""
    if _depth > 64:
        return repr(value)
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): sanitize(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return [sanitize(v, _depth + 1) for v in items]
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) == ():
        try:
            return sanitize(item(), _depth + 1)
        except Exception:
            pass
    return repr(value)


def dumps(value: Any) -> str:
    """One line of strict JSON (ASCII, no NaN/Infinity). ``value`` must be sanitized."""
    return json.dumps(value, ensure_ascii=True, allow_nan=False)


def loads(text: str, where: str) -> Any:
    """Parses JSON; any failure (syntax, nesting depth, huge numbers) is a CacheFormatError."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError, MemoryError) as e:
        kind = "nested too deeply" if isinstance(e, RecursionError) else f"not valid JSON ({e})"
        raise CacheFormatError(f"{where} is {kind}") from None


# ---- the winners file ----------------------------------------------------------------------

class WinnersFile:
    """One winners file, read once: its header, and its entries by key, each parsed on first
    use. ``get`` returns ``(entry, None)``, ``(None, reason)`` for a damaged entry, or
    ``(None, None)`` when the key is absent."""

    __slots__ = (
        "_entries",
        "_parsed",
        "_spans",
        "_text",
        "damage",
        "header",
        "identity",
        "path",
    )

    def __init__(self, path: str, header: dict[str, Any], *, identity: tuple[Any, ...],
                 text: str | None = None, spans: dict[str, tuple[int, int] | str] | None = None,
                 entries: dict[str, Any] | None = None, damage: tuple[str, ...] = ()):
        self.path = path
        self.header = header
        self.damage = damage  # File-level problems that left the other entries readable.
        self.identity = identity
        self._text = text
        self._spans = spans
        self._entries = entries
        self._parsed: dict[str, tuple[Any, str | None]] = {}

    @property
    def schema(self) -> int:
        return int(self.header.get("schema", 0))

    def keys(self) -> list[str]:
        return list(self._spans if self._spans is not None else self._entries or {})

    def __contains__(self, key: str) -> bool:
        return key in (self._spans if self._spans is not None else self._entries or {})

    def raw(self, key: str) -> tuple[Any, str | None]:
        """(parsed JSON value, None) or (None, why it cannot be parsed); KeyError if absent."""
        if key in self._parsed:
            return self._parsed[key]
        if self._spans is None:
            out: tuple[Any, str | None] = (self._entries[key], None)  # type: ignore[index]
        else:
            span = self._spans[key]
            if isinstance(span, str):
                out = (None, span)
            else:
                text = self._text[span[0]: span[1]].rstrip()  # type: ignore[index]
                text = text.removesuffix(",")
                try:
                    text.encode("utf-8")
                    out = (loads(text, "the entry"), None)
                except UnicodeEncodeError:
                    out = (None, "the entry holds bytes that are not UTF-8")
                except CacheFormatError as e:
                    out = (None, str(e))
        self._parsed[key] = out
        return out

    def items(self) -> Iterator[tuple[str, Any, str | None]]:
        for key in self.keys():
            value, problem = self.raw(key)
            yield key, value, problem


def file_identity(st: os.stat_result, write_id: Any) -> tuple[Any, ...]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, write_id)


def read_raw(path: str) -> tuple[bytes, os.stat_result]:
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        return f.read(), st


def parse_winners(raw: bytes, path: str, st: os.stat_result) -> WinnersFile:
    """Parses a winners file of either schema and layout. Raises CacheFormatError when nothing
    in it can be trusted (not JSON, not an object, unknown schema, no entries object)."""
    text = raw.decode("utf-8", "surrogateescape")
    nl = text.find("\n")
    first = text if nl < 0 else text[:nl]
    if _CANONICAL_HEAD.match(first):
        try:
            header = json.loads(first + "}}")
        except (ValueError, RecursionError):
            header = None
        if isinstance(header, dict) and header.get("schema") == SCHEMA_VERSION:
            indexed = _index_lines(path, check_header(header, path), text, nl + 1, st)
            if not indexed.damage:
                return indexed
            try:  # Valid JSON in another line layout (an editor's) parses whole.
                return _parse_whole(text, path, st)
            except CacheFormatError:
                return indexed  # Truly damaged: the intact lines still serve.
    return _parse_whole(text, path, st)


def _parse_whole(text: str, path: str, st: os.stat_result) -> WinnersFile:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise CacheFormatError(f"cache file {path} is not UTF-8 text") from None
    data = loads(text, f"cache file {path}")
    header = check_header(data, path)
    entries = data["entries"]
    return WinnersFile(path, header, entries=entries,
                       identity=file_identity(st, header.get("write_id")))


def check_header(data: Any, path: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise CacheFormatError(f"cache file {path} does not hold a JSON object")
    schema = data.get("schema")
    if schema not in READABLE_SCHEMAS or isinstance(schema, bool):
        raise CacheFormatError(
            f"cache file {path} has schema {schema!r}; this pallas-tune reads schemas "
            f"{list(READABLE_SCHEMAS)}. Re-tune with `pallas-tune sweep`, or upgrade pallas-tune")
    if not isinstance(data.get("entries"), dict):
        raise CacheFormatError(f"cache file {path} has no `entries` object")
    for field in ("kernel", "chip", "kind"):
        if field in data and not isinstance(data[field], str):
            raise CacheFormatError(f"cache file {path}: `{field}` is not a string")
    return {k: v for k, v in data.items() if k != "entries"}


def _index_lines(path: str, header: dict[str, Any], text: str, pos: int,
                 st: os.stat_result) -> WinnersFile:
    """Indexes the entry lines of a canonical file by key, without parsing their values."""
    spans: dict[str, tuple[int, int] | str] = {}
    damage: list[str] = []
    closed = False
    n = len(text)
    lineno = 1
    while pos < n:
        end = text.find("\n", pos)
        end = n if end < 0 else end
        lineno += 1
        if closed:
            if text[pos:end].strip():
                damage.append(f"line {lineno} follows the closing `}}}}` and was ignored")
        elif text.startswith("}}", pos) and not text[pos + 2: end].strip():
            closed = True
        elif text.startswith('"', pos):
            try:
                key, kend = _scanstring(text, pos + 1)
            except ValueError:
                key, kend = None, 0
            if key is None or not text.startswith(": ", kend) or kend >= end:
                damage.append(f"line {lineno} is not a `\"key\": {{...}}` entry and was ignored")
            else:
                spans[key] = (kend + 2, end)
        elif text[pos:end].strip():
            damage.append(f"line {lineno} is not a `\"key\": {{...}}` entry and was ignored")
        pos = end + 1
    if not closed:
        damage.append("it ends before its closing `}}` (truncated?)")
    return WinnersFile(path, header, text=text, spans=spans, damage=tuple(damage),
                       identity=file_identity(st, header.get("write_id")))


def render_winners(header: Mapping[str, Any], entries: Mapping[str, Any]) -> str:
    """The canonical text of a winners file. ``header`` and ``entries`` must be sanitized."""
    head = dumps({k: v for k, v in header.items() if k != "entries"})
    lines = [head[:-1] + ', "entries": {']
    body = [f"{dumps(k)}: {dumps(v)}" for k, v in sorted(entries.items())]
    if body:
        lines.append(",\n".join(body))
    lines.append("}}\n")
    return "\n".join(lines)


def new_write_id() -> str:
    return secrets.token_hex(8)


# ---- atomic replacement and the temp files of killed writers -------------------------------

_HOST: Final = re.sub(r"[^A-Za-z0-9]+", "", socket.gethostname())[:32] or "host"
_TEMP_RE: Final = re.compile(r"^\.(tmp|probe)-(?:(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)-)?")
STALE_TEMP_S: Final = 3600.0


def temp_path(directory: str, suffix: str = ".json") -> str:
    """A fresh temp file name that says which host and process owns it."""
    return os.path.join(directory, f".tmp-{_HOST}-{os.getpid()}-{secrets.token_hex(6)}{suffix}")


def write_temp(directory: str, text: str) -> str:
    """Writes ``text`` to a new temp file in ``directory``, synced to disk; returns its path."""
    tmp = temp_path(directory)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # Umask applies.
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # Some file systems cannot sync a directory.
            os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def clean_stale_temps(directory: str, *, now: float | None = None) -> list[str]:
    """Removes temp files left by killed writers: those of a dead process on this host, and any
    older than an hour. Returns the names removed. Never raises."""
    removed = []
    now = time.time() if now is None else now
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _TEMP_RE.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        dead = (m.group("host") == _HOST and m.group("pid") is not None
                and int(m.group("pid")) != os.getpid() and not _alive(int(m.group("pid"))))
        try:
            old = now - os.stat(path).st_mtime > STALE_TEMP_S
        except OSError:
            continue
        if dead or old:
            _unlink(path)
            removed.append(name)
    return removed
