"""Kernel fingerprints: which version of a kernel's code a cache entry was tuned on.

A tuned config is a fact about one program. When a kernel's code changes (another layout,
masking, a different program) its old cache entries may no longer be its best, so the tuner
records the kernel's fingerprint in each entry's provenance (``"kernel_fingerprint"``), the
dispatcher warns when it serves an entry tuned on other code, and ``pallas-tune sweep``
re-tunes such entries. As Triton's autotuner keys its cache on a hash of the kernel source.

The fingerprint is 16 hex digits of a SHA-256:

- by default, of the code of the module that defines the kernel function: its syntax tree
  with docstrings (and other bare string statements) removed, so that comments, docstrings
  and formatting do not count, while any change to the code does, helpers such as
  ``_kernel`` and the declared space included. The tree is serialized here (node type, then
  non-empty fields), not with ``ast.dump``, whose text differs between Python versions.
  What does not make the kernel's program is left out: its gradient declaration and its
  estimate stand-in (``standin=``, with the module's functions only it reaches: a stand-in
  decides how an estimate is made, which each entry records, not what the kernel runs);
- with ``@tunable(version="...")``, of that string only: for a kernel whose code spans several
  modules, or whose author wants to decide when its caches go stale;
- None ("unknown") when the source cannot be read (a kernel defined in a REPL, a notebook or
  by ``exec``): nothing is then recorded, checked or warned.

Entries without a recorded fingerprint (every cache written before fingerprints) are
"unknown" too, and serve as they always did. Entries recorded under an earlier scheme (scheme
1: the stand-in counted) are current while that scheme's fingerprint of the code now matches
(:func:`earlier_fingerprints`), so no cache goes stale because the fingerprint's definition
changed.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any, Final

__all__ = ["FIELD", "code_fingerprint", "earlier_fingerprints", "kernel_state", "recorded",
           "source_changed", "source_fingerprint", "state", "version_fingerprint"]

FIELD: Final = "kernel_fingerprint"  # The provenance field.
SCHEME: Final = 2  # 1: without the gradient declaration; 2: without the stand-in too.
LENGTH: Final = 16
_HEX: Final = re.compile(r"[0-9a-f]{16}")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:LENGTH]


def version_fingerprint(version: str) -> str:
    """The fingerprint of an explicit ``@tunable(version=...)``."""
    return _digest(b"version\0" + version.encode("utf-8"))


def _is_doc(node: ast.AST) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


def _canon(node: Any, out: list[str]) -> None:
    """Appends a Python-version-stable text of ``node``: fields that are None or empty lists
    are left out (newer Pythons add such fields, e.g. ``type_params`` in 3.12)."""
    if isinstance(node, ast.AST):
        out.append(type(node).__name__ + "(")
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or (isinstance(value, list) and not value):
                continue
            out.append(name + "=")
            _canon(value, out)
            out.append(",")
        out.append(")")
    elif isinstance(node, list):
        out.append("[")
        for item in node:
            if _is_doc(item):
                continue  # A docstring, or a string used as a comment: no code.
            _canon(item, out)
            out.append(",")
        out.append("]")
    else:
        out.append(f"{type(node).__name__}:{node!r}")


def source_fingerprint(source: str, scheme: int = SCHEME) -> str:
    """The fingerprint of a module's source text (SyntaxError if it does not parse), without
    the kernel's gradient declaration (see :func:`_without_gradient`) and, from scheme 2, its
    stand-in (:func:`_without_standin`)."""
    tree = _without_gradient(ast.parse(source))
    if scheme >= 2:
        tree = _without_standin(tree)
    out: list[str] = []
    _canon(tree, out)
    return _digest("".join(out).encode("utf-8"))


# ``@tunable(backward=..., backward_args=..., backward_residuals=...)``: the forward's gradient;
# ``partition=``: how a sharded call splits (around the kernel, not its program), left out alike.
GRADIENT_KEYWORDS: Final = ("backward", "backward_args", "backward_residuals", "partition")


def _without_gradient(tree: ast.Module) -> ast.Module:
    """The module without its gradient declaration: the ``backward*`` keywords of every call
    and the module-level imports that bring in only names those keywords use. Declaring (or
    changing) a backward does not change the forward's program, so it does not stale the
    forward's cache entries; the backward kernel has a fingerprint of its own."""
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            kept = [k for k in node.keywords if k.arg not in GRADIENT_KEYWORDS]
            for k in node.keywords:
                if k.arg in GRADIENT_KEYWORDS:
                    used.update(n.id for n in ast.walk(k.value) if isinstance(n, ast.Name))
            node.keywords = kept
    if used:
        tree.body = [n for n in tree.body if not (
            isinstance(n, ast.Import | ast.ImportFrom)
            and all((a.asname or a.name).split(".")[0] in used for a in n.names))]
    return tree


