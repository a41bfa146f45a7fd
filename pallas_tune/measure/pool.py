"""Worker processes that evaluate candidates: the one pool mechanism of pallas-tune.

A worker is a fresh Python process (``subprocess``, not ``multiprocessing``: it never re-imports
the caller's ``__main__``, starts no resource tracker, and a script without an
``if __name__ == "__main__":`` guard works) hosting a *session*: an object built once from
picklable arguments (a kernel reference, the inputs, the settings) whose methods the parent
calls by name. While a method runs it reports its phase (``trace``, ``check``, ``compile``,
``run``); each phase has its own time limit. A worker that overruns is killed (its whole process
group), one that dies (abort, segfault, out of memory) is noticed by its pipe closing; either way
the call returns a :class:`Reply` saying so, with the tail of the worker's output, and a fresh
worker takes the next call.

Workers die with their parent: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux, and everywhere a
watchdog thread that exits when the parent's pid changes. They ignore SIGINT and SIGTERM, so
Ctrl-C in a terminal, or a scheduler's SIGTERM to the process group, is handled by the parent
alone, which kills them when it closes the pool.
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Pipe, wait
from typing import Any, Final

from pallas_tune.measure.child import Channel, importing_main_script, off_path_modules
from pallas_tune.measure.logs import RunLogs, cut_output

__all__ = ["Channel", "Pool", "Reply", "WorkerStartError", "importing_main_script",
           "worker_memory_limit"]

# How long a new worker may take to import JAX, the kernel and build its session.
STARTUP_S: Final = 600.0
_TAIL_BYTES: Final = 3000
_OUTPUT_BYTES: Final = 8 * 2**20  # A worker's captured stdout and stderr, at most.
_LOOK_S: Final = 1.0  # How often the parent bounds logs while workers run.


class WorkerStartError(RuntimeError):
    """A worker could not start its session (the message says why: its traceback, or a
    script that starts tuning when imported)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Reply:
    """How one call ended: ``done`` (``value`` is the result), ``error`` (the session raised;
    ``message`` holds the traceback), ``timeout`` or ``crashed`` (the worker was replaced)."""

    kind: str
    value: Any = None
    phase: str = ""
    seconds: float = 0.0
    message: str = ""


@dataclasses.dataclass(slots=True)
class _Job:
    index: int
    method: str
    args: tuple[Any, ...]
    phase: str


def safe_path_env(cwd: str | None = None) -> dict[str, str]:
    """``PYTHONSAFEPATH=1`` for a worker unless this process's pallas_tune lives in ``cwd``.

    A worker starts with ``python -c``, which puts the working directory first on its path:
    run from a source checkout while the installed wheel is the one imported (a lent GPU
    machine, a CI job), the worker imported the checkout's pallas_tune, which has no
    ``pallas_tune.kernels`` without an install, and every worker failed to start."""
    # This file is pallas_tune/measure/pool.py: the directory holding pallas_tune.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    here = os.path.abspath(cwd or os.getcwd())
    return {} if root == here else {"PYTHONSAFEPATH": "1"}


