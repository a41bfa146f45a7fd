"""pallas_tune.autotune on a training step under jax.checkpoint (rematerialization), two policies,
in interpret mode: the tuned calls are found (the forward flash attention, the lse forward the
gradient recomputes, and its backward), the result's configs are the ones the step traces with,
and the step's gradients are the reference's."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draws import normals

import pallas_tune as pt
from pallas_tune.kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_tune.kernels.flash_attention_bwd import flash_attention_bwd

S = 256  # Blocks of 128 or 256 (larger clamp to 256): a few distinct configs per kernel.


def _loss(attention, q, k, v):
    return jnp.sum(attention(q, k, v, causal=True) * jnp.cos(q))


def _pallas_names(jaxpr) -> list[str]:
    return re.findall(r"name=(flash_attention\w*)", str(jaxpr))


@pytest.mark.parametrize("policy", [jax.checkpoint_policies.nothing_saveable,
                                    jax.checkpoint_policies.dots_saveable],
                         ids=["nothing_saveable", "dots_saveable"])
def test_autotune_under_checkpoint(cache_dir, policy):
    q, k, v = normals(0, [(1, 2, S, 32), (1, 1, S, 32), (1, 1, S, 32)])
    step = jax.grad(jax.checkpoint(functools.partial(_loss, flash_attention), policy=policy),
                    argnums=(0, 1, 2))
    flash_attention._memo.clear()
    flash_attention_bwd._memo.clear()

    result = pt.autotune(step, q, k, v, trials=2, repeats=1, retime_top=1)

    by_kernel = {c.kernel: c for c in result.calls}
    assert set(by_kernel) == {flash_attention.name, flash_attention_bwd.name}, result.calls
    assert all(c.source == "tuned" for c in result.calls), result.calls
    fwd = dict(by_kernel[flash_attention.name].config)
    bwd = dict(by_kernel[flash_attention_bwd.name].config)
    with result:
        names = _pallas_names(jax.make_jaxpr(step)(q, k, v))
        grads = jax.jit(step)(q, k, v)

    def blocks(a, b):
        return f"{min(a, S)}x{min(b, S)}"

    want = {f"flash_attention_lse_{blocks(fwd['bq'], fwd['bkv'])}"}
    if bwd["fused"]:  # One pass: dq, dk and dv.
        want.add(f"flash_attention_fused_{blocks(bwd['bq_dkv'], bwd['bkv_dkv'])}")
    else:
        want |= {f"flash_attention_dkv_{blocks(bwd['bq_dkv'], bwd['bkv_dkv'])}",
                 f"flash_attention_dq_{blocks(bwd['bq_dq'], bwd['bkv_dq'])}"}
    assert set(names) == want, (names, fwd, bwd)
    ref = jax.grad(functools.partial(_loss, flash_attention_reference), argnums=(0, 1, 2))(
        q, k, v)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        assert np.isfinite(np.asarray(g)).all(), name
        np.testing.assert_allclose(g, r, atol=2e-5 * max(1.0, float(np.abs(r).max())), rtol=0,
                                   err_msg=name)
    flash_attention._memo.clear()
    flash_attention_bwd._memo.clear()


def test_find_calls_keeps_no_tracer_of_a_masked_call(cache_dir):
    """A masked call's keyword arrays (segment ids) are recorded abstract: finding the calls
    of a step that traces them leaks no tracer, and the recorded call re-traces."""
    from pallas_tune.kernels.flash_attention import SegmentIds
    from pallas_tune.step.program import find_calls

    q = jnp.ones((1, 2, S, 32), jnp.float32)
    k = v = jnp.ones((1, 1, S, 32), jnp.float32)
    ids = jnp.repeat(jnp.arange(2, dtype=jnp.int32), S // 2)[None]

    def loss(q, k, v, ids):
        return jnp.sum(flash_attention(q, k, v, segment_ids=SegmentIds(ids, ids)))

    calls = find_calls(jax.grad(loss), q, k, v, ids)
    masked = [c for c in calls if c.kernel.name == flash_attention.name]
    assert masked, calls
    seg = masked[0].kwargs["segment_ids"]
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(seg))
    jax.eval_shape(lambda *a: flash_attention(*a, **masked[0].kwargs), *masked[0].args)
