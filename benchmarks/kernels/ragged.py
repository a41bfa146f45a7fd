"""What a ragged shape costs: v6e compiler ESTIMATES, a shape that divides vs the next ragged one.

For each shipped kernel and config, programs compiled deviceless for v6e (libtpu's static cycle
estimate of each op, converted at the chip clock):

- divides: the kernel at a shape every tile divides (1024, 2048, ...);
- masked:  the shipped kernel at the next ragged shape (1000, 2000, ...): cdiv grid, the
           reduction's tail masked on its last step only. "Mask's own cost" is masked minus the
           same program with the masks replaced by the identity (wrong results; cost only);
- padded:  the alternative design: zero-pad the ragged reduction axis to a tile multiple in the
           wrapper (an XLA pad: an extra copy of the input), run the kernel at that size, slice.
           Shown as the kernel at the padded size (inputs in HBM, like the other columns) plus
           the pad/slice ops of the padded program; and as that whole program compiled alone,
           where XLA keeps the padded copies in VMEM when they fit (v6e has 128 MiB), which makes
           the kernel's own reads cheaper than from HBM. A model's larger program may not
           get that placement, so the first padded column is the like-for-like one.

The masked program should cost no more than its padded size predicts (the "divides" column: the
same grid) and no more than padding. Flash attention cannot use padding (zero-padded keys score 0,
not -inf, so they would still need the mask): its padded row is a cost reference only. RMSNorm
reduces over the whole hidden axis, one full block, so it needs no mask; its ragged rows are
computed and dropped on store.

Every figure is a v6e compiler ESTIMATE from a CPU host, not a measurement.

    python benchmarks/kernels/ragged.py [--workers 2] [--kernels matmul flash_attention ...]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): the matmul at 256^3 / 200^3, its default tiles, one worker.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import multiprocessing
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_tune.chips import chip_spec  # noqa: E402
from pallas_tune.feasibility import compile as _compile  # noqa: E402
from pallas_tune.kernels.flash_attention import flash_attention  # noqa: E402
from pallas_tune.kernels.grouped_matmul import grouped_matmul  # noqa: E402
from pallas_tune.kernels.linear_attention import linear_attention  # noqa: E402
from pallas_tune.kernels.matmul import matmul  # noqa: E402
from pallas_tune.kernels.rms_norm import rms_norm  # noqa: E402
from pallas_tune.measure.estimate import FLAG  # noqa: E402

BF16 = jnp.bfloat16
MM = ("parallel", "parallel", "arbitrary")


def _up(n: int, tile: int) -> int:
    tile = min(tile, n)
    return -(-n // tile) * tile


def _pad_axis(x, axis: int, size: int):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


# ---- the padded alternatives (module level: estimator workers import them by name) ----------
# _pad_<kernel>(*args, **kwargs_and_config) -> padded args; <kernel>_padded = pad, kernel, slice.

def _pad_matmul(x, y, **config):
    kp = _up(x.shape[1], config["bk"])
    return _pad_axis(x, 1, kp), _pad_axis(y, 0, kp)


def matmul_padded(x, y, **config):
    return matmul(*_pad_matmul(x, y, **config), **config)


def _pad_grouped_matmul(lhs, rhs, group_sizes, **config):
    kp = _up(lhs.shape[1], config["tk"])
    return _pad_axis(lhs, 1, kp), _pad_axis(rhs, 1, kp), group_sizes


def grouped_matmul_padded(lhs, rhs, group_sizes, **config):
    return grouped_matmul(*_pad_grouped_matmul(lhs, rhs, group_sizes, **config), **config)


def _pad_linear_attention(q, k, v, *, decay, chunk):
    tp = _up(q.shape[2], chunk)
    return tuple(_pad_axis(a, 2, tp) for a in (q, k, v))


def linear_attention_padded(q, k, v, *, decay, chunk):
    padded = _pad_linear_attention(q, k, v, decay=decay, chunk=chunk)
    return linear_attention(*padded, decay=decay, chunk=chunk)[:, :, :q.shape[2]]


def _pad_flash_attention(q, k, v, *, causal, bq, bkv):
    sk = _up(k.shape[2], bkv)
    return _pad_axis(q, 2, _up(q.shape[2], bq)), _pad_axis(k, 2, sk), _pad_axis(v, 2, sk)


def flash_attention_padded(q, k, v, *, causal, bq, bkv):
    """Cost reference only: zero-padded keys would change the softmax without a mask."""
    padded = _pad_flash_attention(q, k, v, causal=causal, bq=bq, bkv=bkv)
    return flash_attention(*padded, causal=causal, bq=bq, bkv=bkv)[:, :, :q.shape[2]]


def _pad_rms_norm(x, weight, *, block_rows):
    return _pad_axis(x, 0, _up(x.shape[0], block_rows)), weight


def rms_norm_padded(x, weight, *, block_rows):
    padded = _pad_rms_norm(x, weight, block_rows=block_rows)
    return rms_norm(*padded, block_rows=block_rows)[:x.shape[0]]


# ---- cases --------------------------------------------------------------------------------

S = jax.ShapeDtypeStruct


def _mm(n):
    return [S((n, n), BF16), S((n, n), BF16)]


def _fa(s):  # Llama's GQA group of 4, 8 query heads (32 at S=2048 outgrow an 8 GiB worker).
    return [S((1, 8, s, 128), BF16), S((1, 2, s, 128), BF16), S((1, 2, s, 128), BF16)]


def _la(t):
    return [S((1, 16, t, 128), BF16)] * 3


def _gm(n):
    return [S((n, n), BF16), S((8, n, n), BF16), S((8,), jnp.int32)]


def _rn(rows):
    return [S((rows, 4096), BF16), S((4096,), BF16)]


# (name, kernel, kwargs, [(divides args, ragged args, label, configs)]); <name>_padded above.
_MM_SMALL = dict(bm=256, bn=256, bk=256, buffering=2, semantics=MM)  # The declared default.
_MM_BIG = dict(bm=1024, bn=1024, bk=512, buffering=2, semantics=MM)  # Near the 2048^3 optimum.
CASES = [
    ("matmul", matmul, {}, [(_mm(1024), _mm(1000), "1024^3 / 1000^3", [_MM_SMALL, _MM_BIG]),
                            (_mm(2048), _mm(2000), "2048^3 / 2000^3", [_MM_SMALL, _MM_BIG])]),
    ("flash_attention", flash_attention, {"causal": True},
     [(_fa(1024), _fa(1000), "S=1024 / 1000", [dict(bq=512, bkv=512)]),
      (_fa(2048), _fa(2000), "S=2048 / 2000", [dict(bq=512, bkv=512), dict(bq=256, bkv=1024)])]),
    ("flash_attention", flash_attention, {"causal": False},
     [(_fa(2048), _fa(2000), "S=2048 / 2000", [dict(bq=512, bkv=512)])]),
    ("linear_attention", linear_attention, {"decay": 0.96875},
     [(_la(2048), _la(2000), "T=2048 / 2000", [dict(chunk=128)]),
      (_la(8192), _la(8000), "T=8192 / 8000", [dict(chunk=512)])]),
    ("grouped_matmul", grouped_matmul, {},
     [(_gm(1024), _gm(1000), "m=k=n=1024 / 1000", [dict(tm=128, tk=128, tn=128)]),
      (_gm(2048), _gm(2000), "m=k=n=2048 / 2000", [dict(tm=512, tk=1024, tn=1024)])]),
    ("rms_norm", rms_norm, {},
     [(_rn(8192), _rn(8000), "8192x4096 / 8000x4096", [dict(block_rows=128),
                                                      dict(block_rows=256)])]),
]

if bench.SMOKE:  # One small matmul: the whole path (divides, masked, padded, unmasked).
    CASES = [("matmul", matmul, {}, [(_mm(256), _mm(200), "256^3 / 200^3", [_MM_SMALL])])]


# ---- estimates: one deviceless compile per program, cycles per op --------------------------

def _init_worker(memory_limit_bytes: int) -> None:
    """Spawned compile worker: libtpu's static-profile flag must be set before libtpu loads."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    dump = bench.scratch(f"pallas-tune-ragged-{os.getpid()}-")
    os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + f" {FLAG}={dump}")
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    os.environ["JAX_PLATFORMS"] = "cpu"


