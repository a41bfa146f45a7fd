"""Measuring candidates in a worker process, so a hang or a crash costs one candidate.

The worker imports the kernel by reference (``module:qualname``), receives the tuning inputs as
NumPy arrays and measures one config per request with the same code as in-process measurement.
The parent waits at most ``timeout_s`` per candidate (compile included): a candidate that
overruns is recorded as ``timeout`` and the worker is killed; one that kills the worker (segfault,
abort, out of memory) is recorded as ``runtime_error`` with the exit signal. Either way a fresh
worker is started for the next candidate.

On TPU only one process may hold the chip: isolate from a process that has not initialised the
TPU backend itself (``pallas-tune sweep`` arranges that).
"""

from __future__ import annotations

import multiprocessing
import signal
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from pallas_tune.measure.timing import Measurement, Outcome

__all__ = ["IsolatedRunner"]


def _worker_main(conn: Any, ref: str, args: Sequence[Any], kwargs: Mapping[str, Any],
                 interpret: bool, env: Mapping[str, str]) -> None:
    import os

    os.environ.update(env)
    try:
        import jax
        import jax.numpy as jnp

        from pallas_tune._refs import load
        from pallas_tune.measure.timing import measure

        kernel = load(ref)
        fn = getattr(kernel, "fn", kernel)
        args = jax.tree_util.tree_map(lambda a: jnp.asarray(a) if hasattr(a, "dtype") else a,
                                      list(args))
        conn.send(("ready", None))
    except Exception:  # noqa: BLE001
        conn.send(("error", traceback.format_exc(limit=5)))
        return
    reference = None
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            return
        if msg[0] == "reference":
            reference = msg[1]
            continue
        if msg[0] == "retime":
            from pallas_tune.measure.timing import retime_interleaved

            try:
                conn.send(("result", retime_interleaved(fn, args, kwargs, msg[1],
                                                        interpret=interpret, rounds=msg[2])))
            except Exception:  # noqa: BLE001
                conn.send(("error", traceback.format_exc(limit=5)))
            continue
        _, config, options, want_output = msg
        outcome, m, out, err, max_err = measure(fn, args, {**kwargs, **config},
                                                interpret=interpret, reference_out=reference,
                                                **options)
        out_np = None
        if want_output and out is not None:
            out_np = jax.tree_util.tree_map(lambda x: __import__("numpy").asarray(x), out)
        conn.send(("result", (outcome.value, m, out_np, err, max_err)))


class IsolatedRunner:
    """Runs ``measure`` for one kernel and one set of inputs in a restartable worker process."""

    def __init__(self, ref: str, args: Sequence[Any], kwargs: Mapping[str, Any], *,
                 interpret: bool, timeout_s: float | None, env: Mapping[str, str] | None = None):
        import jax
        import numpy as np

        self._ref = ref
        self._args = jax.tree_util.tree_map(
            lambda a: np.asarray(a) if hasattr(a, "dtype") else a, list(args))
        self._kwargs = dict(kwargs)
        self._interpret = interpret
        self._timeout = timeout_s
        self._env = dict(env or {})
        self._ctx = multiprocessing.get_context("spawn")
        self._proc: Any = None
        self._conn: Any = None
        self._reference: Any = None
        self.restarts = 0

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(
            target=_worker_main, daemon=True,
            args=(child, self._ref, self._args, self._kwargs, self._interpret, self._env))
        self._proc.start()
        child.close()
        self._conn = parent
        if not self._conn.poll(600):
            self._kill()
            raise RuntimeError("the measurement worker did not start within 600 s")
        kind, payload = self._conn.recv()
        if kind != "ready":
            self._kill()
            raise RuntimeError(f"the measurement worker could not load {self._ref}:\n{payload}")
        if self._reference is not None:
            self._conn.send(("reference", self._reference))

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
        self._proc = None
        self._conn = None

    def set_reference(self, out: Any) -> None:
        self._reference = out
        if self._conn is not None:
            self._conn.send(("reference", out))

    def measure(self, config: Mapping[str, Any], *, want_output: bool, **options: Any
                ) -> tuple[Outcome, Measurement | None, Any, str, float | None]:
        if self._proc is None or not self._proc.is_alive():
            if self._proc is not None:
                self.restarts += 1
            self._start()
        self._conn.send(("measure", dict(config), options, want_output))
        start = time.perf_counter()
        try:
            ready = self._conn.poll(self._timeout)
        except (EOFError, OSError):
            ready = True
        if not ready:
            self._kill()
            self.restarts += 1
            return (Outcome.TIMEOUT, None, None,
                    f"no result within timeout_s={self._timeout} (compile and run); the worker "
                    "was killed", None)
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            code = self._proc.exitcode if self._proc is not None else None
            if self._proc is not None:
                self._proc.join(10)
                code = self._proc.exitcode
            self._kill()
            self.restarts += 1
            return (Outcome.RUNTIME_ERROR, None, None,
                    f"the measurement worker died {_describe_exit(code)} after "
                    f"{time.perf_counter() - start:.1f} s", None)
        outcome, m, out, err, max_err = payload
        return Outcome(outcome), m, out, err, max_err

    def retime(self, configs: Sequence[Mapping[str, Any]], rounds: int) -> list[list[float]] | None:
        """Interleaved re-timing in the worker; None if it fails or overruns."""
        if self._proc is None or not self._proc.is_alive():
            self._start()
        self._conn.send(("retime", [dict(c) for c in configs], rounds))
        timeout = None if self._timeout is None else self._timeout * (len(configs) + 1)
        try:
            if not self._conn.poll(timeout):
                self._kill()
                return None
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self._kill()
            return None
        return payload if kind == "result" else None

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        if self._proc is not None:
            self._proc.join(5)
        self._kill()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "(exit status unknown)"
    if code < 0:
        try:
            return f"from signal {signal.Signals(-code).name}"
        except ValueError:
            return f"from signal {-code}"
    return f"with exit code {code}"
