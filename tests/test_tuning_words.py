"""What a tuning run says about itself: hints that name a command that works on this host,
counts that say what they count, clamped values explained, the XLA margin in plain words
(issues 53.13, 56.6). With fake evaluators, on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

import pallas_tune as pt
from pallas_tune.errors import TuneOptionError


def _kern(name, **space):
    @pt.tunable(**(space or {"a": list(range(4)), "b": list(range(2))}), name=name)
    def kern(x, *, a, b):
        return x

    return kern


def test_the_confirm_top_hint_on_a_cpu_host_names_what_works_there(cache_dir):
    """Issue 53.13: on a CPU host the hint said ``--timer tpu-estimate --chip cpu``, which
    fails (cpu is no TPU); it now says estimates are for a TPU chip and where to confirm."""
    from test_tuner import Landscape

    from pallas_tune.tuning import TuneOptions, run

    with pytest.raises(TuneOptionError) as e:
        run(_kern("confirm_hint_toy"), (np.ones((8, 128), np.float32),), {},
            TuneOptions(confirm_top=2, write=False), evaluator=Landscape(lambda c: 1.0))
    text = str(e.value)
    assert "--chip cpu" not in text, text
    assert "'cpu', not a TPU" in text and "--timer tpu-estimate --chip v6e" in text
    assert "on a host with that TPU" in text and "drop --confirm-top" in text


def test_the_xla_margin_is_said_plainly():
    """Issue 56.6: "Pallas is kept: XLA's figure ... is lower, but by less than the 1.55x
    margin the footing needs" said neither by how much XLA was ahead nor why it must win by
    1.55x. Now: how much lower, the margin, why, and what runs."""
    from pallas_tune.tuning.footing import MARGIN, xla_decision

    row = {"implementation": "xla", "timer": "tpu-estimate", "median_ms": 0.5, "partial": 0}
    _, impl, note = xla_decision(row, 0.6)
    assert impl == "pallas"
    assert note == (f"XLA's figure is 1.20x lower (libtpu's estimate of both), but XLA must "
                    f"win by {MARGIN:g}x here (the margin: the estimates' error against the "
                    "chip varies that much between calls); Pallas kept")
    _, impl, note = xla_decision(row, 1.0)
    assert impl == "xla" and "its figure is 2.00x lower" in note and "must win by" in note
