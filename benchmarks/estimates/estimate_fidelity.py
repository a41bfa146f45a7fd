"""Ground truth for the estimate: how libtpu's static cycle estimate, and pallas-tune's models,
rank block sizes that were measured best on real TPUs.

The default run (issue 55, ``estimate_fidelity_stratified``): a stratified sample of
tpu-inference's v6e int8 and v7 float8 keys (strata of n_batch x problem size, drawn at random
with a seed), the real winner's rank distribution first (K95), per chip and stratum, written to
``benchmarks/results/estimate_fidelity.md`` with its data in
``benchmarks/results/data/estimate_fidelity_strata.json``:

    PALLAS_TUNE_TPU_LOGS=off python benchmarks/estimates/estimate_fidelity.py [--resume]
        [--keys N] [--rivals 8] [--workers 1] [--dry-run] [--from-dump JSON]

Each key's winner is ranked over its whole space (``estimate_fidelity_complete``), with
libtpu's figures of the full programs where affordable and extrapolated from two stand-ins
elsewhere (``estimate_fidelity_twopoint``); ``--complete`` and ``--two-point`` do either for
the runs of an older ``--dump``.

``--seeded-sample`` runs the earlier, biased sample (issue 39; keys drawn only among those cheap
to compile) described below, which the correction's fit reads; its report goes to
``benchmarks/results/estimate_fidelity_seeded10.md``.

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
``tpu_inference.logger``, are put in ``sys.modules`` when ``estimate_fidelity_qmm`` is imported (so also in
the estimate workers, which import that module to load the proxy). Needs ``pip install --no-deps
tpu-inference==0.32.0`` and libtpu; exits 2 without tpu-inference.

    PALLAS_TUNE_TPU_LOGS=off python benchmarks/estimates/estimate_fidelity.py --seeded-sample
        [--keys 10] [--seed 39]

The parts live beside this entry point: ``estimate_fidelity_space`` (the table, the space, the
sample, the ranking metrics: pure), ``estimate_fidelity_qmm`` (the kernel, the proxy, its
stand-in, the roofline and corrected figures), ``estimate_fidelity_run`` (a key's run, the dump)
and ``estimate_fidelity_report`` (the Markdown); the stratified run's are
``estimate_fidelity_strata`` (the draw, the capped stand-in, a key's run),
``estimate_fidelity_strata_report`` and ``estimate_fidelity_stratified`` (its options and
loop). This module re-exports the first four.

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): one cheap key (three rivals), one worker; the report and
dump go to the smoke folder.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

# The parts, re-exported: tests and estimate_correction_fit.py read them as ``ef.<name>``.
from estimate_fidelity_qmm import *  # noqa: E402,F403
from estimate_fidelity_qmm import DIST, TPU_INFERENCE_DIR  # noqa: E402
from estimate_fidelity_report import *  # noqa: E402,F403
from estimate_fidelity_report import report, sample_note  # noqa: E402
from estimate_fidelity_run import *  # noqa: E402,F403
from estimate_fidelity_run import REPORTED_KEYS, REPORTED_MAX_COST, dump, load_dump, run_sample  # noqa: E402
from estimate_fidelity_space import *  # noqa: E402,F403
from estimate_fidelity_space import load_table, predicted_cost_s, sample_keys, space  # noqa: E402

RESULTS = bench.result("estimate_fidelity.md")  # The stratified sample's report.
SEEDED_RESULTS = bench.result("estimate_fidelity_seeded10.md")  # --seeded-sample's.
DUMP = bench.result("data", "estimate_fidelity.json")
FIT_DUMP = bench.result("data", "estimate_fidelity_fit.json")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    if TPU_INFERENCE_DIR is None:
        print(f"{DIST} is not installed: pip install --no-deps {DIST}==0.32.0 (its vLLM "
              "dependency is not needed). Nothing to compare against.", file=sys.stderr)
        return 2
    if "--seeded-sample" not in args:  # The default: issue 55's stratified sample.
        import estimate_fidelity_stratified

        return estimate_fidelity_stratified.main(args, p)
    args.remove("--seeded-sample")
    p.add_argument("--keys", type=int, default=bench.smoke(REPORTED_KEYS, 1))
    p.add_argument("--seed", type=int, default=39)
    p.add_argument("--workers", type=int, default=bench.smoke(2, 1))
    p.add_argument("--max-key-cost", type=float, default=bench.smoke(REPORTED_MAX_COST, 30.0),
                   help="draw keys only among those whose predicted proxy compiles cost at "
                        "most this many CPU seconds (predicted_cost_s; default 400)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per-config compile limit")
    p.add_argument("--out", default=SEEDED_RESULTS)
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
    a = p.parse_args(args)
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


if __name__ == "__main__":
    sys.exit(main())
