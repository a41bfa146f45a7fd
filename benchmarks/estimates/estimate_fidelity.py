"""Ground truth for the estimate (issue 39): how libtpu's static cycle estimate, and pallas-tune's
roofline model, rank block sizes that were measured best on a real TPU v6e.

The real-hardware winners are vLLM tpu-inference's published table for its int8 quantized matmul
(``tpu_inference/kernels/quantized_matmul/tuned_block_sizes.py``, Apache-2.0, PyPI package
``tpu-inference``): key ``(6, n_batch, n_out, n_in, 'int8', 'int8')`` -> ``(batch_block,
out_block, in_block)``, measured on v6e; a key not in the table runs (128, 128, 128). For a
seeded sample of v6e keys, every config of a block-size space (powers of two dividing each
dimension, plus the winner's values and the miss default; and a wider space of every multiple
of 128 dividing each dimension, computed in the same run: see :func:`space`) is given two
figures, each ranked:

- ``proxy``: libtpu's static cycle estimate (deviceless compile for v6e on this CPU host, via
  :class:`pallas_tune.measure.estimate.Estimator`, on a stand-in with fewer batch blocks
  checked as a tune checks one) of tpu-inference's kernel with ONE function replaced:
  ``tpu_inference.kernels.quantized_matmul.util.quantize_array`` (per-row int8 quantization
  of an activation block inside the kernel) by :func:`proxy_quantize_array`, which computes
  the scale row (row max / 127) and its reciprocal in float32 and casts the reciprocal back
  to bf16. The unmodified kernel makes libtpu 0.0.50's static profiler abort (``LLO_CHECK
  failure ... Expected vector-bf16packed, got vector-int32``, from the bf16 divide by a
  constant; computing only the scale in f32 still aborts, at the bf16 reciprocal); the
  proxy compiles. It is a proxy: one (1, batch_block) row op differs from the kernel the
  table was measured with.
- ``roofline``: pallas-tune's roofline model (``candidate.roofline_time``) of the UNMODIFIED
  kernel: what a tune with ``--estimate-fallback roofline`` ranks by when libtpu aborts.

Neither figure is a measurement. Per key it reports the real winner's rank under each figure,
est(real winner) / est(figure's pick), whether the pick is the real winner, and whether the
figure ranks the real winner ahead of the miss default (128, 128, 128); then a summary, written
as Markdown to ``benchmarks/results/estimate_fidelity.md``.

tpu-inference is loaded WITHOUT its package ``__init__`` (which imports vLLM): stub package
modules whose ``__path__`` is the installed package's directories, and a stub
``tpu_inference.logger``, are put in ``sys.modules`` when this module is imported (so also in
the estimate workers, which import this script). Needs ``pip install --no-deps
tpu-inference==0.32.0`` and libtpu; exits 2 without tpu-inference.

    PALLAS_TUNE_TPU_LOGS=off python benchmarks/estimates/estimate_fidelity.py [--keys 10]
        [--seed 39]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): one cheap key, one worker; the report and dump go to the
smoke folder.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import logging
import math
import os
import platform
import random
import re
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

DIST = "tpu-inference"
PKG = "tpu_inference"
QMM = f"{PKG}.kernels.quantized_matmul"
TABLE_FILE = "kernels/quantized_matmul/tuned_block_sizes.py"
MISS_DEFAULT = (128, 128, 128)  # What tpu-inference runs for a key its table does not hold.
TPU_VERSION = 6  # v6e: the table's key[0].
CHIP = "v6e"
MIN_TILE = 128  # Lane width: the smallest out and in block.
RESULTS = bench.result("estimate_fidelity.md")
DUMP = bench.result("data", "estimate_fidelity.json")
FIT_DUMP = bench.result("data", "estimate_fidelity_fit.json")

Key = tuple[int, int, int]  # (n_batch, n_out, n_in) of a v6e int8 x int8 entry.
Blocks = tuple[int, int, int]  # (batch_block, out_block, in_block).


# --- Loading tpu-inference without its __init__ (it imports vLLM) -------------------------

def package_dir() -> str | None:
    """The installed ``tpu_inference`` package directory, from the distribution's file list
    (not by importing it: its ``__init__`` imports vLLM); None if it is not installed."""
    from importlib import metadata

    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).replace("\\", "/") == f"{PKG}/__init__.py":
            return os.path.dirname(str(dist.locate_file(f)))
    return None


class _OnceLogger(logging.LoggerAdapter):
    """``init_logger``'s logger: a plain ``logging.getLogger`` with vLLM's ``*_once`` methods,
    which tpu-inference's block-size lookup calls (``get_device_vmem_limit`` on a CPU host)."""

    def __init__(self, name: str):
        super().__init__(logging.getLogger(name), {})
        self._said: set[tuple[str, Any]] = set()

    def _once(self, level: int, msg: str, *args: Any) -> None:
        key = (msg, args)
        if key not in self._said:
            self._said.add(key)
            self.log(level, msg, *args)

    def warning_once(self, msg: str, *args: Any, **_: Any) -> None:
        self._once(logging.WARNING, msg, *args)

    def info_once(self, msg: str, *args: Any, **_: Any) -> None:
        self._once(logging.INFO, msg, *args)

    def debug_once(self, msg: str, *args: Any, **_: Any) -> None:
        self._once(logging.DEBUG, msg, *args)


def _stub_package(name: str, path: str) -> types.ModuleType:
    import importlib.machinery

    module = types.ModuleType(name)
    module.__path__ = [path]
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__spec__.submodule_search_locations = [path]
    module.__file__ = None
    return module


def install_stubs() -> str | None:
    """Puts stub ``tpu_inference``, ``tpu_inference.kernels``,
    ``tpu_inference.kernels.quantized_matmul`` (their ``__path__``: the installed directories,
    so submodules import from the wheel unchanged) and ``tpu_inference.logger`` in
    ``sys.modules``, unless the real package is imported already. Returns the package
    directory, or None if tpu-inference is not installed."""
    root = package_dir()
    if root is None:
        return None
    if PKG in sys.modules and getattr(sys.modules[PKG], "__file__", None):
        return root  # The real package is loaded (vLLM present): nothing to stub.
    for name, path in ((PKG, root), (f"{PKG}.kernels", os.path.join(root, "kernels")),
                       (QMM, os.path.join(root, "kernels", "quantized_matmul"))):
        sys.modules.setdefault(name, _stub_package(name, path))
    if f"{PKG}.logger" not in sys.modules:
        logger = types.ModuleType(f"{PKG}.logger")
        logger.init_logger = _OnceLogger  # type: ignore[attr-defined]
        sys.modules[f"{PKG}.logger"] = logger
        sys.modules[PKG].logger = logger  # type: ignore[attr-defined]
    return root


