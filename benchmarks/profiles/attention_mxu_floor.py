"""How fast can attention's two matmuls go on v6e, by the compiler's estimate? The MXU floor.

Compiles (deviceless, libtpu's static profile) Pallas programs that do nothing but attention's
matmuls on resident blocks, 32 grid steps, and prints the estimated MACs per cycle:

- ``qk+pv``: s = q kᵀ, p = bf16(s), o = p v            (the usual orientation)
- ``qkT+vTpT``: sᵀ = k qᵀ, oᵀ = vᵀ pᵀ                   (the transposed one kernels/flash uses)

at head_dim 128 and 256. v6e's MXU is a 256x256 array: with head_dim 128, q kᵀ fills half its
depth whichever way round, and p v has 128 output columns (half its width), while vᵀ pᵀ streams
the 128 and holds the full pᵀ tile. From the MACs/cycle at head_dim 128 follows the best
fraction of the bf16 FLOP roofline (918 TFLOP/s) any causal attention kernel at head_dim 128
can reach by this estimate, before any softmax work or diagonal waste.

Every figure is a COMPILER ESTIMATE on a CPU host, not a measurement.

    python benchmarks/profiles/attention_mxu_floor.py

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): 256x256 blocks at head_dim 128, both forms.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

bench.static_profile_env("mxu-floor-")  # Before JAX loads.

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from pallas_tune.feasibility import compile as _compile  # noqa: E402

STEPS, CLOCK, PEAK_FLOPS = 32, 1.75e9, 918e12
BLOCKS = bench.smoke(((2048, 2048, 128), (2048, 2048, 256), (1024, 1024, 128)),
                     ((256, 256, 128),))  # (bq, bkv, head_dim)
_NT = (((1,), (1,)), ((), ()))  # Contract the last dims: a bᵀ.


def _program(form: str, bq: int, bkv: int, d: int):
    def kernel(q_ref, k_ref, v_ref, o_ref):
        if form == "qk+pv":
            s = lax.dot_general(q_ref[...], k_ref[...], _NT, preferred_element_type=jnp.float32)
            o = jnp.dot(s.astype(jnp.bfloat16), v_ref[...], preferred_element_type=jnp.float32)
        else:
            s = lax.dot_general(k_ref[...], q_ref[...], _NT, preferred_element_type=jnp.float32)
            o = lax.dot_general(v_ref[...], s.astype(jnp.bfloat16), (((0,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)
        o_ref[...] = o.astype(o_ref.dtype)

    out = (bq, d) if form == "qk+pv" else (d, bq)
    block = lambda rows: pl.BlockSpec((None, rows, d), lambda h: (h, 0, 0))  # noqa: E731

    def f(q, k, v):
        return pl.pallas_call(
            kernel, grid=(STEPS,), out_shape=jax.ShapeDtypeStruct((STEPS,) + out, jnp.bfloat16),
            in_specs=[block(bq), block(bkv), block(bkv)],
            out_specs=pl.BlockSpec((None,) + out, lambda h: (h, 0, 0)),
            compiler_params=pltpu.CompilerParams(vmem_limit_bytes=100 * 2**20),
            name=f"mxu_{form.replace('+', '_')}_{bq}_{bkv}_{d}")(q, k, v)

    shape = lambda rows: jax.ShapeDtypeStruct((STEPS, rows, d), jnp.bfloat16)  # noqa: E731
    return f, [shape(bq), shape(bkv), shape(bkv)]


def main() -> int:
    if not bench.have_libtpu():
        return 0
    print("# attention's matmuls alone, v6e compiler ESTIMATES, 32 grid steps of resident blocks")
    print(f"{'form':>10s} {'bq':>5s} {'bkv':>5s} {'d':>4s} {'cycles':>8s} {'MAC/cycle':>10s}")
    rate = {}
    for form in ("qk+pv", "qkT+vTpT"):
        for bq, bkv, d in BLOCKS:
            f, args = _program(form, bq, bkv, d)
            r = _compile.compile_deviceless(f, args, {}, chip="tpu_v6e")
            if not r.ok or not r.estimated_cycles:
                print(f"{form:>10s} {bq:5d} {bkv:5d} {d:4d} no estimate ({r.kind})")
                continue
            cycles = sum(r.estimated_cycles)
            rate[form, bq, d] = 2 * STEPS * bq * bkv * d / cycles
            print(f"{form:>10s} {bq:5d} {bkv:5d} {d:4d} {cycles:8d} {rate[form, bq, d]:10.0f}",
                  flush=True)
    peak_macs = PEAK_FLOPS / 2 / CLOCK
    for form in ("qk+pv", "qkT+vTpT"):
        if (form, 2048, 128) in rate:
            print(f"best fraction of the FLOP roofline at head_dim 128, {form}: "
                  f"{rate[form, 2048, 128] / peak_macs:.1%} (matmuls only, no softmax, "
                  f"no diagonal waste; peak {peak_macs:.0f} MAC/cycle at {CLOCK / 1e9} GHz)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
