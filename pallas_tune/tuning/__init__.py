"""The tuning loop: ask a sampler, evaluate candidates, tell, record, write the cache.

Never imported on the dispatch path; :meth:`TunableKernel.tune` imports it on first use.
"""

from pallas_tune.tuning.loop import TuningResult as TuningResult
from pallas_tune.tuning.loop import tune as tune

__all__ = ["TuningResult", "tune"]