TPU_INFERENCE_DIR = install_stubs()  # At import: the estimate workers import this script too.


def qmm() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """tpu-inference's quantized-matmul modules: (kernel, util, tuned_block_sizes)."""
    import importlib

    return tuple(importlib.import_module(f"{QMM}.{m}")  # type: ignore[return-value]
                 for m in ("kernel", "util", "tuned_block_sizes"))


def tpu_inference_version() -> str:
    return bench.version(DIST)


# --- The kernel, unmodified and as the proxy ----------------------------------------------

def proxy_quantize_array(x: Any, x_abs_max: Any, quant_dtype: Any) -> tuple[Any, Any]:
    """``util.quantize_array`` with the scale row and its reciprocal computed in float32, the
    reciprocal cast back to the block's dtype (bf16) before it scales ``x`` (in bf16, as in
    0.32.0); the returned scale is float32 as there. The original computes ``x_abs_max /
    dtype_max`` and ``1 / scale`` on the bf16 row: libtpu 0.0.50's static profiler aborts on
    both (the divide by a packed bf16 constant, then the bf16 reciprocal's ``vpop.eup``), so
    computing only the scale in float32 is not enough."""
    import jax.numpy as jnp

    is_float = jnp.issubdtype(quant_dtype, jnp.floating)
    dtype_info = jnp.finfo(quant_dtype) if is_float else jnp.iinfo(quant_dtype)
    dtype_max = float(dtype_info.max)
    scale = jnp.transpose(x_abs_max.astype(jnp.float32) / dtype_max)
    scale_inv = jnp.nan_to_num(1 / scale, dtype_max)
    return (x * scale_inv.astype(x.dtype)).astype(quant_dtype), scale


@contextlib.contextmanager
def proxy_patch() -> Iterator[None]:
    """``util.quantize_array`` replaced by :func:`proxy_quantize_array` (the attribute of
    tpu-inference's util module object, which the kernel body looks up when traced), with the
    jitted kernel's trace cache cleared on entry and exit so that traces with and without the
    patch never stand in for each other."""
    kernel, util, _ = qmm()
    original = util.quantize_array
    kernel.quantized_matmul_kernel.clear_cache()
    util.quantize_array = proxy_quantize_array
    try:
        yield
    finally:
        util.quantize_array = original
        kernel.quantized_matmul_kernel.clear_cache()


def unmodified_qmm(x: Any, w_q: Any, w_scale: Any, *, batch_block: int, out_block: int,
                   in_block: int) -> Any:
    """tpu-inference's ``quantized_matmul_kernel`` (int8 activations and weights) at the given
    block sizes, unmodified."""
    import jax.numpy as jnp

    kernel, _, tbs = qmm()
    return kernel.quantized_matmul_kernel(
        x, w_q, w_scale, x_q_dtype=jnp.int8,
        tuned_value=tbs.TunedValue(batch_block, out_block, in_block))


def proxy_qmm(x: Any, w_q: Any, w_scale: Any, *, batch_block: int, out_block: int,
              in_block: int) -> Any:
    """The same kernel traced with :func:`proxy_patch` (see the module docstring)."""
    with proxy_patch():
        return unmodified_qmm(x, w_q, w_scale, batch_block=batch_block, out_block=out_block,
                              in_block=in_block)


def operands(key: Key) -> tuple[Any, Any, Any]:
    """x (n_batch, n_in) bf16, w_q (n_out, n_in) int8, w_scale (n_out,) f32: shapes only."""
    import jax
    import jax.numpy as jnp

    n_batch, n_out, n_in = key
    return (jax.ShapeDtypeStruct((n_batch, n_in), jnp.bfloat16),
            jax.ShapeDtypeStruct((n_out, n_in), jnp.int8),
            jax.ShapeDtypeStruct((n_out,), jnp.float32))


def qmm_standin(args: Sequence[Any], kwargs: Mapping[str, Any], config: Mapping[str, int]
                ) -> tuple[list[Any], dict[str, Any], float]:
    """The proxy's stand-in (pallas-tune's ``standin=`` protocol): fewer batch blocks (the
    grid's one parallel axis; every batch block is the same work), see
    :func:`standin_batch_blocks`; returns the smaller operands and the scale."""
    import jax

    x, w_q, w_scale = args
    key = (x.shape[0], w_q.shape[0], x.shape[1])
    blocks = (config["batch_block"], config["out_block"], config["in_block"])
    nb = -(-key[0] // blocks[0])
    keep = standin_batch_blocks(key, blocks)
    rows = min(key[0], keep * blocks[0])
    return [jax.ShapeDtypeStruct((rows, key[2]), x.dtype), w_q, w_scale], dict(kwargs), nb / keep


def proxy_parts() -> Any:
    """The proxy as pallas-tune kernel parts (its function and stand-in), for ``Estimator``."""
    from pallas_tune.measure.candidate import KernelParts

    return KernelParts(name="tpu_inference.quantized_matmul_kernel (proxy)", fn=proxy_qmm,
                       standin=qmm_standin)


def config(blocks: Blocks) -> dict[str, int]:
    return dict(zip(("batch_block", "out_block", "in_block"), blocks, strict=True))


# --- Pure parts: the table, the space, the sample, the ranking ----------------------------

def parse_table(source: str) -> dict[tuple[Any, ...], tuple[int, ...]]:
    """``TUNED_BLOCK_SIZES_RAW`` from tuned_block_sizes.py's source text (a dict literal),
    read with ``ast.literal_eval``, never executed."""
    for node in ast.walk(ast.parse(source)):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "TUNED_BLOCK_SIZES_RAW" for t in targets):
            raw = ast.literal_eval(node.value)
            return {tuple(k): tuple(v) for k, v in raw.items()}
    raise ValueError("no TUNED_BLOCK_SIZES_RAW dict literal in the source")


