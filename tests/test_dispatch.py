"""Trace-time dispatch: resolution order, explicit keywords, misses, modes, zero overhead."""

import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import subprocess_env

import pallas_tune as pt


def _seed_cache(kernel, key, config, chip="cpu"):
    kernel.cache.write(chip, kernel.name, key, {"key": key, "config": config, "median_ms": 1.0,
                                                "provenance": {"kind": "measured"}})


def _plant(kernel, entries, chip="cpu"):
    """Entries a lookup skips, in the kernel's winners file as a hand edit leaves them
    (``cache.write`` refuses them)."""
    import os

    from pallas_tune.cache import files

    path = kernel.cache.path(chip, kernel.name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    header = {"schema": 2, "kernel": kernel.name, "chip": chip, "kind": "measured"}
    with open(path, "w") as f:
        f.write(files.render_winners(header, files.sanitize(entries)))
    return path


def test_miss_without_default_uses_the_cost_model_and_warns_once(cache_dir, fresh):
    x = fresh.ones()
    with pytest.warns(pt.PallasTuneWarning,
                      match="no tuned config.*roofline cost model.*pallas-tune sweep"):
        cfg = fresh.scale.config_for(x)
    assert cfg.source == "model"
    # The fewest grid steps for 64x256 (not the first point of the space, br=8, bc=128).
    assert (cfg["br"], cfg["bc"]) == (64, 256)
    assert not fresh.scale.violations(cfg, (x,), {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_allclose(fresh.scale(x), x * 2)  # Same key: no second warning.


def test_exact_hit_and_explicit_keywords_win(cache_dir, fresh):
    x = fresh.ones()
    key = fresh.scale.cache_key(x)
    assert key == "x=64x256:float32,factor=2.0"
    _seed_cache(fresh.scale, key, {"br": 32, "bc": 256, "buffering": 2})
    cfg = fresh.scale.config_for(x)
    assert cfg.source == "cache" and cfg == {"br": 32, "bc": 256, "buffering": 2}
    assert fresh.scale.config_for(x, br=16) == {"br": 16, "bc": 256, "buffering": 2}
    full = fresh.scale.config_for(x, br=8, bc=128, buffering=1)
    assert full.source == "explicit"
    np.testing.assert_allclose(fresh.scale(x, br=16), x * 2)


def test_static_kwargs_are_part_of_the_key(cache_dir, fresh):
    x = fresh.ones()
    key3 = fresh.scale.cache_key(x, factor=3.0)
    _seed_cache(fresh.scale, key3, {"br": 64, "bc": 256, "buffering": 2})
    assert fresh.scale.config_for(x, factor=3.0).source == "cache"
    # A miss on the static value only: the entry tuned on the same shapes serves (issue 26.5).
    with pytest.warns(pt.PallasTuneWarning, match="nearest tuned shape"):
        cfg = fresh.scale.config_for(x)
    assert (cfg.source, cfg.origin) == ("nearest", key3)
    assert cfg == {"br": 64, "bc": 256, "buffering": 2}
    # Other shapes are no fallback for a static value: the cost model's pick.
    y = fresh.ones((32, 256))
    with pytest.warns(pt.PallasTuneWarning):
        assert fresh.scale.config_for(y).source == "model"


def test_equal_static_values_share_one_key(cache_dir, fresh):
    """``factor=3`` and ``factor=3.0`` are one key (it once fell to the default: 139 ms vs
    0.8 ms tuned); the parameter's default decides the spelling."""
    x = fresh.ones()
    assert fresh.scale.cache_key(x, factor=3) == fresh.scale.cache_key(x, factor=3.0)
    assert fresh.scale.cache_key(x, factor=3).endswith("factor=3.0")
    _seed_cache(fresh.scale, fresh.scale.cache_key(x, factor=3.0),
                {"br": 32, "bc": 256, "buffering": 1})
    cfg = fresh.scale.config_for(x, factor=3)
    assert cfg.source == "cache" and cfg["br"] == 32
    np.testing.assert_allclose(fresh.scale(x, factor=3), x * 3)


def test_key_names_like_triton(cache_dir):
    """``key=[...]`` names the arguments that make the key; the others do not split it."""
    @pt.tunable(br=[8, 16], key=["x"], name="test_key_names_like_triton")
    def scaled(x, *, factor=2.0, br):
        return x * factor + 0 * br

    x = jnp.ones((16, 128), jnp.float32)
    assert scaled.cache_key(x, factor=5.0) == scaled.cache_key(x) == "x=16x128:float32"
    for bad in (["nope"], ["br"], "x", []):
        with pytest.raises(pt.SearchSpaceError, match="key="):
            pt.tunable(br=[8], key=bad, name="t")(lambda x, *, factor=1.0, br: x)


def test_nearest_tuned_shape_if_valid(cache_dir, fresh):
    _seed_cache(fresh.scale, "x=128x256:float32,factor=2.0", {"br": 64, "bc": 256, "buffering": 2})
    # 256x256 is nearest to 128x256, and br=64, bc=256 tile it: used.
    x = fresh.ones((256, 256))
    with pytest.warns(pt.PallasTuneWarning, match="nearest tuned shape"):
        cfg = fresh.scale.config_for(x)
    assert cfg.source == "nearest" and cfg["br"] == 64
    # 8x256: a 64-row block over 8 rows is allowed on TPU (edge blocks are padded): used,
    # without a second warning (one per kernel, chip and fallback).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh.scale.config_for(fresh.ones((8, 256)))["br"] == 64
    # br=12 tiles 12 rows (the full dim) but not 24 (12 is no multiple of 8): the default is used.
    _seed_cache(fresh.scale_checked, "x=12x256:float32,factor=2.0",
                {"br": 12, "bc": 128, "wrong": False})
    assert fresh.scale_checked.config_for(fresh.ones((12, 256))).source == "cache"
    with pytest.warns(pt.PallasTuneWarning, match="using the default"):
        cfg = fresh.scale_checked.config_for(fresh.ones((24, 256)))
    assert cfg.source == "default"


def test_declared_default_is_used(cache_dir, fresh):
    x = fresh.ones()
    with pytest.warns(pt.PallasTuneWarning):
        cfg = fresh.scale_checked.config_for(x)
    assert cfg == {"br": 16, "bc": 128, "wrong": False} and cfg.source == "default"


def test_strict_mode_miss_names_key_and_command(cache_dir, fresh, monkeypatch):
    monkeypatch.setenv("PALLAS_TUNE_MODE", "strict")
    x = fresh.ones()
    with pytest.raises(pt.CacheMissError) as info:
        fresh.scale(x)
    msg = str(info.value)
    assert "x=64x256:float32,factor=2.0" in msg
    assert "pallas-tune sweep toy_kernels:scale --shapes 'x=64x256:float32,factor=2.0'" in msg
    assert isinstance(info.value, KeyError)


def test_tune_mode_tunes_on_miss_under_jit(cache_dir, fresh, monkeypatch):
    monkeypatch.setenv("PALLAS_TUNE_MODE", "tune")
    x = fresh.ones((32, 256))
    with pytest.warns(pt.PallasTuneWarning, match="PALLAS_TUNE_MODE=tune: tuning .* now; "
                      "this call waits"):  # Said before the wait, not after (issue 26.9).
        out = jax.jit(fresh.add)(x, x)  # Tunes inside the trace (abstract inputs); caches.
    np.testing.assert_allclose(out, 2 * x)
    assert fresh.add.cache.lookup("cpu", fresh.add.name, fresh.add.cache_key(x, x)) is not None
    fresh.add._memo.clear()
    monkeypatch.setenv("PALLAS_TUNE_MODE", "strict")
    assert fresh.add.config_for(x, x).source == "cache"


def test_works_eagerly_and_under_jit(cache_dir, fresh):
    x = fresh.ones()
    _seed_cache(fresh.scale, fresh.scale.cache_key(x), {"br": 32, "bc": 256, "buffering": 2})
    np.testing.assert_allclose(fresh.scale(x), 2 * x)
    np.testing.assert_allclose(jax.jit(fresh.scale)(x), 2 * x)
    np.testing.assert_allclose(jax.jit(lambda a: fresh.scale(a, factor=0.5))(x), 0.5 * x)
    assert fresh.scale.__wrapped__ is fresh.scale.fn
    assert fresh.scale.__name__ == "scale"


def _strip_module_name(text):
    return re.sub(r"module @\S+", "module @M", text)


def test_lowered_module_identical_to_explicit_config(cache_dir, fresh):
    x = fresh.ones((128, 512))
    cfg = {"br": 32, "bc": 256, "buffering": 2}
    _seed_cache(fresh.scale, fresh.scale.cache_key(x), cfg)
    cached = jax.jit(fresh.scale).lower(x).as_text()
    explicit = jax.jit(lambda a: fresh.scale(a, **cfg)).lower(x).as_text()
    assert _strip_module_name(cached) == _strip_module_name(explicit)
    other = jax.jit(lambda a: fresh.scale(a, br=64, bc=256, buffering=2)).lower(x).as_text()
    assert _strip_module_name(cached) != _strip_module_name(other)  # The check can fail.


def test_tpu_lowering_identical_to_hand_written_call(cache_dir, fresh):
    from pallas_tune.kernels.matmul import matmul

    x = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)
    cfg = {"vmem_limit_bytes": 0, "bm": 256, "bn": 512, "bk": 128, "buffering": 2,
           "semantics": ("parallel", "parallel", "arbitrary")}
    _seed_cache(matmul, matmul.cache_key(x, x), cfg, chip="tpu_v6e")
    matmul._memo.clear()
    with pt.target("v6e"):
        assert matmul.config_for(x, x).source == "cache"
        served = jax.jit(matmul).trace(x, x).lower(lowering_platforms=("tpu",)).as_text()
        by_hand = jax.jit(lambda a, b: matmul.__wrapped__(a, b, **cfg)).trace(x, x).lower(
            lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in served  # The real Mosaic kernel, not the interpreter.
    assert _strip_module_name(served) == _strip_module_name(by_hand)
    matmul._memo.clear()


def test_cpu_default_runs_interpreted_and_env_switch(cache_dir, fresh):
    from pallas_tune import chips

    x = fresh.ones()
    assert chips.should_interpret()
    with pt.target("v6e"):
        assert not chips.should_interpret()
        assert chips.current_chip() == "tpu_v6e"
    np.testing.assert_allclose(fresh.scale(x, br=8, bc=128, buffering=2), 2 * x)


def test_import_and_cached_call_do_not_import_optuna(cache_dir, fresh, tmp_path):
    """The production path (``pallas_tune.runtime``: declaration, key, lookup, dispatch,
    receipts) imports nothing of the tuner, the step, the CLI or their heavy dependencies, in
    a fresh process that imports the package and traces a cached call under ``jax.jit`` with
    receipts on."""
    x = fresh.ones()
    _seed_cache(fresh.scale, fresh.scale.cache_key(x), {"br": 32, "bc": 256, "buffering": 2})
    receipts = tmp_path / "receipts.jsonl"
    code = (
        "import sys, jax, numpy as np, pallas_tune, pallas_tune.runtime, toy_kernels\n"
        "assert 'optuna' not in sys.modules\n"
        "x = toy_kernels.ones()\n"
        "c = toy_kernels.scale.config_for(x); assert c.source == 'cache', c\n"
        "np.testing.assert_allclose(jax.jit(toy_kernels.scale)(x), 2 * x)\n"
        "heavy = ('optuna', 'pandas', 'rich', 'plotly', 'matplotlib', 'sqlalchemy', 'scipy',\n"
        "         'pallas_tune.tuning', 'pallas_tune.measure', 'pallas_tune.search',\n"
        "         'pallas_tune.step', 'pallas_tune.cli')\n"
        "bad = [m for m in heavy if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('OK')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir,
                                          PALLAS_TUNE_RECEIPTS=receipts), timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
    assert "cache" in receipts.read_text()  # The receipt was written: that path ran too.


# ---- issue 12: nothing invalid is ever served, whatever its source ----------------------------

def _trace_counter(monkeypatch):
    from pallas_tune.feasibility import inspect as _inspect

    calls = []
    real = _inspect.find_pallas_calls

    def counting(fn, args, kwargs):
        calls.append(dict(kwargs))
        return real(fn, args, kwargs)

    monkeypatch.setattr(_inspect, "find_pallas_calls", counting)
    return calls


@pytest.fixture
def dk():
    import dispatch_kernels

    dispatch_kernels.rowsum._memo.clear()
    dispatch_kernels.rowsum._warned.clear()
    yield dispatch_kernels
    dispatch_kernels.rowsum._memo.clear()
    dispatch_kernels.rowsum._warned.clear()


def test_declared_default_is_checked_like_any_candidate(cache_dir, dk):
    x = dk.data((16, 512))
    with pytest.warns(pt.PallasTuneWarning, match="using the default"):
        assert dk.rowsum.config_for(x).source == "default"  # Valid at 512 columns.
    x = dk.data((16, 384))
    with pytest.warns(pt.PallasTuneWarning) as record:
        cfg = dk.rowsum.config_for(x)
    assert cfg.source == "model" and cfg["bc"] == 128
    msg = " ".join(str(w.message) for w in record)
    # Which config, why the default was refused, and the command that tunes the shape.
    assert "using {'br': 16, 'bc': 128}" in msg
    assert "the declared default {'br': 8, 'bc': 256} (constraint bc_divides_cols" in msg
    assert "x=16x384:float32" in msg and ".tune(" in msg or "pallas-tune sweep" in msg
    np.testing.assert_allclose(dk.rowsum(x), dk.rowsum_reference(x))


def test_shipped_matmul_default_at_k384_is_valid_and_the_result_is_right(cache_dir):
    """Issue 12: bm=bn=bk=256 at K=384 used to return NaN (the last K block read out of bounds).

    The kernel now masks the ragged K tail, so the declared default is valid there: the dispatcher
    checks it (the same check as every source) and uses it, and the result is right."""
    from pallas_tune.kernels.matmul import matmul, matmul_reference

    x = jax.random.normal(jax.random.key(0), (256, 384), jnp.float32)
    y = jax.random.normal(jax.random.key(1), (384, 256), jnp.float32)
    matmul._memo.clear()
    with pytest.warns(pt.PallasTuneWarning, match="using the default .*'bk': 256"):
        cfg = matmul.config_for(x, y)
    assert cfg.source == "default" and not matmul.violations(cfg, (x, y), {})
    out = matmul(x, y)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(out, matmul_reference(x, y), rtol=1e-5, atol=1e-4)
    matmul._memo.clear()


@pytest.mark.parametrize("config,reason", [
    ({"br": 16, "bc": 256}, "constraint bc_divides_cols"),  # Valid types, wrong for the shape.
    ({"br": 16.0, "bc": 128}, "br=16.0 is a float, not a int"),
    ({"br": True, "bc": 128}, "br=True is a bool"),
    ({"br": 16, "bc": 128, "bz": 1}, "unknown parameter"),
    ({"br": 16}, "lacks parameter"),
    ({"br": -16, "bc": 128}, "not one of the declared choices"),
    ({"br": 32, "bc": 128}, "not one of the declared choices"),
    ({"br": [16], "bc": 128}, "is a tuple, not a int"),
])
def test_exact_hit_is_validated_and_a_bad_entry_spares_the_others(cache_dir, dk, config, reason):
    x, other = dk.data((16, 384)), dk.data((8, 384))
    key, other_key = dk.rowsum.cache_key(x), dk.rowsum.cache_key(other)
    path = _plant(dk.rowsum, {key: {"config": config},
                              other_key: {"config": {"br": 8, "bc": 128}}})
    before = open(path, "rb").read()
    with pytest.warns(pt.PallasTuneWarning) as record:
        cfg = dk.rowsum.config_for(x)
    assert cfg.source != "cache" and not dk.rowsum.violations(cfg, (x,), {})
    skipped = [str(w.message) for w in record if "skipped the cache entry" in str(w.message)]
    assert len(skipped) == 1 and path in skipped[0] and key in skipped[0]
    assert reason in skipped[0]
    np.testing.assert_allclose(dk.rowsum(x), dk.rowsum_reference(x))
    assert dk.rowsum.config_for(other).source == "cache"  # The file's other entry serves.
    assert open(path, "rb").read() == before


def test_outside_space_entries_serve_only_when_marked_and_valid(cache_dir, dk):
    from pallas_tune.cache import TuningCache

    x = dk.data((16, 384))
    key = dk.rowsum.cache_key(x)
    _plant(dk.rowsum, {key: {"config": {"br": 4, "bc": 128}}})
    with pytest.warns(pt.PallasTuneWarning, match="br=4 is not one of the declared choices"):
        assert dk.rowsum.config_for(x).source != "cache"
    dk.rowsum._memo.clear()
    dk.rowsum.cache.write("cpu", dk.rowsum.name, key,
                          {"config": {"br": 16, "bc": 384}, "outside_space": True})
    cfg = dk.rowsum.config_for(x)
    assert cfg.source == "cache" and cfg == {"br": 16, "bc": 384}  # Full dims: valid.
    np.testing.assert_allclose(dk.rowsum(x), dk.rowsum_reference(x))
    assert isinstance(dk.rowsum.cache, TuningCache)


def test_first_resolution_traces_once_then_memoized(cache_dir, dk, monkeypatch):
    x = dk.data((16, 384))
    dk.rowsum.cache.write("cpu", dk.rowsum.name, dk.rowsum.cache_key(x),
                          {"config": {"br": 16, "bc": 128}})
    traces = _trace_counter(monkeypatch)
    assert dk.rowsum.config_for(x).source == "cache"
    assert len(traces) == 1
    jax.jit(dk.rowsum)(x)  # Another fast key (a tracer), same cache key: no new validation.
    dk.rowsum.config_for(jax.ShapeDtypeStruct((16, 384), jnp.float32))
    assert len(traces) == 1


def test_a_miss_costs_a_few_traces_whatever_the_cache_size(cache_dir, dk, monkeypatch):
    # 300 tuned shapes whose configs (bc=256) are all invalid for 384 columns.
    entries = {f"x={8 * (i + 1)}x{256 * (1 + i % 4)}:float32": {"config": {"br": 8, "bc": 256}}
               for i in range(300)}
    dk.rowsum.cache.write_many("cpu", dk.rowsum.name, entries)
    traces = _trace_counter(monkeypatch)
    x = dk.data((16, 384))
    with pytest.warns(pt.PallasTuneWarning):
        cfg = dk.rowsum.config_for(x)
    assert cfg.source == "model" and cfg["bc"] == 128
    # Constraints refuse bc=256 before any trace: neighbours and default cost no trace here;
    # the cost model traces the 2 valid candidates.
    assert len(traces) <= 4


def test_nearest_tries_at_most_three_distinct_configs(cache_dir, dk, monkeypatch):
    # 200 tuned shapes near 8x128, all with b=64, which only a trace shows invalid for 8 rows.
    kernel = dk.picky
    kernel._memo.clear()
    entries = {f"x={16 * (i + 1)}x128:float32": {"config": {"b": 64, "c": i % 8}}
               for i in range(200)}
    kernel.cache.write_many("cpu", kernel.name, entries)
    traces = _trace_counter(monkeypatch)
    with pytest.warns(pt.PallasTuneWarning) as record:
        cfg = kernel.config_for(jnp.ones((8, 128)))
    assert cfg.source == "default" and cfg == {"b": 8, "c": 0}
    msg = " ".join(str(w.message) for w in record)
    assert msg.count("the config of the tuned shape") == 3 and "must not exceed" in msg
    assert len(traces) == 3 + 1  # Three distinct neighbour configs, then the default.
    kernel._memo.clear()


def test_kernels_from_factories_need_a_name(cache_dir):
    def make(n):
        @pt.tunable(b=[n])
        def k(x, *, b):
            return x
        return k

    with pytest.raises(pt.SearchSpaceError, match="no unique name.*name="):
        make(1)
    with pytest.raises(pt.SearchSpaceError, match="lambda|no unique name"):
        pt.tunable(b=[1])(lambda x, *, b: x)

    def make_named(n):
        @pt.tunable(b=[n], name=f"tests.factory_{n}")
        def k(x, *, b):
            return x
        return k

    assert make_named(1).name != make_named(2).name


def test_invalid_config_raised_by_the_kernel_is_a_violation(cache_dir):
    @pt.tunable(b=[1, 2], name="tests.picky_local")
    def picky(x, *, b):
        if b == 2:
            raise pt.InvalidConfig(f"b={b} must be 1 for x of shape {x.shape}")
        return x

    x = jnp.ones((4,))
    assert picky.violations({"b": 2}, (x,), {}) == [
        "the kernel refused it: b=2 must be 1 for x of shape (4,)"]
    assert picky.violations({"b": 1}, (x,), {}) == []
    picky.cache.write("cpu", picky.name, picky.cache_key(x), {"config": {"b": 2}})
    with pytest.warns(pt.PallasTuneWarning, match="the kernel refused it"):
        assert picky.config_for(x) == {"b": 1}


def test_strict_mode_names_refused_entries(cache_dir, dk, monkeypatch):
    x = dk.data((16, 384))
    dk.rowsum.cache.write("cpu", dk.rowsum.name, dk.rowsum.cache_key(x),
                          {"config": {"br": 16, "bc": 256}})
    monkeypatch.setenv("PALLAS_TUNE_MODE", "strict")
    with pytest.raises(pt.CacheMissError, match="were refused.*bc_divides_cols"):
        dk.rowsum(x)


def test_check_returns_the_traced_calls_for_the_tuner(cache_dir, fresh):
    x = fresh.ones()
    problems, calls = fresh.scale.check({"br": 8, "bc": 128, "buffering": 2}, (x,), {})
    assert problems == [] and calls and calls[0].name == "scale"
    problems, calls = fresh.scale.check({"br": 8, "bc": 128}, (x,), {})
    assert problems == ["lacks parameter(s) ['buffering']"] and calls is None


def test_receipts_say_what_each_call_ran(cache_dir, fresh, monkeypatch, tmp_path):
    """PALLAS_TUNE_RECEIPTS=FILE: one line per (kernel, key) and process naming the config and
    its source (the cache file for a hit), so "did the tuned kernel run?" needs no logs."""
    import json

    path = tmp_path / "ran.jsonl"
    monkeypatch.setenv("PALLAS_TUNE_RECEIPTS", str(path))
    x, y = fresh.ones(), fresh.ones((32, 256))
    _seed_cache(fresh.scale, fresh.scale.cache_key(x), {"br": 32, "bc": 256, "buffering": 2})
    for _ in range(3):  # Three traces (a new function each: no jit cache), one receipt.
        jax.jit(lambda a: fresh.scale(a))(x)
    with pytest.warns(pt.PallasTuneWarning):
        fresh.scale(y)
    fresh.scale(x, br=8, bc=128, buffering=1)  # Every keyword given: nothing resolved.
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["key"], r["source"]) for r in lines] == [
        (fresh.scale.cache_key(x), "cache"), (fresh.scale.cache_key(y), "nearest")], lines
    assert lines[1]["origin"] == fresh.scale.cache_key(x)  # The tuned key it borrowed from.
    hit = lines[0]
    assert hit["config"] == {"br": 32, "bc": 256, "buffering": 2}
    assert hit["implementation"] == "pallas" and hit["kernel"] == fresh.scale.name
    assert hit["origin"].endswith("toy_kernels.scale.json") and hit["pid"] > 0
    monkeypatch.delenv("PALLAS_TUNE_RECEIPTS")
    fresh.scale._memo.clear()
    fresh.scale(x)
    assert len(path.read_text().splitlines()) == 2  # Unset: nothing written.


def test_one_gradient_warns_once_per_kernel_and_points_at_the_caller(cache_dir):
    """A step's misses: one warning per kernel and fallback (not one per shape), each shown at
    the user's line, also for a backward kernel resolved inside jax.grad's machinery."""
    import grad_kernels as gk

    for k in (gk.square, gk.square_bwd):
        k._memo.clear()
        k._warned.clear()

    def loss(x, y):
        return gk.square(x).sum() + gk.square(y).sum() + gk.square(x[:3]).sum()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.grad(loss, argnums=(0, 1))(jnp.ones(5), jnp.ones(7))
    ours = [w for w in caught if issubclass(w.category, pt.PallasTuneWarning)]
    named = sorted(re.search(r"of '([^']+)'", str(w.message)).group(1) for w in ours)
    assert named == ["tests.square", "tests.square_bwd"], [str(w.message) for w in ours]
    assert {w.filename for w in ours} == {__file__}, [w.filename for w in ours]
    assert all("PALLAS_TUNE_RECORD=FILE" in str(w.message) for w in ours)


def test_a_fallback_the_vmem_model_puts_over_a_tpus_vmem_is_not_served(cache_dir, dk):
    """On a cache miss for a TPU, the default (and any nearest-shape or model pick) goes through
    the VMEM model first: a default that cannot fit v6e's VMEM at this shape is refused, with the
    reason, for the fastest config that fits. Off TPU (interpret mode) the default serves."""
    k = dk.wide_copy
    x = jax.ShapeDtypeStruct((4096, 8192), jnp.float32)
    k._memo.clear()
    with pytest.warns(pt.PallasTuneWarning, match="using the default"):
        assert k.config_for(x).source == "default"  # cpu: interpreted, no VMEM to fit.
    k._memo.clear()
    k._warned.clear()
    with pt.target("v6e"), pytest.warns(pt.PallasTuneWarning) as record:
        cfg = k.config_for(x)
    assert cfg.source == "model" and cfg["br"] < 4096
    msg = " ".join(str(w.message) for w in record)
    assert "the declared default {'br': 4096}" in msg and "VMEM model" in msg
    # The pick fits by the same model; the default does not.
    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility.inspect import find_pallas_calls
    from pallas_tune.feasibility.model import model_verdict

    def verdict(br):
        return model_verdict(find_pallas_calls(k.fn, [x], {"br": br}), chip_spec("v6e"))
    assert verdict(cfg["br"]).ok and not verdict(4096).ok
    k._memo.clear()
    k._warned.clear()
