"""pallas-tune: Bayesian autotuning of JAX Pallas kernel tile parameters.

Public API::

    import pallas_tune as pt

    @pt.tunable(bm=[128, 256, 512], bn=[128, 256, 512], bk=[128, 256, 512])
    def matmul(x, y, *, bm, bn, bk): ...

    matmul(x, y)                  # tuned config from the per-chip cache, at trace time
    matmul.tune(x, y, trials=32)  # Bayesian search, measured, written to the cache
    pt.tune(matmul, x, y, options=pt.TuneOptions(trials=32))  # the same
    matmul.config_for(x, y)       # the config a call would use, and its .source

Importing this package does not import Optuna, pandas or the tuner; cached dispatch never does.
"""

import os as _os

from pallas_tune import chips as _chips
from pallas_tune.chips import current_chip as current_chip
from pallas_tune.chips import interpret_mode as interpret_mode
from pallas_tune.chips import normalize_chip as normalize_chip
from pallas_tune.chips import target as target
from pallas_tune.errors import CacheFormatError as CacheFormatError
from pallas_tune.errors import CacheMissError as CacheMissError
from pallas_tune.errors import InvalidConfig as InvalidConfig
from pallas_tune.errors import MeasurementError as MeasurementError
from pallas_tune.errors import NoFeasibleConfigError as NoFeasibleConfigError
from pallas_tune.errors import PallasTuneError as PallasTuneError
from pallas_tune.errors import PallasTuneWarning as PallasTuneWarning
from pallas_tune.errors import SearchSpaceError as SearchSpaceError
from pallas_tune.errors import TuneOptionError as TuneOptionError
from pallas_tune.space import Config as Config
from pallas_tune.space import Constraint as Constraint
from pallas_tune.space import Param as Param
from pallas_tune.space import SearchSpace as SearchSpace
from pallas_tune.space import load_space as load_space
from pallas_tune.runtime.tunable import TunableKernel as TunableKernel
from pallas_tune.runtime.tunable import tunable as tunable

# A host without a TPU (no /dev/accel*, /dev/vfio/N or TPU PCI id, looked up without JAX):
# libtpu, which JAX's start-up loads wherever it is installed, prints no start-up errors and
# writes nothing to /tmp/tpu_logs in a user's program. Only unset variables are set, so the
# user's own win; a host that may have a TPU gets none.
_chips.LIBTPU_DEFAULTS.update(_chips.quiet_tpu_probe_env())
_os.environ.update(_chips.LIBTPU_DEFAULTS)

__version__ = "0.1.0"

# Imported on first use: they trace with jax and are not needed on the dispatch path.
_LAZY = {
    "check_feasible": "pallas_tune.feasibility.model",
    "estimate_vmem": "pallas_tune.feasibility.model",
    "Verdict": "pallas_tune.feasibility.model",
    "chip_spec": "pallas_tune.chips",
    "ChipSpec": "pallas_tune.chips",
    "tune": "pallas_tune.tuning",
    "autotune": "pallas_tune.step.program",
    "AutotuneResult": "pallas_tune.step.result",
    "TuneOptions": "pallas_tune.tuning",
    "TuningResult": "pallas_tune.tuning",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pallas_tune' has no attribute {name!r}")

__all__ = [
    "AutotuneResult",
    "CacheFormatError",
    "CacheMissError",
    "ChipSpec",
    "Config",
    "Constraint",
    "InvalidConfig",
    "MeasurementError",
    "NoFeasibleConfigError",
    "PallasTuneError",
    "PallasTuneWarning",
    "Param",
    "SearchSpace",
    "SearchSpaceError",
    "TunableKernel",
    "TuneOptionError",
    "TuneOptions",
    "TuningResult",
    "Verdict",
    "autotune",
    "check_feasible",
    "chip_spec",
    "current_chip",
    "estimate_vmem",
    "interpret_mode",
    "load_space",
    "normalize_chip",
    "target",
    "tunable",
    "tune",
]
