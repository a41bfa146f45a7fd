"""The space a tuning run searches for one call: one point per distinct effective config
(:mod:`pallas_tune.effective`), less the choices no config valid for the call uses, less the
parameters that cannot change the program where it is evaluated (:func:`fold_for`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["INTERPRET_INERT", "PRUNE_LIMIT", "call_space", "fold_for", "folded_note"]

# Parameters a kernel passes to the TPU compiler only (pltpu.CompilerParams): in interpret
# mode nothing compiles the kernel for a TPU, so every value runs the same program there.
INTERPRET_INERT = ("vmem_limit_bytes",)

PRUNE_LIMIT = 20_000  # Spaces up to this many points are pruned by the declared constraints.


def call_space(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
               ) -> tuple[Any, dict[str, int]]:
    """The space searched for this call: one point per distinct effective config when the
    kernel declares its clamps (see :mod:`pallas_tune.effective`), else its whole space; then
    without the choices no config valid for the call uses (:func:`_pruned`)."""
    if hasattr(kernel, "call_space"):
        space, dims = kernel.call_space(*args, **kwargs)
    else:
        space, dims = kernel.space, {}
    return _pruned(kernel, space, args, kwargs), dims


def _pruned(kernel: Any, space: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """``space`` less each parameter's choices that no config passing the kernel's declared
    constraints for this call uses (a block size no tile of this shape divides), so that the
    sampler never proposes them: one space declared for every shape serves each shape. The
    default's values stay (it is the baseline); a space where no config passes, or one of more
    than :data:`PRUNE_LIMIT` points, is left whole (its trials then say why)."""
    from pallas_tune.space import Param, SearchSpace

    check = getattr(kernel, "declared_problems", None)
    if check is None or not getattr(space, "constraints", None) or space.size > PRUNE_LIMIT:
        return space
    used: dict[str, set[Any]] = {p.name: set() for p in space.params}
    for config in space:
        if not check(config, args, kwargs):
            for name, value in config.items():
                used[name].add(value)
    if not any(used.values()):
        return space
    default = dict(space.default or {})
    params = tuple(Param(name=p.name, choices=tuple(
        c for c in p.choices if c in used[p.name] or (p.name in default and c == default[p.name])))
        for p in space.params)
    if all(a.choices == b.choices for a, b in zip(params, space.params, strict=True)):
        return space
    return SearchSpace(params=params, default=space.default, constraints=space.constraints,
                       clamps=space.clamps)


def fold_for(space: Any, device: Mapping[str, Any], estimating: bool
             ) -> tuple[Any, dict[str, Any]]:
    """``space`` with the parameters that cannot change the program on the evaluating backend
    held at one value (the default's; in interpret mode, :data:`INTERPRET_INERT`), and the
    values held. Cache entries keep each such parameter at its held value, so lookups, which
    need every parameter, still take them (:func:`folded_note` says so)."""
    from pallas_tune import effective

    if estimating or not device.get("interpret"):
        return space, {}
    return effective.fold(space, INTERPRET_INERT)


def folded_note(held: Mapping[str, Any]) -> str:
    """What :func:`fold_for` held, for the result (once per run)."""
    values = ", ".join(f"{name}={value!r}" for name, value in held.items())
    return (f"not searched: {values} (the default's): a TPU compiler setting changes nothing "
            "in interpret mode, so every value would time the same program")
