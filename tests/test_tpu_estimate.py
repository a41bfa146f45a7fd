"""The tpu-estimate timer: the TPU compiler's static cycle estimate, deviceless (needs libtpu)."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import pallas_tune as pt
from conftest import subprocess_env
from pallas_tune.measure.estimate import Estimator, _memory_limit, shrink_parallel
from pallas_tune.kernels.matmul import matmul

SEM = ("parallel", "parallel", "arbitrary")
X = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)


def _bwd_args(m, k, n):
    return [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (m, n))]


def _bwd_tiles(t):
    return {f"{p}_{d}": t for p in ("dx", "dy") for d in ("bm", "bn", "bk")}


def test_a_program_of_several_kernels_splits_into_its_kernels_and_the_rest():
    import toy_kernels
    from pallas_tune.feasibility.compile import kernel_calls
    from pallas_tune.kernels.flash_attention_bwd import flash_attention_bwd
    from pallas_tune.kernels.matmul_bwd import matmul_bwd

    args = _bwd_args(512, 256, 384)
    calls, rest = kernel_calls(matmul_bwd.fn, args, _bwd_tiles(128))
    assert rest is None  # Nothing but the two kernels.
    assert [[tuple(a.shape) for a in ops] for _, ops in calls] == [
        [(512, 384), (256, 384)], [(512, 256), (512, 384)]]  # dx = g·yᵀ, dy = xᵀ·g.
    for one, ops in calls:  # Each part is a program of its own: its kernel, nothing else.
        eqns = jax.make_jaxpr(one)(*ops).jaxpr.eqns
        assert [e.primitive.name for e in eqns] == ["pallas_call"]
    assert [o.shape for o in jax.eval_shape(calls[0][0], *calls[0][1])] == [(512, 256)]
    # One kernel, kernels nested in another op, or a dropped result: the program is whole.
    assert kernel_calls(matmul.fn, [X, X], dict(bm=256, bn=256, bk=256, buffering=2,
                                                semantics=SEM)) is None
    assert kernel_calls(toy_kernels.matmul_bwd_whole, args, _bwd_tiles(128)) is None
    assert kernel_calls(toy_kernels.matmul_bwd_dx, args, _bwd_tiles(128)) is None  # dy dropped.
    # Flash attention's backward: its dK/dV and dQ passes, and the row statistics (lse in
    # log2 units, delta = rowsum(o * do)) made by XLA ops, which the rest returns.
    q = jax.ShapeDtypeStruct((1, 4, 256, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1, 256, 64), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, 4, 256), jnp.float32)
    tiles = dict(causal=True, bq_dq=128, bkv_dq=128, bq_dkv=128, bkv_dkv=128)
    calls, rest = kernel_calls(flash_attention_bwd.fn, [q, kv, kv, q, lse, q],
                               dict(tiles, fused=False))
    assert len(calls) == 2 and rest is not None
    # Fused: one pass makes dq, dk and dv, and a program of one kernel is estimated whole.
    assert kernel_calls(flash_attention_bwd.fn, [q, kv, kv, q, lse, q],
                        dict(tiles, fused=True)) is None
    made = jax.eval_shape(rest[0], *rest[1])
    assert sorted(tuple(o.shape) for o in made) == [(1, 4, 1, 256)] * 2
    assert "pallas_call" not in str(jax.make_jaxpr(rest[0])(*rest[1]))


@pytest.mark.libtpu
def test_flash_attention_backward_with_gqa_is_estimated_pass_by_pass():
    """libtpu 0.0.50's static profile aborts on the causal GQA backward compiled whole (from
    2048 tokens; each pass alone profiles fine): split, it has a figure."""
    from pallas_tune.kernels.flash_attention_bwd import flash_attention_bwd

    q = jax.ShapeDtypeStruct((1, 4, 2048, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1, 2048, 128), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, 4, 2048), jnp.float32)
    with Estimator(1) as est:
        (r,) = est.map(flash_attention_bwd, [q, kv, kv, q, lse, q], {"causal": True},
                       [dict(flash_attention_bwd.space.default)], "v6e", standin=False)
    assert r.ok and r.kernels_alone == 2 and r.cycles > 0, r.message


@pytest.mark.libtpu
def test_a_program_of_kernels_is_estimated_kernel_by_kernel():
    # libtpu's profile of a program with two large kernels costs far more than the kernels
    # alone (matmul_bwd at 4096x4096x6144: 17.6 GB whole, 2.2 GB alone), so such a program is
    # estimated as the sum of its kernels, each compiled alone, as a one-kernel entry is.
    import toy_kernels
    from pallas_tune.kernels.matmul_bwd import matmul_bwd

    args, tiles = _bwd_args(2048, 1024, 1536), _bwd_tiles(512)
    kernels = (matmul_bwd, toy_kernels.matmul_bwd_dx, toy_kernels.matmul_bwd_dy,
               toy_kernels.matmul_bwd_whole)
    with Estimator(1) as est:
        split, dx, dy, whole = (est.map(k, args, {}, [tiles], "v6e", standin=False)[0]
                                for k in kernels)
    assert all(r.ok for r in (split, dx, dy, whole)), [r.message for r in (split, dx, dy, whole)]
    assert (split.kernels_alone, dx.kernels_alone, whole.kernels_alone) == (2, 0, 0)
    assert split.cycles == dx.cycles + dy.cycles
    # Compiled together, the compiler's figure for the second kernel moves with its
    # neighbour, by libtpu version: the whole program measured 1% below the sum (0.0.50)
    # and 23% above it (0.0.42).
    assert abs(split.cycles - whole.cycles) <= 0.25 * whole.cycles, (split.cycles, whole.cycles)


def test_shrink_parallel_keeps_enough_steps():
    blocks, scale = shrink_parallel([16, 16], 16, target_steps=128)
    assert blocks[0] * blocks[1] * 16 >= 128 and scale == 16 * 16 * 16 / (blocks[0] * blocks[1] * 16)
    assert shrink_parallel([2, 2], 8) == ([2, 2], 1.0)  # Small problems stay whole.


def test_worker_memory_cap_leaves_a_single_compile_most_of_the_host():
    gib = 1 << 30
    # One worker on a 24 GiB host: 21 GiB of address space (a 1x8192 Mamba-2 compile maps 12.3 GB,
    # which the old cap of half the host failed); two share it; small hosts keep 4 GiB each.
    assert _memory_limit(1, -1, total=24 * gib) == 21 * gib
    assert _memory_limit(2, -1, total=24 * gib) == 21 * gib // 2
    assert _memory_limit(8, -1, total=8 * gib) == 4 * gib
    assert _memory_limit(1, 3 * gib) == 3 * gib and _memory_limit(1, None) is None  # As asked.


@pytest.mark.libtpu
def test_matmul_2048_estimates_rank_tiles_and_buffering():
    cfgs = [dict(bm=t, bn=t, bk=t, buffering=2, semantics=SEM) for t in (128, 256, 512)]
    cfgs.append(dict(bm=512, bn=512, bk=512, buffering=1, semantics=SEM))
    with Estimator(2) as est:
        r128, r256, r512, r512_b1 = est.map(matmul, (X, X), {}, cfgs, "v6e")
    assert all(r.ok for r in (r128, r256, r512, r512_b1))
    assert r128.cycles > r256.cycles > r512.cycles  # Strictly better with bigger tiles.
    assert r512_b1.cycles > r512.cycles  # Buffered(1) loses the DMA/compute overlap.
    assert r128.scale > 1 and r512.scale == 1  # 4096 steps were estimated on a stand-in.


def test_every_tpu_chip_listed_has_a_clock_for_its_estimates():
    """7x had none: its estimates could not be turned into time (ZeroDivisionError in the
    floor check after the whole compile, and a refusal up front when tuning)."""
    from pallas_tune import chips

    assert "tpu_7x" in chips._TPU
    for name in chips._TPU:  # The TPU chips with specs (older kinds are only recognized).
        assert chips.chip_spec(name).clock_hz > 0, name


def _libtpu_at_least(version: tuple[int, ...]) -> bool:
    from importlib import metadata

    try:
        have = metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return False
    return tuple(int(p) for p in have.split(".")[:len(version)] if p.isdigit()) >= version


@pytest.mark.libtpu
def test_a_7x_estimate_is_converted_at_its_clock():
    if not _libtpu_at_least((0, 0, 50)):  # Python 3.11 gets JAX 0.10 and libtpu 0.0.42.1.
        pytest.skip("this libtpu predates 7x static profiles (0.0.42.1 aborts in its LLO "
                    "check compiling for 7x); 0.0.50 (Python >= 3.12's) estimates it")
    cfg = dict(bm=512, bn=512, bk=512, buffering=2, semantics=SEM)
    with Estimator(1) as est:
        (r,) = est.map(matmul, (X, X), {}, [cfg], "7x")
    assert r.ok, r.message
    from pallas_tune.chips import chip_spec
    from pallas_tune.measure.estimate import cycles_to_ms

    ms = cycles_to_ms(r.cycles, chip_spec("7x").clock_hz)
    peak_ms = 2 * 2048 ** 3 / chip_spec("7x").bf16_flops * 1e3
    assert peak_ms < ms < 4 * peak_ms  # Above the bf16 peak's time, within a few times it.


@pytest.mark.libtpu
def test_an_estimate_of_a_scalar_prefetch_kernel_says_what_it_cannot_follow(cache_dir):
    """The grouped matmul reads its group table by scalar prefetch, which libtpu's profile
    takes as 0: the estimate counts the kernel, its trial detail and the entry say so."""
    from pallas_tune.kernels.grouped_matmul import grouped_matmul
    from pallas_tune.measure.loops import PREFETCH_NOTE

    bf = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((512, 256), bf), jax.ShapeDtypeStruct((2, 256, 256), bf),
            jax.ShapeDtypeStruct((2,), jnp.int32))
    with Estimator(1) as est:
        r, whole_k = est.map(grouped_matmul, args, {}, [dict(tm=128, tk=128, tn=128),
                                                         dict(tm=128, tk=256, tn=128)], "v6e",
                             standin=False)
    assert r.ok and r.prefetch_kernels == 1, r.message
    # One k step: the profile would see its lhs and rhs tiles fetched once per n tile (tables
    # of 0), so that config gets no estimate, and the tune goes on without it.
    assert not whole_k.ok and whole_k.kind == "no_estimate_config", whole_k
    assert "(0.06 MiB blocks) counted 1 time(s), up to 10 by the data" in whole_k.message
    result = grouped_matmul.tune(*args, timer="tpu-estimate", chip="v6e", trials=4,
                                 workers=1, write=False, xla=False)
    assert PREFETCH_NOTE in result.provenance["estimate_caveat"]
    assert PREFETCH_NOTE in result.best_record.detail
    assert result.best_record.config["tk"] < 256
    for rec in result.records:
        if min(rec.config["tk"], 256) == 256:
            assert not rec.outcome.timed and "no static estimate" in rec.error, rec


@pytest.mark.libtpu
def test_an_estimate_far_below_what_the_kernels_dots_need_is_refused():
    """libtpu's profile can lose a whole program: the same accumulating dot estimates near the
    MXU's time with a 2-D output block and next to nothing with an (8, t, t) one. The census
    counts the dot FLOPs each kernel does at every step whatever the data (its cheapest branch
    of a conditional), and an estimate below half their time at the chip's peak is refused."""
    import toy_kernels

    from pallas_tune.measure.loops import kernel_census

    a = jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16)
    census = kernel_census(toy_kernels.stacked_output, [a, a], dict(t=256, stacked=False),
                           chip="v6e")
    assert census.floor_flops == (2.0 * 2048 * 512 * 512,)
    with Estimator(1) as est:
        plain, stacked = est.map(toy_kernels.stacked_output, (a, a), {},
                                 [dict(t=256, stacked=False), dict(t=256, stacked=True)],
                                 "v6e", standin=False)
    floor_cycles = census.floor_flops[0] / (918e12 / 1.75e9)
    assert plain.ok and plain.cycles >= floor_cycles, plain
    assert not stacked.ok and stacked.kind == "no_estimate_config", stacked
    assert "did not follow its program" in stacked.message
    assert "at the chip's peak" in stacked.message


