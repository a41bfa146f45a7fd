import itertools
import math
import statistics

import numpy as np
import optuna
import pytest

from pallas_tune.search import gp
from pallas_tune.search.gp import CandidateBO, CandidateSampler, encode_features

SIZES = [16, 32, 64, 128, 256, 512, 1024]


def _bowl(c):
    """A smooth landscape in log2 tile sizes with a single optimum at (256, 64, 2)."""
    bm, bn, depth = c
    return 1.0 + (math.log2(bm) - 8) ** 2 + 0.5 * (math.log2(bn) - 6) ** 2 + (depth - 2) ** 2


CANDIDATES = list(itertools.product(SIZES, SIZES, [1, 2, 3]))


def test_features_log2_sizes_onehot_labels_and_selectors():
    sizes, labels, selector, const = encode_features(
        [[128, 256, 512], ["a", "b"], [0, 1, 2], [7]])
    assert np.allclose(sizes[:, 0], [0.0, 0.5, 1.0])  # log2, evenly spaced.
    assert labels.shape == (2, 2) and selector.shape == (3, 3)  # One-hot.
    assert const.shape == (1, 0)


def test_never_proposes_measured_or_pending_and_ends_when_exhausted():
    cands = CANDIDATES[:30]
    bo = CandidateBO(cands, [SIZES, SIZES, [1, 2, 3]], seed=0)
    measured, pending = {}, [cands[0], cands[1]]
    while True:
        c = bo.propose(measured, pending)
        if c is None:
            break
        assert c not in measured and c not in pending
        measured[c] = _bowl(c) if len(measured) % 7 else math.inf  # Some failures.
    assert len(measured) == len(cands) - len(pending)


def test_finds_the_optimum_far_sooner_than_random():
    best = min(_bowl(c) for c in CANDIDATES)

    def evals_to_opt(order_fn, seed):
        measured = {}
        for n in range(1, len(CANDIDATES) + 1):
            c = order_fn(measured, seed)
            measured[c] = _bowl(c)
            if measured[c] == best:
                return n
        raise AssertionError("never reached the optimum")

    bos = {}

    def gp(measured, seed):
        bo = bos.setdefault(seed, CandidateBO(CANDIDATES, [SIZES, SIZES, [1, 2, 3]], seed=seed))
        return bo.propose(measured)

    def rand(measured, seed):
        rng = np.random.default_rng(seed + len(measured))
        free = [c for c in CANDIDATES if c not in measured]
        return free[rng.integers(len(free))]

    gp_med = statistics.median(evals_to_opt(gp, s) for s in range(5))
    rand_med = statistics.median(evals_to_opt(rand, s) for s in range(5))
    # 147 candidates, one optimum: random needs ~74; the GP learns the bowl.
    assert gp_med <= 25 and gp_med * 2 < rand_med


def _study(seed=0):
    names = ["bm", "bn", "depth"]
    choices = [SIZES, SIZES, [1, 2, 3]]
    dists = {n: optuna.distributions.CategoricalDistribution(list(range(len(ch))))
             for n, ch in zip(names, choices)}
    cands = [dict(zip(names, (SIZES.index(a), SIZES.index(b), d - 1))) for a, b, d in CANDIDATES]
    sampler = CandidateSampler(cands, dists, values=dict(zip(names, choices)), seed=seed)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(sampler=sampler), names, choices


def _suggest(trial, names, choices):
    return tuple(ch[trial.suggest_categorical(n, list(range(len(ch))))]
                 for n, ch in zip(names, choices))


