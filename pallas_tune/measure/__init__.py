"""The evaluation boundary: everything that happens to one candidate, and where it happens.

- :mod:`.records`: outcomes, measurements, trial records.
- :mod:`.candidate`: trace once, screen (block rules, VMEM model, deviceless compile), lower,
  fingerprint; :mod:`.fingerprint`: one identity per lowered program.
- :mod:`.timing`: the correctness check and timing (a time budget, a cut-off for slow ones).
- :mod:`.session`: a candidate's whole path, in this process or in a worker.
- :mod:`.evaluate`: the :class:`~.evaluate.Evaluator` interface and its in-process and worker
  implementations; :mod:`.pool`: the worker processes; :mod:`.estimate`: the ``tpu-estimate``
  timer (the TPU compiler's static cycle estimate).

Never imported on the dispatch path; imports neither the decorator nor the tuner.
"""
