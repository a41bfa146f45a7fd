"""The tuning loop: ask a sampler, evaluate candidates, tell, record, write the cache.

Never imported on the dispatch path; :meth:`TunableKernel.tune` imports it on first use.
"""

from pallas_tune.tuning.loop import run as run
from pallas_tune.tuning.loop import tune as tune
from pallas_tune.tuning.options import TuneOptions as TuneOptions
from pallas_tune.tuning.result import Progress as Progress
from pallas_tune.tuning.result import TuningResult as TuningResult

__all__ = ["Progress", "TuneOptions", "TuningResult", "run", "tune"]
