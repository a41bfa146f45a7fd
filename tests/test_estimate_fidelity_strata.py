"""benchmarks/estimates/estimate_fidelity's stratified sample (issue 55), on tiny made-up data:
the v6e int8 and v7 float8 tables, the strata (n_batch 8192 and 16384 among them), the seeded
draw (every stratum once before any twice), the drawn space, the capped stand-in, and the
report's figures: the winner's rank estimated in the whole space, K95, and what a tune with
``--estimate-fallback model`` ranks (the model calibrated onto libtpu's figures)."""

from __future__ import annotations

import json
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
    with estimate_modules("estimate_fidelity_strata", "estimate_fidelity_strata_report",
                          "estimate_fidelity_complete") as m:
        yield m


def test_chip_tables_keep_v6e_int8_and_v7_float8_only(mods):
    st, *_ = mods
    v6e, v7 = st.chip_table(RAW, "v6e"), st.chip_table(RAW, "7x")
    assert len(v6e) == 5 and (64, 128, 128) not in v6e
    assert v7 == {(1024, 4096, 4096): (256, 256, 256), (64, 1024, 1024): (64, 512, 1024)}


def test_strata_hold_8192_and_16384_apart_and_cut_size_at_tertiles(mods):
    st, *_ = mods
    table = st.chip_table(RAW, "v6e")
    lo, hi = st.size_edges(table)
    assert lo <= hi
    names = {st.stratum(k, (lo, hi)) for k in table}
    assert any(n.startswith("n_batch 8192 /") for n in names)
    assert any(n.startswith("n_batch 16384 /") for n in names)
    assert st.stratum((16, 128, 128), (1 << 20, 1 << 24)) == "n_batch 16-64 / small"
    assert st.stratum((16, 4096, 4096), (1 << 20, 1 << 24)) == "n_batch 16-64 / large"


def test_the_draw_is_seeded_and_covers_every_stratum_before_any_twice(mods):
    st, *_ = mods
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
    st, *_ = mods
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
    st, *_ = mods
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
    _, rp, _ = mods
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
    _, rp, _ = mods
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
    _, rp, _ = mods
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
    _, rp, _ = mods
    meta = {"planned": [{"chip": "v6e", "key": [1024, 1024, 1024]},
                        {"chip": "7x", "key": [64, 1024, 1024]}],
            "versions": {"tpu-inference": "0.32.0"}, "command": "x", "date": "d",
            "host": "h", "workers": 1, "total_s": 60, "rivals": 20, "seed": 55,
            "per_stratum": {"v6e": 2, "7x": 1},
            "caps": {"mac_cap": 1e9, "step_cap": 256, "min_steps": 128, "check_cap_s": 20}}
    text = rp.report({"meta": meta, "runs": [_run(proxy_ms=[[[1, 1, 1], 1.0]])]})
    assert "1 of 2 planned keys done" in text and "7x (64, 1024, 1024)" in text
    assert "K95" in text and "| v6e | 1024-4096 / small | (1024, 1024, 1024) |" in text


def test_what_a_users_shapes_see_counts_the_pick_within_2pc_per_batch_band(mods):
    """The user table gives, per n_batch band, on how many keys the pick is within 2% of the
    winner's figure: 1.01x counts, 1.5x does not, and the bands are kept apart."""
    _, rp, _ = mods
    near = [[[1, 1, 1], 1.01], [[2, 2, 2], 1.0], [[3, 3, 3], 3.0]]
    far = [[[1, 1, 1], 1.5], [[2, 2, 2], 1.0], [[3, 3, 3], 3.0]]
    small = [_run(key=[k, 1024, 1024], proxy_ms=f) for k, f in ((16, near), (32, far))]
    large = [_run(key=[8192, 1024, 1024], proxy_ms=far, stratum="n_batch 8192 / small")]
    lines = rp.user_rows(small + large)
    head = lines[0].split(" | ")
    col = head.index("libtpu: pick within 2%")
    rows = {r.split(" | ")[1]: r.split(" | ") for r in lines[2:]}
    assert rows["n_batch 16-64"][col] == "1/2" and rows["n_batch 8192"][col] == "0/1"
    assert rows["all"][col] == "1/3" and rows["n_batch 16-64"][col - 1] == "2"  # K95: 2nd.


def _completed():
    """Drawn: the winner (1, 1, 1) and two rivals, libtpu and the model agreeing (calibration
    1.0). The whole space adds (5, 5, 5) and (6, 6, 6), which the model puts ahead of the
    winner (contenders: compiled), and (7, 7, 7), which it puts behind (never compiled)."""
    drawn = [[[1, 1, 1], 1.0], [[2, 2, 2], 2.0], [[3, 3, 3], 3.0]]
    run = _run(proxy_ms=drawn, public_ms=drawn, space=6)
    whole = [*drawn, [[5, 5, 5], 0.5], [[6, 6, 6], 0.8], [[7, 7, 7], 5.0]]
    return run, whole