def v6e_int8(table: Mapping[tuple[Any, ...], tuple[int, ...]]) -> dict[Key, Blocks]:
    """The table's v6e int8 x int8 entries, as (n_batch, n_out, n_in) -> (batch_block,
    out_block, in_block); other chips and dtypes, and malformed rows, left out."""
    out: dict[Key, Blocks] = {}
    for k, v in table.items():
        if (len(k) == 6 and k[0] == TPU_VERSION and k[4:] == ("int8", "int8") and len(v) >= 3
                and all(isinstance(n, int) and n > 0 for n in (*k[1:4], *v[:3]))):
            out[(k[1], k[2], k[3])] = (v[0], v[1], v[2])
    return out


def load_table(root: str) -> dict[Key, Blocks]:
    with open(os.path.join(root, TABLE_FILE), encoding="utf-8") as f:
        return v6e_int8(parse_table(f.read()))


def powers_of_two(lo: int, hi: int) -> list[int]:
    out, p = [], 1
    while p <= hi:
        if p >= lo:
            out.append(p)
        p *= 2
    return out


def batch_floor(table: Mapping[Key, Blocks]) -> int:
    """The smallest batch block: the smallest power of two, at least 16 (a bf16 sublane tile),
    that is at least the table's smallest batch block (16: its n_batch=16 entries)."""
    least = min((v[0] for v in table.values()), default=16)
    return next(p for p in powers_of_two(16, max(16, least) * 2) if p >= least)


def block_choices(dim: int, lo: int, extra: Iterable[int] = (), *, divisors: bool = False
                  ) -> list[int]:
    """Powers of two from ``lo`` up to ``dim`` that divide it (no padding), plus ``extra``
    values (the real winner's, which need not be powers of two). With ``divisors``: every
    multiple of ``lo`` that divides ``dim`` (the powers of two among them, and e.g. 640, 896
    or the whole dimension), plus ``extra``."""
    if divisors:
        return sorted({m for m in range(lo, dim + 1, lo) if dim % m == 0} | set(extra))
    return sorted({p for p in powers_of_two(lo, dim) if dim % p == 0} | set(extra))


def space(key: Key, table: Mapping[Key, Blocks], *, divisors: bool = False) -> list[Blocks]:
    """Every (batch_block, out_block, in_block) of :func:`block_choices` per dimension (batch
    from :func:`batch_floor`, out and in from 128), with the real winner's value added to each
    (so the winner is in the space), and the miss default (128, 128, 128), which pads a batch
    under 128 (what tpu-inference runs for a key it has no entry for). VMEM is left to the
    compile: a config that does not fit fails there and is not ranked. ``divisors``: the
    wider space of every multiple of 128 (of the batch floor, for batch) dividing each
    dimension, which holds the powers-of-two space."""
    n_batch, n_out, n_in = key
    win = table.get(key)
    bb = block_choices(n_batch, batch_floor(table), [win[0]] if win else [], divisors=divisors)
    ob = block_choices(n_out, MIN_TILE, [win[1]] if win else [], divisors=divisors)
    ib = block_choices(n_in, MIN_TILE, [win[2]] if win else [], divisors=divisors)
    out = [(b, o, i) for b in bb for o in ob for i in ib]
    return out if MISS_DEFAULT in out else [*out, MISS_DEFAULT]