def _job(fn_name: str, specs, kwargs, config, unmasked: bool = False):
    """(ok, message, Pallas kernel cycles, cycles of the other ops) of one program on v6e.

    ``unmasked``: with the tail masks replaced by the identity (wrong results at ragged shapes;
    only to price the masks)."""
    import re

    from pallas_tune.kernels import _ragged

    me = importlib.import_module("ragged")
    fn = getattr(me, fn_name)
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs]
    real = _ragged.fill_tail
    if unmasked:
        _ragged.fill_tail = lambda x, valid, axis, value=0.0: x
    try:
        res = _compile.compile_deviceless(getattr(fn, "fn", fn), args, {**kwargs, **config},
                                          chip="v6e", keep_text=True)
    finally:
        _ragged.fill_tail = real
    if not res.ok:
        return False, f"{res.kind}: {res.message[:300]}", 0, 0
    kernel = other = 0
    for line in res.hlo_text.splitlines():
        found = re.search(r'bundle_analysis_data":\{"estimated_cycles":"(\d+)"', line)
        if found:
            if 'custom_call_target="tpu_custom_call"' in line:
                kernel += int(found.group(1))
            else:
                other += int(found.group(1))
    return True, "", kernel, other


def _specs(args):
    return [(tuple(a.shape), str(a.dtype)) for a in args]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workers", type=int, default=bench.smoke(2, 1))
    p.add_argument("--kernels", nargs="+", default=None)
    a = p.parse_args()
    if not bench.have_libtpu():
        return
    # This file imported as a module, so worker processes can import the padded wrappers.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    me = importlib.import_module("ragged")
    clock = chip_spec("v6e").clock_hz
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = max(4 << 30, total // (a.workers + 1))  # Per worker: a runaway compile dies alone.

    def new_pool():  # One compile per worker process: libtpu's memory grows compile by compile.
        return concurrent.futures.ProcessPoolExecutor(
            a.workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=me._init_worker, initargs=(limit,),
            max_tasks_per_child=bench.smoke(1, None))  # Smoke: one worker's start, not five.

    pool = new_pool()

    def us(cycles: float) -> float:
        return cycles / clock * 1e6

    print(f"# $ {bench.command(__file__)}   ({bench.today()}, {os.cpu_count()}-core CPU host "
          f"shared with other jobs, no TPU; jax {jax.__version__}, libtpu "
          f"{bench.version('libtpu')})")
    print(f"\nTPU v6e compiler ESTIMATES (deviceless libtpu static cycle estimate of each op, at "
          f"{clock / 1e9:g} GHz), in µs. Not measurements.\n")
    print("\n".join(bench.table(
        ["kernel", "config", "shape divides / ragged", "divides", "masked (shipped)",
         "mask's own cost", "padded: kernel + pad ops", "masked / divides", "masked / padded",
         "padded, one program"], [])))
    t0 = time.perf_counter()
    worst = []
    for name, kernel, kwargs, shapes in CASES:
        if a.kernels and name not in a.kernels:
            continue
        pad = getattr(me, f"_pad_{name}")
        for div, rag, label, configs in shapes:
            for config in configs:
                big = jax.eval_shape(lambda *x: pad(*x, **kwargs, **config), *rag)
                jobs = [(name, _specs(div), False), (name, _specs(rag), False),
                        (f"{name}_padded", _specs(rag), False), (name, _specs(big), False),
                        (name, _specs(rag), True)]
                futures = [pool.submit(me._job, fn, specs, kwargs, config, unmasked)
                           for fn, specs, unmasked in jobs]
                try:
                    d, r, pd, kp, um = (f.result() for f in futures)
                    failed = [res[1] for res in (d, r, pd, kp, um) if not res[0]]
                except concurrent.futures.process.BrokenProcessPool:
                    pool.shutdown(wait=False, cancel_futures=True)
                    pool = new_pool()
                    failed = [f"a compile worker died (memory cap {limit >> 20} MiB)"]
                cfg = ", ".join(f"{k}={v}" for k, v in config.items() if k != "semantics")
                kw = "".join(f", {k}={v}" for k, v in kwargs.items())
                if failed:
                    why = " ".join(failed[0].split())[:160]
                    print(f"| {name}{kw} | {cfg} | {label} | failed: {why} ||||||")
                    continue
                div_us, rag_us = us(sum(d[2:])), us(sum(r[2:]))
                pad_ops_us = us(pd[3])
                padded_us = us(sum(kp[2:])) + pad_ops_us
                mask_us = rag_us - us(sum(um[2:]))
                worst.append(rag_us / div_us)
                print(f"| {name}{kw} | {cfg} | {label} | {div_us:.2f} | {rag_us:.2f} | "
                      f"{mask_us:+.2f} | {padded_us:.2f} = {us(sum(kp[2:])):.2f} + "
                      f"{pad_ops_us:.2f} | {rag_us / div_us:.3f} | {rag_us / padded_us:.3f} | "
                      f"{us(sum(pd[2:])):.2f} |", flush=True)
    pool.shutdown()
    print(f"\nmasked / divides: worst {max(worst):.3f}, median {statistics.median(worst):.3f} "
          f"over {len(worst)} rows. Estimated in {time.perf_counter() - t0:.0f} s with "
          f"{a.workers} compile workers.")


if __name__ == "__main__":
    main()
