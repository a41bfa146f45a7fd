"""benchmarks/estimates/estimate_fidelity's stratified sample (issue 55), on tiny made-up data:
the v6e int8 and v7 float8 tables, the strata (n_batch 8192 and 16384 among them), the seeded
draw (every stratum once before any twice), the drawn space, the capped stand-in, and the
report's figures: the winner's rank estimated in the whole space, K95, and what a tune with
``--estimate-fallback model`` ranks (the model calibrated onto libtpu's figures)."""

from __future__ import annotations

import math

import pytest
from conftest import estimate_modules

RAW = {
    (6, 16, 1536, 640, "int8", "int8"): (16, 768, 640),
    (6, 256, 8192, 8192, "int8", "int8"): (256, 1024, 2048),
    (6, 8192, 2048, 2048, "int8", "int8"): (1024, 1024, 2048),
    (6, 16384, 128, 8192, "int8", "int8"): (2048, 128, 8192),
    (6, 16384, 4096, 4096, "int8", "int8"): (1024, 2048, 4096),
    (6, 64, 128, 128, "float8_e4m3fn", "int8"): (64, 128, 128),
    (7, 1024, 4096, 4096, "float8_e4m3fn", "float8_e4m3fn"): (256, 256, 256),
    (7, 1024, 4096, 4096, "float8_e4m3fn", "float4_e2m1fn"): (512, 256, 256),
    (7, 64, 1024, 1024, "float8_e4m3fn", "float8_e4m3fn"): (64, 512, 1024),
}


@pytest.fixture(scope="module")
def mods():
    """(strata, report) modules, taken out of ``sys.modules`` afterwards with the stub
    ``tpu_inference`` modules their import installs."""
    with estimate_modules("estimate_fidelity_strata", "estimate_fidelity_strata_report") as m:
        yield m


def test_chip_tables_keep_v6e_int8_and_v7_float8_only(mods):
    st, _ = mods
    v6e, v7 = st.chip_table(RAW, "v6e"), st.chip_table(RAW, "7x")
    assert len(v6e) == 5 and (64, 128, 128) not in v6e
    assert v7 == {(1024, 4096, 4096): (256, 256, 256), (64, 1024, 1024): (64, 512, 1024)}


def test_strata_hold_8192_and_16384_apart_and_cut_size_at_tertiles(mods):
    st, _ = mods
    table = st.chip_table(RAW, "v6e")
    lo, hi = st.size_edges(table)
    assert lo <= hi
    names = {st.stratum(k, (lo, hi)) for k in table}
    assert any(n.startswith("n_batch 8192 /") for n in names)
    assert any(n.startswith("n_batch 16384 /") for n in names)
    assert st.stratum((16, 128, 128), (1 << 20, 1 << 24)) == "n_batch 16-64 / small"
    assert st.stratum((16, 4096, 4096), (1 << 20, 1 << 24)) == "n_batch 16-64 / large"


def test_the_draw_is_seeded_and_covers_every_stratum_before_any_twice(mods):
    st, _ = mods
    tables = {c: st.chip_table(RAW, c) for c in st.CHIPS}
    entries = st.draw(tables, {"v6e": 2, "7x": 1}, seed=5)
    assert entries == st.draw(tables, {"v6e": 2, "7x": 1}, seed=5)
    assert len(entries) == len({(e.chip, e.key) for e in entries}) == 7  # Every key: all fit.
    strata = [(e.chip, e.stratum) for e in entries]
    first = len(set(strata))
    assert len(set(strata[:first])) == first  # Round one covers every stratum once.
    for e in entries:
        assert tables[e.chip][e.key] == e.winner
        assert e.stratum == st.stratum(e.key, st.size_edges(tables[e.chip]))


def test_the_drawn_space_holds_the_winner_the_default_and_seeded_rivals(mods):
    st, _ = mods
    table = st.chip_table(RAW, "v6e")
    e = st.Entry("v6e", (16384, 4096, 4096), (1024, 2048, 4096), "s")
    blocks, n = st.drawn_space(e, table, rivals=5, seed=1)
    assert blocks[:2] == [e.winner, st.MISS_DEFAULT] and len(blocks) == 7
    assert blocks == st.drawn_space(e, table, rivals=5, seed=1)[0]
    full, refused = st.strata_space(e.key, table)
    assert n == len(full) and refused > 0 and all(st.valid(e.key, b) for b in blocks)
    everything, n2 = st.drawn_space(e, table, rivals=10_000, seed=1)
    assert sorted(everything) == sorted(full) and n2 == len(full)


