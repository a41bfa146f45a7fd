"""The few ``PALLAS_TUNE_*`` environment knobs, each read in one place.

``PALLAS_TUNE_MODE``       ``cached`` (default): serve from the cache, fall back on a miss;
                           ``tune``: tune on a miss and cache the result;
                           ``strict``: raise :class:`CacheMissError` on a miss, and
                           :class:`CacheFormatError` on an unreadable cache file.
``PALLAS_TUNE_CACHE_DIR``  where tuned configs are written and first looked up
                           (default: the platform's user cache directory).
``PALLAS_TUNE_INTERPRET``  ``auto`` (default): interpret Pallas kernels when the default backend is
                           the CPU and no TPU target is set; ``1``: always; ``0``: never.
``PALLAS_TUNE_CHIP``       override the chip used for cache lookups (e.g. ``v6e``).
``PALLAS_TUNE_MAX_FILE_MB`` the most MiB pallas-tune reads of one file (64): a winners file at
                           trace time, a ``--shapes @FILE``, a ``--from-record`` or ``--space``
                           file. A real 10,000-shape winners file is about 3 MB.

``PALLAS_TUNE_MODE`` and ``PALLAS_TUNE_MAX_FILE_MB`` are read when used (a cache miss, a file
read), never on a hit, so they may change at run time.
``PALLAS_TUNE_INTERPRET`` and ``PALLAS_TUNE_CHIP`` sit on the per-call path and are read once;
call :func:`reload` after changing them in a running process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Final, Literal

MODES: Final = ("cached", "tune", "strict")
Mode = Literal["cached", "tune", "strict"]


def mode() -> Mode:
    value = os.environ.get("PALLAS_TUNE_MODE", "cached").strip().lower() or "cached"
    if value not in MODES:
        from pallas_tune.errors import PallasTuneError

        raise PallasTuneError(
            f"PALLAS_TUNE_MODE={value!r} is not one of {MODES}; unset it or pick one of those."
        )
    return value  # type: ignore[return-value]


def cache_dir() -> str:
    explicit = os.environ.get("PALLAS_TUNE_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    import platformdirs

    return platformdirs.user_cache_dir("pallas-tune", appauthor=False)


MAX_FILE_MB: Final = 64  # The default of PALLAS_TUNE_MAX_FILE_MB.


def max_file_bytes() -> int:
    """The size limit of every file pallas-tune reads, in bytes (``PALLAS_TUNE_MAX_FILE_MB``,
    a whole number of MiB, default 64). Raises PallasTuneError for a value that is not one."""
    text = os.environ.get("PALLAS_TUNE_MAX_FILE_MB", "").strip()
    if not text:
        return MAX_FILE_MB * 2**20
    if not text.isdigit() or not 1 <= int(text) <= 2**20:
        from pallas_tune.errors import PallasTuneError

        raise PallasTuneError(
            f"PALLAS_TUNE_MAX_FILE_MB={text!r} is not a whole number of MiB from 1 to 1048576; "
            f"unset it (default {MAX_FILE_MB}) or give one, e.g. PALLAS_TUNE_MAX_FILE_MB=256.")
    return int(text) * 2**20


_ONCE: dict[str, object] = {}
# Callbacks of modules that cache what they derived from the knobs (chips: the host's chip).
# Registered by those modules, so that this leaf imports none of them.
_RELOAD_HOOKS: list[Callable[[], None]] = []


def on_reload(fn: Callable[[], None]) -> Callable[[], None]:
    """Registers ``fn`` to run on :func:`reload` (for modules caching derived values)."""
    _RELOAD_HOOKS.append(fn)
    return fn


def reload() -> None:
    """Forgets the knobs read once, so the next call re-reads the environment."""
    _ONCE.clear()
    for fn in _RELOAD_HOOKS:
        fn()


def interpret() -> Literal["auto", "on", "off"]:
    if "interpret" not in _ONCE:
        _ONCE["interpret"] = _read_interpret()
    return _ONCE["interpret"]  # type: ignore[return-value]


def _read_interpret() -> Literal["auto", "on", "off"]:
    value = os.environ.get("PALLAS_TUNE_INTERPRET", "auto").strip().lower()
    if value in ("1", "true", "on", "yes"):
        return "on"
    if value in ("0", "false", "off", "no"):
        return "off"
    return "auto"


def chip_override() -> str | None:
    if "chip" not in _ONCE:
        _ONCE["chip"] = os.environ.get("PALLAS_TUNE_CHIP") or None
    return _ONCE["chip"]  # type: ignore[return-value]
