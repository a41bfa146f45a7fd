"""libtpu's own logs, in every process pallas-tune starts: somewhere we own, and bounded.

libtpu writes glog files (INFO, WARNING, ERROR, FATAL) to ``$TPU_LOG_DIR``, ``/tmp/tpu_logs``
by default. When its static profiler trips over a kernel (``LLO_CHECK failure ... Expected
vector-bf16packed, got vector-int32``: a bf16 multiply by a constant is enough on v6e), each
abort writes the kernel's whole LLO program to three of them: 10-24 MB per candidate measured
here, and a sweep's workers abort once per candidate, overnight. So each worker pool gets a
run directory of its own (``TPU_LOG_DIR``), under a root this user owns, and the parent keeps it
under ``PALLAS_TUNE_TPU_LOG_MB`` (default 64): the largest files are cut to their first part
(where a log starts; the abort's own message is in the small FATAL file and in the worker's
output, which a crashed trial reports), then the oldest files go. Run directories of processes
no longer alive are kept, newest first, within four times that bound.

``PALLAS_TUNE_TPU_LOGS``: unset, the per-user log directory (``platformdirs.user_log_path``,
``tpu/`` in it); a directory, that one; ``off``, no log files kept: ``TPU_MIN_LOG_LEVEL=3``
leaves only a fatal abort's (four files of about 2.6 KB), and those go to a private scratch
directory removed when the pool closes (``TPU_LOG_DIR=disabled`` sent them to ``/tmp``, where
they stayed, four more per abort).
Workers also get no core files (``RLIMIT_CORE`` 0; libtpu's abort says "Dumping core").
"""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import tempfile
import time
from typing import Final

__all__ = ["ENV", "MB_ENV", "RunLogs", "cut_output", "shrink"]

ENV: Final = "PALLAS_TUNE_TPU_LOGS"
MB_ENV: Final = "PALLAS_TUNE_TPU_LOG_MB"
DEFAULT_MB: Final = 64
_KEEP_RUNS: Final = 4  # Bounds of dead runs' directories kept under the root.
_EVERY_S: Final = 1.0  # How often the parent looks while its workers run.
_RUNS = itertools.count(1)  # Run directories named by this process.


def _bound_bytes() -> int:
    text = os.environ.get(MB_ENV, "").strip()
    if not text:
        return DEFAULT_MB * 2**20
    if not text.isdigit() or not 1 <= int(text) <= 2**20:
        from pallas_tune.errors import PallasTuneError

        raise PallasTuneError(f"{MB_ENV}={text!r} is not a whole number of MiB from 1 to "
                              f"1048576; unset it (default {DEFAULT_MB}) or give one.")
    return int(text) * 2**20


def _root() -> str | None:
    """Where run directories go; None when logs are off."""
    value = os.environ.get(ENV, "").strip()
    if value.lower() == "off":
        return None
    if value:
        return os.path.abspath(os.path.expanduser(value))
    import platformdirs

    return os.path.join(platformdirs.user_log_path("pallas-tune"), "tpu")