def test_the_capped_standin_bounds_the_compile_and_scales_by_the_blocks_cut(mods):
    st, _ = mods
    key = (16384, 4096, 8192)
    for b in [(128, 128, 128), (1024, 2048, 512), (2048, 4096, 8192), (16384, 128, 128)]:
        keep = st.standin_keep(key, b)
        full = st.counts(key, b)
        assert all(min(f, 2) <= k <= f for k, f in zip(keep, full, strict=True))
        assert (st.macs(key, b, keep) <= st.MAC_CAP or all(
            k == min(f, 2) for k, f in zip(keep, full, strict=True)))
        assert math.prod(keep) <= st.STEP_CAP or keep[0] == min(full[0], 2)
    assert st.standin_keep((256, 1024, 1024), (256, 512, 512)) == (1, 2, 2)  # Small: uncut.
    import jax
    import jax.numpy as jnp

    args = (jax.ShapeDtypeStruct((16384, 8192), jnp.bfloat16),
            jax.ShapeDtypeStruct((4096, 8192), jnp.int8),
            jax.ShapeDtypeStruct((4096,), jnp.float32))
    cfg = {"batch_block": 1024, "out_block": 512, "in_block": 512}
    (x, w, s), kwargs, scale = st.capped_standin(args, {}, cfg)
    keep = st.standin_keep(key, (1024, 512, 512))
    assert x.shape == (keep[0] * 1024, keep[2] * 512) and w.shape == (keep[1] * 512,
                                                                      keep[2] * 512)
    assert s.shape == (keep[1] * 512,) and w.dtype == jnp.int8 and kwargs == {}
    assert scale == math.prod(st.counts(key, (1024, 512, 512))) / math.prod(keep) > 1


def _run(**kw):
    run = {"chip": "v6e", "key": [1024, 1024, 1024], "winner": [1, 1, 1], "stratum":
           "n_batch 1024-4096 / small", "configs": 5, "space": 5, "proxy_ms": [],
           "fitted_ms": [], "roofline_ms": [], "aborted": [], "failures": {},
           "standin_check": "no config needed a stand-in", "winner_kind": "ok"}
    return {**run, **kw}


def test_the_winners_rank_is_estimated_in_the_whole_space_and_k95_counts_misses(mods):
    _, rp = mods
    figs = [[[1, 1, 1], 2.0], [[2, 2, 2], 1.0], [[3, 3, 3], 3.0], [[4, 4, 4], 4.0]]
    exact = rp.judge(_run(proxy_ms=figs), "libtpu")
    assert (exact["rank"], exact["est_rank"], exact["ratio"]) == (2, 2, 2.0)
    # 1 of 4 drawn rivals ahead of it, in a space of 41: about 10 of 40 rivals.
    drawn = rp.judge(_run(proxy_ms=figs, space=41), "libtpu")
    assert drawn["rank"] == 2 and drawn["est_rank"] == 11
    missing = rp.judge(_run(proxy_ms=figs[1:]), "libtpu")
    assert missing["rank"] is None and missing["est_rank"] == math.inf
    assert rp.k95([1] * 19 + [7]) == 1 and rp.k95([1] * 18 + [9, 7]) == 7  # 95% of 20: 19.
    assert rp.k95([1] * 20 + [math.inf]) == 1
    assert rp.k95([1, 2, math.inf]) == math.inf and rp.k_text(math.inf) == "none"
    s = rp.rates([_run(proxy_ms=figs), _run(proxy_ms=figs[1:])], "libtpu")
    assert (s["keys"], s["top1"], s["top3"], s["unranked"], s["k95"]) == (2, 0, 1, 1, math.inf)


