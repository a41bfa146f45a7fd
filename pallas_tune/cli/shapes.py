"""``--shapes`` specs: read, checked against the kernel's signature and reference before any
kernel is traced, and turned into the call's ``ShapeDtypeStruct`` arguments."""

from __future__ import annotations

import functools
import inspect
import math
import os
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["CLIUsageError", "build_call", "check_specs", "example_spec", "read_shapes",
           "read_text", "spec_items"]

_ARRAYISH = re.compile(r"[0-9][0-9A-Za-z]*(x[0-9A-Za-z]*)*(:.*)?")


class CLIUsageError(Exception):
    """Bad command-line input; printed without a traceback, exit status 2."""


# A dtype name after the colon of an unquoted value: the value was meant as an array.
_DTYPEISH = re.compile(r"[^\"]*:(bool|u?int\d+|b?float\d+\w*|complex\d+)")
MAX_SPEC_CHARS = 10_000  # Longer specs are not shapes (and would flood the terminal).
MAX_DIM = 2**31 - 1
MAX_ELEMENTS = 2**40  # Elements, and bytes: no device holds a TiB in one array.


def check_specs(specs: Sequence[str]) -> None:
    """Validates --shapes syntax before any kernel module is imported."""
    for spec in specs:
        _parse(spec)


def _parse(spec: str) -> dict[str, Any]:
    from pallas_tune import keys

    if len(spec) > MAX_SPEC_CHARS:
        raise CLIUsageError(f"--shapes {spec[:60]!r}... is {len(spec)} characters long, over "
                            f"{MAX_SPEC_CHARS}: not a shape spec")
    try:
        parsed = keys.parse_key(spec)
    except ValueError as e:
        raise CLIUsageError(f"--shapes {spec!r}: {e}") from None
    for name, p in parsed.items():
        why = _problem(name, p)
        if why is not None:
            raise CLIUsageError(f"--shapes {spec!r}: {why}; an array is written "
                                f"name=DIMS:DTYPE, e.g. {name}=1024x1024:bfloat16")
    return parsed


def _problem(name: str, p: Any) -> str | None:
    """What is wrong with one parsed item of a spec (an array's dims), or None."""
    if p[0] == "arrays":
        return next((w for w in (_problem(name, x) for x in p[1]) if w is not None), None)
    if p[0] == "array":
        dims = "x".join(map(str, p[1]))
        if any(d < 1 for d in p[1]):
            return f"{name}={dims}:{p[2]}: every dim must be at least 1"
        if any(d > MAX_DIM for d in p[1]) or math.prod(p[1]) > MAX_ELEMENTS:
            return (f"{name}={dims[:80]}:{p[2]} has more elements than any device could hold "
                    f"(the most: 2**40 elements, 2**31-1 per dim)")
        return None
    text = p[1]
    if text == "":
        return f"{name}= has no value"
    if not isinstance(text, str):
        return None
    if ("x" in text or ":" in text) and _ARRAYISH.fullmatch(text) or _DTYPEISH.fullmatch(text):
        dims, _, dtype = text.partition(":")
        if dtype and not all(d.isdigit() for d in dims.split("x")):
            return f"{name}={text}: dims {dims!r} must be whole numbers separated by 'x'"
        if not dtype:
            return f"{name}={text}: it has no dtype: write {name}={dims}:float32 (or " \
                   "bfloat16, int8, ...)"
        return f"{name}={text}: it is neither an array spec nor a plain value"
    return None


