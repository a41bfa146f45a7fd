"""Flash attention's mask arguments in the forms users write them (issue 53 items 4 and 12):
64-bit segment ids never wrap onto one another, windows past int32 and numpy windows run, and
malformed segment ids are refused naming what to give."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_tune as pt
from pallas_tune.kernels.flash_attention import SegmentIds, flash_attention

Q = jax.random.normal(jax.random.key(0), (1, 1, 128, 64), jnp.float32)


def _attend(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Untuned shapes: the miss warning.
        return np.asarray(flash_attention(Q, Q, Q, **kwargs))


def _two_documents(dtype, first, second):
    ids = np.full((1, 128), first, dtype)
    ids[:, 64:] = second
    return ids


def _intended():
    ids = jnp.asarray(_two_documents(np.int32, 0, 1))
    return _attend(segment_ids=SegmentIds(ids, ids))


def test_numpy_int64_ids_past_int32_are_refused_without_x64(cache_dir):
    """1 and 2**32 + 1 would both become 1 in int32: one document instead of two."""
    ids = _two_documents(np.int64, 1, 2**32 + 1)
    with pytest.raises(ValueError, match=r"segment_ids\.q is an int64 array .* outside int32"
                                         r".*Renumber"):
        _attend(segment_ids=SegmentIds(ids, ids))
    small = _two_documents(np.int64, 0, 1)  # In range: runs as the int32 ids do.
    np.testing.assert_array_equal(_attend(segment_ids=SegmentIds(small, small)), _intended())


def test_unsigned_ids_past_int31_are_kept_apart(cache_dir):
    """uint64 ids JAX narrows to uint32 without loss, then a bijective int32 cast."""
    ids = _two_documents(np.uint64, 2**31 + 1, 2**31 + 2)
    np.testing.assert_array_equal(_attend(segment_ids=SegmentIds(ids, ids)), _intended())
    with pytest.raises(ValueError, match=r"uint64 array .* outside uint32"):
        wide = _two_documents(np.uint64, 1, 2**32 + 1)
        _attend(segment_ids=SegmentIds(wide, wide))


@pytest.mark.parametrize("how", ["numpy", "jax", "jit"])
def test_int64_ids_past_int32_keep_documents_apart_under_x64(cache_dir, how):
    want = _intended()
    with jax.enable_x64(True):
        ids = _two_documents(np.int64, 1, 2**32 + 1)
        if how == "jit":
            call = jax.jit(lambda s: flash_attention(Q, Q, Q, segment_ids=SegmentIds(s, s)))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = np.asarray(call(jnp.asarray(ids)))
        else:
            ids = ids if how == "numpy" else jnp.asarray(ids)
            got = _attend(segment_ids=SegmentIds(ids, ids))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_ids32_is_injective_and_keeps_order():
    from pallas_tune.kernels._masks import ids32

    with jax.enable_x64(True):
        q = jnp.asarray([[5, 2**40, -(2**40), 5], [7, 7, 2**33, 0]], jnp.int64)
        kv = jnp.asarray([[2**40, 5, 3], [0, 2**33 + 2**32, 7]], jnp.int64)
        rq, rk = ids32((q, kv))
    assert rq.dtype == rk.dtype == jnp.int32
    both, ranks = np.concatenate([q, kv], 1), np.concatenate([rq, rk], 1)
    for row, rank in zip(both, ranks, strict=True):
        assert ((row[:, None] == row[None, :]) == (rank[:, None] == rank[None, :])).all()
        assert ((row[:, None] < row[None, :]) == (rank[:, None] < rank[None, :])).all()


def test_a_window_past_int32_sees_every_key(cache_dir):
    """Was a JAX OverflowError inside every candidate (NoFeasibleConfigError)."""
    np.testing.assert_allclose(_attend(local_window_size=2**31), _attend(), rtol=1e-6,
                               atol=1e-6)
    np.testing.assert_array_equal(_attend(local_window_size=(2**40, 0)),
                                  _attend(local_window_size=(128, 0)))


def test_numpy_windows_are_python_ints(cache_dir):
    """Was "local_window_size=JitTracer(int32[]) must be an int" for every candidate."""
    want = _attend(local_window_size=16)
    np.testing.assert_array_equal(_attend(local_window_size=np.int64(16)), want)
    np.testing.assert_array_equal(_attend(local_window_size=(np.int32(16), 16)), want)


@pytest.mark.parametrize("ids,match", [
    (SegmentIds([[0] * 128], [[0] * 128]), r"segment_ids\.q is list, not an integer array"),
    (SegmentIds(jnp.zeros((1, 128), jnp.int32), None),
     r"segment_ids\.kv is NoneType.*the same array as q's"),
])
def test_malformed_segment_ids_are_refused_naming_the_fix(cache_dir, ids, match):
    with pytest.raises(pt.PallasTuneError, match=match) as e:
        _attend(segment_ids=ids)
    if not isinstance(ids.q, list):  # The key shows the array's shape, not its data.
        assert "segment_ids=(1x128:int32;null)" in str(e.value)
