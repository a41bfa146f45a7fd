"""Tuning for training (``grad=True``): the forward, then its backward kernel.

The backward is a :class:`~pallas_tune.runtime.tunable.TunableKernel` of its own, so it is
tuned like
any kernel, for the arguments the forward's ``backward_args(args, kwargs)`` builds (residuals
and a cotangent, computed with the reference), against its own reference, into its own cache
entries. The forward's winner never fixes the backward's tiles: the gradient resolves them from
the cache when it is traced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pallas_tune.errors import TuneOptionError
from pallas_tune.tuning.options import TuneOptions
from pallas_tune.tuning.result import TuningResult

__all__ = ["backward_call", "backward_options", "check_grad", "tune_backward"]


def check_grad(kernel: Any) -> None:
    """``grad=True`` needs a declared backward (and, for a kernel one, ``backward_args``)."""
    backend = getattr(kernel, "backward_backend", None)
    name = getattr(kernel, "name", kernel)
    if backend is None:
        raise TuneOptionError(f"grad=True: {name} declares no backward; declare one with "
                              "@pallas_tune.tunable(backward=KERNEL, backward_args=FN) or "
                              "backward=\"xla\".")
    if backend == "pallas" and kernel.backward_args is None:
        raise TuneOptionError(f"grad=True: {name} declares backward={kernel.backward.name} "
                              "but no backward_args= to build its arguments from the forward's.")


def backward_call(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any], seed: int
                  ) -> tuple[list[Any], dict[str, Any]]:
    """The backward's arguments for a forward call with these.

    Concrete forward arguments give concrete backward arguments (``backward_args`` computes
    the residuals and a cotangent). ``jax.ShapeDtypeStruct`` forward arguments (sweeps) give
    abstract backward arguments (``jax.eval_shape`` of ``backward_args``) where the backward
    kernel declares ``inputs=`` to build consistent ones, as any kernel's tuning does; else
    the forward's are made concrete first (its ``inputs`` or random), then passed through."""
    import jax

    from pallas_tune.measure.timing import make_inputs

    args, kwargs = list(args), dict(kwargs)
    if not any(isinstance(x, jax.ShapeDtypeStruct)
               for x in jax.tree_util.tree_leaves((args, kwargs))):
        bwd_args, bwd_kwargs = kernel.backward_args(args, kwargs)
        return list(bwd_args), dict(bwd_kwargs)
    if kernel.backward.inputs is not None:
        return _abstract_call(kernel.backward_args, args, kwargs)
    if kernel.inputs is not None:
        new_args, new_kwargs = kernel.inputs(*args, **kwargs)
        args, kwargs = list(new_args), dict(new_kwargs)
    else:
        args = make_inputs(args, seed)
    bwd_args, bwd_kwargs = kernel.backward_args(args, kwargs)
    return list(bwd_args), dict(bwd_kwargs)


def _abstract_call(backward_args: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]
                   ) -> tuple[list[Any], dict[str, Any]]:
    """``backward_args`` traced abstractly: arrays out as ShapeDtypeStructs, static values as
    they are."""
    import jax

    static: dict[str, Any] = {}

    def arrays(*a: Any) -> Any:
        bwd_args, bwd_kwargs = backward_args(list(a), dict(kwargs))
        static.update({k: v for k, v in bwd_kwargs.items() if not hasattr(v, "shape")})
        return list(bwd_args), {k: v for k, v in bwd_kwargs.items() if hasattr(v, "shape")}

    bwd_args, array_kwargs = jax.eval_shape(arrays, *args)
    return list(bwd_args), {**static, **array_kwargs}


def backward_options(options: TuneOptions) -> TuneOptions:
    """The forward's options for its backward: no grad, and a study name of its own."""
    name = options.study_name and f"{options.study_name}|backward"
    return dataclasses.replace(options, grad=False, study_name=name)


def tune_backward(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
                  options: TuneOptions, forward: TuningResult,
                  run: Callable[..., TuningResult]) -> TuningResult:
    """``forward`` with the backward's own result attached (tuned with ``run``)."""
    backend = kernel.backward_backend
    if backend != "pallas":
        return dataclasses.replace(forward, backward_backend=backend)
    bwd_args, bwd_kwargs = backward_call(kernel, args, kwargs, options.seed or 0)
    backward = run(kernel.backward, bwd_args, bwd_kwargs, backward_options(options))
    with kernel.backward._lock:
        kernel.backward._memo.clear()
    return dataclasses.replace(forward, backward=backward, backward_backend=backend)