def example_spec(kernel: Any) -> str:
    """A spec of the right form for ``kernel``: its untuned arguments without defaults."""
    tuned = set(kernel.space.names)
    parts = [f"{n}=1024x1024:float32" for n, p in kernel.signature.parameters.items()
             if n not in tuned and p.default is inspect.Parameter.empty
             and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return ",".join(parts) or "(no array arguments)"


def build_call(kernel: Any, spec: str) -> tuple[list[Any], dict[str, Any]]:
    """Turns ``"x=1024x1024:bfloat16,causal=true"`` into (args, kwargs) of ShapeDtypeStructs,
    checked against the kernel's signature and (abstractly, never run) its reference."""
    import jax
    import jax.numpy as jnp

    parsed = _parse(spec)

    def materialize(p: Any) -> Any:
        if p[0] == "array":
            try:
                dtype = jnp.dtype(p[2])
            except TypeError:
                raise CLIUsageError(f"unknown dtype {p[2]!r} in {spec!r}"
                                    f"{_dtype_hint(p[2])}") from None
            if math.prod(p[1]) * dtype.itemsize > MAX_ELEMENTS:
                raise CLIUsageError(f"--shapes {spec!r}: an array of {p[1]} {dtype.name} is "
                                    f"over {MAX_ELEMENTS} bytes (1 TiB), more than any device "
                                    "holds")
            return jax.ShapeDtypeStruct(p[1], dtype)
        if p[0] == "arrays":
            return tuple(materialize(x) for x in p[1])
        return p[1]

    values = {name: materialize(p) for name, p in parsed.items()}
    sig = kernel.signature
    hint = f"; a right spec looks like {example_spec(kernel)!r}"
    tuned = set(kernel.space.names)
    named_tuned = sorted(tuned.intersection(values))
    if named_tuned:
        raise CLIUsageError(f"--shapes {spec!r} sets {', '.join(named_tuned)}, which "
                            f"{kernel.name} tunes: give only its arguments{hint}")
    try:
        bound = sig.bind_partial(**values)
    except TypeError as e:
        raise CLIUsageError(f"--shapes {spec!r} does not fit {kernel.name}{sig}: {e}{hint}"
                            ) from None
    missing = [n for n, p in sig.parameters.items()
               if n not in tuned and n not in values and p.default is inspect.Parameter.empty
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing:
        raise CLIUsageError(f"--shapes {spec!r} does not fit {kernel.name}{sig}: missing "
                            f"{', '.join(missing)}{hint}")
    args, kwargs = list(bound.args), dict(bound.kwargs)
    if kernel.reference is not None:
        try:
            jax.eval_shape(functools.partial(kernel.reference, **kwargs), *args)
        except Exception as e:  # noqa: BLE001  Any refusal of the reference is the spec's fault.
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise CLIUsageError(f"--shapes {spec!r}: {kernel.name}'s reference refuses these "
                                f"shapes ({type(e).__name__}: {first}){hint}") from None
    return args, kwargs


def spec_items(spec: Any) -> str:
    """A shapes entry from a TOML file (a table) -> the --shapes string form."""
    if isinstance(spec, str):
        return spec
    parts = []
    for k, v in spec.items():
        if isinstance(v, bool):
            v = "true" if v else "false"
        parts.append(f"{k}={v}")
    return ",".join(parts)


def read_text(path: str, what: str, *, errors: str = "strict") -> str:
    """A file named on the command line, as text: at most ``PALLAS_TUNE_MAX_FILE_MB`` of it
    (``/dev/zero`` or an endless pipe is refused after that). Raises CLIUsageError."""
    from pallas_tune import _bounded, _settings
    from pallas_tune.errors import InputTooLargeError

    try:
        raw = _bounded.read_path(path, _settings.max_file_bytes(), what=what)
    except (InputTooLargeError, _bounded.NoWriterError) as e:
        raise CLIUsageError(str(e)) from None
    except OSError as e:
        raise CLIUsageError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    except ValueError:  # A NUL in the name.
        raise CLIUsageError(f"{what} {path!r} is not a file name") from None
    try:
        return raw.decode("utf-8", errors)
    except UnicodeDecodeError as e:
        raise CLIUsageError(f"{what} {path} is not UTF-8 text (byte {e.start}); give a text "
                            "file") from None


def read_shapes(given: Sequence[str] | None) -> list[str]:
    """The ``--shapes`` values given (None: the flag never was), each ``@FILE`` (or the name
    of a file, without ``=``) replaced by the file's lines that are not blank or comments."""
    specs: list[str] = []
    for s in given or []:
        if s.startswith("@") or (os.path.isfile(s) and "=" not in s):
            path = s.lstrip("@")
            text = read_text(path, "shapes file")
            specs += [ln.strip() for ln in text.splitlines()
                      if ln.strip() and not ln.startswith("#")]
        else:
            specs.append(s)
    return specs


_DTYPE_ALIASES = {"bf16": "bfloat16", "f32": "float32", "fp32": "float32", "f16": "float16",
                  "fp16": "float16", "half": "float16", "f64": "float64", "i8": "int8",
                  "i32": "int32", "u8": "uint8", "fp8": "float8_e4m3fn"}
_DTYPES = ("bfloat16", "float32", "float16", "float64", "int8", "int16", "int32", "int64",
           "uint8", "uint32", "bool", "float8_e4m3fn", "float8_e5m2")


def _dtype_hint(name: str) -> str:
    """``: did you mean 'bfloat16'?`` for a common short name or a near miss, else ''."""
    import difflib

    guess = _DTYPE_ALIASES.get(name.lower()) or next(
        iter(difflib.get_close_matches(name.lower(), _DTYPES, n=1, cutoff=0.6)), None)
    return f": did you mean {guess!r}?" if guess else (
        f"; use a NumPy/JAX dtype name such as {', '.join(_DTYPES[:3])}")

