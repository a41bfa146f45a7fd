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

Only what pallas-tune made is ever removed. The root may be a directory of the user's own
(``PALLAS_TUNE_TPU_LOGS=~`` is allowed): a run directory is made here, named
``DATE-TIME-PID-N``, with a marker file (``MARKER``) written at once; pruning removes a
directory only if it is a real directory (never through a link), of this user, named so, and
holds that marker, also this user's. Files in the root itself are never touched. A run
directory that holds nothing but its marker is removed when its run closes.

``PALLAS_TUNE_TPU_LOGS``: unset, the per-user log directory (``platformdirs.user_log_path``,
``tpu/`` in it); a directory, that one; ``off``, no log files kept: ``TPU_MIN_LOG_LEVEL=3``
leaves only a fatal abort's (four files of about 2.6 KB), and those go to a private scratch
directory removed when the pool closes (``TPU_LOG_DIR=disabled`` sent them to ``/tmp``, where
they stayed, four more per abort). A root that cannot hold run directories (a file, a link,
another user's directory, one this user cannot write) is treated as ``off``, with one warning
naming the problem and the fix: libtpu's own fallback would put the logs outside the bound.
Workers also get no core files (``RLIMIT_CORE`` 0; libtpu's abort says "Dumping core").
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import stat
import tempfile
import time
import warnings
from typing import Final

__all__ = ["ENV", "MARKER", "MB_ENV", "RunLogs", "cut_output", "shrink"]

ENV: Final = "PALLAS_TUNE_TPU_LOGS"
MB_ENV: Final = "PALLAS_TUNE_TPU_LOG_MB"
DEFAULT_MB: Final = 64
MARKER: Final = ".pallas-tune-run"  # In each run directory: made by pallas-tune, its to remove.
_MAGIC: Final = b"pallas-tune run directory"
_RUN_NAME: Final = re.compile(r"^\d{8}-\d{6}-(\d+)-\d+$")
_KEEP_RUNS: Final = 4  # Bounds of dead runs' directories kept under the root.
_EVERY_S: Final = 1.0  # How often the parent looks while its workers run.
_RUNS = itertools.count(1)  # Run directories named by this process.
_WARNED: set[tuple[str, str]] = set()  # (root, problem) said once per process.


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


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


class RunLogs:
    """The libtpu log directory of one pool of workers (or one CLI process), and its bound.

    ``env``: what each process it covers gets (``TPU_LOG_DIR``); ``path``: the directory, None
    when logs are off or no run directory could be made (then libtpu writes a fatal abort's
    only, into a scratch directory of ours that :meth:`close` removes)."""

    def __init__(self) -> None:
        self.bound = _bound_bytes()
        self.path: str | None = None
        self._next = 0.0
        root = _root()
        if root is not None:
            problem = _root_problem(root)
            if problem is None:
                with contextlib.suppress(OSError):
                    _prune_root(root, _KEEP_RUNS * self.bound)
                self.path, problem = _make_run(root)
            if problem is not None:
                _warn_once(root, problem)
        # No directory: TPU_LOG_DIR=disabled alone sends libtpu's glog files to /tmp instead
        # (measured, libtpu 0.0.50: tpu_driver.*.log.INFO, 18 KB a compile, up to 1 GB each
        # where the profiler aborts); below FATAL it writes none, and a FATAL goes to a
        # scratch directory of ours (mkdtemp: 0700, never a planted link), removed by close.
        self._scratch: str | None = None
        if self.path:
            self.env = {"TPU_LOG_DIR": self.path, **_levels_kept()}
        else:
            self._scratch = tempfile.mkdtemp(prefix="pallas-tune-nologs-")
            self.env = {"TPU_LOG_DIR": self._scratch, "TPU_MIN_LOG_LEVEL": "3"}

    def close(self) -> None:
        """Removes the scratch directory of logs that are off (what an abort left there), and
        this run's directory if libtpu wrote nothing in it."""
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        if self.path is not None and _ours(self.path) and not _holds_logs(self.path):
            _remove_run(self.path)

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


def _levels_kept() -> dict[str, str]:
    """libtpu's own log level in a run directory, where ``import pallas_tune`` lowered it to
    keep a TPU-less host's user programs free of libtpu files (the user's own setting wins)."""
    from pallas_tune import chips

    return {"TPU_MIN_LOG_LEVEL": "0"} if "TPU_MIN_LOG_LEVEL" in chips.LIBTPU_DEFAULTS else {}


def _root_problem(root: str) -> str | None:
    """Makes ``root`` (mode 0700) if missing; what keeps it from holding run directories of
    this user's (None: nothing). Links are not followed: one planted in a shared /tmp, or
    another user's directory, gets no logs."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
            st = os.lstat(root)
        except OSError as e:
            return f"it cannot be made ({e.strerror or e})"
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return ("it is a link, which pallas-tune does not follow for its logs; give the "
                "directory it points to")
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    uid = _uid()
    if uid is not None and st.st_uid != uid:
        return f"it belongs to another user (uid {st.st_uid})"
    if not os.access(root, os.W_OK | os.X_OK):
        return "you cannot write in it"
    return None


def _make_run(root: str) -> tuple[str | None, str | None]:
    """A new run directory in ``root``, with its marker: (path, None), or (None, problem)."""
    path = os.path.join(root, f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{next(_RUNS)}")
    try:
        os.mkdir(path, 0o700)
    except OSError as e:
        return None, f"a run directory cannot be made in it ({e.strerror or e})"
    try:
        fd = os.open(os.path.join(path, MARKER),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + b": libtpu's logs of one run; pallas-tune prunes it.\n")
    except OSError as e:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        return None, f"a run directory cannot be made in it ({e.strerror or e})"
    return path, None


def _warn_once(root: str, problem: str) -> None:
    if (root, problem) in _WARNED:
        return
    _WARNED.add((root, problem))
    from pallas_tune.errors import PallasTuneWarning

    given = os.environ.get(ENV, "").strip()
    where = f"{ENV}={given}" if given else f"the default log directory {root}"
    warnings.warn(PallasTuneWarning(
        f"libtpu's logs are not kept: {where} cannot hold them ({problem}); only a fatal "
        "abort's are written, to a scratch directory removed when the run ends. Point "
        f"{ENV} at a directory of yours that you can write (it is made if missing), or set "
        f"{ENV}=off to keep none without this warning."), stacklevel=3)


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
    """Cuts the files under ``path`` (not recursive; links and the run's marker never) so that
    they use at most ``bound`` bytes: files over an eighth of it are cut to that (their head:
    a writer with ``O_APPEND``, as glog's, goes on at the new end), then the oldest files are
    removed. Returns the bytes used after."""
    files = _files(path)
    used = sum(size for _, size, _ in files)
    if used <= bound:
        return used
    each = max(bound // 8, 4096)
    for name, size, _ in files:
        if size > each:
            try:
                fd = os.open(name, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
                try:
                    os.ftruncate(fd, each)
                finally:
                    os.close(fd)
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
    """(path, bytes on disk, mtime) of the regular files in ``path`` but the marker, links
    not followed."""
    out = []
    try:
        with os.scandir(path) as it:
            for entry in it:
                try:
                    if entry.name != MARKER and entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        out.append((entry.path, min(st.st_size, st.st_blocks * 512),
                                    st.st_mtime))
                except OSError:
                    continue
    except OSError:
        pass
    return out


def _ours(path: str) -> bool:
    """Whether ``path`` is a run directory pallas-tune made: a real directory (not a link) of
    this user's, named ``DATE-TIME-PID-N``, holding this user's marker file."""
    if not _RUN_NAME.match(os.path.basename(path)):
        return False
    uid = _uid()
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or (uid is not None and st.st_uid != uid):
            return False
        fd = os.open(os.path.join(path, MARKER), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            mst = os.fstat(fd)
            head = os.read(fd, len(_MAGIC))
        finally:
            os.close(fd)
    except OSError:
        return False
    return (stat.S_ISREG(mst.st_mode) and (uid is None or mst.st_uid == uid)
            and head == _MAGIC)


def _holds_logs(path: str) -> bool:
    """Whether a run directory holds anything but its marker."""
    try:
        return any(name != MARKER for name in os.listdir(path))
    except OSError:
        return True


def _remove_run(path: str) -> None:
    """Removes one run directory of ours (checked by the caller; rmtree never follows links)."""
    shutil.rmtree(path, ignore_errors=True)


def _prune_root(root: str, bound: int) -> None:
    """Removes run directories of ours (:func:`_ours`) whose processes are no longer alive:
    those holding nothing, then the oldest, past ``bound`` bytes in all; a live process's
    directory is left to its own process, and anything else in the root to its owner."""
    runs = []
    with os.scandir(root) as it:
        for entry in it:
            if entry.is_dir(follow_symlinks=False) and _ours(entry.path):
                size = sum(s for _, s, _ in _files(entry.path))
                runs.append((entry.stat(follow_symlinks=False).st_mtime, entry.path, size,
                             _owner_alive(entry.name)))
    total = sum(r[2] for r in runs)
    for _, path, size, alive in sorted(runs):
        if not alive and (total > bound or not _holds_logs(path)):
            _remove_run(path)
            total -= size


def _owner_alive(name: str) -> bool:
    """Whether the process a run directory is named after (``DATE-TIME-PID-N``) is alive."""
    m = _RUN_NAME.match(name)
    if m is None:
        return True  # Not ours to judge.
    try:
        os.kill(int(m.group(1)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True