def test_only_configs_the_model_puts_ahead_are_compiled_to_complete_a_run(mods):
    _, _, ec = mods
    run, whole = _completed()
    public = {tuple(b): v for b, v in whole}
    assert ec.contenders(run, public) == [(5, 5, 5), (6, 6, 6)]
    # The drawn pick bounds it too: a winner far behind raises the threshold to its figure.
    slow = _run(proxy_ms=[[[1, 1, 1], 6.0], *run["proxy_ms"][1:]],
                public_ms=[[[1, 1, 1], 6.0], *run["public_ms"][1:]])
    assert ec.contenders(slow, public) == [(5, 5, 5), (6, 6, 6), (7, 7, 7)]
    # Ranked by the model alone (libtpu figured under 3): its whole-space rank is the model's.
    few = _run(proxy_ms=run["proxy_ms"][:2], public_ms=run["public_ms"])
    assert ec.contenders(few, public) == []


def test_a_completed_run_ranks_the_models_and_the_tune_over_the_whole_space(mods):
    _, rp, ec = mods
    run, whole = _completed()
    # (5, 5, 5): libtpu's 2.5 is behind the winner; (6, 6, 6): its profile aborted, ranked by
    # the calibrated model's 0.8, ahead; a contender whose compile failed has no figure.
    run["whole"] = {"public_ms": whole, "roofline_ms": whole, "fitted_ms": whole,
                    "contenders": [[5, 5, 5], [6, 6, 6], [8, 8, 8]],
                    "proxy_ms": [[[5, 5, 5], 2.5]], "aborted": [[6, 6, 6]],
                    "flag_only_oom": [], "failures": {"vmem_physical_oom": 1}}
    run["whole"]["public_ms"] = [*whole, [[8, 8, 8], 0.1]]
    tune = ec.whole_tune(run)
    assert tune[(5, 5, 5)] == 2.5 and tune[(6, 6, 6)] == pytest.approx(0.8)
    assert tune[(7, 7, 7)] == 5.0 and (8, 8, 8) not in tune  # A lower bound; no figure.
    t = rp.judge(run, "tune")
    assert (t["rank"], t["exact"], t["ratio"]) == (2, True, pytest.approx(1 / 0.8))
    pub = rp.judge(run, "public")
    assert (pub["rank"], pub["est_rank"], pub["exact"]) == (4, 4, True)  # (8, 8, 8) too.
    lib = rp.judge(run, "libtpu")  # No bound outside the drawn configs: the draw's estimate.
    assert (lib["rank"], lib["exact"]) == (1, False)
    meta = {"planned": [{"chip": "v6e", "key": [1024, 1024, 1024]}],
            "versions": {"tpu-inference": "0.32.0"}, "command": "x", "date": "d",
            "host": "h", "workers": 1, "total_s": 60, "rivals": 2, "seed": 55,
            "per_stratum": {"v6e": 2}, "complete_command": "y --complete",
            "caps": {"mac_cap": 1e9, "step_cap": 256, "min_steps": 128, "check_cap_s": 20}}
    text = rp.report({"meta": meta, "runs": [run]})
    assert "y --complete" in text and "| 2 (exact) | 4 (exact) |" in text


class _FakeEstimator:
    """Estimator.map's shape: per config, libtpu's figure from ``cycles`` (by block sizes), a
    physical VMEM OOM for the configs in ``oom``, or a profiler abort for those in ``abort``."""

    def __init__(self, cycles, oom=(), abort=()):
        self.cycles, self.oom, self.abort, self.asked = cycles, set(oom), set(abort), []

    def map(self, parts, args, kwargs, configs, chip, **_):
        from pallas_tune.feasibility.compile import VMEM_PHYSICAL
        from pallas_tune.measure.estimate import EstimateResult

        out = []
        for c in configs:
            b = (c["batch_block"], c["out_block"], c["in_block"])
            self.asked.append(b)
            if b in self.oom:
                out.append(EstimateResult(ok=False, kind=VMEM_PHYSICAL, message="vmem"))
            elif b in self.abort:
                out.append(EstimateResult(ok=False, kind="compile_error",
                                          message="Cannot schedule FIFO push instruction"))
            else:
                out.append(EstimateResult(ok=True, kind="ok", cycles=self.cycles(b)))
        return out


