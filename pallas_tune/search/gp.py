"""The default search over an enumerated candidate set: Bayesian optimization with a Gaussian
process on the tile parameters, its expected improvement scored on every candidate not yet
measured, alternated with the same score restricted to a trust region around the incumbent
and with a multivariate TPE step (scored on the same candidates).

Why not only Optuna's TPE: a tile space is a finite set of valid configs, so the acquisition can
be scored on *every* candidate (TPE samples from per-parameter densities and wastes proposals on
configs that are invalid or already measured), and a GP with one length scale per parameter
learns the smooth, multiplicative structure of kernel run times (log time is close to additive
in log2 tile sizes) from a handful of points.

The proposer, :class:`CandidateBO`, is plain numpy/scipy (:mod:`.model`);
:class:`CandidateSampler` wraps it as an Optuna sampler so the tuner keeps Optuna's ask/tell,
storages (resume, many hosts) and plots. How the settings below were chosen, and on which
landscapes: benchmarks/search/search_settings.py and benchmarks/results/search_settings.txt.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from pallas_tune.search.model import (GP, encode_features, expected_improvement, is_ordinal,
                                      joint_parzen_log_ratio, one_blas_thread, parzen_log_ratio)

__all__ = ["DEFAULT_STARTUP", "TUNING_SET", "CandidateBO", "CandidateSampler",
           "encode_features"]

# The initial design (proposals before the GP takes over; warm starts count among them):
# DEFAULT_STARTUP configs, but at most STARTUP_SHARE of the run's budget where it is known and
# never fewer than MIN_STARTUP (a 32-trial tune: 9). Chosen with the "glm" cycle below on
# TUNING_SET by benchmarks/search/search_settings.py (10 seeds, budget 50): over the 15 GPU
# landscapes, 15 initial and "glm" score a mean @50 of 0.940 against the previous default's
# (5, "gl") 0.921, and hold when a kernel or a device is left out of the choice
# (benchmarks/results/search_settings.txt; 20 seeds in search_efficiency.md).
DEFAULT_STARTUP = 15
MIN_STARTUP = 5
STARTUP_SHARE = 0.3
# From 20 measurements on, log times above this quantile are capped at it (what is slower than
# the median only tells "bad"), and expected improvement is taken over the best minus XI (in
# standard deviations of the capped log times).
CAP_QUANTILE = 0.5
XI = 0.1
# The proposals after the initial design cycle through: "g" the best expected improvement over
# every free candidate, "l" the same within LOCAL_RADIUS rank steps of the incumbent (a trust
# region), "t" the best TPE score (independent Parzen densities of good and bad configs), "m"
# the best multivariate TPE score (joint densities over categorical parameters).
CYCLE = "glm"
LOCAL_RADIUS = 2
# Initial design: "random" or "maximin" (greedy farthest points in feature space).
INIT = "random"

# Integer sizes that mix powers of two with others (16, 32, 48, ... 256) also get a feature
# saying how near each is to a power of two (model.encode_features): on convolution_milo's five
# GPUs, where block_size_x steps by 16 and the AMD ones run its non-powers of two 2 to 8x slower,
# the mean @50 rose from 0.798 to 0.825 (A4000 alone fell, 0.874 to 0.842), and on convolution
# (RTX 2080 Ti, 3090, Titan) from 0.965 to 0.991 (benchmarks/results/search_efficiency.md, 10
# seeds; leave one device out chooses it on every landscape).
POW2 = True

# Landscapes (kernel/device in ../shared/landscapes) whose replays chose the settings above:
# CYCLE, XI, INIT and DEFAULT_STARTUP were chosen by benchmarks/search/search_settings.py on
# these six alone (the first device of each kernel in name order, and pnpoly RTX 3090);
# CAP_QUANTILE and the one-hot selectors earlier on the convolution_milo and dedispersion_milo
# A100 and pnpoly RTX 3090 spaces. The other nine chose nothing, but the variants compared for
# CYCLE and DEFAULT_STARTUP came out of replays on all five convolution_milo GPUs; leave-one-
# kernel-out and leave-one-device-out scores are in benchmarks/results/search_settings.txt.
TUNING_SET: frozenset[str] = frozenset({
    "convolution/RTX_2080_Ti", "convolution_milo/A100", "dedispersion_milo/A100",
    "gemm/RTX_2080_Ti", "pnpoly/RTX_2080_Ti", "pnpoly/RTX_3090"})

# Largest number of candidates scored per global proposal: bigger spaces score a random
# subsample of this size plus the free neighbours (one rank step) of the best measured configs,
# so a proposal stays cheap on spaces of 10^4 to 10^5 configs (times in search_efficiency.md).
MAX_SCORED = 4096

# With a prior (other tasks' trials, :mod:`.prior`): proposals before the GP takes over (the
# prior's best configs), the pseudo-points its scale is shrunk towards 1 with, and how many of
# its best free configs every global proposal scores on top of the subsample. PRIOR_CYCLE: the
# cycle with a prior (global steps alternating with and without it, and trust-region steps), as
# transfer was measured with; the TPE step of CYCLE only thinned the prior's global steps there
# (W7800: 0.981 to 0.952 at 50).
PRIOR_STARTUP = 2
PRIOR_CYCLE = "gl"
PRIOR_EVERY = 2
PRIOR_HALF = 30.0
PRIOR_SHRINK = 3.0
PRIOR_SCORED = 512


class CandidateBO:
    """Proposes the next config to measure from a finite list of candidates.

    ``candidates``: hashable configs (tuples), each a value per parameter; ``choices``: per
    parameter, its possible values; ``values``: what those stand for, if they are only labels
    (the features are built from them). Values are run times (lower is better);
    ``inf`` marks a failed config. Proposals never repeat a measured or pending config.

    The first ``n_startup`` proposals (after any warm starts the caller measured) are an initial
    design (``init``), then each is the candidate of highest expected improvement in log time
    under a GP fitted to the finite measurements, with failed configs counted as the worst time
    seen (so the search moves away from them without a separate classifier) and times slower
    than the ``cap_quantile`` capped there; ``xi`` asks for that much improvement
    (exploration). ``cycle`` interleaves these global steps ("g") with local ones ("l": only
    within ``local_radius`` rank steps, a categorical change being one step, of the incumbent,
    the measured config the GP thinks fastest) and TPE steps ("t": the best ratio of Parzen
    densities of the good and the bad configs, per parameter; "m": the same with joint
    densities, as multivariate TPE). Pending configs are filled in with the GP's mean (kriging
    believer), so a batch of proposals spreads out.

    ``startup_per_dim``: the initial design has at least this many configs per parameter that
    varies (0, the default: ``n_startup`` alone; a setting for replay studies). ``budget``:
    the evaluations the run will make, where known; the initial design is then at most
    ``startup_share`` of it, and never below ``MIN_STARTUP``.

    ``prior`` (transfer, :mod:`.prior`): per task already measured elsewhere (other shapes,
    chips or devices of the same kernel), a score per candidate, lower is faster: a (tasks,
    candidates) array, or one row. The initial design is then the prior's best configs, and
    every other global step's GP models the residual from ``a * prior + b`` (fitted on the new
    task's points, the slope shrunk towards 1 at first and towards 0 as points accumulate; the
    tasks weighted by how well each orders those points); the other steps ignore the prior,
    so a misleading one costs evaluations, not the search. The cycle is then ``prior_cycle``.
    """

    def __init__(self, candidates: Sequence[tuple[Hashable, ...]],
                 choices: Sequence[Sequence[Hashable]], *, seed: int | None = 0,
                 n_startup: int = DEFAULT_STARTUP, refit_every: int = 5,
                 values: Sequence[Sequence[Any]] | None = None,
                 cap_quantile: float = CAP_QUANTILE, xi: float = XI,
                 cycle: str = CYCLE, local_radius: int = LOCAL_RADIUS, init: str = INIT,
                 prior: Sequence[float] | np.ndarray | None = None, pow2: bool = POW2,
                 startup_per_dim: float = 0.0, budget: int | None = None,
                 startup_share: float = STARTUP_SHARE, prior_cycle: str = PRIOR_CYCLE):
        if not candidates:
            raise ValueError("CandidateBO needs at least one candidate")
        if init not in ("random", "maximin"):
            raise ValueError(f"init={init!r} must be 'random' or 'maximin'")
        for name, c in (("cycle", cycle), ("prior_cycle", prior_cycle)):
            if not c or set(c) - set("gltm"):
                raise ValueError(f"{name}={c!r} must be a non-empty string of 'g', 'l', 't' "
                                 "and 'm'")
        self.candidates = list(candidates)
        self.index = {c: i for i, c in enumerate(self.candidates)}
        feats = values if values is not None else choices
        tables = encode_features(feats, pow2=pow2)
        pos = [{v: j for j, v in enumerate(ch)} for ch in choices]
        ranks = np.array([[pos[p][c[p]] for p in range(len(choices))] for c in self.candidates],
                         dtype=np.int32).reshape(len(self.candidates), len(choices))
        cols = [tables[p][ranks[:, p]] for p in range(len(choices))]
        self.x = np.concatenate(cols, axis=1) if cols else np.zeros((len(candidates), 0))
        # Trust-region distances: rank steps for numbers, one step for any categorical change.
        self._ranks = ranks
        self._ordinal = np.array([is_ordinal(v) for v in feats], dtype=bool)
        self.rng = np.random.default_rng(seed)
        varying = sum(len(ch) > 1 for ch in choices)
        self.n_startup = max(n_startup, math.ceil(startup_per_dim * varying))
        if budget is not None:  # At most this share of the evaluations spent at random.
            self.n_startup = min(self.n_startup,
                                 max(MIN_STARTUP, math.floor(startup_share * budget)))
        self.refit_every = max(1, refit_every)
        self.cap_quantile = cap_quantile
        self.xi = xi
        self.cycle = cycle
        self.local_radius = local_radius
        self.init = init
        self._gp = GP(self.x.shape[1], self.rng)
        self._fitted_at = -1
        self._model_steps = 0
        # Per prior task, a score per candidate (lower is faster); see _weighted.
        self._tasks = None if prior is None else np.asarray(prior, dtype=float)
        if self._tasks is not None:
            if self._tasks.ndim == 1:
                self._tasks = self._tasks[None, :]
            if (self._tasks.ndim != 2 or self._tasks.shape[1] != len(self.candidates)
                    or not np.isfinite(self._tasks).all()):
                raise ValueError(f"prior must be finite scores, one per candidate "
                                 f"({len(self.candidates)}) for each prior task, got shape "
                                 f"{self._tasks.shape}")
            if not len(self._tasks):
                self._tasks = None
        self.prior = None if self._tasks is None else _standard(self._tasks.mean(0))
        if self.prior is not None:  # The prior's best configs replace the initial design.
            self.n_startup = min(self.n_startup, PRIOR_STARTUP)
            self.cycle = prior_cycle

    def propose(self, measured: Mapping[tuple[Hashable, ...], float],
                pending: Sequence[tuple[Hashable, ...]] = ()) -> tuple[Hashable, ...] | None:
        """The next candidate to measure, or None when every candidate is measured or pending."""
        with one_blas_thread():
            return self._propose(measured, pending)

    def _propose(self, measured: Mapping[tuple[Hashable, ...], float],
                 pending: Sequence[tuple[Hashable, ...]]) -> tuple[Hashable, ...] | None:
        taken = np.zeros(len(self.candidates), dtype=bool)
        for c in (*measured, *pending):
            i = self.index.get(c)
            if i is not None:
                taken[i] = True
        free = np.flatnonzero(~taken)
        if free.size == 0:
            return None
        known = [(self.index[c], v) for c, v in measured.items() if c in self.index]
        finite = [v for _, v in known if math.isfinite(v) and v > 0]
        if len(known) < self.n_startup or len(finite) < 2 or self.x.shape[1] == 0:
            if self.prior is not None:  # The best free config by the other tasks.
                return self.candidates[int(free[np.argmin(self.prior[free])])]
            return self.candidates[self._initial(taken, free)]
        mode = self.cycle[self._model_steps % len(self.cycle)]
        self._model_steps += 1
        try:
            if mode in "tm":
                return self.candidates[self._tpe_pick(known, pending, free, mode == "m")]
            # With a prior, every other global step ignores it, as do local steps (a hedge: a
            # prior the new task contradicts must not hold the search where it points).
            with_prior = self.prior is not None and (self._model_steps - 1) % PRIOR_EVERY == 0
            return self.candidates[self._ei_pick(known, finite, pending, free, mode == "l",
                                                 with_prior)]
        except (np.linalg.LinAlgError, ValueError, FloatingPointError):
            # A numerically singular fit: measure a random candidate and refit next time.
            self._fitted_at = -1
            return self.candidates[int(self.rng.choice(free))]

    def _initial(self, taken: np.ndarray, free: np.ndarray) -> int:
        """A random free candidate, or (maximin) the one farthest from those taken, among a
        random subsample of at most 2000."""
        if self.init == "random" or not taken.any() or self.x.shape[1] == 0:
            return int(self.rng.choice(free))
        pool = free if free.size <= 2000 else self.rng.choice(free, 2000, replace=False)
        done = self.x[np.flatnonzero(taken)]
        d2 = ((self.x[pool][:, None, :] - done[None, :, :]) ** 2).sum(-1).min(1)
        top = np.flatnonzero(d2 >= d2.max() * (1 - 1e-9))
        return int(pool[top[self.rng.integers(top.size)]])

    def _targets(self, known: list[tuple[int, float]], finite: list[float]) -> np.ndarray:
        """Standardized log times of the measured configs, failures at the worst, capped."""
        worst = max(math.log(v) for v in finite)
        y = np.array([math.log(v) if math.isfinite(v) and v > 0 else worst for _, v in known])
        if self.cap_quantile < 1 and len(y) >= 20:
            # Output capping: what is slower than the median only tells "bad"; its exact size
            # would make the GP model the slow half, not the fast region that matters.
            y = np.minimum(y, np.quantile(y, self.cap_quantile))
        return (y - y.mean()) / (y.std() or 1.0)

    def _tpe_pick(self, known: list[tuple[int, float]],
                  pending: Sequence[tuple[Hashable, ...]], free: np.ndarray,
                  joint: bool) -> int:
        """The free candidate of best TPE score; the good group is the best 15% measured, the
        bad one the rest with failures and pending configs."""
        order = sorted(known, key=lambda iv: iv[1] if math.isfinite(iv[1]) else math.inf)
        n_good = max(2, math.ceil(0.15 * len(order)))
        good = np.array([i for i, _ in order[:n_good]])
        bad = np.array([i for i, _ in order[n_good:]] +
                       [self.index[c] for c in pending if c in self.index], dtype=int)
        if bad.size == 0:
            return int(self.rng.choice(free))
        score = (joint_parzen_log_ratio(self._ranks, good, bad, free) if joint else
                 parzen_log_ratio(self._ranks, self._ordinal, good, bad, free))
        top = np.flatnonzero(score >= score.max() - 1e-9)
        return int(free[top[self.rng.integers(top.size)]])

    def _ei_pick(self, known: list[tuple[int, float]], finite: list[float],
                 pending: Sequence[tuple[Hashable, ...]], free: np.ndarray, local: bool,
                 with_prior: bool = False) -> int:
        idx = np.array([i for i, _ in known])
        ys = self._targets(known, finite)
        base = self._prior_line(idx, ys, with_prior)  # The prior's mean at every candidate, or zeros.
        n = len(idx)
        # Hyperparameters move less as data accumulates: refit every 5, then 10, then 20.
        every = self.refit_every * (1 if n < 30 else 2 if n < 60 else 4)
        optimize = self._fitted_at < 0 or n - self._fitted_at >= every
        self._gp.fit(self.x[idx], ys - base[idx], optimize=optimize)
        if optimize:
            self._fitted_at = n
        ok = np.array([math.isfinite(v) and v > 0 for _, v in known])
        best = ys[ok].min()
        if local:
            # The incumbent: the measured config the model thinks fastest (noise-robust).
            mu_m, _ = self._gp.predict(self.x[idx[ok]])
            inc = idx[ok][int(np.argmin(mu_m + base[idx[ok]]))]
            region = free[self._distance(inc, free) <= self.local_radius]
            if region.size:
                free = region
        pend = [self.index[c] for c in pending if c in self.index]
        if pend:  # Kriging believer: pending points take the mean prediction.
            mu_p, _ = self._gp.predict(self.x[pend])
            self._gp.fit(np.concatenate([self.x[idx], self.x[pend]]),
                         np.concatenate([ys - base[idx], mu_p]), optimize=False)
        if free.size > MAX_SCORED:
            near = np.zeros(len(self.candidates), dtype=bool)
            for i in idx[ok][np.argsort(ys[ok])[:3]]:
                near[free[self._distance(i, free) <= 1]] = True
            sample = np.zeros(len(self.candidates), dtype=bool)
            sample[self.rng.choice(free, MAX_SCORED, replace=False)] = True
            if with_prior:  # And the prior's best free configs.
                sample[free[np.argsort(self.prior[free])[:PRIOR_SCORED]]] = True
            free = np.flatnonzero(near | sample)
        mu, sd = self._gp.predict(self.x[free])
        ei = expected_improvement(mu + base[free], sd, best - self.xi)
        top = np.flatnonzero(ei >= ei.max() * (1 - 1e-9))
        return int(free[top[self.rng.integers(top.size)]])

    def _prior_line(self, idx: np.ndarray, ys: np.ndarray, use: bool) -> np.ndarray:
        """The GP's mean at every candidate: ``a * prior + b`` fitted on the measured points
        (the slope shrunk towards 1 by PRIOR_SHRINK pseudo-points, kept in [0, 3]: a prior the
        new task contradicts fades), or zeros without a prior."""
        if self.prior is None or not use:
            return np.zeros(len(self.candidates))
        prior = self._weighted(idx, ys)
        m = prior[idx]
        mc, yc = m - m.mean(), ys - ys.mean()
        a = float(np.clip((mc @ yc + PRIOR_SHRINK) / (mc @ mc + PRIOR_SHRINK), 0.0, 3.0))
        a *= PRIOR_HALF / (PRIOR_HALF + len(idx))  # The new task's own data takes over.
        b = float(ys.mean() - a * m.mean())
        return a * prior + b

    def _weighted(self, idx: np.ndarray, ys: np.ndarray) -> np.ndarray:
        """The prior tasks' scores averaged with weights by how well each orders the new task's
        measured configs (the share of concordant pairs above chance, squared, as RGPE weighs
        its base models by ranking loss); equal weights until 4 points, all tasks alike if
        none orders them better than chance."""
        tasks = self._tasks
        if len(tasks) == 1 or len(idx) < 4:
            return self.prior
        dy = np.sign(ys[:, None] - ys[None, :])
        pairs = np.triu(dy != 0, 1)
        if not pairs.any():
            return self.prior
        ds = np.sign(tasks[:, idx][:, :, None] - tasks[:, idx][:, None, :])
        agree = ((ds == dy[None]) & pairs[None]).sum((1, 2)) / pairs.sum()
        w = np.maximum(agree - 0.5, 0.0) ** 2
        if w.sum() <= 0:
            return self.prior
        return _standard((w[:, None] * tasks).sum(0) / w.sum())

    def _distance(self, center: int, rows: np.ndarray) -> np.ndarray:
        diff = np.abs(self._ranks[rows] - self._ranks[center])
        return np.where(self._ordinal, diff, diff > 0).sum(1)


def _standard(v: np.ndarray) -> np.ndarray:
    return (v - v.mean()) / (v.std() or 1.0)


class CandidateSampler(optuna.samplers.BaseSampler):
    """An Optuna sampler over a finite candidate list, proposing with :class:`CandidateBO`.

    ``candidates``: configs as dicts of the trial's parameter values (every parameter
    categorical). ``values``: per parameter, what its choices stand for, where the choices
    are only indices (the features are built from these: log2 tile sizes, not indices).
    Running trials are the pending set, so several hosts or a batch of asks spread out.
    Enqueued trials (warm starts) keep their fixed parameters. ``prior``: per other task, a
    score per candidate (see :class:`CandidateBO`, :mod:`.prior`). ``budget``: the trials the
    run will measure (caps the initial design, see :class:`CandidateBO`)."""

    def __init__(self, candidates: Sequence[Mapping[str, Any]],
                 distributions: Mapping[str, CategoricalDistribution], *,
                 values: Mapping[str, Sequence[Any]] | None = None,
                 seed: int | None = None, n_startup: int = DEFAULT_STARTUP,
                 prior: Any = None, budget: int | None = None):
        self._names = list(distributions)
        self._dists = dict(distributions)
        values = values or {}
        tuples = [tuple(c[n] for n in self._names) for c in candidates]
        features = [list(values.get(n, self._dists[n].choices)) for n in self._names]
        # CandidateBO sees choice positions mapped to the values they stand for.
        self._bo = CandidateBO(tuples, [list(self._dists[n].choices) for n in self._names],
                               seed=seed, n_startup=n_startup, values=features, prior=prior,
                               budget=budget)
        self._random = optuna.samplers.RandomSampler(seed=seed)

    def reseed_rng(self) -> None:
        self._random.reseed_rng()

    def infer_relative_search_space(self, study, trial):
        del study, trial
        return dict(self._dists)

    def _key(self, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        try:
            return tuple(params[n] for n in self._names)
        except KeyError:
            return None

    def sample_relative(self, study, trial, search_space):
        if not search_space or "fixed_params" in trial.system_attrs:
            return {}  # An enqueued trial (a warm start) takes its own parameters.
        measured: dict[tuple[Any, ...], float] = {}
        pending = []
        for t in study.get_trials(deepcopy=False,
                                  states=(TrialState.COMPLETE, TrialState.RUNNING,
                                          TrialState.FAIL)):
            if t.number == trial.number:
                continue
            # A running enqueued trial is pending with its fixed parameters before it suggests.
            key = self._key(t.params or t.system_attrs.get("fixed_params", {}))
            if key is None:
                continue
            if t.state == TrialState.RUNNING:
                pending.append(key)
            elif t.state == TrialState.FAIL or t.value is None:
                measured.setdefault(key, math.inf)
            else:
                measured[key] = min(measured.get(key, math.inf), float(t.value))
        key = self._bo.propose(measured, pending)
        if key is None:  # All measured: let the caller see a repeat and stop.
            return {}
        return dict(zip(self._names, key, strict=True))

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self._random.sample_independent(study, trial, param_name,
                                               param_distribution)
