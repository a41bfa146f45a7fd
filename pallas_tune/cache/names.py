"""File names in a chip directory: an injective map from kernel names, and what each file is."""

from __future__ import annotations

import hashlib
import re
from typing import Final

__all__ = ["classify", "kernel_filename", "ledger_name", "legacy_filename", "recovered_name",
           "winners_name"]

_SAFE: Final = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_.-")
# A stem's last dot-component may not start with these: they mark the other files of a stem.
_RESERVED: Final = ("estimate", "trials", "recovered")
_MAX_STEM: Final = 180


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