def test_completing_a_run_compiles_exactly_its_contenders(mods):
    """The whole-space step as the benchmark runs it, libtpu faked: the models traced over the
    key's whole space, the contenders (and nothing else) sent to libtpu, a profile abort and
    a flag-only VMEM OOM (the unprofiled compile fits) kept apart from a real failure."""
    st, _, ec = mods
    from estimate_fidelity_qmm import TPU_INFERENCE_DIR

    if TPU_INFERENCE_DIR is None:
        pytest.skip("tpu-inference is not installed (pip install --no-deps "
                    "tpu-inference==0.32.0): its kernel is traced for the model's figures")
    from pallas_tune.chips import chip_spec

    table = st.chip_table(RAW, "v6e")
    key = (16, 1536, 640)
    full, _ = st.strata_space(key, table)
    public = {b: v * 1e3 for b, v in st.model_figures(key, full, "v6e", "int8")[2].items()}
    winner = sorted(public, key=public.get)[3]  # As if: three configs the model puts ahead.
    clock = chip_spec("v6e").clock_hz
    # libtpu agrees with the model (calibration 1) on the drawn configs: the winner and the
    # two configs the model ranks last; everything the model puts ahead is a contender.
    drawn = [winner] + sorted(public, key=public.get)[-2:]
    rows = [[list(b), public[b]] for b in drawn]
    run = {"chip": "v6e", "key": list(key), "winner": list(winner), "stratum": "s",
           "proxy_ms": rows, "public_ms": rows, "aborted": [], "flag_only_oom": []}
    ahead = sorted(b for b, v in public.items() if v < public[winner])
    est = _FakeEstimator(lambda b: int(public[winner] * 10 * clock / 1e3), oom=ahead[:1],
                         abort=ahead[1:2])
    plain = _FakeEstimator(lambda b: 1)  # Without the profiling flag, everything compiles.
    whole = ec.complete_run(est, plain, run, table)
    assert sorted(est.asked) == ahead == sorted(tuple(b) for b in whole["contenders"])
    assert whole["space"] == len(full) and len(whole["public_ms"]) == len(public)
    assert [tuple(b) for b in whole["flag_only_oom"]] == ahead[:1] == plain.asked
    assert [tuple(b) for b in whole["aborted"]] == ahead[1:2]
    assert {tuple(b) for b, _ in whole["proxy_ms"]} == set(ahead[2:])
    run["whole"] = whole
    tune = ec.whole_tune(run)
    # libtpu's figure puts the contenders it estimated far behind the winner;
    # the aborted and flag-only ones keep the calibrated model's figure, ahead of it.
    rank = 1 + sum(1 for b, v in tune.items() if b != winner and v < tune[winner])
    assert rank == 1 + len(ahead[:2])


def test_the_page_carries_ragged_paged_attentions_rows_in_its_rank_table(mods, tmp_path):
    """rpa_fidelity.py's like-for-like ranks, read back into this page's rank table: K95 (none
    where the winner is unranked on more than 5% of keys), top 1 / 3 / 8, pick within 2%."""
    _, rp, _ = mods
    assert rp.rpa_lines(str(tmp_path / "absent.json")) == []
    rows = [{"page": 16, "heads": "32/8", "rank": 1, "ratio": 1.0},
            {"page": 16, "heads": "32/8", "rank": 2, "ratio": 1.05},
            {"page": 128, "heads": "28/4", "rank": None, "ratio": None}]
    path = tmp_path / "ranks.json"
    path.write_text(json.dumps({"command": "python rpa_fidelity.py", "date": "d",
                                "versions": "jax x", "rows": rows}))
    text = "\n".join(rp.rpa_lines(str(path)))
    assert "| page 16 (32/8 q/kv heads) | 2 | 2 | 1/2 / 2/2 / 2/2 | 1/2 |" in text
    assert "| page 128 (28/4 q/kv heads) | 1 | none | 0/1 / 0/1 / 0/1 | 0/1 |" in text
    assert "| all keys | 3 | none | 1/3 / 2/3 / 2/3 | 1/3 |" in text
    assert "`python rpa_fidelity.py`" in text


class _AffineLibtpu:
    """libtpu faked as a program that pays ``once`` cycles per compile and ``step`` per grid
    step, on whatever operands (a stand-in's or the full problem's) it is given: the case the
    two-point figure is exact for, and a scaled stand-in overcounts."""

    def __init__(self, once, step, fail_full=()):
        self.once, self.step, self.full, self.fail_full = once, step, [], set(fail_full)

    def map(self, parts, args, kwargs, configs, chip, standin=True, **_):
        from estimate_fidelity_strata import counts
        from pallas_tune.measure.estimate import EstimateResult

        out = []
        for c in configs:
            b = (c["batch_block"], c["out_block"], c["in_block"])
            a, scale = list(args), 1.0
            if standin and getattr(parts, "standin", None):
                a, _, scale = parts.standin(a, kwargs, c)
            else:
                self.full.append(b)
                if b in self.fail_full:  # As flag-only VMEM OOMs of full programs do.
                    out.append(EstimateResult(ok=False, kind="vmem_physical_oom",
                                              message="Ran out of memory in memory space vmem"))
                    continue
            key = (a[0].shape[0], a[1].shape[0], a[0].shape[1])
            raw = self.once + self.step * math.prod(counts(key, b))
            out.append(EstimateResult(ok=True, kind="ok", cycles=int(raw * scale),
                                      standin_cycles=raw, scale=scale))
        return out


