"""pallas_tune.autotune on programs that fought it (issue 38): a call no config can run is
listed as untuned while the others are tuned; static arguments (``static_argnums`` and
``static_argnames``, as ``jax.jit``'s); a receipts file that cannot be written is warned about
even when autotune's own trace meets it first."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import toy_kernels as tk
from jax.experimental import pallas as pl

import pallas_tune as pt
from pallas_tune.errors import RecordWarning

ROWS = 12  # No row tile of the kernels below divides it.


def _double(x, br):
    r, c = x.shape

    def body(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    block = pl.BlockSpec((br, c), lambda i: (i, 0))
    return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(pl.cdiv(r, br),), in_specs=[block], out_specs=block)(x)


def _refuse(x, br):
    if x.shape[0] % br:
        raise pt.InvalidConfig(f"br={br} does not divide {x.shape[0]} rows")


def doubled(x):
    return x * 2.0


@pt.tunable(br=[8, 16], constraints={"br_divides_rows": "x.shape[0] % br == 0"})
def constrained(x, *, br):
    """Every config refused by its declared constraint at ROWS rows (it would trace)."""
    return _double(x, br)


@pt.tunable(br=[8, 16], reference=doubled)
def refusing_with_reference(x, *, br):
    """Every config refused by the kernel itself at ROWS rows; a reference computes it."""
    _refuse(x, br)
    return _double(x, br)


@pt.tunable(br=[8, 16])
def refusing(x, *, br):
    """Every config refused by the kernel itself at ROWS rows, and nothing else computes it."""
    _refuse(x, br)
    return _double(x, br)


def _grids(jaxpr) -> list[tuple[int, ...]]:
    return [tuple(int(v) for v in g.split(",") if v.strip())
            for g in re.findall(r"grid=\(([\d, ]*)\)", str(jaxpr))]


@pytest.mark.parametrize("bad", [constrained, refusing_with_reference, refusing],
                         ids=["constraint", "kernel-with-reference", "kernel-alone"])
def test_a_call_no_config_can_run_is_listed_untuned_and_the_others_tuned(bad, cache_dir, fresh):
    """Before: NoFeasibleConfigError, raised while autotune traced the program to find its
    calls, aborted every call. Now the call is listed as untuned with the dispatcher's reason,
    warned about, and the calls before it (and after it, where something can stand in for its
    result: a config that traces, or its reference) are tuned."""
    bad._memo.clear()

    def program(x, z):
        a = fresh.add(x, x)           # Before the call that cannot run.
        b = bad(z)                    # No config of `bad` can run 12 rows.
        return a, fresh.add(b, b)     # After it, on its result.

    x, z = jnp.ones((8, 128), jnp.float32), jnp.ones((ROWS, 128), jnp.float32)
    with pytest.warns(pt.PallasTuneWarning) as caught:
        result = pt.autotune(program, x, z, trials=2, repeats=1, step_time=True)
    said = [str(w.message) for w in caught]
    assert any(re.match(f"autotune: {bad.name} .* could not be tuned: no config", m)
               for m in said), said
    # The step cannot run (that call has no config): its time is not taken, the result stands.
    assert any(m.startswith("autotune: the step's time was not taken: ") for m in said), said
    assert result.step_ms == {}
    by = {(c.kernel, c.key): c for c in result.calls}
    before = by[(fresh.add.name, fresh.add.cache_key(x, x))]
    failed = by[(bad.name, bad.cache_key(z))]
    assert before.source == "tuned" and np.isfinite(before.best_ms)
    assert failed.source == "untuned" and failed.config == {}
    assert f"no config of {bad.name!r}" in failed.error, failed.error
    if bad is constrained:
        assert "br_divides_rows" in failed.error
    else:
        assert "does not divide 12 rows" in failed.error
    after = by.get((fresh.add.name, fresh.add.cache_key(z, z)))
    if bad is refusing:  # Nothing gives its result's shape: the trace stopped there.
        assert after is None and len(result.calls) == 2
        assert "calls after it in the program were not found" in failed.error
    else:
        assert after is not None and after.source == "tuned" and len(result.calls) == 3
        assert "not found" not in failed.error
    assert "1 could not be tuned" in repr(result)


def _step(x, n):
    """``n`` is a Python int: a loop count and a shape (a tracer for it cannot be either)."""
    for _ in range(n):
        x = tk.scale(x)
    return jnp.tile(x, (n, 1))


def test_autotune_with_a_static_positional_argument(cache_dir, fresh):
    """``static_argnums``: before, autotune traced every argument (ConcretizationTypeError for
    ``n``). Now the call is found, tuned, the step timed, and the result applies to the step
    jitted with the same static argument."""
    x = fresh.ones((64, 256))
    result = pt.autotune(_step, x, 2, static_argnums=1, trials=2, repeats=1, step_time=True)
    (call,) = result.calls
    assert call.source == "tuned" and call.key == fresh.scale.cache_key(x)
    assert set(result.step_ms) == {"default", "tuned", "xla"}
    assert all(np.isfinite(v) for v in result.step_ms.values()), result.step_ms
    with result:
        inside = jax.make_jaxpr(_step, static_argnums=1)(x, 2)
        out = jax.jit(_step, static_argnums=1)(x, 2)
    best = call.config
    assert _grids(inside) == [(64 // best["br"], 256 // best["bc"])] * 2, inside
    np.testing.assert_allclose(out, np.tile(4 * np.asarray(x), (2, 1)))

    with pytest.raises(ValueError, match="static_argnums=5"):
        pt.autotune(_step, x, 2, static_argnums=5)


def test_static_argnames_names_a_positional_argument_as_jax_jit_does(cache_dir, fresh):
    """``static_argnames="n"`` makes ``n`` static though it is passed by position (jax.jit's
    rule: names and positions inferred from the signature); negative positions count from the
    end. The keys show the static value reached the program."""
    def tiled(x, n):
        return fresh.add(jnp.tile(x, (n, 1)), jnp.tile(x, (n, 1)))

    x = jnp.ones((8, 128), jnp.float32)
    for static in ({"static_argnames": "n"}, {"static_argnums": -1},
                   {"static_argnames": ("n",), "static_argnums": (1,)}):
        result = pt.autotune(tiled, x, 3, trials=1, repeats=1, **static)
        assert [(c.key, c.source) for c in result.calls] == [
            ("x=24x128:float32,y=24x128:float32", "tuned")], static
    result = pt.autotune(tiled, x, n=3, static_argnames="n", trials=1, repeats=1)
    assert [c.key for c in result.calls] == ["x=24x128:float32,y=24x128:float32"]
    with pytest.raises(ValueError, match="static_argnames.*'m'"):
        pt.autotune(tiled, x, 3, static_argnames="m")


@pytest.mark.libtpu
def test_a_static_argument_reaches_the_step_estimate(cache_dir, fresh):
    """The whole step's compiler estimate traces the program too: with the static argument."""
    x = fresh.ones((64, 256))
    result = pt.autotune(_step, x, 2, static_argnums=(1,), trials=1, timer="tpu-estimate",
                         chip="v6e", step_time=True)
    assert [c.source for c in result.calls] == ["tuned"]
    assert set(result.step_ms) == {"default", "tuned", "xla"}
    assert all(v > 0 for v in result.step_ms.values()), result.step_detail


def test_autotune_s_own_trace_does_not_swallow_a_receipts_warning(cache_dir, fresh, tmp_path,
                                                                 monkeypatch):
    """autotune's first trace hides cache misses (what it is about to tune); a receipts file
    that cannot be written is still warned about there (once), not silenced for good."""
    from pallas_tune.runtime import record as _record
    from pallas_tune.step.program import find_calls

    _record._dropped.clear()
    monkeypatch.setenv("PALLAS_TUNE_RECEIPTS", str(tmp_path))  # A directory.
    x = fresh.ones((64, 256))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        calls = find_calls(lambda a: fresh.scale(a) + fresh.scale(a * 2), x)
    assert len(calls) == 1
    got = [str(w.message) for w in caught if issubclass(w.category, RecordWarning)]
    assert got == [f"PALLAS_TUNE_RECEIPTS={tmp_path}: not written (Is a directory); receipts "
                   "of this process are dropped"], got
    assert not [w for w in caught if "no tuned config" in str(w.message)]  # Misses: hidden.
    _record._dropped.clear()
