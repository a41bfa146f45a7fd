"""The glue of the Llama-3.1-8B training step two ways: libtpu's static profile, and XLA's cost
model at the footing (the fallback ``pallas_tune.step.figures`` takes where the profile dies),
to say how far the fallback is from the profile where both exist. v6e compiler ESTIMATES.

    python benchmarks/steps/glue_footing.py TOKENS profiled|unprofiled [--memory-gb 12]

(The smoke test runs it at 128 tokens, unprofiled.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from steps import layers  # noqa: E402

import jax  # noqa: E402

from pallas_tune import chips  # noqa: E402
from pallas_tune.feasibility.inspect import array_function  # noqa: E402
from pallas_tune.measure.estimate import Estimator, cycles_to_ms  # noqa: E402
from pallas_tune.step import figures, glue  # noqa: E402
from pallas_tune.tuning.footing import on_footing  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tokens", type=int)
    p.add_argument("how", choices=["profiled", "unprofiled"])
    p.add_argument("--memory-gb", type=float, default=12.0)
    a = p.parse_args()
    flat_fn, arrays = array_function(layers.train(layers.llama8b), layers.llama8b_args(a.tokens),
                                     {})
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays]
    with chips.target("v6e", abstract_mesh=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        blob, g_specs, _ = figures._export(glue.glue_function(flat_fn), specs, {}, "v6e",
                                           contextlib.nullcontext())
    with Estimator(1, memory_limit_bytes=int(a.memory_gb * (1 << 30)),
                   profile=a.how == "profiled") as est:
        r = est.map(figures.call_exported, g_specs, {}, [{"exported": blob}], "tpu_v6e",
                    standin=False)[0]
    clock = chips.chip_spec("v6e").clock_hz
    print(f"Llama-3.1-8B step glue, {a.tokens} tokens, {a.how}: libtpu "
          f"{cycles_to_ms(r.cycles, clock) if r.cycles else None} ms; XLA's cost model "
          f"{cycles_to_ms(r.model_cycles, clock) if r.model_cycles else None} ms, at the "
          f"footing {cycles_to_ms(on_footing(r.model_cycles), clock) if r.model_cycles else None}"
          f" ms ({'ok' if r.ok else (r.message or r.kind)[:120]})")


if __name__ == "__main__":
    main()
