"""The surrogate model of the default search: features of a finite space's configs, and a
Gaussian process on them (plain numpy/scipy; scipy comes with jax)."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from scipy.linalg import cho_solve, solve_triangular

__all__ = ["GP", "encode_features", "expected_improvement", "one_blas_thread"]

# Hyperparameters are fitted on at most this many measurements (the best half, a random half).
FIT_POINTS = 160


@functools.cache
def _blas() -> Any:
    """The process's BLAS thread pools (threadpoolctl), found once: scanning the loaded
    libraries takes 2 to 3 ms, a limit and its undoing through the found pools 15 us."""
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


_HOLD_LOCK = threading.Lock()
_holders = 0  # Proposals under way (an Optuna study may ask from several threads).
_held: Any = None  # The limit they share; the last to finish restores the process's own.


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """BLAS held to one thread while the search proposes. Its products are small (tens of
    points, a few thousand candidates); with more threads, starting them costs more than they
    save, and under a tune's own compile and timing processes the threads wait for cores:
    benchmarks/search/proposal_time.py measures both. The limit is the process's: proposals
    in several threads share it, and the process's own limits come back when the last ends."""
    global _holders, _held
    with _HOLD_LOCK:
        if _holders == 0:
            try:
                _held = _blas().limit(limits=1, user_api="blas")
            except Exception as e:  # noqa: BLE001 - a BLAS it cannot read: propose as is.
                _held = None
                logging.getLogger("pallas_tune.search").debug(
                    "BLAS threads not limited while proposing: %s: %s", type(e).__name__, e)
        _holders += 1
    try:
        yield
    finally:
        with _HOLD_LOCK:
            _holders -= 1
            if _holders == 0 and _held is not None:
                _held.restore_original_limits()
                _held = None


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_selector(values: Sequence[Any]) -> bool:
    """0, 1, 2 or 0, 1, 2, 3: read as a choice among methods (one-hot), not as a size (sizes are
    never 0). Replayed on pnpoly (two such parameters), one-hot took 13.5 evaluations to 5% of
    the optimum against 18.5 as numbers. Longer 0-based ranges are counts, kept ordinal."""
    return 3 <= len(values) <= 4 and sorted(values) == list(range(len(values)))


def is_ordinal(values: Sequence[Any]) -> bool:
    """Whether a parameter's values are sizes or counts (ordered), not labels."""
    return (len(values) > 1 and all(_is_number(v) for v in values)
            and not _is_selector(values))


def _pow2_column(values: Sequence[Any]) -> np.ndarray | None:
    """How close each value is to a power of two, where integer sizes mix powers of two with
    others (16, 32, 48, ...): 1 for a power of two, else log2 of its largest power-of-two
    divisor over log2 of the value (48 = 16 * 3: 4 / 5.58). Hardware tiles are powers of
    two (warps of 32 or 64 lanes, TPU vregs of 8 x 128), so such sizes run unlike their
    neighbours; a smooth kernel over log2(size) alone cannot see that."""
    if len(values) < 3 or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                                  and v > 0 for v in values):
        return None
    x = np.asarray(values, dtype=np.int64)
    low = (x & -x).astype(float)  # The largest power-of-two divisor.
    col = np.where(x == 1, 1.0, np.log2(low) / np.log2(np.maximum(x, 2)))
    if col.min() == col.max():
        return None
    return ((col - col.min()) / (col.max() - col.min())).reshape(-1, 1)


def encode_features(choices: Sequence[Sequence[Any]], pow2: bool = False) -> list[np.ndarray]:
    """Per parameter, a (len(choices), width) feature table in [0, 1].

    Numbers are min-max scaled, on a log2 scale where all are positive and span at least a
    factor 4 (tile sizes, buffer depths); anything else is one-hot. Constant parameters get
    width 0. ``pow2``: integer sizes that mix powers of two with other values get a second
    column, how near each is to a power of two (:func:`_pow2_column`)."""
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
            col = ((x - lo) / (hi - lo)).reshape(n, 1)
            extra = _pow2_column(values) if pow2 else None
            tables.append(col if extra is None else np.concatenate([col, extra], axis=1))
        else:
            tables.append(np.eye(n))
    return tables


