"""Effective configs: what a config runs as for a call's shapes, and the space of those.

Most kernels clamp a block size to the dimension it tiles (``bm = min(bm, M)``: a block as
large as the array always meets the TPU block rule), so on a 256-row matmul ``bm=512`` and
``bm=1024`` are the same program as ``bm=256``. A kernel declares that mapping with
``clamp=`` (``@tunable(clamp={"bm": "x.shape[0]", ...})`` or a ``[clamp]`` table in its
search-space file): parameter name → an expression over the call's arguments (the language of
:mod:`pallas_tune.constraints`) giving the dimension the value is clamped to. Then, for a call:

- the **effective** config is each clamped value capped at its dimension: what runs, and what
  results, caches, ``show`` and the report show beside the config;
- the **call space** keeps, per clamped parameter, the choices below the dimension and the
  smallest one at or above it (its *representative*): one point per distinct effective config,
  each a point of the declared space, so that the search never spends a trial on a program
  it already has, stops when they are exhausted, and a cached config keeps its meaning on a
  larger shape (a nearest-shape fallback reuses ``bm=256``, not ``bm=1024``).

Pure Python: nothing here imports jax.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from pallas_tune.space import Param, SearchSpace, _freeze

__all__ = ["call_env", "call_space", "clamp_dims", "clamp_notes", "effective", "fold",
           "representative"]


def call_env(signature: inspect.Signature, args: Any, kwargs: Mapping[str, Any]
             ) -> dict[str, Any] | None:
    """The call's arguments by name (defaults applied), or None when they do not bind."""
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    env = dict(bound.arguments)
    for name, p in signature.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            env.update(env.pop(name, {}))
    return env


def clamp_dims(space: SearchSpace, env: Mapping[str, Any] | None) -> dict[str, int]:
    """Parameter → the positive integer dimension it is capped at for this call. A clamp whose
    expression fails or is not a positive int is left out (that parameter is not reduced)."""
    if env is None:
        return {}
    dims = {}
    for name, c in space.clamps:
        try:
            d = c.value(env)
        except Exception:  # noqa: BLE001  Not reducing is always safe.
            continue
        if isinstance(d, int) and not isinstance(d, bool) and d > 0:
            dims[name] = d
    return dims


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def effective(config: Mapping[str, Any], dims: Mapping[str, int]) -> dict[str, Any]:
    """What ``config`` runs as: each clamped integer value capped at its dimension."""
    return {k: min(v, dims[k]) if k in dims and _int(v) else v for k, v in config.items()}


def _kept(p: Param, dim: int) -> tuple[Any, ...]:
    """Choices below ``dim``, and the smallest at or above it (declaration order kept)."""
    if not all(_int(v) for v in p.choices):
        return p.choices
    above = [v for v in p.choices if v >= dim]
    rep = min(above) if above else None
    return tuple(v for v in p.choices if v < dim or v == rep)


def representative(config: Mapping[str, Any], space: SearchSpace, dims: Mapping[str, int]
                   ) -> dict[str, Any]:
    """The point of the call space that runs as ``config`` does (values at or above their
    dimension become the smallest declared choice at or above it)."""
    out = dict(config)
    for k, d in dims.items():
        v = out.get(k)
        if _int(v) and v >= d and k in space.names:
            above = [c for c in space[k].choices if _int(c) and c >= d]
            if above:
                out[k] = min(above)
    return out


def call_space(space: SearchSpace, dims: Mapping[str, int]) -> SearchSpace:
    """The space of distinct effective configs for a call: ``space`` itself when nothing is
    clamped below a declared choice, else the same parameters with the redundant choices
    left out, the default mapped to its representative."""
    params = tuple(Param(name=p.name, choices=_kept(p, dims[p.name]))
                   if p.name in dims else p for p in space.params)
    if all(a.choices == b.choices for a, b in zip(params, space.params, strict=True)):
        return space
    default = (None if space.default is None else
               {k: _freeze(v) for k, v in representative(space.default, space, dims).items()})
    return SearchSpace(params=params, default=default, constraints=space.constraints,
                       clamps=space.clamps)


def clamp_notes(config: Mapping[str, Any], space: SearchSpace, dims: Mapping[str, int]
                ) -> list[str]:
    """Each value of ``config`` that runs as a smaller one for this call, said plainly:
    ``bm=256 runs as 200 (clamped to the call's x.shape[0])``."""
    exprs = {name: c.describe() for name, c in space.clamps}
    return [f"{k}={v} runs as {dims[k]} (clamped to the call's {exprs.get(k, 'dimension')})"
            for k, v in config.items() if k in dims and _int(v) and v > dims[k]]


def fold(space: SearchSpace, names: Any) -> tuple[SearchSpace, dict[str, Any]]:
    """``space`` with each of ``names`` that has several choices held at one value: the
    default's, else its first choice (a point of the declared space, so what is cached stays
    a valid entry). For parameters that cannot change the program where it is evaluated (a
    TPU compiler setting in interpret mode). Returns the space and the held values."""
    default = dict(space.default or {})
    held = {p.name: default.get(p.name, p.choices[0]) for p in space.params
            if p.name in names and len(p.choices) > 1}
    if not held:
        return space, {}
    params = tuple(Param(name=p.name, choices=(held[p.name],)) if p.name in held else p
                   for p in space.params)
    return SearchSpace(params=params, default=space.default, constraints=space.constraints,
                       clamps=space.clamps), held
