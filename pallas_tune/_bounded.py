"""Reading a file that may be hostile: never more than a limit, whatever the file is.

Every file pallas-tune reads whole goes through :func:`read_fd` (winners files at trace time)
or :func:`read_path` (the command line's ``@FILE``, ``--from-record``, ``--space``): at most
``cap + 1`` bytes are read, so ``/dev/zero``, a pipe that never closes or a sparse 1 TB file
costs ``cap`` bytes of memory, not all of it. The caller gets the limit from
``pallas_tune._settings.max_file_bytes()`` (``PALLAS_TUNE_MAX_FILE_MB``).
"""

from __future__ import annotations

import os
import stat

from pallas_tune.errors import InputTooLargeError

__all__ = ["read_fd", "read_path", "too_large"]

_CHUNK = 1 << 24


def too_large(what: str, path: str, cap: int, size: int | None = None) -> InputTooLargeError:
    """The error for ``path`` being over ``cap`` bytes (``size``: its size, None if it has no
    end, such as a device or a pipe), naming the file, the size, the limit and the knob."""
    mib = cap / 2**20
    if size is None:
        found = f"more than {mib:g} MiB (it did not end there: a device or a pipe?)"
        raise_to = ""
    else:
        found = f"{size} bytes ({size / 2**20:.1f} MiB)"
        raise_to = f"={-(-size // 2**20)}"
    return InputTooLargeError(
        f"{what} {path} is {found}, over pallas-tune's limit of {mib:g} MiB for one file; "
        f"if it is right, raise the limit with PALLAS_TUNE_MAX_FILE_MB{raise_to or '=<MiB>'}")


def read_fd(fd: int, cap: int, *, what: str, path: str,
            st: os.stat_result | None = None) -> bytes:
    """All of ``fd``'s bytes, at most ``cap``. Raises :class:`InputTooLargeError` (before
    reading anything when ``st`` says a regular file is too large), or OSError."""
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_size > cap:
        raise too_large(what, path, cap, st.st_size)
    chunks, n = [], 0
    while n <= cap:
        chunk = os.read(fd, min(_CHUNK, cap + 1 - n))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        n += len(chunk)
    size = st.st_size if st is not None and stat.S_ISREG(st.st_mode) and st.st_size > cap \
        else None
    raise too_large(what, path, cap, size)


def read_path(path: str, cap: int, *, what: str) -> bytes:
    """The bytes of ``path`` (a file, or anything ``open`` reads: ``/dev/stdin``, a pipe given
    as ``<(cmd)``), at most ``cap``. Raises :class:`InputTooLargeError`, or OSError (a
    directory is IsADirectoryError)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, "Is a directory", path)
        return read_fd(fd, cap, what=what, path=path, st=st)
    finally:
        os.close(fd)