class RunLogs:
    """The libtpu log directory of one pool of workers (or one CLI process), and its bound.

    ``env``: what each process it covers gets (``TPU_LOG_DIR``); ``path``: the directory, None
    when logs are off or the directory could not be made (then libtpu writes none either)."""

    def __init__(self) -> None:
        self.bound = _bound_bytes()
        self.path: str | None = None
        self._next = 0.0
        root = _root()
        if root is not None and _own_dir(root):
            try:
                _prune_root(root, _KEEP_RUNS * self.bound)
            except OSError:
                pass
            # libtpu makes the directory when it first writes: a pool that never loads libtpu
            # leaves nothing behind.
            self.path = os.path.join(
                root, f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_RUNS)}")
        # No directory: TPU_LOG_DIR=disabled alone sends libtpu's glog files to /tmp instead
        # (measured, libtpu 0.0.50: tpu_driver.*.log.INFO, 18 KB a compile, up to 1 GB each
        # where the profiler aborts); below FATAL it writes none, and a FATAL goes to a
        # scratch directory of ours (mkdtemp: 0700, never a planted link), removed by close.
        self._scratch: str | None = None
        if self.path:
            self.env = {"TPU_LOG_DIR": self.path}
        else:
            self._scratch = tempfile.mkdtemp(prefix="pallas-tune-nologs-")
            self.env = {"TPU_LOG_DIR": self._scratch, "TPU_MIN_LOG_LEVEL": "3"}

    def close(self) -> None:
        """Removes the scratch directory of logs that are off (what an abort left there)."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def note(self) -> str:
        """Where a failure's logs are, for its message ("" when there are none)."""
        if self.path is None:
            return ""
        return (f"libtpu's logs: {self.path} (kept within {self.bound / 2**20:g} MiB; "
                f"{ENV}=off writes none)")

    def due(self, now: bool = False) -> bool:
        """Whether it is time to look again (at most once a second, or ``now``)."""
        if not now and time.monotonic() < self._next:
            return False
        self._next = time.monotonic() + _EVERY_S
        return True

    def enforce(self) -> int:
        """Keeps the directory within its bound; the bytes it holds after."""
        return 0 if self.path is None else shrink(self.path, self.bound)


def cut_output(fd: int, limit: int) -> None:
    """Past ``limit`` bytes, empties a captured output file that its writer appends to, so
    that what comes next (the tail a failure reports) is kept and the rest is not."""
    try:
        if os.fstat(fd).st_size > limit:
            os.ftruncate(fd, 0)
            os.write(fd, b"[pallas-tune: earlier worker output dropped]\n")
    except (OSError, ValueError):
        pass


def shrink(path: str, bound: int) -> int:
    """Cuts the files under ``path`` (not recursive) so that they use at most ``bound`` bytes:
    files over an eighth of it are cut to that (their head: a writer with ``O_APPEND``, as
    glog's, goes on at the new end), then the oldest files are removed. Returns the bytes
    used after."""
    files = _files(path)
    used = sum(size for _, size, _ in files)
    if used <= bound:
        return used
    each = max(bound // 8, 4096)
    for name, size, _ in files:
        if size > each:
            try:
                os.truncate(name, each)
                used -= size - each
            except OSError:
                pass
    for name, size, _ in sorted(_files(path), key=lambda f: f[2]):  # Oldest first.
        if used <= bound:
            break
        try:
            os.unlink(name)
            used -= min(size, each)
        except OSError:
            pass
    return max(used, 0)


def _files(path: str) -> list[tuple[str, int, float]]:
    """(path, bytes on disk, mtime) of the regular files in ``path``, links not followed."""
    out = []
    try:
        with os.scandir(path) as it:
            for entry in it:
                try:
                    if entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        out.append((entry.path, min(st.st_size, st.st_blocks * 512),
                                    st.st_mtime))
                except OSError:
                    continue
    except OSError:
        pass
    return out


def _own_dir(root: str) -> bool:
    """Makes ``root`` (mode 0700) if missing; whether it is a directory of this user's, not a
    link (another user's directory, or a link planted in a shared /tmp, gets no logs)."""
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        st = os.lstat(root)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and (not hasattr(os, "getuid") or st.st_uid == os.getuid())


def _prune_root(root: str, bound: int) -> None:
    """Removes run directories of processes no longer alive, oldest first, past ``bound``
    bytes in all; a live process's directory is left to its own process."""
    runs = []
    with os.scandir(root) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False):
                size = sum(s for _, s, _ in _files(entry.path))
                runs.append((entry.stat(follow_symlinks=False).st_mtime, entry.path, size,
                             _owner_alive(entry.name)))
    total = sum(r[2] for r in runs)
    for _, path, size, alive in sorted(runs):
        if total <= bound:
            return
        if not alive:
            shutil.rmtree(path, ignore_errors=True)
            total -= size


def _owner_alive(name: str) -> bool:
    """Whether the process a run directory is named after (``DATE-TIME-PID-N``) is alive."""
    parts = name.split("-")
    if len(parts) < 3 or not parts[2].isdigit():
        return False
    try:
        os.kill(int(parts[2]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True
