"""``pallas-tune sweep --program MODULE:FN --shapes SPEC``: tune every tunable call of a whole
program (a training or serving step) at once, through :func:`pallas_tune.autotune`.

The shape spec gives ``FN``'s own arguments (``"x=2048x4096:bfloat16,w=4096x14336:bfloat16"``);
each call the program traces is tuned unless its key has an entry, and written to the cache
like any sweep. A table of the calls follows: kernel, key, config, source (cache or tuned),
implementation (Pallas or XLA), and the default's and the tuned time from the same ranking.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pallas_tune.cli.shapes import CLIUsageError

if TYPE_CHECKING:
    from pallas_tune.cli.edge import SweepRequest

__all__ = ["cmd_program", "program_args"]


def program_args(fn: Any, spec: str) -> tuple[list[Any], dict[str, Any]]:
    """``FN``'s arguments from a shape spec (arrays as ShapeDtypeStructs, statics as given),
    bound to its signature; a usage error names what does not fit."""
    import jax
    import jax.numpy as jnp

    from pallas_tune.cli.shapes import _dtype_hint, _parse

    values = {}
    for name, p in _parse(spec).items():
        if p[0] == "array":
            try:
                values[name] = jax.ShapeDtypeStruct(p[1], jnp.dtype(p[2]))
            except TypeError:
                raise CLIUsageError(f"unknown dtype {p[2]!r} in {spec!r}"
                                    f"{_dtype_hint(p[2])}") from None
        elif p[0] == "arrays":
            values[name] = tuple(jax.ShapeDtypeStruct(x[1], jnp.dtype(x[2])) for x in p[1])
        else:
            values[name] = p[1]
    sig = inspect.signature(fn)
    try:
        bound = sig.bind(**values)
    except TypeError as e:
        raise CLIUsageError(f"--shapes {spec!r} does not fit {fn.__qualname__}{sig}: {e}"
                            ) from None
    return list(bound.args), dict(bound.kwargs)


def _load(ref: str, paths: Sequence[str]) -> Any:
    from pallas_tune import _refs
    from pallas_tune.cli.registry import check_ref, import_path, raised

    check_ref(ref, "--program")
    with import_path(paths):
        try:
            fn = _refs.load(ref)
        except (ValueError, ImportError, AttributeError) as e:
            raise CLIUsageError(f"cannot load program {ref!r}: {e} (pass --path DIR for a "
                                "module in a directory of yours)") from None
        except (Exception, KeyboardInterrupt):
            raise
        except BaseException as e:  # noqa: BLE001 - SystemExit at import: not our exit.
            raise CLIUsageError(f"cannot load program {ref!r}: importing its module raised "
                                f"{raised(e)}") from None
    if not callable(fn):
        raise CLIUsageError(f"--program {ref} is not a function (got {type(fn).__name__})")
    return fn


def _static_positions(call_args: Sequence[Any]) -> tuple[int, ...]:
    """The positions of the arguments that are not arrays (keywords pass as plain values)."""
    return tuple(i for i, a in enumerate(call_args)
                 if not hasattr(a, "shape") and not (isinstance(a, tuple) and a and all(
                     hasattr(x, "shape") for x in a)))


def cmd_program(request: SweepRequest) -> int:
    """Autotunes ``request.program`` once per shape spec, with ``request.options`` (its chip
    settled); prints each call. Exit 1 if one failed."""
    import pallas_tune as pt
    from pallas_tune.errors import DiskFullError, PallasTuneError
    from pallas_tune.step.result import ms_text

    fn = _load(request.program, request.paths)
    calls = [(spec, *program_args(fn, spec)) for spec in request.shapes]  # All checked first.
    failures = 0
    for spec, call_args, call_kwargs in calls:
        print(f"pallas-tune sweep --program {request.program}: {spec}", flush=True)
        try:  # A spec's plain values (n=2, causal=true) are FN's static arguments, as in jit.
            result = pt.autotune(fn, *call_args, options=request.options, **call_kwargs,
                                 static_argnums=_static_positions(call_args))
        except DiskFullError:
            raise
        except (PallasTuneError, ValueError) as e:
            failures += 1
            print(f"pallas-tune sweep: {spec}: FAILED: {e}", file=sys.stderr, flush=True)
            continue
        for c in result.calls:
            runs_as = f" runs as {c.effective}" if c.effective else ""
            print(f"  {c.kernel}  {c.key}\n    {c.config}{runs_as}  ({c.source}, runs "
                  f"{c.implementation}; default {ms_text(c.default_ms)} ms, tuned "
                  f"{ms_text(c.best_ms)} ms, XLA {ms_text(c.xla_ms)} ms)", flush=True)
        print(f"  {result}", flush=True)
    return 1 if failures else 0
