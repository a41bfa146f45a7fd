"""Bayesian optimization over an enumerated candidate set: a Gaussian process on the tile
parameters, expected improvement scored on every candidate not yet measured.

Why not only Optuna's TPE: a tile space is a finite set of valid configs, so the acquisition can
be scored on *every* candidate (TPE samples from per-parameter densities and wastes proposals on
configs that are invalid or already measured), and a GP with one length scale per parameter
learns the smooth, multiplicative structure of kernel run times (log time is close to additive
in log2 tile sizes) from a handful of points. Replayed on the measured landscapes
(benchmarks/search_efficiency.py) it needs a fraction of TPE's evaluations.

The proposer, :class:`CandidateBO`, is plain numpy/scipy (scipy comes with jax);
:class:`CandidateSampler` wraps it as an Optuna sampler so the tuner keeps Optuna's ask/tell,
storages (resume, many hosts) and plots.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState
from scipy.linalg import cho_solve, solve_triangular

__all__ = ["DEFAULT_STARTUP", "CandidateBO", "CandidateSampler", "encode_features"]

# Hyperparameters are fitted on at most this many measurements (the best half, a random half).
FIT_POINTS = 160

# Random proposals before the GP takes over (after any warm starts). Chosen by replay on the
# measured landscapes (pnpoly, 20 seeds: 3 → 12.5, 5 → 13.5, 10 → 22.5 evaluations to 5%);
# 5 is nearly as fast and safer on spaces with more parameters.
DEFAULT_STARTUP = 5

# From 20 measurements on, log times above this quantile are capped at it, and expected
# improvement is taken over the best minus XI (in standard deviations of the capped log times).
# Replayed on the convolution landscape (one config within 5% of the optimum among 4362; 8 seeds,
# 300 evaluations): neither → 0 of 8 seeds found it, cap 0.5 → 2, cap 0.5 and XI 0.3 → 6; over 20
# seeds that setting found it in a median of 196.5 evaluations (random search: 2629.5) and kept
# pnpoly, dedispersion and the v6e estimate landscapes as good as without.
CAP_QUANTILE = 0.5
XI = 0.3

# Largest number of candidates scored per proposal; bigger spaces score a random subsample.
MAX_SCORED = 20_000


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_selector(values: Sequence[Any]) -> bool:
    """0, 1, 2 or 0, 1, 2, 3: read as a choice among methods (one-hot), not as a size (sizes are
    never 0). Replayed on pnpoly (two such parameters), one-hot took 13.5 evaluations to 5% of
    the optimum against 18.5 as numbers. Longer 0-based ranges are counts, kept ordinal."""
    return 3 <= len(values) <= 4 and sorted(values) == list(range(len(values)))


def encode_features(choices: Sequence[Sequence[Any]]) -> list[np.ndarray]:
    """Per parameter, a (len(choices), width) feature table in [0, 1].

    Numbers are min-max scaled, on a log2 scale where all are positive and span at least a
    factor 4 (tile sizes, buffer depths); anything else is one-hot. Constant parameters get
    width 0."""
    tables = []
    for values in choices:
        n = len(values)
        if n <= 1:
            tables.append(np.zeros((n, 0)))
            continue
        if all(_is_number(v) for v in values) and not _is_selector(values):
            x = np.asarray(values, dtype=float)
            if x.min() > 0 and x.max() / x.min() >= 4:
                x = np.log2(x)
            lo, hi = x.min(), x.max()
            tables.append(((x - lo) / (hi - lo)).reshape(n, 1))
        else:
            tables.append(np.eye(n))
    return tables


class _GP:
    """Zero-mean GP, Matern 5/2 with one length scale per feature, Gaussian noise; hyper-
    parameters by maximum marginal likelihood (L-BFGS-B, a few restarts, log-normal prior)."""

    def __init__(self, dim: int, rng: np.random.Generator):
        self.dim = dim
        self.rng = rng
        # log length scales, log signal variance, log noise variance.
        self.theta = np.concatenate([np.full(dim, math.log(0.5)), [0.0, math.log(1e-2)]])
        self._fitted = False

    @staticmethod
    def _kernel(a: np.ndarray, b: np.ndarray, ls: np.ndarray, var: float) -> np.ndarray:
        a, b = a / ls, b / ls
        sq = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * (a @ b.T)
        d = np.sqrt(5.0 * np.maximum(sq, 0.0))
        return var * (1.0 + d + d * d / 3.0) * np.exp(-d)

    def _nll(self, theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
        """Negative log marginal likelihood plus log-prior, and its gradient in ``theta``."""
        dim = self.dim
        ls, var, noise = np.exp(theta[:dim]), math.exp(theta[-2]), math.exp(theta[-1])
        diff2 = ((x[:, None, :] - x[None, :, :]) / ls) ** 2  # (n, n, dim)
        d = np.sqrt(5.0 * diff2.sum(-1))
        e = np.exp(-d)
        ks = var * (1.0 + d + d * d / 3.0) * e
        k = ks + (noise + 1e-8) * np.eye(len(x))
        try:
            chol = np.linalg.cholesky(k)
        except np.linalg.LinAlgError:
            return 1e10, np.zeros_like(theta)
        alpha = cho_solve((chol, True), y)
        nll = 0.5 * y @ alpha + np.log(np.diag(chol)).sum()
        # dNLL/dθ = ½ tr((K⁻¹ − ααᵀ) dK/dθ);
        # Matern 5/2: dK/dlog ℓ_k = σ² e^{-d} (1 + d) · 5/3 · (Δ_k/ℓ_k)².
        w = cho_solve((chol, True), np.eye(len(x))) - np.outer(alpha, alpha)
        common = var * e * (1.0 + d) * (5.0 / 3.0)
        grad = np.empty_like(theta)
        grad[:dim] = 0.5 * np.einsum("ij,ij,ijk->k", w, common, diff2)
        grad[-2] = 0.5 * (w * ks).sum()
        grad[-1] = 0.5 * noise * np.trace(w)
        # Weak priors keep the fit sane with few points: length scales around 0.5, noise small.
        z_ls = (theta[:dim] - math.log(0.5)) / 1.5
        z_noise = (theta[-1] - math.log(1e-2)) / 2.0
        z_var = theta[-2] / 2.0
        nll += 0.5 * (z_ls ** 2).sum() + 0.5 * z_noise ** 2 + 0.5 * z_var ** 2
        grad[:dim] += z_ls / 1.5
        grad[-1] += z_noise / 2.0
        grad[-2] += z_var / 2.0
        return float(nll), grad

    def fit(self, x: np.ndarray, y: np.ndarray, *, optimize: bool) -> None:
        if optimize:
            from scipy.optimize import minimize

            xf, yf = x, y
            if len(x) > FIT_POINTS:  # Hyperparameters from the best half and a random half.
                order = np.argsort(y)
                rest = self.rng.choice(order[FIT_POINTS // 2:], FIT_POINTS - FIT_POINTS // 2,
                                       replace=False)
                keep = np.concatenate([order[:FIT_POINTS // 2], rest])
                xf, yf = x[keep], y[keep]
            bounds = [(math.log(0.03), math.log(20.0))] * self.dim + [
                (math.log(0.05), math.log(20.0)), (math.log(1e-6), math.log(1.0))]
            starts = [self.theta]
            if not self._fitted:
                starts.append(np.concatenate([
                    self.rng.uniform(math.log(0.1), math.log(3.0), self.dim),
                    [0.0, math.log(1e-2)]]))
            best = None
            for t0 in starts:
                r = minimize(self._nll, t0, args=(xf, yf), jac=True, method="L-BFGS-B",
                             bounds=bounds, options={"maxiter": 100})
                if best is None or r.fun < best.fun:
                    best = r
            self.theta = best.x
            self._fitted = True
        ls, var, noise = np.exp(self.theta[:self.dim]), math.exp(self.theta[-2]), \
            math.exp(self.theta[-1])
        self._x, self._ls, self._var = x, ls, var
        k = self._kernel(x, x, ls, var) + (noise + 1e-8) * np.eye(len(x))
        self._chol = np.linalg.cholesky(k)
        self._alpha = cho_solve((self._chol, True), y)

    def predict(self, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ks = self._kernel(xs, self._x, self._ls, self._var)
        mu = ks @ self._alpha
        v = solve_triangular(self._chol, ks.T, lower=True)
        sd = np.sqrt(np.maximum(self._var - (v * v).sum(0), 1e-12))
        return mu, sd


def _expected_improvement(mu: np.ndarray, sd: np.ndarray, best: float) -> np.ndarray:
    from scipy.stats import norm

    z = (best - mu) / sd
    return sd * (z * norm.cdf(z) + norm.pdf(z))


class CandidateBO:
    """Proposes the next config to measure from a finite list of candidates.

    ``candidates``: hashable configs (tuples), each a value per parameter; ``choices``: per
    parameter, its possible values; ``values``: what those stand for, if they are only labels
    (the features are built from them). Values are run times (lower is better);
    ``inf`` marks a failed config. Proposals never repeat a measured or pending config.

    The first ``n_startup`` proposals (after any warm starts the caller measured) are random,
    then each is the candidate of highest expected improvement in log time under a GP fitted to
    the finite measurements, with failed configs counted as the worst time seen (so the search
    moves away from them without a separate classifier) and times slower than the
    ``cap_quantile`` capped there; ``xi`` asks for that much improvement (exploration).
    Pending configs are filled in with the GP's mean (kriging believer), so a batch of
    proposals spreads out.
    """

    def __init__(self, candidates: Sequence[tuple[Hashable, ...]],
                 choices: Sequence[Sequence[Hashable]], *, seed: int | None = 0,
                 n_startup: int = DEFAULT_STARTUP, refit_every: int = 5,
                 values: Sequence[Sequence[Any]] | None = None,
                 cap_quantile: float = CAP_QUANTILE, xi: float = XI):
        if not candidates:
            raise ValueError("CandidateBO needs at least one candidate")
        self.candidates = list(candidates)
        self.index = {c: i for i, c in enumerate(self.candidates)}
        tables = encode_features(values if values is not None else choices)
        pos = [{v: j for j, v in enumerate(ch)} for ch in choices]
        cols = [tables[p][[pos[p][c[p]] for c in self.candidates]]
                for p in range(len(choices))]
        self.x = np.concatenate(cols, axis=1) if cols else np.zeros((len(candidates), 0))
        self.rng = np.random.default_rng(seed)
        self.n_startup = n_startup
        self.refit_every = max(1, refit_every)
        self.cap_quantile = cap_quantile
        self.xi = xi
        self._gp = _GP(self.x.shape[1], self.rng)
        self._fitted_at = -1

    def propose(self, measured: Mapping[tuple[Hashable, ...], float],
                pending: Sequence[tuple[Hashable, ...]] = ()) -> tuple[Hashable, ...] | None:
        """The next candidate to measure, or None when every candidate is measured or pending."""
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
            return self.candidates[int(self.rng.choice(free))]
        try:
            return self.candidates[self._ei_pick(known, finite, pending, free)]
        except (np.linalg.LinAlgError, ValueError, FloatingPointError):
            # A numerically singular fit: measure a random candidate and refit next time.
            self._fitted_at = -1
            return self.candidates[int(self.rng.choice(free))]

    def _ei_pick(self, known: list[tuple[int, float]], finite: list[float],
                 pending: Sequence[tuple[Hashable, ...]], free: np.ndarray) -> int:
        worst = max(math.log(v) for v in finite)
        idx = np.array([i for i, _ in known])
        y = np.array([math.log(v) if math.isfinite(v) and v > 0 else worst for _, v in known])
        if self.cap_quantile < 1 and len(y) >= 20:
            # Output capping: what is slower than the median only tells "bad"; its exact size
            # would make the GP model the slow half, not the fast region that matters.
            y = np.minimum(y, np.quantile(y, self.cap_quantile))
        mean, std = y.mean(), y.std() or 1.0
        ys = (y - mean) / std
        n = len(idx)
        every = self.refit_every if n < 60 else 4 * self.refit_every
        optimize = self._fitted_at < 0 or n - self._fitted_at >= every
        self._gp.fit(self.x[idx], ys, optimize=optimize)
        if optimize:
            self._fitted_at = n
        pend = [self.index[c] for c in pending if c in self.index]
        if pend:  # Kriging believer: pending points take the mean prediction.
            mu_p, _ = self._gp.predict(self.x[pend])
            self._gp.fit(np.concatenate([self.x[idx], self.x[pend]]),
                         np.concatenate([ys, mu_p]), optimize=False)
        if free.size > MAX_SCORED:
            free = self.rng.choice(free, MAX_SCORED, replace=False)
        mu, sd = self._gp.predict(self.x[free])
        best = ys[np.array([math.isfinite(v) and v > 0 for _, v in known])].min()
        ei = _expected_improvement(mu, sd, best - self.xi)
        top = np.flatnonzero(ei >= ei.max() * (1 - 1e-9))
        return int(free[top[self.rng.integers(top.size)]])


class CandidateSampler(optuna.samplers.BaseSampler):
    """An Optuna sampler over a finite candidate list, proposing with :class:`CandidateBO`.

    ``candidates``: configs as dicts of the trial's parameter values (every parameter
    categorical). ``values``: per parameter, what its choices stand for, where the choices
    are only indices (the features are built from these: log2 tile sizes, not indices).
    Running trials are the pending set, so several hosts or a batch of asks spread out.
    Enqueued trials (warm starts) keep their fixed parameters."""

    def __init__(self, candidates: Sequence[Mapping[str, Any]],
                 distributions: Mapping[str, CategoricalDistribution], *,
                 values: Mapping[str, Sequence[Any]] | None = None,
                 seed: int | None = None, n_startup: int = DEFAULT_STARTUP):
        self._names = list(distributions)
        self._dists = dict(distributions)
        values = values or {}
        tuples = [tuple(c[n] for n in self._names) for c in candidates]
        features = [list(values.get(n, self._dists[n].choices)) for n in self._names]
        # CandidateBO sees choice positions mapped to the values they stand for.
        self._bo = CandidateBO(tuples, [list(self._dists[n].choices) for n in self._names],
                               seed=seed, n_startup=n_startup, values=features)
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