def test_optuna_sampler_spreads_a_batch_and_honours_enqueued_warm_starts():
    study, names, choices = _study()
    study.enqueue_trial({"bm": SIZES.index(256), "bn": SIZES.index(64), "depth": 1})
    first = study.ask()
    assert _suggest(first, names, choices) == (256, 64, 2)
    study.tell(first, 1.0)
    for _ in range(6):
        t = study.ask()
        study.tell(t, _bowl(_suggest(t, names, choices)))
    # A batch of asks before any tell: each sees the others running, so all differ.
    batch = [study.ask() for _ in range(4)]
    configs = [_suggest(t, names, choices) for t in batch]
    assert len(set(configs)) == 4
    done = {_suggest(t, names, choices) for t in study.trials[:7]}
    assert not done & set(configs)


def test_optuna_sampler_never_repeats_over_a_whole_study():
    study, names, choices = _study(seed=1)
    seen = []
    for _ in range(40):
        t = study.ask()
        c = _suggest(t, names, choices)
        seen.append(c)
        study.tell(t, _bowl(c) if c[2] != 3 else math.inf)  # Failures told +inf.
    assert len(set(seen)) == len(seen)
    assert min(_bowl(c) for c in seen) <= 1.5  # Found the bowl's floor (1.0) or next to it.


def test_rejects_an_empty_candidate_list():
    with pytest.raises(ValueError, match="at least one candidate"):
        CandidateBO([], [[1]])


def test_a_singular_fit_falls_back_to_a_random_free_candidate(monkeypatch):
    from pallas_tune.search import model as search

    bo = CandidateBO(CANDIDATES, [SIZES, SIZES, [1, 2, 3]], seed=0, n_startup=2)
    measured = {c: _bowl(c) for c in CANDIDATES[:10]}

    def singular(self, x, y, *, optimize):
        raise np.linalg.LinAlgError("not positive definite")

    monkeypatch.setattr(search.GP, "fit", singular)
    c = bo.propose(measured)
    assert c in CANDIDATES and c not in measured


def test_a_running_enqueued_warm_start_counts_as_pending():
    study, names, choices = _study()
    for _ in range(9):  # Seed 0, 9 trials: the GP's next pick is the bowl's floor itself.
        t = study.ask()
        study.tell(t, _bowl(_suggest(t, names, choices)))
    study.enqueue_trial({"bm": SIZES.index(256), "bn": SIZES.index(64), "depth": 1})
    warm = study.ask()  # Running, its parameters not suggested yet.
    other = study.ask()
    assert _suggest(other, names, choices) != (256, 64, 2)
    assert _suggest(warm, names, choices) == (256, 64, 2)


def test_optuna_sampler_over_real_value_choices():
    """The study's CategoricalDistributions may hold the real values (ints, floats, strings,
    bools, None), not indices; the features come from those values."""
    dists = {"bm": optuna.distributions.CategoricalDistribution([16, 32, 64, 128]),
             "mode": optuna.distributions.CategoricalDistribution(["a", "b"]),
             "flag": optuna.distributions.CategoricalDistribution([False, True]),
             "scale": optuna.distributions.CategoricalDistribution([None, 0.5, 2.0])}
    cands = [dict(zip(dists, c)) for c in itertools.product(
        *(d.choices for d in dists.values())) if not (c[0] == 128 and c[2])]  # Constrained.

    def cost(p):
        return (1.0 + abs(math.log2(p["bm"]) - 5) + (p["mode"] == "b") + 0.5 * p["flag"]
                + (0.3 if p["scale"] is None else p["scale"]))

    sampler = CandidateSampler(cands, dists, seed=0)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=sampler)
    seen = []
    for _ in range(20):
        t = study.ask()
        p = {n: t.suggest_categorical(n, d.choices) for n, d in dists.items()}
        assert p in cands and p not in seen  # Only valid configs, never twice.
        seen.append(p)
        study.tell(t, cost(p))
    assert min(cost(p) for p in seen) == min(cost(c) for c in cands)


@pytest.mark.parametrize("settings", [{"cycle": "glt"}, {"cycle": "t"}, {"cycle": "l"},
                                      {"cycle": "gm"}, {"init": "maximin"}])
