"""The gradient contract (issue 27): @tunable(backward=, backward_args=), the custom_vjp that calls
the backward kernel with no tile keywords, tune(..., grad=True) and `pallas-tune sweep --grad`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_tune as pt


@pytest.fixture
def gk(cache_dir):
    import grad_kernels

    kernels = (grad_kernels.scaled, grad_kernels.scaled_bwd, grad_kernels.square,
               grad_kernels.square_bwd, grad_kernels.cube, grad_kernels.shifted,
               grad_kernels.shifted_bwd)
    for k in kernels:
        k._memo.clear()
        k._warned.clear()
    grad_kernels.CALLS.clear()
    yield grad_kernels
    for k in kernels:
        k._memo.clear()


def test_grad_calls_the_backward_kernel_with_its_own_config_and_the_forward_keywords(gk):
    x, n = jnp.arange(6.0).reshape(2, 3), jnp.ones((2, 3), jnp.int32)
    pt_cache = gk.scaled_bwd.cache
    key = gk.scaled_bwd.cache_key(x, n, x, factor=3.0)
    pt_cache.write(pt.current_chip(), gk.scaled_bwd.name, key,
                   {"key": key, "config": {"c": 4}, "median_ms": 1.0})
    # The forward's own tile (b=2) is passed explicitly: it must not reach the backward.
    dx = jax.jit(jax.grad(lambda x: gk.scaled(x, n, factor=3.0, b=2).sum()))(x)
    np.testing.assert_array_equal(dx, np.full((2, 3), 3.0))
    # From the cache, with the forward's keyword (traced twice: the validity check, the call).
    assert gk.CALLS and all(c == {"factor": 3.0, "c": 4} for c in gk.CALLS)
    assert gk.scaled.backward_backend == "pallas" and gk.scaled.backward is gk.scaled_bwd


def test_integer_arguments_get_no_cotangent_and_vmap_works(gk):
    x, n = jnp.arange(6.0).reshape(2, 3), jnp.ones((2, 3), jnp.int32)
    out, vjp = jax.vjp(lambda x, n: gk.scaled(x, n), x, n)
    np.testing.assert_array_equal(out, 2 * x + 1)
    dx, dn = vjp(jnp.ones_like(out))
    np.testing.assert_array_equal(dx, np.full((2, 3), 2.0))
    assert dn.dtype == jax.dtypes.float0
    batched = jax.vmap(jax.grad(lambda x: gk.scaled(x, n[0]).sum()))(x)
    np.testing.assert_array_equal(batched, np.full((2, 3), 2.0))


def test_backward_residuals_and_xla_backward(gk):
    x = jnp.linspace(-1.0, 1.0, 5)
    np.testing.assert_allclose(jax.grad(lambda x: gk.square(x).sum())(x), 2 * x)
    np.testing.assert_allclose(jax.grad(lambda x: gk.cube(x).sum())(x), 3 * x * x, rtol=1e-6)
    assert gk.cube.backward_backend == "xla" and gk.cube.backward is None
    assert gk.square_bwd.config_for(x, x, x).source == "default"


def test_keyword_arrays_are_operands_under_checkpoint_and_keyed_only_when_given(gk):
    """A keyword array (``offset``) reaches the backward as a traced operand of the custom VJP,
    not a closed-over constant: jit, jax.checkpoint and vmap trace it. ``key_optional``: the
    key names it only when it is given."""
    x, off = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), jnp.arange(6.0).reshape(2, 3)

    def loss(x, off):
        return (gk.shifted(x, offset=off) * x).sum()

    for wrap in (lambda f: f, jax.checkpoint,
                 lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)):
        np.testing.assert_allclose(jax.jit(jax.grad(wrap(loss)))(x, off), 2 * x * off)
    batched = jax.vmap(jax.grad(loss))(jnp.stack([x, -x]), jnp.stack([off, off + 1]))
    np.testing.assert_allclose(batched, np.stack([2 * x * off, -2 * x * (off + 1)]))
    assert gk.shifted.cache_key(x) == "x=2x3:float32"
    assert gk.shifted.cache_key(x, offset=None) == "x=2x3:float32"
    assert gk.shifted.cache_key(x, offset=off) == "x=2x3:float32,offset=2x3:float32"
    with pytest.raises(pt.SearchSpaceError, match="key_optional"):
        pt.tunable(name="t.badkey", b=[1], key_optional=["y"])(lambda x, *, b: x)


def test_declaration_errors():
    with pytest.raises(pt.SearchSpaceError, match="must be a @tunable kernel or"):
        pt.tunable(name="t.bad1", b=[1], backward="jax")(lambda x, *, b: x)
    with pytest.raises(pt.SearchSpaceError, match="need a backward= kernel"):
        pt.tunable(name="t.bad2", b=[1], backward_args=lambda a, k: (a, k))(lambda x, *, b: x)
    with pytest.raises(pt.SearchSpaceError, match="declare reference="):
        pt.tunable(name="t.bad3", b=[1], backward="xla")(lambda x, *, b: x)
    with pytest.raises(pt.SearchSpaceError, match="@pallas_tune.tunable"):
        pt.tunable(name="t.bad4", b=[1], backward=lambda *a: a)(lambda x, *, b: x)
    plain = pt.tunable(name="t.plain", b=[1])(lambda x, *, b: x)
    assert plain.backward_backend is None


def test_tune_grad_tunes_the_forward_then_the_backward(gk):
    x, n = jnp.arange(12.0).reshape(3, 4), jnp.zeros((3, 4), jnp.int32)
    result = gk.scaled.tune(x, n, grad=True, trials=2, seed=0)
    assert result.backward_backend == "pallas"
    bwd = result.backward
    assert bwd.kernel == "tests.scaled_bwd" and bwd.key == gk.scaled_bwd.cache_key(x, n, x)
    assert bwd.best["c"] in (1, 2, 4) and bwd.cache_path and result.cache_path != bwd.cache_path
    assert gk.scaled_bwd.config_for(x, n, x).source == "cache"
    assert gk.scaled.tune(x, n, trials=1, seed=0).backward is None  # Without grad: forward only.
    xla = gk.cube.tune(x, grad=True, trials=1)
    assert xla.backward is None and xla.backward_backend == "xla"
    with pytest.raises(pt.TuneOptionError, match="no backward_args"):
        gk.square.tune(x, grad=True, trials=1)
    plain = pt.tunable(name="t.plain2", b=[1])(lambda x, *, b: x)
    with pytest.raises(pt.TuneOptionError, match="declares no backward"):
        pt.tune(plain, x, grad=True, trials=1)


def test_sweep_grad_tunes_each_shape_and_its_backward(gk, capsys):
    import os

    from pallas_tune import cli
    from conftest import TESTS_DIR

    argv = ["sweep", "grad_kernels:scaled", "--path", TESTS_DIR, "--shapes",
            "x=3x4:float32,n=3x4:int32", "--trials", "2", "--grad", "--no-storage"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "then its backward (Pallas kernel tests.scaled_bwd)" in out
    assert "backward x=3x4:float32,n=3x4:int32,g=3x4:float32" in out
    assert os.path.exists(gk.scaled_bwd.cache.path(pt.current_chip(), "tests.scaled_bwd"))
    assert cli.main(argv) == 0  # Both cached now: both skipped.
    assert capsys.readouterr().out.count("cached, skipped") == 2
    assert cli.main(["sweep", "grad_kernels:square", "--path", TESTS_DIR, "--shapes",
                     "x=3:float32", "--grad", "--no-storage"]) == 2


def test_gradient_declaration_is_not_part_of_the_forward_fingerprint():
    from pallas_tune._kernel_hash import source_fingerprint

    base = ("import pallas_tune as pt\n"
            "@pt.tunable(b=[1])\ndef f(x, *, b):\n    return x\n")
    declared = ("import pallas_tune as pt\nfrom m_bwd import f_bwd, f_bwd_args\n"
                "@pt.tunable(b=[1], backward=f_bwd, backward_args=f_bwd_args)\n"
                "def f(x, *, b):\n    return x\n")
    changed = declared.replace("return x", "return x + 1")
    assert source_fingerprint(base) == source_fingerprint(declared)
    assert source_fingerprint(declared) != source_fingerprint(changed)


def test_show_says_how_each_kernel_differentiates(cache_dir, capsys):
    from pallas_tune import cli
    from pallas_tune.kernels.mamba2_ssd import mamba2_ssd
    from pallas_tune.kernels.matmul import matmul

    for kernel, config in ((matmul, dict(matmul.space.default)),
                           (mamba2_ssd, dict(mamba2_ssd.space.default))):
        kernel.cache.write("cpu", kernel.name, "k", {"key": "k", "config": config,
                                                     "median_ms": 1.0})
    assert cli.main(["show", "--chip", "cpu"]) == 0
    out = capsys.readouterr().out
    assert ("pallas_tune.kernels.matmul.matmul: backward pallas: kernel "
            "pallas_tune.kernels.matmul_bwd.matmul_bwd") in out
    assert ("pallas_tune.kernels.mamba2_ssd.mamba2_ssd: backward xla: jax.vjp of "
            "the reference (not a kernel") in out


def test_a_backward_that_cannot_take_what_the_gradient_passes_is_refused():
    import grad_kernels

    def fwd(q, k, v, *, causal=False, bq):
        return q

    with pytest.raises(pt.SearchSpaceError, match="declare backward_residuals="):
        pt.tunable(name="t.attn", bq=[1], backward=grad_kernels.square_bwd)(fwd)

    @pt.tunable(name="t.attn_bwd", c=[1])
    def attn_bwd(q, k, v, g, *, c):
        return q, k, v

    with pytest.raises(pt.SearchSpaceError, match=r"keyword\(s\) \['causal'\]"):
        pt.tunable(name="t.attn2", bq=[1], backward=attn_bwd)(fwd)
