"""Reading a file that may be hostile: never more than a limit, whatever the file is.

Every file pallas-tune reads whole goes through :func:`read_fd` (winners files at trace time)
or :func:`read_path` (the command line's ``@FILE``, ``--from-record``, ``--space``): at most
``cap + 1`` bytes are read, so ``/dev/zero``, a pipe that never closes or a sparse 1 TB file
costs ``cap`` bytes of memory, not all of it. The caller gets the limit from
``pallas_tune._settings.max_file_bytes()`` (``PALLAS_TUNE_MAX_FILE_MB``). A path is opened
without blocking, so a FIFO no program writes to is refused after ``FIFO_WAIT_S`` seconds
(:class:`NoWriterError`) rather than waited on forever; a pipe with a writer (``<(cmd)``, a FIFO
a program has open) is read to its end as before.
"""

from __future__ import annotations

import os
import stat

from pallas_tune.errors import InputTooLargeError

__all__ = ["FIFO_WAIT_S", "NoWriterError", "read_fd", "read_path", "too_large"]

_CHUNK = 1 << 24
FIFO_WAIT_S = 5.0  # How long a FIFO nothing writes to is waited for before it is refused.


class NoWriterError(OSError):
    """A FIFO (named pipe) given as a file has no writer: reading it would wait forever."""

    def __str__(self) -> str:
        return str(self.strerror)


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
            st: os.stat_result | None = None, head: bytes = b"") -> bytes:
    """All of ``fd``'s bytes (after ``head``, what was read of it already), at most ``cap``.
    Raises :class:`InputTooLargeError` (before reading anything when ``st`` says a regular
    file is too large), or OSError."""
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_size > cap:
        raise too_large(what, path, cap, st.st_size)
    chunks, n = [head], len(head)
    while n <= cap:
        chunk = os.read(fd, min(_CHUNK, cap + 1 - n))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        n += len(chunk)
    size = st.st_size if st is not None and stat.S_ISREG(st.st_mode) and st.st_size > cap \
        else None
    raise too_large(what, path, cap, size)


def read_path(path: str, cap: int, *, what: str, fifo_wait_s: float = FIFO_WAIT_S) -> bytes:
    """The bytes of ``path`` (a file, or anything ``open`` reads: ``/dev/stdin``, a pipe given
    as ``<(cmd)``), at most ``cap``. Raises :class:`InputTooLargeError`, or OSError (a
    directory is IsADirectoryError; a FIFO nothing writes to within ``fifo_wait_s`` is
    :class:`NoWriterError`, rather than a wait forever)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # A FIFO: no wait here.
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, "Is a directory", path)
        head = (_first_bytes(fd, path, what, cap, fifo_wait_s) if stat.S_ISFIFO(st.st_mode)
                else b"")
        os.set_blocking(fd, True)
        return read_fd(fd, cap, what=what, path=path, st=st, head=head)
    finally:
        os.close(fd)


def _first_bytes(fd: int, path: str, what: str, cap: int, wait_s: float) -> bytes:
    """What a pipe or FIFO opened without blocking holds now: some bytes, or b"" when a writer
    has it open (the caller then waits for it, as for any pipe) or had it and closed it.
    Nothing and no writer (a FIFO no program writes to): a writer is waited for ``wait_s`` at
    most, then :class:`NoWriterError`."""
    import select

    n = min(_CHUNK, cap + 1)
    try:
        head = os.read(fd, n)
    except BlockingIOError:  # Empty, and a writer has it open: a pipe being written.
        return b""
    if head:
        return head
    # Nothing and no writer: written and closed empty, or not opened by any writer yet.
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.poll(wait_s * 1000)  # Until data comes, or a writer that came closes it.
    try:
        head = os.read(fd, n)
    except BlockingIOError:  # A writer came and has written nothing yet: wait for it.
        return b""
    if head or poller.poll(0):  # Data; or a writer came and closed it empty.
        return head
    raise NoWriterError(
        6, f"{what} {path} is a FIFO with no writer (nothing opened it for writing within "
           f"{wait_s:g} s); start the program that writes it first, or give a regular file",
        path)