def test_every_proposal_mode_finds_the_bowl_and_never_repeats(settings):
    bo = CandidateBO(CANDIDATES, [SIZES, SIZES, [1, 2, 3]], seed=2, **settings)
    measured = {}
    for _ in range(40):
        c = bo.propose(measured)
        assert c in CANDIDATES and c not in measured
        measured[c] = _bowl(c) if c[2] != 3 else math.inf
    assert min(measured.values()) <= 1.5


def test_rejects_unknown_settings():
    with pytest.raises(ValueError, match="cycle="):
        CandidateBO(CANDIDATES, [SIZES, SIZES, [1, 2, 3]], cycle="gx")
    with pytest.raises(ValueError, match="init="):
        CandidateBO(CANDIDATES, [SIZES, SIZES, [1, 2, 3]], init="sobol")


def test_maximin_initial_design_spreads_out():
    bo = CandidateBO(CANDIDATES, [SIZES, SIZES, [1, 2, 3]], seed=0, init="maximin",
                     n_startup=4)
    measured = {}
    for _ in range(4):
        c = bo.propose(measured)
        measured[c] = 1.0
    # The 2nd to 4th picks are far from what was picked before: corners of the (log) box.
    first, *rest = measured
    assert all(max(abs(math.log2(a[0]) - math.log2(b[0])) for b in measured if b != a) >= 3
               for a in rest)


def test_parzen_ratio_prefers_the_values_of_good_configs():
    from pallas_tune.search.model import parzen_log_ratio

    ranks = np.array(list(itertools.product(range(5), range(3))))
    ordinal = np.array([True, False])
    good = np.flatnonzero((ranks[:, 0] == 1) & (ranks[:, 1] == 2))
    bad = np.flatnonzero(ranks[:, 0] >= 3)
    score = parzen_log_ratio(ranks, ordinal, good, bad, np.arange(len(ranks)))
    best = ranks[np.argmax(score)]
    assert best[1] == 2 and best[0] <= 1  # The good label; the good rank or away from the bad.
    # Ordinal smoothing: rank 0 and 2 (next to the good rank 1) beat rank 4.
    s = {tuple(r): v for r, v in zip(ranks, score)}
    assert s[(0, 2)] > s[(4, 2)] and s[(2, 2)] > s[(4, 2)]


def test_pow2_feature_marks_powers_of_two_among_other_sizes():
    (sizes,) = encode_features([[16, 32, 48, 64, 80, 96]], pow2=True)
    assert sizes.shape == (6, 2)
    pow2 = dict(zip([16, 32, 48, 64, 80, 96], sizes[:, 1], strict=True))
    assert pow2[16] == pow2[32] == pow2[64] == 1.0
    # log2 of the largest power-of-two divisor over log2 of the size, scaled to [0, 1]:
    # 80 = 16 * 5 (4 / 6.32) < 48 = 16 * 3 (4 / 5.58) < 96 = 32 * 3 (5 / 6.58).
    assert pow2[80] == 0.0 < pow2[48] < pow2[96] < 1.0
    # Only powers of two, labels, floats or two values: nothing to add.
    for values in ([16, 32, 64, 128], ["a", "b", "c"], [0.5, 1.5, 3.0], [16, 48]):
        (table,) = encode_features([values], pow2=True)
        (plain,) = encode_features([values])
        assert np.array_equal(table, plain)


def _pow2_landscape():
    """Run time smooth in log2(size) (best at 256), and 3x slower at sizes that are not
    powers of two, as GPU block sizes that are not a multiple of the warp run."""
    sizes = list(range(16, 513, 16))
    cands = list(itertools.product(sizes, [1, 2, 3]))

    def cost(c):
        size, depth = c
        base = 1.0 + 0.3 * (math.log2(size) - 8) ** 2 + 0.2 * (depth - 2) ** 2
        return base * (1 if size & (size - 1) == 0 else 3)
    return sizes, cands, cost