class GP:
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

    def _nll(self, theta: np.ndarray, sq: np.ndarray, y: np.ndarray
             ) -> tuple[float, np.ndarray]:
        """Negative log marginal likelihood plus log-prior, and its gradient in ``theta``;
        ``sq``: the (n, n, dim) squared feature differences of the points."""
        dim = self.dim
        ls, var, noise = np.exp(theta[:dim]), math.exp(theta[-2]), math.exp(theta[-1])
        diff2 = sq / (ls * ls)  # (n, n, dim)
        d = np.sqrt(5.0 * diff2.sum(-1))
        e = np.exp(-d)
        ks = var * (1.0 + d + d * d / 3.0) * e
        k = ks + (noise + 1e-8) * np.eye(len(y))
        try:
            chol = np.linalg.cholesky(k)
        except np.linalg.LinAlgError:
            return 1e10, np.zeros_like(theta)
        alpha = cho_solve((chol, True), y)
        nll = 0.5 * y @ alpha + np.log(np.diag(chol)).sum()
        # dNLL/dθ = ½ tr((K⁻¹ − ααᵀ) dK/dθ);
        # Matern 5/2: dK/dlog ℓ_k = σ² e^{-d} (1 + d) · 5/3 · (Δ_k/ℓ_k)².
        w = cho_solve((chol, True), np.eye(len(y))) - np.outer(alpha, alpha)
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
            sq = (xf[:, None, :] - xf[None, :, :]) ** 2
            for t0 in starts:
                r = minimize(self._nll, t0, args=(sq, yf), jac=True, method="L-BFGS-B",
                             bounds=bounds, options={"maxiter": 50})
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


def expected_improvement(mu: np.ndarray, sd: np.ndarray, best: float) -> np.ndarray:
    from scipy.special import ndtr  # scipy.stats would cost a second to import.

    z = (best - mu) / sd
    return sd * (z * ndtr(z) + np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi))


def parzen_log_ratio(ranks: np.ndarray, ordinal: np.ndarray, good: np.ndarray,
                     bad: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """TPE's acquisition, log l(x) − log g(x), for the candidates ``rows``: per parameter, a
    smoothed density of the ``good`` and of the ``bad`` measured configs' value ranks (a kernel
    falling off by half per rank step for numbers, a uniform prior of one pseudo-count for labels),
    summed over parameters as independent TPE does. ``ranks``: (candidates, parameters)."""
    out = np.zeros(len(rows))
    for p in range(ranks.shape[1]):
        k = int(ranks[:, p].max()) + 1
        if k <= 1:
            continue
        grid = np.arange(k)
        dens = []
        for group in (good, bad):
            r = ranks[group, p]
            if ordinal[p]:
                w = 0.5 ** np.abs(grid[None, :] - r[:, None])
                d = (w / w.sum(1, keepdims=True)).sum(0) + 1.0 / k
            else:
                d = np.bincount(r, minlength=k) + 1.0 / k
            dens.append(d / d.sum())
        out += np.log(dens[0][ranks[rows, p]]) - np.log(dens[1][ranks[rows, p]])
    return out


def joint_parzen_log_ratio(ranks: np.ndarray, good: np.ndarray, bad: np.ndarray,
                           rows: np.ndarray) -> np.ndarray:
    """Multivariate TPE's acquisition over categorical parameters (as Optuna's multivariate
    TPESampler builds it), log l(x) − log g(x) for the candidates ``rows``: each density is a
    mixture of one product kernel per measured config of its group, plus a uniform prior
    component; a kernel puts (1 + 1/k)/2 on its config's value of a k-valued parameter and
    (1/k)/2 on each other value. Joint, so it keeps which values go well together."""
    ks = ranks.max(0) + 1
    cand = ranks[rows]
    logs = []
    for group in (good, bad):
        obs = ranks[group]
        logk = np.zeros((len(rows), len(group)))
        for p, k in enumerate(ks):
            if k <= 1:
                continue
            same = cand[:, p][:, None] == obs[:, p][None, :]
            logk += np.where(same, math.log((1 + 1 / k) / 2), math.log((1 / k) / 2))
        prior = -np.log(ks).sum()
        both = np.concatenate([logk, np.full((len(rows), 1), prior)], axis=1)
        top = both.max(1, keepdims=True)
        logs.append(top[:, 0] + np.log(np.exp(both - top).mean(1)))
    return logs[0] - logs[1]
