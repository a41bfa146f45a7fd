"""The worker's side of :mod:`pallas_tune.measure.pool`: a fresh process that builds its
session, then runs the parent's calls on it, reporting phases and asking questions over its
pipe (:class:`Channel`)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["Channel", "importing_main_script", "off_path_modules"]

_BOOTSTRAPPING = False  # True in a worker while it imports the parent's __main__ script.


def importing_main_script() -> bool:
    """True inside a worker that is importing the parent's script to find a kernel defined
    there. Code that would start tuning at that moment must not (it would recurse)."""
    return _BOOTSTRAPPING


class Channel:
    """The session's line to the parent during a call: report phases, ask questions."""

    def __init__(self, conn: Connection | None = None,
                 answer: Callable[[Any], Any] | None = None):
        self._conn = conn
        self._answer = answer
        self.phase_name = ""

    def phase(self, name: str) -> None:
        """Starts a new phase: the parent applies that phase's time limit from now on."""
        self.phase_name = name
        if self._conn is not None:
            self._conn.send(("phase", name))

    def ask(self, question: Any) -> Any:
        """Asks the parent (e.g. whether a program was evaluated already) and waits."""
        if self._conn is None:
            return self._answer(question) if self._answer is not None else None
        self._conn.send(("ask", question))
        kind, answer = self._conn.recv()
        assert kind == "answer", kind
        return answer



def off_path_modules(path: list[str]) -> dict[str, str]:
    """The parent's top-level modules that no entry of ``path`` holds (those the CLI imported
    from a ``--path`` directory, which it never puts on sys.path), by name: the directory a
    worker imports each from, for those names only, after every other finder."""
    here = {os.path.realpath(p) for p in path}
    out = {}
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if "." in name or spec is None or not spec.has_location or not spec.origin:
            continue
        where = os.path.dirname(spec.origin)
        if spec.submodule_search_locations is not None:  # A package: the folder holding it.
            where = os.path.dirname(where)
        if os.path.realpath(where) not in here and name != "__main__":
            out[name] = where
    return out


class _OffPathFinder:
    """Finds exactly the modules :func:`off_path_modules` names, each in its directory."""

    def __init__(self, where: dict[str, str]):
        self.where = where

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        del path, target  # Top-level names only.
        if name not in self.where:
            return None
        import importlib.machinery

        return importlib.machinery.PathFinder.find_spec(name, [self.where[name]])

    def invalidate_caches(self) -> None:
        pass


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # The parent died before prctl took effect.
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="pallas-tune-parent-watch", daemon=True).start()


def _import_main(path: str) -> None:
    """Imports the parent's script as ``__mp_main__`` (its ``__main__`` guard stays shut)."""
    global _BOOTSTRAPPING
    import importlib.util

    spec = importlib.util.spec_from_file_location("__mp_main__", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the script {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["__mp_main__"] = module
    sys.modules["__main__"] = module
    _BOOTSTRAPPING = True
    try:
        spec.loader.exec_module(module)
    finally:
        _BOOTSTRAPPING = False


def _child_main() -> None:
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    _die_with_parent(parent)
    # Ctrl-C and a scheduler's SIGTERM reach the whole process group: the parent handles them
    # (saves, exits) and its workers die with it, rather than die first as a failed candidate.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(fd)
    factory, args, memory_limit, main_path, path, extra = conn.recv()
    sys.path[:] = path + [p for p in sys.path if p not in path]
    if extra:
        sys.meta_path.append(_OffPathFinder(extra))
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # libtpu's abort would dump core.
        if memory_limit:
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
        if main_path:
            _import_main(main_path)
        from pallas_tune._refs import load

        session = load(factory)(*args)
        conn.send(("ready", session.info()))
    except BaseException as e:  # noqa: BLE001 - report why, then exit.
        text = str(e) if getattr(e, "unguarded_script", False) else traceback.format_exc(limit=8)
        conn.send(("failed", text))
        return
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        method, args = msg
        channel = Channel(conn)
        try:
            result = getattr(session, method)(*args, channel=channel)
        except BaseException:  # noqa: BLE001 - a bug in a session is reported, not fatal.
            conn.send(("error", traceback.format_exc(limit=8)))
            continue
        conn.send(("done", result))
