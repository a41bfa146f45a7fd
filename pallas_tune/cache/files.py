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

import json
import math
import os
import re
import secrets
import stat
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Final

from pallas_tune import _bounded, _settings
from pallas_tune.errors import CacheFormatError, InputTooLargeError

__all__ = ["SCHEMA_VERSION", "WinnersFile", "parse_winners", "render_winners", "sanitize"]

SCHEMA_VERSION: Final = 2
READABLE_SCHEMAS: Final = (1, 2)
KINDS: Final = ("measured", "estimate")

_CANONICAL_HEAD: Final = re.compile(r'^\{"schema": 2, .*"entries": \{$')


# ---- strict JSON ---------------------------------------------------------------------------

def sanitize(value: Any, _depth: int = 0) -> Any:
    """``value`` as strict JSON data: non-finite floats become None, tuples and sets lists,
    numpy scalars Python numbers, mapping keys strings, anything else its repr."""
    if _depth > 64:
        return "<nested too deeply>"  # Not repr: that could recurse past the stack.
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
    """One winners file, read once. ``find(key)`` returns ``(entry, None)``, ``(None, reason)``
    for a damaged entry, or None when the key is absent.

    A file in the canonical layout is kept as bytes: a lookup finds its key's line with one
    ``bytes.rfind`` and parses that line only (the last line of a key wins, as in a whole-file
    parse). The search stops at the closing ``}}`` line (the last one: see
    :func:`_closing_line`): a line after it is damage, ignored by every reader (the index,
    ``check``, ``show``), so the fast search must not serve it either.
    The key index (every line's key) is built only when something needs it: listing keys,
    neighbours, a key not found by the fast search, a line that does not parse, and at once
    when the file does not end at its closing line (so that the damage is reported by the call
    that meets it, not only by the tools). If the index finds damage but the file is valid JSON
    in another line layout, it is parsed whole.
    """

    __slots__ = ("_damage", "_end", "_entries", "_index", "_lock", "_parsed", "_raw", "_start",
                 "header", "identity", "path")

    def __init__(self, path: str, header: dict[str, Any], *, identity: tuple[Any, ...],
                 raw: bytes | None = None, start: int = 0,
                 entries: dict[str, Any] | None = None):
        self.path = path
        self.header = header
        self.identity = identity
        self._raw = raw  # Canonical layout: the file's bytes, entries parsed on demand.
        self._start = start  # Offset of the first entry line.
        self._entries = entries  # Any other layout: parsed whole.
        self._index: dict[str, tuple[int, int]] | None = None
        self._damage: tuple[str, ...] = ()
        self._parsed: dict[str, tuple[Any, str | None]] = {}
        self._lock = threading.RLock()  # Traces may resolve keys from several threads.
        self._end = 0  # Offset of the closing line: the fast search looks before it only.
        if raw is not None:
            self._end, complete = _closing_line(raw, start)
            if not complete:  # Truncated, or something after the closing line: damage.
                self._build_index()

    @property
    def schema(self) -> int:
        return int(self.header.get("schema", 0))

    @property
    def indexed(self) -> bool:
        """Whether every line has been looked at (so ``damage`` is known without more work)."""
        return self._entries is not None or self._index is not None

    @property
    def damage(self) -> tuple[str, ...]:
        """Damage that cost some lines (and so their entries) but left the others readable."""
        self._ensure_index()
        return self._damage

    def keys(self) -> list[str]:
        self._ensure_index()
        return list(self._entries if self._entries is not None else self._index or {})

    def __contains__(self, key: str) -> bool:
        return self.find(key) is not None

    def find(self, key: str) -> tuple[Any, str | None] | None:
        found = self._parsed.get(key)
        if found is not None:
            return found
        with self._lock:
            return self._find(key)

    def _find(self, key: str) -> tuple[Any, str | None] | None:
        if self._entries is None and self._index is None:
            pattern = b"\n" + dumps(key).encode("ascii") + b": "
            at = self._raw.rfind(pattern, self._start - 1, self._end)  # type: ignore[union-attr]
            if at >= 0:
                a = at + len(pattern)
                b = self._raw.find(b"\n", a)  # type: ignore[union-attr]
                out = self._parse_span(a, len(self._raw) if b < 0 else b)  # type: ignore[arg-type]
                if out[1] is None:
                    self._parsed[key] = out
                    return out
            self._ensure_index()  # Not found, or not parsed: look at every line once.
        if self._entries is not None:
            if key not in self._entries:
                return None
            out = (self._entries[key], None)
        else:
            span = self._index.get(key)  # type: ignore[union-attr]
            if span is None:
                return None
            out = self._parse_span(*span)
        self._parsed[key] = out
        return out

    def raw(self, key: str) -> tuple[Any, str | None]:
        """(parsed JSON value, None) or (None, why it cannot be parsed); KeyError if absent."""
        found = self.find(key)
        if found is None:
            raise KeyError(key)
        return found

    def raw_texts(self) -> dict[str, RawJSON] | None:
        """Every entry's JSON text as it is in the file, if the file is in the canonical
        layout without damage (None otherwise): what a writer copies without re-encoding."""
        self._ensure_index()
        if self._index is None or self._damage:
            return None
        raw = self._raw
        assert raw is not None
        return {key: RawJSON(raw[a:b].decode("utf-8", "surrogateescape").rstrip()
                             .removesuffix(","))
                for key, (a, b) in self._index.items()}

    def items(self) -> Iterator[tuple[str, Any, str | None]]:
        for key in self.keys():
            value, problem = self.raw(key)
            yield key, value, problem

    def _parse_span(self, a: int, b: int) -> tuple[Any, str | None]:
        try:
            text = self._raw[a:b].decode("utf-8")  # type: ignore[index]
        except UnicodeDecodeError:
            return None, "the entry holds bytes that are not UTF-8"
        try:
            return loads(text.rstrip().removesuffix(","), "the entry"), None
        except CacheFormatError as e:
            return None, str(e)

    def _ensure_index(self) -> None:
        with self._lock:
            if self._entries is None and self._index is None:
                self._build_index()

    def _build_index(self) -> None:
        raw = self._raw
        assert raw is not None
        index, damage = _index_lines(raw, self._start)
        if damage:
            try:  # Valid JSON in another line layout (an editor's) parses whole.
                whole = _parse_whole(raw, self.path, None)
            except CacheFormatError:
                whole = None
            if whole is not None:
                self._entries, self._raw, self._parsed = whole._entries, None, {}
                return
        self._index, self._damage = index, tuple(damage)