def test_pow2_feature_finds_a_power_of_two_optimum_among_step_sizes():
    sizes, cands, cost = _pow2_landscape()
    best = min(map(cost, cands))

    def evals_to_best(pow2, seed):
        # Five initial configs, as when the feature was measured: what is tested is the
        # feature, not the initial design.
        bo = CandidateBO(cands, [sizes, [1, 2, 3]], seed=seed, pow2=pow2, n_startup=5)
        measured = {}
        while min(measured.values(), default=math.inf) > best:
            c = bo.propose(measured)
            measured[c] = cost(c)
        return len(measured)

    # 96 configs, one optimum (256, 2). Measured: 12, 7, 10, 9 with the feature; 7, 17, 22, 9
    # without (a smooth model in log2(size) keeps trying the sizes next to 256).
    with_it = [evals_to_best(True, s) for s in range(4)]
    without = [evals_to_best(False, s) for s in range(4)]
    assert max(with_it) <= 15 and sum(with_it) < sum(without)


def test_the_initial_design_can_grow_with_the_parameters_that_vary():
    """``startup_per_dim``: at least that many initial configs per varying parameter (a
    constant parameter does not count); 0 keeps ``n_startup``."""
    cands = list(itertools.product([1, 2, 4, 8], [16, 32], ["a", "b", "c"], [7]))
    choices = [[1, 2, 4, 8], [16, 32], ["a", "b", "c"], [7]]
    assert CandidateBO(cands, choices, seed=0, n_startup=5).n_startup == 5
    assert CandidateBO(cands, choices, seed=0, n_startup=5, startup_per_dim=2).n_startup == 6
    assert CandidateBO(cands, choices, seed=0, n_startup=5, startup_per_dim=1).n_startup == 5
    bo = CandidateBO(cands, choices, seed=0, n_startup=5, startup_per_dim=3)
    measured = {}
    for _ in range(9):  # Nine initial configs: random, never repeated, none from the GP yet.
        c = bo.propose(measured)
        assert c not in measured
        measured[c] = 1.0 + c[0]
    assert bo._model_steps == 0


def test_the_initial_design_keeps_most_of_a_known_budget_for_the_model():
    """The default initial design is 15 configs; with ``budget`` known, at most
    ``startup_share`` of it and never below 5: a 32-trial tune spends 9 at random (warm
    starts included), a 100-trial one 15."""
    sizes = [16, 32, 64, 128, 256]
    choices = [sizes] * 3 + [["x", "y"], [0, 1], [7]]
    cands = list(itertools.product(*choices))
    assert gp.DEFAULT_STARTUP == 15 and gp.MIN_STARTUP == 5
    assert CandidateBO(cands, choices, seed=0).n_startup == 15
    assert CandidateBO(cands, choices, seed=0, budget=100).n_startup == 15
    assert CandidateBO(cands, choices, seed=0, budget=32).n_startup == 9
    assert CandidateBO(cands, choices, seed=0, budget=10).n_startup == 5
    assert CandidateBO(cands, choices, seed=0, budget=32, startup_share=0.5).n_startup == 15
    assert CandidateBO(cands, choices, seed=0, budget=100, startup_per_dim=4).n_startup == 20
    # Optuna's sampler, as a tune builds it with its trial budget.
    dists = {f"p{i}": optuna.distributions.CategoricalDistribution(list(range(len(ch))))
             for i, ch in enumerate(choices)}
    configs = [{f"p{i}": choices[i].index(v) for i, v in enumerate(c)} for c in cands]
    assert CandidateSampler(configs, dists, budget=32)._bo.n_startup == 9
    # With a prior, the prior's best configs replace the design, whatever the budget.
    prior = np.arange(len(cands), dtype=float)
    assert CandidateBO(cands, choices, seed=0, budget=100, prior=prior).n_startup == 2


