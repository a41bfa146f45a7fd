"""pallas_tune.autotune: every tunable call of a program, each distinct key tuned once, the
result applied as a context manager, XLA dispatched where it won (issue 28)."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_tune as pt


def _program(tk):
    def program(x, y):
        a = tk.scale(x)                  # key A
        b = tk.scale(a)                  # key A again: the same shapes
        return a + b, tk.scale_or_xla(y)  # key B: its reference is far faster here
    return program


def _pallas_grids(jaxpr) -> list[tuple[int, ...]]:
    text = str(jaxpr)
    return [tuple(int(v) for v in g.split(",") if v.strip())
            for g in re.findall(r"grid=\(([\d, ]*)\)", text)]


def test_autotune_tunes_each_key_once_applies_and_dispatches_xla(cache_dir, fresh,
                                                                  monkeypatch, tmp_path):
    tuned: list[tuple[str, str]] = []
    real_tune = pt.TunableKernel.tune

    def counting(self, *args, **kwargs):
        tuned.append((self.name, self.cache_key(*args, **{k: v for k, v in kwargs.items()
                                                          if k != "options"})))
        return real_tune(self, *args, **kwargs)

    monkeypatch.setattr(pt.TunableKernel, "tune", counting)
    fresh.scale_or_xla._memo.clear()
    program = _program(fresh)
    x, y = fresh.ones((64, 256)), jnp.ones((1024, 128), jnp.float32)
    result = pt.autotune(program, x, y, trials=3, repeats=3, xla=True)
    keys = [(c.kernel, c.key) for c in result.calls]
    assert keys == [(fresh.scale.name, fresh.scale.cache_key(x)),
                    (fresh.scale_or_xla.name, fresh.scale_or_xla.cache_key(y))]
    assert sorted(tuned) == sorted(keys)  # Each distinct key tuned once; three calls, two keys.
    assert all(c.source == "tuned" and np.isfinite(c.best_ms) for c in result.calls)
    by_kernel = {c.kernel: c for c in result.calls}
    assert by_kernel[fresh.scale_or_xla.name].implementation == "xla"  # Its reference won.
    assert not list(cache_dir.glob("**/*.json"))  # The cache untouched (write=False).

    outside = jax.make_jaxpr(program)(x, y)
    with result:
        inside = jax.make_jaxpr(program)(x, y)
        out = jax.jit(program)(x, y)
    best = by_kernel[fresh.scale.name].config
    assert _pallas_grids(inside) == [(64 // best["br"], 256 // best["bc"])] * 2, inside
    assert len(_pallas_grids(outside)) == 3  # scale_or_xla's kernel runs outside the result.
    np.testing.assert_allclose(out[0], 6 * x)  # 2x + 4x.
    np.testing.assert_allclose(out[1], 2 * y)

    # A result's configs, dumped, edited and loaded, change the traced program.
    path = tmp_path / "step.json"
    result.dump(path)
    data = json.loads(path.read_text())
    data["calls"][0]["config"] = {"br": 8, "bc": 128, "buffering": 1}
    path.write_text(json.dumps(data))
    loaded = pt.AutotuneResult.load(path)
    with loaded:
        edited = jax.make_jaxpr(program)(x, y)
    assert _pallas_grids(edited) == [(8, 2), (8, 2)], edited
    merged = pt.AutotuneResult.merge(result, loaded)
    assert len(merged.calls) == 2 and merged.calls[0].config["br"] == 8
    written = result.write()
    assert len(written) == 2 and all(p and p.endswith(".json") for p in written)
    fresh.scale._memo.clear()
    assert fresh.scale.config_for(x).source == "cache"
    again = pt.autotune(program, x, y, trials=3, repeats=1)
    assert [c.source for c in again.calls] == ["cache", "cache"]  # Nothing tuned twice.


def test_a_call_that_cannot_be_tuned_loses_no_other_call(cache_dir, fresh, monkeypatch):
    """One kernel's tuning failing (seen: the grouped matmul backward, whose every config the
    estimate refuses) leaves the others tuned: the failed call is listed as untuned with why,
    warned about, and the result applies nothing to it."""
    real_tune = pt.TunableKernel.tune

    def failing(self, *args, **kwargs):
        if self is fresh.scale_or_xla:
            raise pt.NoFeasibleConfigError("none of 3 candidates succeeded (not estimable)")
        return real_tune(self, *args, **kwargs)

    monkeypatch.setattr(pt.TunableKernel, "tune", failing)
    fresh.scale._memo.clear()  # Lookups made by other tests in this process.
    fresh.scale_or_xla._memo.clear()
    program = _program(fresh)
    x, y = fresh.ones((64, 256)), jnp.ones((1024, 128), jnp.float32)
    with pytest.warns(pt.PallasTuneWarning, match="could not be tuned: none of 3"):
        result = pt.autotune(program, x, y, trials=3, repeats=1)
    by_kernel = {c.kernel: c for c in result.calls}
    ok, failed = by_kernel[fresh.scale.name], by_kernel[fresh.scale_or_xla.name]
    assert ok.source == "tuned" and failed.source == "untuned"
    assert "not estimable" in failed.error and "1 could not be tuned" in repr(result)
    with result:
        inside = jax.make_jaxpr(program)(x, y)
    assert len(_pallas_grids(inside)) == 3  # The failed call still runs, as it resolves.
    loaded = pt.AutotuneResult.from_json(json.loads(json.dumps(result.to_json())))
    assert [c.source for c in loaded.calls] == ["tuned", "untuned"]


def test_autotune_finds_calls_under_grad_vmap_and_scan(cache_dir, fresh):
    """The calls are found wherever tracing meets them (here under vmap and scan)."""
    from pallas_tune.step.program import find_calls

    def program(xs):
        def body(carry, x):
            return carry + fresh.scale(x).sum(), None
        total, _ = jax.lax.scan(body, 0.0, xs)
        return total + jax.vmap(fresh.add, in_axes=(0, 0))(xs, xs).sum()

    xs = jnp.ones((3, 16, 128), jnp.float32)
    calls = find_calls(program, xs)
    assert [(c.kernel.name, c.key) for c in calls] == [
        (fresh.scale.name, "x=16x128:float32,factor=2.0"),
        (fresh.add.name, "x=16x128:float32,y=16x128:float32")]


def test_autotune_result_rejects_a_damaged_file(tmp_path):
    bad = tmp_path / "r.json"
    for text in ("[]", '{"calls": [1]}', '{"calls": [{"kernel": "k"}]}'):
        bad.write_text(text)
        with pytest.raises(ValueError, match="autotune result|call 0"):
            pt.AutotuneResult.load(bad)


def test_sweep_program_tunes_a_whole_step(cache_dir, tmp_path, capsys):
    """`pallas-tune sweep --program MODULE:FN --shapes ...`: every call of the program tuned
    and written; a second run finds them all in the cache."""
    from pallas_tune.cli import main

    (tmp_path / "mystep.py").write_text(
        "import toy_kernels as tk\n\n\ndef step(x, y):\n"
        "    return tk.scale(x) + tk.scale(tk.scale(x)), tk.add(y, y)\n")
    argv = ["sweep", "--program", "mystep:step", "--path", str(tmp_path), "--shapes",
            "x=64x256:float32,y=32x256:float32", "--trials", "2", "--repeats", "1",
            "--no-storage"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("(tuned, runs pallas") == 2 and "2 calls: 2 tuned" in out, out
    assert main(argv) == 0
    assert "2 calls: 0 tuned, 2 from the cache" in capsys.readouterr().out
    assert main(["sweep", "--program", "mystep:step", "--path", str(tmp_path),
                 "--shapes", "z=8x8:float32", "--no-storage"]) == 2
    assert "does not fit" in capsys.readouterr().err