def _without_standin(tree: ast.Module) -> ast.Module:
    """The module without its stand-in: the ``standin`` keyword of every call, the module's
    functions that only it reaches (directly or through one another), and the module-level
    imports only those use. A stand-in is the smaller problem an estimate is made on; the
    kernel's program does not call it."""
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            roots.update(n.id for k in node.keywords if k.arg == "standin"
                         for n in ast.walk(k.value) if isinstance(n, ast.Name))
            node.keywords = [k for k in node.keywords if k.arg != "standin"]
    if not roots:
        return tree
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    dropped: set[str] = set()
    while True:  # To a fixed point: a helper of two dropped functions goes with the second.
        kept_names = _names([n for n in tree.body if getattr(n, "name", None) not in dropped])
        reached = roots | _names([defs[d] for d in dropped])
        more = {d for d in defs if d in reached and d not in kept_names} - dropped
        if not more:
            break
        dropped |= more
    gone = _names([defs[d] for d in dropped])
    kept = [n for n in tree.body if getattr(n, "name", None) not in dropped]
    remaining = _names(kept)
    tree.body = [n for n in kept if not (
        isinstance(n, ast.Import | ast.ImportFrom) and all(
            (a.asname or a.name).split(".")[0] in gone - remaining for a in n.names))]
    return tree


def _names(nodes: list[ast.AST]) -> set[str]:
    """The names ``nodes`` load (a function's own name, where it is defined, is not one)."""
    return {n.id for node in nodes for n in ast.walk(node)
            if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Store)}


def code_fingerprint(fn: Callable[..., Any], scheme: int = SCHEME) -> str | None:
    """The fingerprint of the module that defines ``fn``, or None when its source cannot be
    read or does not hold ``fn`` (defined in a REPL, by ``exec``, in a notebook). Never
    raises: it runs on the dispatch path."""
    try:
        fn = inspect.unwrap(fn)
        code = getattr(fn, "__code__", None)
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        if code is None or module is None:
            return None
        path = inspect.getsourcefile(module)
        if not path or path != code.co_filename:
            return None  # fn was not compiled from this module's file (exec, a notebook).
        return source_fingerprint(inspect.getsource(module), scheme)
    except Exception:  # noqa: BLE001 - OSError, SyntaxError, RecursionError...: unknown.
        return None


@functools.lru_cache(maxsize=256)
def earlier_fingerprints(fn: Callable[..., Any]) -> frozenset[str]:
    """The earlier schemes' fingerprints of ``fn``'s module as it is now: an entry that
    recorded one of them was tuned on this code (only the fingerprint's definition changed)."""
    found = (code_fingerprint(fn, scheme) for scheme in range(1, SCHEME))
    return frozenset(f for f in found if f is not None)


def source_changed(fn: Callable[..., Any], fingerprint: str) -> str | None:
    """The path of the module file that defines ``fn`` if that file, read from disk now, holds
    other code than ``fingerprint``; else None (unchanged, or not readable: nothing to say).

    Worker processes import the kernel's module afresh, so an edit saved while a shape is
    being tuned splits its trials between two versions of the code."""
    try:
        module = sys.modules.get(getattr(inspect.unwrap(fn), "__module__", None) or "")
        path = inspect.getsourcefile(module) if module is not None else None
        if not path:
            return None
        with open(path, encoding="utf-8") as f:
            return path if source_fingerprint(f.read()) != fingerprint else None
    except Exception:  # noqa: BLE001 - unreadable or unparsable now: not a verdict.
        return None


def recorded(provenance: Any) -> tuple[str | None, str | None]:
    """(fingerprint, problem) recorded in an entry's provenance: (None, None) when none is,
    (None, why) when the value is malformed (then it counts as unknown)."""
    if not isinstance(provenance, Mapping) or FIELD not in provenance:
        return None, None
    value = provenance[FIELD]
    if value is None:
        return None, None
    if not isinstance(value, str) or not _HEX.fullmatch(value):
        text = repr(value)
        text = text if len(text) <= 40 else text[:37] + "..."
        return None, (f"its provenance's {FIELD} {text} is not {LENGTH} lowercase hex "
                      "digits; treated as unknown")
    return value, None


def state(recorded_fp: str | None, current: str | None,
          earlier: frozenset[str] = frozenset()) -> str:
    """``"current"``, ``"stale"`` (tuned on other code) or ``"unknown"`` (either side not
    known). ``earlier``: the current code's fingerprints under earlier schemes, which count
    as current (:func:`earlier_fingerprints`)."""
    if recorded_fp is None or current is None:
        return "unknown"
    return "current" if recorded_fp == current or recorded_fp in earlier else "stale"


def kernel_state(recorded_fp: str | None, kernel: Any) -> str:
    """:func:`state` of an entry of a declared kernel (``fingerprint``, ``version``, ``fn``;
    None: "unknown"): where the entry recorded another fingerprint than the kernel's, its
    code's earlier-scheme fingerprints are computed (once per kernel) and count as current.
    Never raises."""
    current = getattr(kernel, "fingerprint", None)
    if recorded_fp is None or current is None or recorded_fp == current:
        return state(recorded_fp, current)
    try:
        earlier = (frozenset() if kernel.version is not None
                   else earlier_fingerprints(kernel.fn))
    except Exception:  # noqa: BLE001 - unhashable or odd fn: no earlier scheme to accept.
        earlier = frozenset()
    return state(recorded_fp, current, earlier)