def grid_steps(key: Key, blocks: Blocks) -> int:
    return math.prod(-(-n // b) for n, b in zip(key, blocks, strict=True))


STANDIN_STEPS = 128  # As the shipped kernels' stand-ins: at least this many grid steps kept.


def standin_batch_blocks(key: Key, blocks: Blocks) -> int:
    """How many batch blocks (the one parallel grid axis) the stand-in keeps: enough for
    ``STANDIN_STEPS`` grid steps (``shrink_parallel``'s rule), and at least 2 where the key
    has 2, so that tpu-inference's VMEM limit (which counts x's second buffer only when there
    are several batch blocks or in blocks) is the full problem's."""
    nb = -(-key[0] // blocks[0])
    other = grid_steps(key, blocks) // nb
    need = -(-STANDIN_STEPS // max(1, other))
    return max(min(nb, 2), min(nb, need))


def sample_keys(table: Mapping[Key, Blocks], count: int, seed: int,
                affordable: Callable[[Key], bool] = lambda k: True) -> list[Key]:
    """``count`` keys spread over n_batch and shapes, drawn with ``random.Random(seed)`` among
    the ``affordable`` keys: every n_batch value that has one is drawn once (values cut into
    ``count`` even strata, one drawn per stratum, where there are more values than keys; the
    keys left over go to n_batch values drawn at random); per drawn n_batch, a shape (n_out,
    n_in) not drawn yet where one is left, at random."""
    rng = random.Random(seed)
    ok = sorted(k for k in table if affordable(k))
    batches = sorted({k[0] for k in ok})
    if not batches or count <= 0:
        return []
    if count <= len(batches):
        edges = [round(i * len(batches) / count) for i in range(count + 1)]
        picks = [rng.choice(batches[edges[i]:edges[i + 1]]) for i in range(count)]
    else:
        picks = batches + [rng.choice(batches) for _ in range(count - len(batches))]
    chosen: list[Key] = []
    shapes_used: set[tuple[int, int]] = set()
    for n_batch in sorted(picks):
        pool = [k for k in ok if k[0] == n_batch and k not in chosen]
        fresh = [k for k in pool if (k[1], k[2]) not in shapes_used] or pool
        if fresh:
            k = rng.choice(fresh)
            chosen.append(k)
            shapes_used.add((k[1], k[2]))
    return chosen


def ranks(figures: Mapping[Blocks, float]) -> dict[Blocks, int]:
    """1 = best (smallest); ties share the best rank (1 + how many are strictly better)."""
    values = sorted(figures.values())
    import bisect

    return {c: 1 + bisect.bisect_left(values, v) for c, v in figures.items()}


@dataclasses.dataclass(frozen=True, slots=True)
class KeyVerdict:
    """One figure's ranking of one key's space, against the real winner."""

    ranked: int  # Configs with a figure.
    winner_rank: int | None  # None: the real winner has no figure (rejected, crashed).
    pick: Blocks | None  # The figure's best (ties: the first in space order).
    ratio: float | None  # fig(real winner) / fig(pick): 1.0 = the pick is as good.
    pick_is_winner: bool
    winner_beats_default: bool | None  # None: the winner or the default has no figure.


def verdict(figures: Mapping[Blocks, float], winner: Blocks,
            default: Blocks = MISS_DEFAULT) -> KeyVerdict:
    """``figures``: config -> a time-like figure (smaller is better), only configs that have
    one. The default's comparison is None where the default is not in ``figures``."""
    if not figures:
        return KeyVerdict(0, None, None, None, False, None)
    r = ranks(figures)
    pick = min(figures, key=lambda c: figures[c])
    w = figures.get(winner)
    d = figures.get(default)
    return KeyVerdict(
        ranked=len(figures), winner_rank=r.get(winner), pick=pick,
        ratio=None if w is None or figures[pick] <= 0 else w / figures[pick],
        pick_is_winner=pick == winner,
        winner_beats_default=None if w is None or d is None or winner == default else w < d)


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    keys: int
    top1: int
    top3: int
    unranked: int  # Keys whose real winner got no figure.
    median_ratio: float | None
    worst_ratio: float | None
    within_2pct: int  # The pick is the winner, or the winner is within 2% of it.
    beats_default: int
    default_compared: int


def summarize(verdicts: Sequence[KeyVerdict]) -> Summary:
    ratios = [v.ratio for v in verdicts if v.ratio is not None]
    compared = [v.winner_beats_default for v in verdicts if v.winner_beats_default is not None]
    return Summary(
        keys=len(verdicts),
        top1=sum(v.winner_rank == 1 for v in verdicts),
        top3=sum(v.winner_rank is not None and v.winner_rank <= 3 for v in verdicts),
        unranked=sum(v.winner_rank is None for v in verdicts),
        median_ratio=statistics.median(ratios) if ratios else None,
        worst_ratio=max(ratios) if ratios else None,
        within_2pct=sum(v.pick_is_winner or (v.ratio is not None and v.ratio <= 1.02)
                        for v in verdicts),
        beats_default=sum(compared), default_compared=len(compared))


def blocks_text(b: Blocks | None) -> str:
    return "-" if b is None else "(" + ", ".join(map(str, b)) + ")"


# --- The run --------------------------------------------------------------------------------

# A config's compile with libtpu's static profile, in CPU seconds, on this 2-core host under
# load (fitted to probe compiles of this kernel): a fixed part, a part per multiply-accumulate
# of the compiled problem (the profile simulates every step's bundles) and a part per step.
FIXED_S, MAC_S, STEP_S = 1.0, 1.6e-9, 4e-3


def predicted_cost_s(key: Key, table: Mapping[Key, Blocks], *, divisors: bool = False
                     ) -> float:
    """A rough guess of one key's proxy compiles (on the stand-in) over its powers-of-two
    space (or the wider ``divisors`` space), only to keep the sample within the budget: keys
    are drawn by the first, the run compiles the second."""
    total = 0.0
    for b in space(key, table, divisors=divisors):
        keep = standin_batch_blocks(key, b)
        nb = -(-key[0] // b[0])
        total += (FIXED_S + MAC_S * keep * b[0] * key[1] * key[2]
                  + STEP_S * grid_steps(key, b) * keep / nb)
    return total


def roofline_figures(key: Key, blocks: Sequence[Blocks]) -> dict[Blocks, float]:
    """pallas-tune's roofline model (seconds) of the unmodified kernel, for configs the model
    accepts (block rules, the VMEM model)."""
    from pallas_tune.measure import candidate as cand

    parts = cand.KernelParts.of(unmodified_qmm)
    args = operands(key)
    out = {}
    for b in blocks:
        s = cand.roofline_time(parts, args, {}, config(b), CHIP)
        if s is not None:
            out[b] = s
    return out


def corrected_figures(key: Key, proxy_ms: Mapping[Blocks, float]) -> dict[Blocks, float]:
    """The proxy's figures (ms) plus pallas-tune's correction (``measure.correction``: what
    libtpu's v6e estimate leaves out on the chip), its terms read off the UNMODIFIED kernel's
    traced pallas_call (the proxy's differs in one row op, not in its blocks or grid)."""
    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility import inspect as _inspect
    from pallas_tune.measure.correction import corrected_ms

    spec, args = chip_spec(CHIP), operands(key)
    out = {}
    for b, ms in proxy_ms.items():
        calls = _inspect.find_pallas_calls(unmodified_qmm, args, config(b))
        out[b] = corrected_ms(ms, calls, spec)[0]
    return out


def pick_vs_winner(verdicts: Sequence[tuple[Blocks, KeyVerdict]]
                   ) -> dict[str, tuple[int, int, int]]:
    """Per block dimension, on how many keys the figure's pick is smaller, equal, larger than
    the real winner's (keys with a pick)."""
    out = {}
    for i, dim in enumerate(("batch_block", "out_block", "in_block")):
        pairs = [(v.pick[i], w[i]) for w, v in verdicts if v.pick is not None]
        out[dim] = (sum(p < w for p, w in pairs), sum(p == w for p, w in pairs),
                    sum(p > w for p, w in pairs))
    return out


CORRECTED_TITLE = ("corrected: the proxy's estimate plus pallas-tune's opt-in correction "
                   "(measure.correction; fitted on other keys)")
REPORTED_KEYS, REPORTED_MAX_COST = 10, 400.0  # The defaults: the sample results report.
STANDIN_TOLERANCE = 0.05  # As pallas-tune's tunes (standin_verdict): beyond it, full compiles.


@dataclasses.dataclass
class KeyRun:
    key: Key
    winner: Blocks
    configs: int  # The powers-of-two space.
    configs_div: int  # The divisors space (which holds it).
    proxy: KeyVerdict
    roofline: KeyVerdict
    proxy_div: KeyVerdict
    roofline_div: KeyVerdict
    proxy_failures: dict[str, int]  # Over the divisors space.
    winner_proxy_kind: str  # "ok" or why the real winner has no proxy estimate.
    winner_without_flag: str  # For a winner the proxy lost: its compile without the flag.
    standin_check: str
    wall_s: float
    proxy_top: list[tuple[Blocks, float]]  # The proxy's best few in the pow2 space, est ms.
    winner_largest: tuple[bool, bool, bool]  # The winner's value is its dimension's largest.
    proxy_ms: dict[Blocks, float] = dataclasses.field(default_factory=dict)  # Divisors space.
    corrected: KeyVerdict | None = None  # The proxy plus measure.correction, pow2 space.
    corrected_div: KeyVerdict | None = None

    def with_correction(self, narrow: Sequence[Blocks]) -> KeyRun:
        """This run with its corrected verdicts (from ``proxy_ms``; ``narrow``: the powers-of-two
        space)."""
        fig = corrected_figures(self.key, self.proxy_ms)
        return dataclasses.replace(
            self, corrected=verdict({b: v for b, v in fig.items() if b in set(narrow)},
                                    self.winner),
            corrected_div=verdict(fig, self.winner))


def run_key(est: Any, key: Key, table: Mapping[Key, Blocks], clock_hz: float) -> KeyRun:
    """Both figures for every config of the key's divisors space (which holds the powers-of-two
    space), on the stand-in, which is checked on one config as a tune does and dropped for
    full compiles where it is off by more than 5%."""
    import collections

    from pallas_tune.feasibility import compile as _compile

    t0 = time.perf_counter()
    winner = table[key]
    blocks = space(key, table, divisors=True)
    narrow = space(key, table)
    roof = roofline_figures(key, blocks)
    results = dict(zip(blocks, est.map(proxy_parts(), operands(key), {},
                                       [config(b) for b in blocks], CHIP), strict=True))
    scaled = sorted((r.scale, b) for b, r in results.items() if r.ok and r.scale > 1)
    check = "no config needed a stand-in"
    if scaled:
        scale, b = scaled[0]
        (full,) = est.map(proxy_parts(), operands(key), {}, [config(b)], CHIP, standin=False)
        if full.ok and full.cycles:
            err = (results[b].cycles - full.cycles) / full.cycles
            check = f"{blocks_text(b)} x{scale:g}: {err:+.2%} vs full compile"
            if abs(err) > STANDIN_TOLERANCE:
                redo = [c for _, c in scaled if c != b]
                results.update(zip(redo, est.map(proxy_parts(), operands(key), {},
                                                 [config(c) for c in redo], CHIP,
                                                 standin=False), strict=True))
                results[b] = full
                check += f"; beyond 5%: all {len(scaled)} scaled configs compiled in full"
        else:
            check = (f"{blocks_text(b)} x{scale:g}: full compile failed ({full.kind}); "
                     "stand-in used unverified")
    proxy = {b: r.cycles / clock_hz * 1e3 for b, r in results.items() if r.ok and r.cycles}
    failures = collections.Counter(r.kind for r in results.values() if not (r.ok and r.cycles))
    w = results[winner]
    winner_kind = "ok" if winner in proxy else f"{w.kind}: {w.message.splitlines()[0][:160]}"
    without_flag = ""
    if winner not in proxy and w.kind != "worker_crashed":
        plain = _compile.compile_deviceless(unmodified_qmm, operands(key), config(winner),
                                            chip=CHIP)
        without_flag = (f"compiles without the profile flag ({plain.compile_s:.0f} s, scoped "
                        f"VMEM {(plain.scoped_vmem_bytes or 0) / 2**20:.1f} MiB)" if plain.ok
                        else f"fails without the flag too ({plain.kind})")

    def only(figures: Mapping[Blocks, float]) -> dict[Blocks, float]:
        return {b: v for b, v in figures.items() if b in set(narrow)}

    largest = tuple(winner[i] == max(b[i] for b in narrow if b != MISS_DEFAULT)
                    for i in range(3))
    return KeyRun(key=key, winner=winner, configs=len(narrow), configs_div=len(blocks),
                  proxy=verdict(only(proxy), winner), roofline=verdict(only(roof), winner),
                  proxy_div=verdict(proxy, winner), roofline_div=verdict(roof, winner),
                  proxy_failures=dict(failures), winner_proxy_kind=winner_kind,
                  winner_without_flag=without_flag, standin_check=check,
                  wall_s=time.perf_counter() - t0,
                  proxy_top=sorted(only(proxy).items(), key=lambda kv: kv[1])[:3],
                  winner_largest=largest, proxy_ms=proxy  # type: ignore[arg-type]
                  ).with_correction(narrow)


def unmodified_abort(est: Any, key: Key) -> str:
    """What libtpu's static profile does with the unmodified kernel (one config)."""
    (r,) = est.map(unmodified_qmm, operands(key), {}, [config(MISS_DEFAULT)], CHIP,
                   standin=False)
    if r.ok:
        return f"{blocks_text(MISS_DEFAULT)} at {key}: estimated ({r.cycles} cycles): no abort"
    from pallas_tune.measure.loops import profiler_abort

    signal = re.search(r"signal (SIG\w+)", r.message)
    why = profiler_abort(r.message) or (
        f"the worker died from {signal.group(1)} during the compile" if signal
        else r.message.splitlines()[0][:200])
    return f"at {blocks_text(MISS_DEFAULT)}, key {key}: `ok={r.ok}`, `kind={r.kind}`, {why}"


def yes_no(v: bool | None) -> str:
    return "-" if v is None else "yes" if v else "no"


def ratio_text(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def summary_lines(label: str, s: Summary) -> list[str]:
    return [
        (f"- **{label}**: real winner ranked 1st on {s.top1}/{s.keys} keys, within the top 3 on "
        f"{s.top3}/{s.keys}; not ranked at all (no figure for it) on {s.unranked}/{s.keys}."),
        (f"  est(real winner) / est(pick): median {ratio_text(s.median_ratio)}, worst "
        f"{ratio_text(s.worst_ratio)} (over keys where the winner is ranked). Pick equal to the "
        f"winner or within 2% of it on {s.within_2pct}/{s.keys} keys. Real winner ranked "
        f"faster than the miss default (128, 128, 128) on {s.beats_default}/"
        f"{s.default_compared} keys where both have a figure."),
    ]


def report(runs: Sequence[KeyRun], *, meta: Mapping[str, Any],
           fit: tuple[Sequence[KeyRun], Mapping[str, Any]] | None = None) -> str:
    versions, command, total_s = meta["versions"], meta["command"], meta["total_s"]
    abort_note, sample_note = meta["abort_note"], meta["sample_note"]
    lines = [
        ("# Estimate fidelity: libtpu's static estimate and pallas-tune's roofline model "
        "against real-hardware winners (TPU v6e)"), "",
        (f"Generated by `{bench.script(__file__)}` (issue 39). **No figure here is a "
        "measurement.** `proxy` figures are libtpu's static cycle ESTIMATES (deviceless compile "
        "for v6e on a CPU host, converted at 1.75 GHz) of a proxy of the kernel; `roofline` "
        "figures are pallas-tune's roofline MODEL of the unmodified kernel. The \"real winner\" "
        "of each key is the block size vLLM tpu-inference publishes as measured best on a real "
        "TPU v6e (`tpu_inference/kernels/quantized_matmul/tuned_block_sizes.py`, tpu-inference "
        f"{versions['tpu-inference']}, Apache-2.0); only the sampled keys and their winners "
        "are reproduced here."), "",
        f"- command: `{command}`",
        f"- date: {meta['date']}; wall time {total_s / 60:.1f} min",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        (f"- host: {bench.host()}, shared with another job's tests, 2 compile workers"), "",
        "## What is compared", "",
        ("- Kernel: tpu-inference 0.32.0 `quantized_matmul_kernel(x, w_q, w_scale, "
        "x_q_dtype=int8, tuned_value=TunedValue(batch_block, out_block, in_block))`, x bf16 "
        "(n_batch, n_in), w_q int8 (n_out, n_in), w_scale f32 (n_out,)."),
        ("- **proxy** (libtpu compiler estimate): the unmodified kernel makes libtpu's static "
        f"profiler abort ({abort_note}). The proxy replaces ONE function at benchmark time: "
        "`tpu_inference.kernels.quantized_matmul.util.quantize_array` (the in-kernel per-row "
        "int8 quantization of the activation block) by `proxy_quantize_array`, which computes "
        "the (1, batch_block) scale row and its reciprocal in float32 and casts the reciprocal "
        "back to bf16 before scaling x (the original computes both in bf16; computing only the "
        "scale in f32 still aborted, at the reciprocal). Everything else is their code, "
        "unmodified. Estimates are on a stand-in where one applies (fewer batch blocks, the "
        "grid's one parallel axis, at least 128 steps, scaled), checked per key as a "
        "pallas-tune tune does: one config against its full compile, and every scaled config "
        "compiled in full where that is off by more than 5% (column `stand-in check`)."),
        ("- **corrected** (pallas-tune's opt-in correction, `--estimate-correction`): the "
        "proxy's estimate plus what `pallas_tune.measure.correction` adds for v6e: the exposed "
        "DMA (each window's first fetch and last write-back, and single-buffered refetches) "
        "that libtpu's profile moves at 1.44x the chip's bandwidth, `1 - 1/1.44` of it at the "
        "spec bandwidth (derived, not fitted), and 0.15 us per grid step (fitted on the keys "
        "of the section `Fitting sample`, none of which is reported above it). It did better "
        "than libtpu's figure on the keys it was fitted on and not on these: it is off by "
        "default (`benchmarks/results/estimate_correction_fit.txt` scores a grid of both "
        "terms on both samples)."),
        ("- **roofline** (pallas-tune's model): `candidate.roofline_time` of the UNMODIFIED "
        "kernel: what `--estimate-fallback roofline` ranks by when libtpu aborts. It counts the "
        "dot of every `lax.cond` branch the kernel traces (1 per step where the grid has one "
        "in and one out block, 2 where only out is split, 4 where in is split), so its FLOPs "
        "overcount; configs its VMEM model refuses are not ranked."),
        ("- Space per key: batch_block, out_block, in_block each a power of two (batch from 16, "
        "the table's smallest batch block; out and in from 128) up to the dimension and "
        "dividing it, plus the real winner's own value in each dimension (winners are often "
        "not powers of two, e.g. 896 or 1536), plus the miss default (128, 128, 128) (which "
        "pads a batch under 128); VMEM left to the compile: a config the compile rejects gets "
        "no figure and is not ranked (batch blocks under 128 that are not the whole batch "
        "fail the block rules: tpu-inference's (1, batch_block) block of the row maxima). "
        "The tables below rank this space. The winner's own values are often the largest in "
        "their dimension of it (a real winner of 896 or 2560 sits beside powers of two no "
        "larger than 512 or 1024), which flatters any figure that prefers big blocks; the "
        "section `Wider space` ranks every multiple of 128 that divides each dimension "
        "instead (all computed in the same run)."),
        f"- Sample: {sample_note}", "",
        ("Columns: `rank` = the real winner's rank under the figure (1 = best) / configs ranked; "
        "`ratio` = fig(real winner) / fig(figure's pick); `pick=win` = the figure's best is the "
        "real winner; `win<def` = the figure puts the real winner ahead of the miss default "
        "(128, 128, 128)."), "",
    ]
    for label, attr in (("proxy: libtpu static estimate (compiler estimate of the proxy)",
                         "proxy"),
                        ("roofline: pallas-tune's roofline model (unmodified kernel)",
                         "roofline"),
                        (CORRECTED_TITLE, "corrected")):
        lines += [f"## {label}", "",
                  ("| key (n_batch, n_out, n_in) | real winner | space | rank | pick | ratio | "
                  "pick=win | win<def |"),
                  "|---|---|---|---|---|---|---|---|"]
        for r in runs:
            v: KeyVerdict = getattr(r, attr)
            rank = f"{v.winner_rank}/{v.ranked}" if v.winner_rank else f"- /{v.ranked}"
            lines.append(f"| {blocks_text(r.key)} | {blocks_text(r.winner)} | {r.configs} | "
                         f"{rank} | {blocks_text(v.pick)} | {ratio_text(v.ratio)} | "
                         f"{yes_no(v.pick_is_winner)} | {yes_no(v.winner_beats_default)} |")
        lines.append("")
    lines += ["## Per key: time, failures, stand-in", "",
              ("| key | wall s | proxy: configs without an estimate | real winner under the "
              "proxy | stand-in check | proxy's top 3 (est ms) |"), "|---|---|---|---|---|---|"]
    for r in runs:
        fails = ", ".join(f"{k} {n}" for k, n in sorted(r.proxy_failures.items())) or "none"
        wk = r.winner_proxy_kind if r.winner_proxy_kind == "ok" else (
            r.winner_proxy_kind + (f"; {r.winner_without_flag}" if r.winner_without_flag
                                   else ""))
        top = "; ".join(f"{blocks_text(b)} {ms:.4f}" for b, ms in r.proxy_top)
        lines.append(f"| {blocks_text(r.key)} | {r.wall_s:.0f} | {fails} | {wk} | "
                     f"{r.standin_check} | {top} |")
    lines += ["", "## Wider space: every multiple of 128 dividing each dimension", "",
              ("Batch blocks as above (powers of two: n_batch is one); out and in blocks every "
               "multiple of 128 that divides the dimension, the whole dimension included; the "
               "miss default added. Same figures, same run."), "",
              ("| key | space | proxy rank | proxy pick | proxy ratio | corrected rank | "
               "corrected pick | corrected ratio | roofline rank | roofline pick | "
               "roofline ratio |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {blocks_text(r.key)} | {r.configs_div} | " + " | ".join(
            f"{v.winner_rank or '-'}/{v.ranked} | {blocks_text(v.pick)} | {ratio_text(v.ratio)}"
            for v in (r.proxy_div, r.corrected_div, r.roofline_div)) + " |")
    lines += ["", "## Summary", "", "Powers-of-two space (the tables above):", ""]
    for label, attr in (("proxy (libtpu compiler estimate)", "proxy"),
                        ("corrected (the proxy + measure.correction)", "corrected"),
                        ("roofline (pallas-tune's model)", "roofline")):
        lines += summary_lines(label, summarize([getattr(r, attr) for r in runs]))
    lines += ["", "Wider space (every multiple of 128 dividing each dimension):", ""]
    for label, attr in (("proxy (libtpu compiler estimate)", "proxy_div"),
                        ("corrected (the proxy + measure.correction)", "corrected_div"),
                        ("roofline (pallas-tune's model)", "roofline_div")):
        lines += summary_lines(label, summarize([getattr(r, attr) for r in runs]))
    big = [sum(r.winner_largest[i] for r in runs) for i in range(3)]
    lines += ["", (f"The real winner's value is the largest choice of its dimension in the "
                   f"powers-of-two space on: batch {big[0]}/{len(runs)}, out {big[1]}/"
                   f"{len(runs)}, in {big[2]}/{len(runs)} keys.")]
    lines += ["", ("Pick vs real winner, per block dimension (keys where the pick is smaller / "
              "equal / larger):"), ""]
    for label, attr in (("proxy", "proxy"), ("corrected", "corrected"),
                        ("roofline", "roofline"), ("proxy, wider space", "proxy_div"),
                        ("corrected, wider space", "corrected_div"),
                        ("roofline, wider space", "roofline_div")):
        pv = pick_vs_winner([(r.winner, getattr(r, attr)) for r in runs])
        lines.append(f"- {label}: " + "; ".join(f"{d} {a}/{b}/{c}" for d, (a, b, c)
                                                in pv.items()))
    if fit is not None:
        lines += fit_section(*fit)
    lines.append("")
    return "\n".join(lines)


def fit_section(runs: Sequence[KeyRun], meta: Mapping[str, Any]) -> list[str]:
    """The correction's fitting sample: its keys, and each figure's summary on them (the
    figures there are fitted, so they say nothing about keys not seen)."""
    lines = ["", "## Fitting sample (what the correction's per-step term was fitted on)", "",
             (f"`{meta['command']}` ({meta['date']}): {meta['sample_note']} Its keys are "
              "disjoint from the reported sample's. The per-step term (0.15 us) minimizes the "
              "sum over these keys of log(fig(real winner) / fig(pick)) in the wider space "
              "(`benchmarks/estimates/estimate_correction_fit.py`); the exposed-DMA term is not "
              "fitted. "
              "Figures on these keys are in-sample."), "",
             "| key | real winner | proxy rank | corrected rank | proxy ratio | "
             "corrected ratio |", "|---|---|---|---|---|---|"]
    for r in runs:
        p, c = r.proxy_div, r.corrected_div
        lines.append(f"| {blocks_text(r.key)} | {blocks_text(r.winner)} | "
                     f"{p.winner_rank or '-'}/{p.ranked} | {c.winner_rank or '-'}/{c.ranked} | "
                     f"{ratio_text(p.ratio)} | {ratio_text(c.ratio)} |")
    lines += ["", "Wider space:", ""]
    for label, attr in (("proxy", "proxy_div"), ("corrected", "corrected_div")):
        lines += summary_lines(label, summarize([getattr(r, attr) for r in runs]))
    return lines


def run_sample(keys: Sequence[Key], table: Mapping[Key, Blocks], *, workers: int,
               timeout_s: float) -> tuple[list[KeyRun], dict[str, Any]]:
    """Every key's run, and the report's metadata (versions, the abort note, wall time)."""
    import jax

    from pallas_tune.chips import chip_spec
    from pallas_tune.measure.estimate import Estimator

    versions = {"libtpu": bench.version("libtpu"), "jax": jax.__version__,
                "jaxlib": bench.version("jaxlib"), "tpu-inference": tpu_inference_version(),
                "pallas-tune": bench.version("pallas-tune"),
                "python": platform.python_version()}
    clock = chip_spec(CHIP).clock_hz
    runs: list[KeyRun] = []
    t0 = time.perf_counter()
    with Estimator(min(2, workers), timeout_s=timeout_s) as est:
        abort_note = unmodified_abort(est, keys[0])
        print("unmodified kernel:", abort_note, flush=True)
        for k in keys:
            r = run_key(est, k, table, clock)
            runs.append(r)
            print(f"{k} winner {r.winner}: " + "; ".join(
                f"{name} rank {v.winner_rank}/{v.ranked} pick {v.pick} ratio "
                f"{ratio_text(v.ratio)}" for name, v in (
                    ("proxy", r.proxy), ("corrected", r.corrected), ("roofline", r.roofline),
                    ("wider proxy", r.proxy_div), ("wider corrected", r.corrected_div)))
                + f"; {r.wall_s:.0f} s; failures {r.proxy_failures}; winner "
                  f"{r.winner_proxy_kind[:80]} {r.winner_without_flag}; stand-in "
                  f"{r.standin_check}", flush=True)
    return runs, {"versions": versions, "abort_note": abort_note,
                  "total_s": time.perf_counter() - t0, "date": bench.today()}


def sample_note(keys: Sequence[Key], table: Mapping[Key, Blocks], seed: int,
                max_key_cost: float) -> str:
    n_batches = sorted({k[0] for k in keys})
    affordable = {k for k in table if predicted_cost_s(k, table) <= max_key_cost}
    left_out = sorted({k[0] for k in table} - {k[0] for k in affordable})
    return (
        f"{len(keys)} of the table's {len(table)} v6e int8 x int8 keys, "
        f"`sample_keys(seed={seed})`: n_batch values {n_batches}, each drawn once (a second "
        "key for one drawn at random where keys outnumber n_batch values), shapes not "
        "repeated where the n_batch has another, drawn only among the "
        f"{len(affordable)} keys whose predicted compile cost over the powers-of-two space is "
        f"at most {max_key_cost:g} CPU s (`--max-key-cost`, `predicted_cost_s`: the "
        "40-minute budget on 2 shared cores). That leaves out n_batch "
        f"{left_out or 'none'} entirely and, at large n_batch, every shape but the smallest "
        "(n_out x n_in): the sample is biased towards small problems at large batch.")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--keys", type=int, default=bench.smoke(REPORTED_KEYS, 1))
    p.add_argument("--seed", type=int, default=39)
    p.add_argument("--workers", type=int, default=bench.smoke(2, 1))
    p.add_argument("--max-key-cost", type=float, default=bench.smoke(REPORTED_MAX_COST, 30.0),
                   help="draw keys only among those whose predicted proxy compiles cost at "
                        "most this many CPU seconds (predicted_cost_s; default 400)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-config compile limit")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--dump", metavar="JSON", default=DUMP,
                   help="where to write every key's run and every config's proxy figure "
                        f"(default {os.path.relpath(DUMP, bench.REPO)}; '' for nowhere)")
    p.add_argument("--from-dump", metavar="JSON",
                   help="re-render the report from a --dump, with the correction as it is "
                        "now, compiling nothing")
    p.add_argument("--fit-dump", metavar="JSON", default=FIT_DUMP,
                   help="the correction's fitting sample (a --dump of a run with "
                        "--exclude-seed 39), summarized beside the reported sample")
    p.add_argument("--exclude-seed", type=int, metavar="SEED",
                   help="draw keys disjoint from the sample this seed draws with the default "
                        "--keys and --max-key-cost (a fitting sample beside the reported one)")
    p.add_argument("--dry-run", action="store_true", help="print the sample and exit")
    a = p.parse_args(argv)
    if TPU_INFERENCE_DIR is None:
        print(f"{DIST} is not installed: pip install --no-deps {DIST}==0.32.0 (its vLLM "
              "dependency is not needed). Nothing to compare against.", file=sys.stderr)
        return 2
    table = load_table(TPU_INFERENCE_DIR)
    if a.from_dump:
        runs, meta = load_dump(a.from_dump, table)
    else:
        held = (set(sample_keys(table, REPORTED_KEYS, a.exclude_seed,
                                lambda k: predicted_cost_s(k, table) <= REPORTED_MAX_COST))
                if a.exclude_seed is not None else set())
        keys = sample_keys(table, a.keys, a.seed, lambda k: k not in held
                           and predicted_cost_s(k, table) <= a.max_key_cost)
        predicted = sum(predicted_cost_s(k, table, divisors=True) for k in keys)
        print(f"{len(keys)} keys (seed {a.seed}), predicted {predicted:.0f} CPU s of compiles:")
        for k in keys:
            print(f"  {k} winner {table[k]}, {len(space(k, table))} configs "
                  f"({len(space(k, table, divisors=True))} in the wider space), predicted "
                  f"{predicted_cost_s(k, table, divisors=True):.0f} s")
        if a.dry_run:
            return 0
        if not bench.have_libtpu(stream=sys.stderr):
            return 2
        runs, meta = run_sample(keys, table, workers=a.workers, timeout_s=a.timeout_s)
        meta.update(command=bench.command(__file__, argv, env="PALLAS_TUNE_TPU_LOGS=off"),
                    sample_note=sample_note(keys, table, a.seed, a.max_key_cost))
        if a.dump:
            dump(a.dump, runs, meta)
    fit = (load_dump(a.fit_dump, table) if a.fit_dump and os.path.exists(a.fit_dump)
           and os.path.abspath(a.fit_dump) != os.path.abspath(a.from_dump or a.dump or "")
           else None)
    bench.write(a.out, report(runs, meta=meta, fit=fit))
    return 0


def dump(path: str, runs: Sequence[KeyRun], meta: Mapping[str, Any]) -> None:
    """Every key's run (its verdicts, and every config's proxy figure in ms) and the report's
    metadata, as JSON: ``--from-dump`` re-renders the report from it, and the correction's
    fitting sample is read from one."""
    import json

    def plain(r: KeyRun) -> dict[str, Any]:
        d = dataclasses.asdict(r)
        d["proxy_ms"] = [[list(b), v] for b, v in sorted(r.proxy_ms.items())]
        d.pop("corrected"), d.pop("corrected_div")  # Recomputed on load.
        return d

    path = bench.output(path)  # Smoke runs: under the smoke folder.
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"meta": dict(meta), "chip": CHIP, "runs": [plain(r) for r in runs]}, f,
                  indent=None, separators=(",", ":"))


def load_dump(path: str, table: Mapping[Key, Blocks]) -> tuple[list[KeyRun], dict[str, Any]]:
    """The runs and metadata :func:`dump` wrote, the corrected verdicts recomputed with the
    correction as it is now."""
    import json

    with open(path, encoding="utf-8") as f:
        data = json.load(f)

    def blocks(v: Any) -> Blocks | None:
        return None if v is None else tuple(v)  # type: ignore[return-value]

    def kv(d: Mapping[str, Any]) -> KeyVerdict:
        return KeyVerdict(**{**d, "pick": blocks(d["pick"])})

    runs = []
    for d in data["runs"]:
        key = blocks(d["key"])
        run = KeyRun(**{**d, "key": key, "winner": blocks(d["winner"]),
                        **{a: kv(d[a]) for a in ("proxy", "roofline", "proxy_div",
                                                 "roofline_div")},
                        "proxy_top": [(blocks(b), ms) for b, ms in d["proxy_top"]],
                        "winner_largest": tuple(d["winner_largest"]),
                        "proxy_ms": {blocks(b): v for b, v in d["proxy_ms"]}})
        runs.append(run.with_correction(space(key, table)))  # type: ignore[arg-type]
    return runs, data["meta"]


if __name__ == "__main__":
    sys.exit(main())