@pytest.mark.libtpu
def test_standin_within_5_percent_of_full_compile():
    cfg = [dict(bm=256, bn=256, bk=256, buffering=2, semantics=SEM)]
    with Estimator(1) as est:
        (scaled,) = est.map(matmul, (X, X), {}, cfg, "v6e", standin=True)
        (full,) = est.map(matmul, (X, X), {}, cfg, "v6e", standin=False)
    assert scaled.scale > 1
    assert abs(scaled.cycles - full.cycles) / full.cycles < 0.05


@pytest.mark.libtpu
def test_sweep_with_tpu_estimate_on_a_cpu_host_writes_estimates(cache_dir):
    env = subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir)
    r = subprocess.run([sys.executable, "-m", "pallas_tune", "sweep", "toy_kernels:scale",
                        "--shapes", "x=256x512:float32", "--chip", "v6e", "--timer",
                        "tpu-estimate", "--trials", "4"], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "compiler estimate" in r.stdout
    data = json.loads((cache_dir / "tpu_v6e" / "toy_kernels.scale.estimate.json").read_text())
    assert data["kind"] == "estimate"
    (entry,) = data["entries"].values()
    assert entry["provenance"]["kind"] == "estimate"
    assert entry["provenance"]["timer"] == "tpu-estimate"
    from pallas_tune.cache import TuningCache  # The trials live in the ledger (issue 14).

    trials = TuningCache(str(cache_dir), use_shipped=False).trials(
        "tpu_v6e", "toy_kernels.scale", "x=256x512:float32,factor=2.0", kind="estimate")
    assert trials and all("estimated_cycles" in t for t in trials if t["outcome"] == "ok")
    show = subprocess.run([sys.executable, "-m", "pallas_tune", "show"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert "ESTIMATE" in show.stdout and "tpu_v6e" in show.stdout
    # A measured entry for the same chip and key wins over the estimate.
    import toy_kernels

    key = "x=256x512:float32,factor=2.0"
    toy_kernels.scale.cache.write("tpu_v6e", toy_kernels.scale.name, key,
                                  {"config": {"br": 8, "bc": 128, "buffering": 1}})
    toy_kernels.scale._memo.clear()
    with pt.target("v6e"):
        cfg = toy_kernels.scale.config_for(jax.ShapeDtypeStruct((256, 512), jnp.float32))
    assert cfg.source == "cache" and dict(cfg) == {"br": 8, "bc": 128, "buffering": 1}
    toy_kernels.scale._memo.clear()


def test_estimate_timer_refuses_non_tpu_chip(cache_dir, fresh):
    with pytest.raises(ValueError, match="needs a TPU chip"):
        fresh.scale.tune(fresh.ones(), timer="tpu-estimate", chip="cpu")
    with pytest.raises(ValueError, match="cannot fill the cache of 'tpu_v6e'"):
        fresh.scale.tune(fresh.ones(), chip="v6e")


@pytest.mark.libtpu
def test_tune_checks_the_standin_and_records_it(cache_dir):
    x = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)
    small = pt.tunable(bm=[128, 256], bn=[256], bk=[512], buffering=[2], semantics=[SEM],
                       standin=matmul.standin, name="mm_small")(matmul.fn)
    # Importable for the worker processes under the name of the function it wraps.
    res = small.tune(x, x, trials=4, timer="tpu-estimate", chip="v6e", write=False)
    check = res.provenance["standin_check"]
    assert check["trusted"] and check["relative_error"] < 0.05
    assert res.provenance["kind"] == "estimate"


def test_roofline_ranks_tiles():
    from pallas_tune.feasibility.roofline import roofline

    times = [roofline(matmul, (X, X), dict(bm=t, bn=t, bk=t, buffering=2, semantics=SEM),
                      chip="v6e").time_ms for t in (128, 256, 512, 1024)]
    assert times == sorted(times, reverse=True)




@pytest.mark.libtpu
def test_a_dying_compile_worker_costs_only_its_candidate():
    import toy_kernels

    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    cfgs = [dict(br=8, bc=128, buffering=2), dict(br=16, bc=128, buffering=2)]
    with Estimator(2) as est:
        results = est.map(toy_kernels.crashy, (x,), {}, cfgs + [dict(br=64, bc=256, buffering=2)],
                          "v6e", standin=False)
    kinds = [r.kind for r in results]
    assert kinds[0] == "ok" and kinds[1] == "ok" and kinds[2] == "worker_crashed"


def test_a_full_compile_that_dies_leaves_the_standin_in_use_and_labelled():
    """A full problem too big for a worker (seen: an 18 GB LLO profile) must not push every
    candidate onto full compiles that would die the same way."""
    from pallas_tune.measure.estimate import EstimateResult, standin_verdict

    cfg = dict(bm=256, bn=256, bk=256, buffering=2, semantics=SEM)
    scaled = EstimateResult(ok=True, kind="ok", cycles=1000, scale=4.0)
    died = EstimateResult(ok=False, kind="worker_crashed", message="the compile worker died")
    with pytest.warns(pt.PallasTuneWarning, match="UNVERIFIED"):
        use, check = standin_verdict(cfg, 4.0, scaled, died)
    assert use and check["unverified"] and not check["trusted"]
    near = EstimateResult(ok=True, kind="ok", cycles=1030)
    assert standin_verdict(cfg, 4.0, scaled, near) == (True, {
        "config": cfg, "scale": 4.0, "relative_error": 0.0291, "trusted": True})
    far = EstimateResult(ok=True, kind="ok", cycles=1200)
    assert standin_verdict(cfg, 4.0, scaled, far)[0] is False


def _checker(scales, outcomes):
    """An EstimateEvaluator whose workers answer stand-in scales and estimates from tables."""
    from types import SimpleNamespace

    from pallas_tune.measure.estimate import EstimateEvaluator

    ev = object.__new__(EstimateEvaluator)
    ev.has_standin, asked, ev.used = True, [], []
    ev.pool = SimpleNamespace(
        map=lambda calls, **kw: [SimpleNamespace(kind="done", value=scales[c[1][0]["t"]])
                                 for c in calls],
        remember=lambda method, use: ev.used.append(use))
    ev._estimate = lambda config, standin: (asked.append((config["t"], standin))
                                            or outcomes[(config["t"], standin)])
    return ev, asked


def test_the_standin_check_passes_over_standins_that_die_in_their_worker():
    """The smallest-scale candidate may keep many steps on its stand-in (matmul_bwd at
    4096x4096x28672 with 128 dx tiles beside 1024 dy ones: its stand-in died at 12 GB, and
    the check then sent every candidate to full compiles that died too)."""
    from pallas_tune.measure.estimate import EstimateResult

    ok = lambda c: EstimateResult(ok=True, kind="ok", cycles=c)  # noqa: E731
    died = EstimateResult(ok=False, kind="worker_crashed", message="the worker died")
    configs = [{"t": t} for t in (1, 2, 3, 4)]
    scales = {1: 1.5, 2: 3.0, 3: 1.0, 4: 2.0}  # Tried by scale above 1: t=1, then 4, then 2.
    ev, asked = _checker(scales, {(1, True): died, (4, True): ok(1000), (4, False): ok(1020)})
    use, check = ev.check_standin(configs)
    assert use and check["trusted"] and check["config"] == {"t": 4} and ev.used == [True]
    assert asked == [(1, True), (4, True), (4, False)]
    # Every stand-in tried dies (3 at most): no full compile, the stand-in kept UNVERIFIED.
    ev, asked = _checker(scales, {(t, True): died for t in (1, 2, 4)})
    with pytest.warns(pt.PallasTuneWarning, match="stand-in compile .* UNVERIFIED"):
        use, check = ev.check_standin(configs)
    assert use and check["unverified"] and asked == [(1, True), (4, True), (2, True)]


def test_a_config_that_fails_on_its_standin_does_not_turn_the_standin_off():
    """32768-row matmuls: the smallest-scale candidate failed to compile on its stand-in (its
    own failure, not the method's), and the check had then sent every candidate to full
    compiles, most of which died (1279 s for one call's 6 trials). The next config is tried;
    where none completes, the stand-in is kept, labelled; a stand-in that compiles where the
    full problem fails to (not dies) turns it off."""
    from pallas_tune.measure.estimate import EstimateResult

    ok = lambda c: EstimateResult(ok=True, kind="ok", cycles=c)  # noqa: E731
    oom = EstimateResult(ok=False, kind="vmem_oom", message="CompileTimeScopedVmemOom")
    died = EstimateResult(ok=False, kind="worker_crashed", message="the worker died")
    configs = [{"t": t} for t in (1, 2, 3, 4)]
    scales = {1: 1.5, 2: 3.0, 3: 1.0, 4: 2.0}
    ev, asked = _checker(scales, {(1, True): oom, (4, True): ok(1000), (4, False): ok(990)})
    use, check = ev.check_standin(configs)
    assert use and check["trusted"] and check["config"] == {"t": 4}
    assert check["passed_over"] == [{"config": {"t": 1}, "compile": "stand-in",
                                     "kind": "vmem_oom", "message": "CompileTimeScopedVmemOom"}]
    ev, asked = _checker(scales, {(1, True): oom, (4, True): died, (2, True): oom})
    with pytest.warns(pt.PallasTuneWarning, match="stand-in compile .* UNVERIFIED"):
        use, check = ev.check_standin(configs)
    assert use and check["unverified"] and len(check["passed_over"]) == 3
    ev, asked = _checker(scales, {(1, True): ok(1000), (1, False): oom})
    use, check = ev.check_standin(configs)
    assert not use and ev.used == [False] and check["passed_over"][0]["compile"] == "full"
    assert asked == [(1, True), (1, False)]


def test_the_standin_check_compiles_nothing_where_no_candidate_shrinks_or_one_raises():
    """standin.check: no candidate with a scale other than 1 needs no check (the stand-in is
    the problem itself); a stand-in function that raises turns the stand-in off, before any
    compile."""
    from pallas_tune.measure import standin

    def never(config, use_standin):
        raise AssertionError(f"compiled {config} (standin={use_standin})")

    configs = [{"t": 1}, {"t": 2}]
    assert standin.check(configs, [1, None], never) == (
        True, {"note": "no candidate needed a stand-in"})
    assert standin.check(configs, [2.0, "error"], never) == (False, {"error": "stand-in raised"})
    ev, asked = _checker({1: "error", 2: 2.0}, {})
    assert ev.check_standin(configs) == (False, {"error": "stand-in raised"})
    assert ev.used == [False] and asked == []


@pytest.mark.libtpu
def test_estimate_sweeps_warm_start_from_neighbours_and_the_roofline(cache_dir, monkeypatch):
    """The estimate workers rank warm starts too: a nearby shape's winner is the first
    candidate after the default (it was dropped when the estimate session had no roofline
    method: every estimate sweep then started from the default alone)."""
    from pallas_tune.cache import store

    # Only this test's entry: the shipped v6e caches hold this very shape, whose own entry
    # would rightly come first.
    monkeypatch.setattr(store, "_DEFAULT", store.TuningCache(str(cache_dir), use_shipped=False))
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    nx, ny = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1024, 1536), (1536, 1024)))
    winner = dict(vmem_limit_bytes=0, bm=512, bn=256, bk=1024, buffering=2, semantics=SEM)
    matmul.cache.write("tpu_v6e", matmul.name, matmul.cache_key(nx, ny),
                       {"config": winner, "median_ms": 0.01})
    res = matmul.tune(x, x, trials=3, timer="tpu-estimate", chip="v6e", write=False, workers=1)
    tried = res.trials.sort_values("number").head(3).to_dict("records")
    tiles = [(t["bm"], t["bn"], t["bk"]) for t in tried]
    default = matmul.space.default
    assert tiles[0] == (default["bm"], default["bn"], default["bk"]), tiles
    assert tiles[1] == (512, 256, 1024), tiles
    # The third is the roofline model's pick: big tiles, not a sampler's random point.
    assert tiles[2][0] * tiles[2][1] >= 512 * 512, tiles


def test_worker_memory_gb_caps_each_estimate_worker(monkeypatch):
    """TuneOptions.worker_memory_gb (--worker-memory-gb) reaches the estimate pool as a byte
    cap; unset, the pool's host-sized default (-1) applies."""
    import types

    from pallas_tune.measure import estimate
    from pallas_tune.tuning.options import TuneOptions
    from pallas_tune.tuning.plan import open_evaluator

    seen = []

    def evaluator(*_, memory_limit_bytes, **__):
        seen.append(memory_limit_bytes)
        return types.SimpleNamespace(start=lambda: None)

    monkeypatch.setattr(estimate, "EstimateEvaluator", evaluator)
    plan = types.SimpleNamespace(estimating=True, parts=None, setup=None)
    open_evaluator(plan, TuneOptions(worker_memory_gb=1.5))
    open_evaluator(plan, TuneOptions())
    assert seen == [int(1.5 * 2**30), -1]
