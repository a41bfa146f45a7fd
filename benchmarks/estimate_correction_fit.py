"""How ``pallas_tune.measure.correction``'s per-step term was chosen: on the fitting sample only.

Reads the fitting sample's dump (``benchmarks/results/data/estimate_fidelity_fit.json``, written
by ``benchmarks/estimate_fidelity.py --seed 3939 --exclude-seed 39 --keys 10 --max-key-cost 150
--dump ...``: ten tpu-inference v6e keys disjoint from the reported ones), and for each candidate
per-step cost, with the exposed-DMA term fixed (``1 - 1/bw_eff``, not fitted), scores the
corrected estimate against the real v6e winners in the wider space: the sum over keys of
log(fig(real winner) / fig(pick)) (0 where the pick is the winner), and the keys where the
winner ranks first, in the top 3, within 2%. The library's constant is the minimizer (ties: the
smaller). Nothing is compiled; needs tpu-inference for the keys' operands and the table.

    python benchmarks/estimate_correction_fit.py [--dump JSON]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import estimate_fidelity as ef  # noqa: E402

STEP_US = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dump", default=ef.FIT_DUMP)
    a = p.parse_args(argv)
    if ef.TPU_INFERENCE_DIR is None:
        print("tpu-inference is not installed: pip install --no-deps tpu-inference==0.32.0",
              file=sys.stderr)
        return 2
    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility import inspect as _inspect
    from pallas_tune.feasibility.fitted import call_features
    from pallas_tune.measure import correction

    table = ef.load_table(ef.TPU_INFERENCE_DIR)
    runs, meta = ef.load_dump(a.dump, table)
    spec = chip_spec(ef.CHIP)
    features = {r.key: {b: [call_features(c) for c in _inspect.find_pallas_calls(
        ef.unmodified_qmm, ef.operands(r.key), ef.config(b))] for b in r.proxy_ms}
        for r in runs}
    print(f"fitting sample: {a.dump} ({meta['command']}), {len(runs)} keys")
    print(f"{'step us':>8} {'sum log ratio':>14} {'first':>6} {'top 3':>6} {'within 2%':>10}")
    best = None
    for us in STEP_US:
        c = dataclasses.replace(correction.V6E_CORRECTION, step_s=us * 1e-6)
        verdicts = []
        for r in runs:
            fig = {b: ms + correction.correction_s(features[r.key][b], spec, c) * 1e3
                   for b, ms in r.proxy_ms.items()}
            verdicts.append(ef.verdict(fig, r.winner))
        s = ef.summarize(verdicts)
        loss = sum(math.log(v.ratio) for v in verdicts if v.ratio is not None)
        print(f"{us:8.2f} {loss:14.4f} {s.top1:6d} {s.top3:6d} {s.within_2pct:10d}")
        if best is None or loss < best[0] - 1e-9:
            best = (loss, us)
    assert best is not None
    print(f"minimizer: {best[1]:.2f} us per step (the library's: "
          f"{correction.V6E_CORRECTION.step_s * 1e6:.2f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
