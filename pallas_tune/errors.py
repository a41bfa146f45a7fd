"""Every exception and warning pallas-tune raises.

Each error carries a builtin co-base so that ``except ValueError`` and friends keep working
(the Optuna convention). Messages name the offending value first and the fix second.
"""

from __future__ import annotations

import warnings

__all__ = [
    "InvalidConfig",
    "CacheFormatError",
    "InputTooLargeError",
    "CacheMissError",
    "DiskFullError",
    "MeasurementError",
    "NoFeasibleConfigError",
    "PallasTuneError",
    "PallasTuneWarning",
    "RecordWarning",
    "SearchSpaceError",
    "TuneOptionError",
]


class PallasTuneError(Exception):
    """Base class of every pallas-tune error."""


class SearchSpaceError(PallasTuneError, ValueError):
    """A declared search space is invalid (unknown parameter, empty or unhashable choices)."""


class InvalidConfig(SearchSpaceError):
    """Raised by a kernel (while traced) for a config that cannot work for these arguments,
    e.g. ``block_k`` not dividing ``block_k_major``. The tuner records it as ``infeasible``."""


class CacheFormatError(PallasTuneError, ValueError):
    """A cache file is malformed, truncated or of an unknown schema."""


class InputTooLargeError(PallasTuneError, ValueError):
    """A file pallas-tune reads is over its size limit (``PALLAS_TUNE_MAX_FILE_MB``), or does
    not end (``/dev/zero``, a pipe that never closes)."""


class CacheMissError(PallasTuneError, KeyError):
    """Raised in ``PALLAS_TUNE_MODE=strict`` when no tuned config exists for a call."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain message.
        return str(self.args[0]) if self.args else ""


class NoFeasibleConfigError(PallasTuneError, RuntimeError):
    """No candidate of the space is feasible or correct for the given arguments."""


class DiskFullError(PallasTuneError, OSError):
    """The disk (or quota) that pallas-tune writes to is full. The message names what was
    being written and where the finished trials are; ``result``: the tuning result that could
    not be written, where there is one (``kernel.cache.write`` it once space is freed)."""

    def __init__(self, message: str, result: object = None):
        super().__init__(message)
        self.result = result

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def is_disk_full(e: BaseException) -> bool:
    """Whether ``e``, or an error it was raised from, says the disk or quota is full: OSError
    ENOSPC or EDQUOT, or a database's own words for it (SQLite's "database or disk is full",
    which Optuna's storage wraps in StorageInternalError)."""
    import errno

    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DiskFullError):
            return True
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
            return True
        text = str(e).lower()
        if "database or disk is full" in text or "no space left on device" in text \
                or "disk quota exceeded" in text:
            return True
        e = e.__cause__ or e.__context__ or getattr(e, "orig", None)  # type: ignore[assignment]
    return False


class MeasurementError(PallasTuneError, RuntimeError):
    """Measuring a candidate failed in a way that is not attributable to the candidate."""


class TuneOptionError(PallasTuneError, ValueError):
    """A tuning option is out of range or unknown (see :class:`pallas_tune.TuneOptions`)."""


class PallasTuneWarning(UserWarning):
    """Warnings from pallas-tune (cache misses, unreadable cache files)."""


def warn(message: str, category: type[Warning] = PallasTuneWarning) -> None:
    """Warns, attributing the warning to the first frame outside pallas-tune."""
    import os
    import sys

    # Our frames, and JAX's: a backward kernel resolves inside jax.grad's machinery, and the
    # line to show is the user's call of jax.grad (or jit), not a JAX internal.
    roots = (os.path.dirname(os.path.abspath(__file__)),) + _jax_roots()
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=roots)
        return
    frame, level = sys._getframe(1), 2  # Python 3.11: count our own frames by hand.
    while frame is not None and frame.f_code.co_filename.startswith(roots):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def _jax_roots() -> tuple[str, ...]:
    import os
    import sys

    jax = sys.modules.get("jax")
    path = getattr(jax, "__file__", None)
    return (os.path.dirname(os.path.abspath(path)) + os.sep,) if path else ()


class RecordWarning(PallasTuneWarning):
    """A ``PALLAS_TUNE_RECORD`` or ``PALLAS_TUNE_RECEIPTS`` file could not be written (a
    directory, a full disk, a FIFO no process reads): what it would have held is dropped.
    Warned once per process and path; the program runs on."""