def test_a_prior_keeps_the_cycle_transfer_was_measured_with():
    """Without a prior the cycle takes a multivariate TPE step; with one it is ``prior_cycle``
    (global and trust-region steps), and a bad cycle string is refused by name."""
    choices = [[16, 32, 64, 128], [1, 2, 3]]
    cands = list(itertools.product(*choices))
    assert CandidateBO(cands, choices, seed=0).cycle == gp.CYCLE == "glm"
    prior = np.arange(len(cands), dtype=float)
    assert CandidateBO(cands, choices, seed=0, prior=prior).cycle == gp.PRIOR_CYCLE == "gl"
    assert CandidateBO(cands, choices, seed=0, prior=prior, prior_cycle="g").cycle == "g"
    with pytest.raises(ValueError, match="prior_cycle='gx'"):
        CandidateBO(cands, choices, seed=0, prior_cycle="gx")


def _blas_threads() -> set[int]:
    """The thread counts of the process's BLAS pools."""
    from threadpoolctl import threadpool_info

    return {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}


def test_a_proposal_holds_blas_to_one_thread_and_gives_the_threads_back(monkeypatch):
    """The GP's products are small: more BLAS threads cost more than they save, and wait for
    cores under a tune's workers (benchmarks/search/proposal_time.py). A proposal runs with one
    BLAS thread, and the process's own limits come back after it, an error included."""
    from threadpoolctl import threadpool_limits

    from pallas_tune.search import model as search

    bo = CandidateBO(CANDIDATES, [SIZES, SIZES, [1, 2, 3]], seed=0, n_startup=2)
    measured = {c: _bowl(c) for c in CANDIDATES[:10]}
    seen = []
    fit = search.GP.fit

    def watched(self, x, y, *, optimize):
        seen.append(_blas_threads())
        return fit(self, x, y, optimize=optimize)

    monkeypatch.setattr(search.GP, "fit", watched)
    with threadpool_limits(limits=2, user_api="blas"):
        before = _blas_threads()
        c = bo.propose(measured)
        assert _blas_threads() == before  # Given back.
        assert seen == [{1}] and c in CANDIDATES and c not in measured

        def broken(self, x, y, *, optimize):
            seen.append(_blas_threads())
            raise FloatingPointError("overflow")

        monkeypatch.setattr(search.GP, "fit", broken)
        assert bo.propose(measured) in CANDIDATES  # The fallback: a random free candidate.
        assert seen[-1] == {1} and _blas_threads() == before


def test_proposals_in_several_threads_share_the_limit_and_the_last_gives_it_back():
    """An Optuna study may ask from several threads: the first proposal to start holds BLAS to
    one thread, and only the last to end gives the process's limits back, whatever the order
    they end in (undoing in the wrong order would leave the process at one thread)."""
    from threadpoolctl import threadpool_limits

    from pallas_tune.search.model import one_blas_thread

    with threadpool_limits(limits=2, user_api="blas"):
        before = _blas_threads()
        a, b = one_blas_thread(), one_blas_thread()
        a.__enter__()
        b.__enter__()
        assert _blas_threads() == {1}
        a.__exit__(None, None, None)  # The first to start ends first: b still proposes.
        assert _blas_threads() == {1}
        b.__exit__(None, None, None)
        assert _blas_threads() == before


def test_a_blas_the_search_cannot_limit_leaves_the_proposal_as_it_was(monkeypatch):
    """Holding BLAS to one thread is for speed: where threadpoolctl cannot read the process's
    BLAS, the search proposes with the threads as they are, and never fails for it."""
    from pallas_tune.search import model as search

    def unreadable():
        raise OSError("cannot read the BLAS library's symbols")

    monkeypatch.setattr(search, "_blas", unreadable)
    bo = CandidateBO(CANDIDATES, [SIZES, SIZES, [1, 2, 3]], seed=0, n_startup=2)
    measured = {c: _bowl(c) for c in CANDIDATES[:10]}
    for _ in range(3):
        c = bo.propose(measured)
        assert c in CANDIDATES and c not in measured
        measured[c] = _bowl(c)