def _closing_line(raw: bytes, start: int) -> tuple[int, bool]:
    """(offset of the line that closes the entries: the last line that is ``}}`` and blanks, or
    the file's length if none is; whether only blanks follow it). Searched from the end, so a
    file of ours costs a few bytes' look, whatever its size; an earlier ``}}`` line is a
    damaged line like any other (the entries after it still serve)."""
    hi = len(raw)
    while (at := raw.rfind(b"\n}}", start - 1, hi)) >= 0:
        end = raw.find(b"\n", at + 3)
        end = len(raw) if end < 0 else end
        if not raw[at + 3:end].strip():
            return at + 1, not raw[end:].strip()
        hi = at + 2  # Not a closing line: look before it.
    return len(raw), False


_ENTRY_LINE: Final = re.compile(rb'^"((?:[^"\\\n]|\\.)*)": ([^\n]*)$', re.M)


def _decode_key(kb: bytes) -> str | None:
    try:
        if b"\\" not in kb:
            return kb.decode("utf-8")
        key = json.loads(b'"' + kb + b'"')
        return key if isinstance(key, str) else None
    except (UnicodeDecodeError, ValueError):
        return None


def _index_lines(raw: bytes, pos: int) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """The byte span of every entry line's value by key, and the damage found on the way.

    The common case (keys without escapes, every line an entry, then the closing line) costs
    a split and a few C calls per line; anything else is walked line by line to say what is
    wrong where."""
    index: dict[str, tuple[int, int]] = {}
    start = pos
    lines = raw[pos:].split(b"\n")
    while lines and not lines[-1]:
        lines.pop()
    if not lines or lines[-1] != b"}}":
        return _index_lines_slowly(raw, start)
    for line in lines[:-1]:
        i = line.find(b'": ', 1)
        kb = line[1:i]
        if i < 0 or line[:1] != b'"' or b"\\" in kb or b'"' in kb:
            return _index_lines_slowly(raw, start)
        try:
            index[kb.decode("utf-8")] = (pos + i + 3, pos + len(line))
        except UnicodeDecodeError:
            return _index_lines_slowly(raw, start)
        pos += len(line) + 1
    return index, []