class _Worker:
    """One child process and the parent's end of its pipe."""

    def __init__(self, spec: _Spec):
        self.spec = spec
        self.log = tempfile.TemporaryFile(prefix="pallas-tune-worker-")
        # The child appends (the flag is the open file's, shared through the fd it inherits),
        # so the parent can cut the file (logs.cut_output) while the child writes.
        fcntl.fcntl(self.log.fileno(), fcntl.F_SETFL,
                    fcntl.fcntl(self.log.fileno(), fcntl.F_GETFL) | os.O_APPEND)
        parent, child = Pipe(duplex=True)
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1", **safe_path_env()}
        code = "from pallas_tune.measure.child import _child_main; _child_main()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, str(child.fileno()), str(os.getpid())],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, stdout=self.log,
            stderr=subprocess.STDOUT, env=env, start_new_session=True, close_fds=True)
        child.close()
        self.conn = parent
        self.info: dict[str, Any] | None = None
        self.job: _Job | None = None
        self.started = time.perf_counter()
        self.phase_deadline = float("inf")
        path = [p or os.getcwd() for p in sys.path]  # The parent's, where the kernel may be.
        self.conn.send((spec.factory, spec.args, spec.memory_limit, spec.main_path, path,
                        off_path_modules(path)))

    def wait_ready(self, replay: Sequence[tuple[str, tuple[Any, ...]]]) -> dict[str, Any]:
        if self.info is not None:
            return self.info
        try:
            ok = self.conn.poll(self.spec.startup_s)
            msg = self.conn.recv() if ok else None
        except (EOFError, OSError):
            msg = None
        if msg is None or msg[0] != "ready":
            why = msg[1] if msg else (f"no answer within {self.spec.startup_s:g} s" if self.alive()
                                      else self.exit_text())
            self.kill()
            raise WorkerStartError(f"{why}\n{self.tail()}".strip())
        self.info = msg[1]
        for method, args in replay:
            self.call_now(method, args)
        return self.info

    def call_now(self, method: str, args: tuple[Any, ...]) -> Any:
        """A quick call outside any job (no time limit), e.g. to hand over a reference."""
        self.conn.send((method, args))
        while True:
            kind, value = self.conn.recv()
            if kind == "done":
                return value
            if kind in ("error", "failed"):
                raise WorkerStartError(f"{method} failed in a worker: {value}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_text(self) -> str:
        try:
            code = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            return "(exit status unknown)"
        if code < 0:
            try:
                return f"from signal {signal.Signals(-code).name}"
            except ValueError:
                return f"from signal {-code}"
        return f"with exit code {code}"

    def tail(self) -> str:
        try:
            self.log.flush()
            size = self.log.seek(0, os.SEEK_END)
            self.log.seek(max(0, size - _TAIL_BYTES))
            text = self.log.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return ""
        return f"worker output (last lines):\n{text}" if text else ""

    def kill(self) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
            self.proc.wait(5)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        self.kill()
        self.log.close()


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Spec:
    factory: str  # "module:qualname" of the session class (or factory function).
    args: tuple[Any, ...]
    env: Mapping[str, str]
    memory_limit: int | None
    main_path: str | None
    startup_s: float


class Pool:
    """Up to ``size`` workers, each hosting ``factory(*args)``.

    ``limits`` maps a phase name to its time limit in seconds (None or missing: no limit).
    ``env`` is set in each worker before it imports anything; ``memory_limit`` caps each
    worker's address space; ``main_path`` is the parent's script, imported by each worker
    (as ``__mp_main__``, so its guarded part does not run) when the session needs objects
    defined there. Not thread-safe: call it from one thread."""

    def __init__(self, factory: str, args: tuple[Any, ...], *, size: int = 1,
                 limits: Mapping[str, float | None] | None = None,
                 env: Mapping[str, str] | None = None, memory_limit: int | None = None,
                 main_path: str | None = None, startup_s: float = STARTUP_S):
        self.logs = RunLogs()  # libtpu's logs of these workers: a directory of their own.
        self._spec = _Spec(factory=factory, args=args, env={**(env or {}), **self.logs.env},
                           memory_limit=memory_limit, main_path=main_path, startup_s=startup_s)
        self.size = max(1, size)
        self.limits = dict(limits or {})
        self._workers: list[_Worker] = []
        self._replay: list[tuple[str, tuple[Any, ...]]] = []
        self.restarts = 0
        self.info: dict[str, Any] = {}

    def start(self) -> dict[str, Any]:
        """Starts the workers; returns what the first one's session reported (``info()``)."""
        while len(self._workers) < self.size:
            self._workers.append(_Worker(self._spec))
        for w in self._workers:
            self.info = self.info or w.wait_ready(self._replay)
        return self.info

    def remember(self, method: str, *args: Any) -> None:
        """Calls ``method(*args)`` on every worker now and on each one started later."""
        self._replay.append((method, args))
        for w in self._workers:
            if w.info is not None and w.job is None:
                w.call_now(method, args)

    def retarget(self, method: str, *args: Any) -> None:
        """Forgets what :meth:`remember` replays, then remembers ``method(*args)``: a pool kept
        for a new job (a worker started later sets up for that job alone)."""
        self._replay.clear()
        self.remember(method, *args)

    def call(self, method: str, *args: Any, phase: str = "run",
             answer: Callable[[Any], Any] | None = None) -> Reply:
        """One call on one worker (see :meth:`map`)."""
        return self.map([(method, args, phase)], answer=answer)[0]

    def map(self, calls: Sequence[tuple[str, tuple[Any, ...], str]], *,
            answer: Callable[[Any], Any] | None = None) -> list[Reply]:
        """Runs each ``(method, args, first phase)`` on some worker, in parallel over the pool;
        ``answer(question)`` answers a session's :meth:`Channel.ask`. One Reply per call."""
        queue = collections.deque(_Job(i, m, a, p) for i, (m, a, p) in enumerate(calls))
        replies: list[Reply | None] = [None] * len(calls)
        while queue or any(w.job for w in self._workers):
            self._assign(queue)
            busy = [w for w in self._workers if w.job is not None]
            timeout = max(0.0, min(w.phase_deadline for w in busy) - time.perf_counter())
            ready = wait([w.conn for w in busy], min(timeout, _LOOK_S))
            self._bound_logs()
            for w in busy:
                if w.conn in ready:
                    self._receive(w, replies, answer)
                elif time.perf_counter() >= w.phase_deadline:
                    self._finish(w, replies, "timeout", message=(
                        f"no result within the {w.job.phase} limit of "
                        f"{self.limits.get(w.job.phase):g} s; the worker was killed"))
        return replies  # type: ignore[return-value]

    def _assign(self, queue: collections.deque[_Job]) -> None:
        self._workers = [w for w in self._workers if w.alive() or w.job is not None]
        while len(self._workers) < self.size:
            self._workers.append(_Worker(self._spec))
        for i, w in enumerate(self._workers):
            if not queue:
                return
            if w.job is None:
                try:
                    w.wait_ready(self._replay)
                except WorkerStartError:
                    if not self.info:
                        raise
                    # A replacement that fails to start (e.g. the device not yet released by
                    # the worker just killed) gets one more try.
                    time.sleep(2.0)
                    w = self._workers[i] = _Worker(self._spec)
                    w.wait_ready(self._replay)
                job = queue.popleft()
                w.job = job
                w.started = time.perf_counter()
                self._set_phase(w, job.phase)
                w.conn.send((job.method, job.args))

    def _set_phase(self, w: _Worker, phase: str) -> None:
        w.job.phase = phase  # type: ignore[union-attr]
        limit = self.limits.get(phase)
        w.phase_deadline = time.perf_counter() + limit if limit else float("inf")

    def _receive(self, w: _Worker, replies: list[Reply | None],
                 answer: Callable[[Any], Any] | None) -> None:
        while w.job is not None:
            try:
                if not w.conn.poll():
                    return
                kind, value = w.conn.recv()
            except (EOFError, OSError):
                self._finish(w, replies, "crashed",
                             message=f"the worker died {w.exit_text()} during {w.job.phase}")
                return
            if kind == "phase":
                self._set_phase(w, value)
            elif kind == "ask":
                w.conn.send(("answer", answer(value) if answer else None))
            else:
                self._finish(w, replies, kind, value=value if kind == "done" else None,
                             message=value if kind == "error" else "")

    def _finish(self, w: _Worker, replies: list[Reply | None], kind: str, *, value: Any = None,
                message: str = "") -> None:
        job = w.job
        assert job is not None
        if kind in ("timeout", "crashed"):
            w.kill()
            tail = w.tail()
            message = f"{message}\n{tail}".strip() if tail else message
            self._bound_logs(now=True)
            if self.logs.note():
                message = f"{message}\n{self.logs.note()}"
            self.restarts += 1
            w.log.close()
            # Start the replacement now: it boots while the parent goes on.
            self._workers[self._workers.index(w)] = _Worker(self._spec)
        replies[job.index] = Reply(kind=kind, value=value, phase=job.phase, message=message,
                                   seconds=time.perf_counter() - w.started)
        w.job = None

    def _bound_logs(self, now: bool = False) -> None:
        """Keeps libtpu's logs and each worker's captured output within their bounds."""
        if self.logs.due(now):
            self.logs.enforce()
            for w in self._workers:
                cut_output(w.log.fileno(), _OUTPUT_BYTES)

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []
        self.logs.enforce()
        self.logs.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def worker_memory_limit(workers: int, limit: int | None, total: int | None = None) -> int | None:
    """Each worker's RLIMIT_AS: ``limit`` unless it is -1 (the default), then the host's memory
    less a reserve for the parent and the system (an eighth, at least 2 GiB), split between the
    workers. The cap counts address space, not resident memory: a libtpu compile reserves about
    2 GB more than it touches (measured: 12.3 GB mapped at 10.6 GB resident, Mamba-2 SSD at
    1x8192), so a cap of half a 24 GiB host failed compiles that fit in it."""
    if limit != -1:
        return limit
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    reserve = max(2 << 30, total // 8)
    return max(4 << 30, (total - reserve) // max(1, workers))
