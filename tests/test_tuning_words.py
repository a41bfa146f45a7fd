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