def _index_lines_slowly(raw: bytes, pos: int) -> tuple[dict[str, tuple[int, int]], list[str]]:
    index: dict[str, tuple[int, int]] = {}
    damage: list[str] = []
    close, _ = _closing_line(raw, pos)  # The same closing line as the fast search's.
    closed = False
    n, lineno = len(raw), 1
    while pos < n:
        end = raw.find(b"\n", pos)
        end = n if end < 0 else end
        lineno += 1
        m = _ENTRY_LINE.match(raw, pos, end)
        key = _decode_key(m.group(1)) if m is not None else None
        if closed:
            if raw[pos:end].strip():
                damage.append(f"line {lineno} follows the closing `}}}}` and was ignored")
        elif pos == close:
            closed = True
        elif key is not None:
            index[key] = m.span(2)  # type: ignore[union-attr]
        elif raw[pos:end].strip():
            damage.append(f"line {lineno} is not a `\"key\": {{...}}` entry and was ignored")
        pos = end + 1
    if not closed:
        damage.append("it ends before its closing `}}` (truncated?)")
    return index, damage


def file_identity(st: os.stat_result, write_id: Any) -> tuple[Any, ...]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, write_id)


def read_raw(path: str) -> tuple[bytes, os.stat_result]:
    """The bytes of a regular file. Raises FileNotFoundError when there is nothing at ``path``,
    or CacheFormatError for anything else in the way (a symbolic link to nothing, a directory,
    a FIFO that would block, a device, over ``PALLAS_TUNE_MAX_FILE_MB`` (64 MiB; a 10,000-shape
    file is about 3 MB), no permission); PallasTuneError if that knob is not a number of MiB."""
    cap = _settings.max_file_bytes()
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        if os.path.islink(path):  # Someone linked a cache here: its loss is news, not absence.
            raise CacheFormatError(f"cache file {path} is a symbolic link to "
                                   f"{_link_target(path)}, which does not exist") from None
        raise
    except OSError as e:
        raise CacheFormatError(f"cache file {path} cannot be read ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CacheFormatError(f"cache file {path} is not a regular file")
        return _bounded.read_fd(fd, cap, what="cache file", path=path, st=st), st
    except InputTooLargeError as e:
        raise CacheFormatError(str(e)) from None
    except OSError as e:
        raise CacheFormatError(f"cache file {path} cannot be read ({e.strerror or e})") from None
    finally:
        os.close(fd)


def _link_target(path: str) -> str:
    try:
        return repr(os.readlink(path))
    except OSError:
        return "a path that cannot be read"


def parse_winners(raw: bytes, path: str, st: os.stat_result) -> WinnersFile:
    """Reads a winners file of either schema and layout: the header now, entries on demand.
    Raises CacheFormatError when nothing in it can be trusted (not JSON, not an object, unknown
    schema, no entries object, a header field of the wrong type)."""
    nl = raw.find(b"\n")
    first = (raw if nl < 0 else raw[:nl]).decode("utf-8", "surrogateescape")
    if _CANONICAL_HEAD.match(first):
        try:
            header = json.loads(first + "}}")
        except (ValueError, RecursionError):
            header = None
        if isinstance(header, dict) and header.get("schema") == SCHEMA_VERSION:
            header = check_header(header, path)
            return WinnersFile(path, header, raw=raw, start=nl + 1,
                               identity=file_identity(st, header.get("write_id")))
    return _parse_whole(raw, path, st)


def _parse_whole(raw: bytes, path: str, st: os.stat_result | None) -> WinnersFile:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CacheFormatError(f"cache file {path} is not UTF-8 text") from None
    data = loads(text, f"cache file {path}")
    header = check_header(data, path)
    identity = file_identity(st, header.get("write_id")) if st is not None else ()
    return WinnersFile(path, header, entries=data["entries"], identity=identity)


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


class RawJSON(str):
    """An entry's JSON text, already strict and on one line, copied as it is."""

    __slots__ = ()


def strict_check(raw: bytes, where: str) -> None:
    """Raises CacheFormatError unless ``raw`` is UTF-8 standard JSON (no NaN, no Infinity)."""

    def reject(name: str) -> Any:
        raise ValueError(f"{name} is not standard JSON")

    try:
        json.loads(raw.decode("utf-8"), parse_constant=reject)
    except (ValueError, RecursionError) as e:
        raise CacheFormatError(f"{where} is not standard JSON ({e})") from None


def render_winners(header: Mapping[str, Any], entries: Mapping[str, Any]) -> str:
    """The canonical text of a winners file. ``header`` and ``entries`` must be sanitized
    (or :class:`RawJSON`)."""
    head = dumps({k: v for k, v in header.items() if k != "entries"})
    lines = [head[:-1] + ', "entries": {']
    body = [f"{dumps(k)}: {v if isinstance(v, RawJSON) else dumps(v)}"
            for k, v in sorted(entries.items())]
    if body:
        lines.append(",\n".join(body))
    lines.append("}}\n")
    return "\n".join(lines)


def new_write_id() -> str:
    return secrets.token_hex(8)