def test_two_point_figures_count_once_what_a_program_pays_once(mods):
    """The two-point stand-in (``--two-point``) on a fake libtpu whose figure is affine in the
    grid steps compiled: every cut config's figure becomes the full program's exactly (the
    scaled one overcounts the once-per-program cost), an uncut config keeps its figure, the
    scaled figures are kept, the contenders the new calibration admits are compiled, and the
    check compiles the real winner in full."""
    st, _, ec = mods
    import estimate_fidelity_twopoint as tp
    from pallas_tune.chips import chip_spec

    key = (8192, 8192, 1024)
    assert tp.pair(key, (512, 8192, 1024)) == ((1, 1, 1), (2, 1, 1))
    assert tp.pair((64, 1024, 1024), (64, 512, 1024)) is None  # Nothing cut.
    assert tp.extrapolate(3.0, 5.0, 1, 2, 16) == pytest.approx(3.0 + 2.0 * 15)
    assert tp.extrapolate(5.0, 5.0, 1, 2, 16) is None  # No per-step cost seen.
    clock = chip_spec("v6e").clock_hz
    once, step = 40_000, 10_000
    winner, rival, small = (512, 8192, 1024), (2048, 2048, 1024), (4096, 256, 128)
    lib = _AffineLibtpu(once, step, fail_full={rival})  # Its full compile gives no figure.

    def ms(cycles):
        return cycles / clock * 1e3

    def scaled(b):
        keep = st.standin_keep(key, b)
        n, total = math.prod(keep), math.prod(st.counts(key, b))
        return ms(once + step * n) * total / n

    drawn = [winner, rival, small]
    public = {winner: 1.0, rival: 1.0, small: 10.0, (1024, 8192, 1024): 0.9}
    run = {"chip": "v6e", "key": list(key), "winner": list(winner), "stratum": "s",
           "proxy_ms": [[list(b), scaled(b)] for b in drawn],
           "public_ms": [[list(b), public[b]] for b in drawn], "aborted": [],
           "flag_only_oom": []}
    run["whole"] = {"public_ms": [[list(b), v] for b, v in public.items()], "contenders": [],
                    "proxy_ms": [], "aborted": [], "flag_only_oom": [], "failures": {}}
    # The run holds no contender yet: refining compiles those the new calibration admits.
    tp.refine_run(lib, _FakeEstimator(lambda b: 1), run)
    figs = {tuple(b): v for b, v in run["proxy_ms"]}
    for b in drawn:
        exact = ms(once + step * math.prod(st.counts(key, b)))
        assert scaled(b) > exact * 1.01
        assert figs[b] == pytest.approx(exact, rel=1e-4)
    assert {tuple(b): v for b, v in run["scaled_proxy_ms"]} == {b: scaled(b) for b in drawn}
    assert ec.contenders(run, public) == [(1024, 8192, 1024)]
    assert run["whole"]["contenders"] == [[1024, 8192, 1024]]
    (b, v), = run["whole"]["proxy_ms"]
    assert v == pytest.approx(ms(once + step * 8), rel=1e-4)
    # Compiled in full too where affordable (here every cut config but the 512-step one):
    # the figure is the full compile's, which checks the two-point and scaled ones. The one
    # whose full compile failed keeps its two-point figure (exact here), its row kept as None.
    checks = {tuple(c["config"]): c for c in tp.checks(run)}
    assert set(lib.full) == {winner, rival, (1024, 8192, 1024)}
    assert set(checks) == {winner, (1024, 8192, 1024)}
    assert [list(rival), None] in run["two_point"]["full"]
    for c in checks.values():
        assert c["two_point_error"] == pytest.approx(0, abs=1e-4)
    assert checks[winner]["scaled_error"] > 0.5  # 2 of 16 steps kept: once cost x8.
    assert checks[winner]["winner"] and not checks[(1024, 8192, 1024)]["winner"]
    s = tp.summary([run])
    assert (s["configs"], s["full"], s["two_point"], s["kept_scaled"]) == (4, 2, 2, 0)
    assert len(s["winner_two_point_errors"]) == 1