def test_a_tune_ranks_aborted_configs_by_the_model_calibrated_onto_libtpu(mods):
    _, rp = mods
    lib = [[[2, 2, 2], 1.0], [[3, 3, 3], 2.0], [[4, 4, 4], 3.0]]
    fit = [[[1, 1, 1], 1.0], [[2, 2, 2], 2.0], [[3, 3, 3], 4.0], [[4, 4, 4], 6.0]]
    run = _run(proxy_ms=lib, fitted_ms=fit, aborted=[[1, 1, 1]])
    tune = rp.figures(run, "tune")
    assert tune[(1, 1, 1)] == pytest.approx(0.5)  # The model's 1.0 times libtpu/model 0.5.
    assert rp.judge(run, "tune")["rank"] == 1 and rp.judge(run, "libtpu")["rank"] is None
    # Out of VMEM only under the profiling flag: the same route as an abort.
    oom = _run(proxy_ms=lib, fitted_ms=fit, flag_only_oom=[[1, 1, 1]])
    assert rp.figures(oom, "tune")[(1, 1, 1)] == pytest.approx(0.5)
    assert (1, 1, 1) not in rp.figures(_run(proxy_ms=lib, fitted_ms=fit), "tune")
    # libtpu figured fewer than 3 configs: every config by the model's own figure.
    few = rp.figures(_run(proxy_ms=lib[:2], fitted_ms=fit, aborted=[[1, 1, 1]]), "tune")
    assert few == {(1, 1, 1): 1.0, (2, 2, 2): 2.0, (3, 3, 3): 4.0}
    # Every config by the larger of libtpu's and the calibrated model's: (4, 4, 4), libtpu's
    # 3.0 but the model's 12.0 x 0.5, is ranked at 6.0.
    slow = [[[1, 1, 1], 1.0], [[2, 2, 2], 2.0], [[3, 3, 3], 4.0], [[4, 4, 4], 12.0]]
    bound = rp.figures(_run(proxy_ms=lib, fitted_ms=slow, aborted=[[1, 1, 1]]), "tune")
    assert bound == {(1, 1, 1): 0.5, (2, 2, 2): 1.0, (3, 3, 3): 2.0, (4, 4, 4): 6.0}
    # libtpu estimated nothing: the model's figures, one scale, for the aborted configs.
    alone = rp.figures(_run(fitted_ms=fit, aborted=[[1, 1, 1], [2, 2, 2]]), "tune")
    assert alone == {(1, 1, 1): 1.0, (2, 2, 2): 2.0}


def test_a_tune_ranks_by_the_public_fit_where_the_run_has_it(mods):
    """Runs made since the fallback's constants were fitted to real-TPU winners carry that
    model's figures (public_ms): a tune's fallback is that model; ``tune+fitted`` is the one
    before it (libtpu's fit). Runs without it keep the fitted model."""
    _, rp = mods
    lib = [[[2, 2, 2], 1.0], [[3, 3, 3], 2.0], [[4, 4, 4], 3.0]]
    fit = [[[1, 1, 1], 1.0], [[2, 2, 2], 2.0], [[3, 3, 3], 4.0], [[4, 4, 4], 6.0]]
    pub = [[[1, 1, 1], 8.0], [[2, 2, 2], 2.0], [[3, 3, 3], 4.0], [[4, 4, 4], 6.0]]
    run = _run(proxy_ms=lib, fitted_ms=fit, public_ms=pub, aborted=[[1, 1, 1]])
    assert rp.figures(run, "tune")[(1, 1, 1)] == pytest.approx(4.0)  # 8.0 x 0.5: last.
    assert rp.judge(run, "tune")["rank"] == 4
    assert rp.figures(run, "tune+fitted")[(1, 1, 1)] == pytest.approx(0.5)
    assert rp.figures(run, "public") == {(1, 1, 1): 8.0, (2, 2, 2): 2.0, (3, 3, 3): 4.0,
                                         (4, 4, 4): 6.0}
    assert rp.figures(_run(proxy_ms=lib, fitted_ms=fit), "public") == {}


def test_the_report_says_how_many_planned_keys_were_done(mods):
    _, rp = mods
    meta = {"planned": [{"chip": "v6e", "key": [1024, 1024, 1024]},
                        {"chip": "7x", "key": [64, 1024, 1024]}],
            "versions": {"tpu-inference": "0.32.0"}, "command": "x", "date": "d",
            "host": "h", "workers": 1, "total_s": 60, "rivals": 20, "seed": 55,
            "per_stratum": {"v6e": 2, "7x": 1},
            "caps": {"mac_cap": 1e9, "step_cap": 256, "min_steps": 128, "check_cap_s": 20}}
    text = rp.report({"meta": meta, "runs": [_run(proxy_ms=[[[1, 1, 1], 1.0]])]})
    assert "1 of 2 planned keys done" in text and "7x (64, 1024, 1024)" in text
    assert "K95" in text and "| v6e | 1024-4096 / small | (1024, 1024, 1024) |" in text
