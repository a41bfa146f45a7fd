"""Measuring candidates: timing in this process, isolated worker processes, compiler estimates.

- :mod:`.timing`: compile, run, compare with a reference, time; trial records and outcomes.
- :mod:`.worker`: the same in a restartable worker process, so a hang or a crash costs one trial.
- :mod:`.estimate`: the ``tpu-estimate`` timer (the TPU compiler's static cycle estimate).

Never imported on the dispatch path.
"""
