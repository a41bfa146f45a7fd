"""The production path: everything a cached call touches at trace time.

``@tunable`` (``tunable``: the decorator and the trace-time lookup, a memo dict), what it
declares (``declare``), the lookup's slow path once per (chip, key) (``dispatch``), gradients'
dispatch (``vjp``) and receipts (``record``). Importing this package, or calling a kernel whose
config is cached, never imports Optuna, pandas, rich, the tuner (``pallas_tune.tuning``,
``measure``, ``search``) or the command line; ``tests/test_dispatch.py`` checks it in a
fresh process. Tuning is reached only through ``TunableKernel.tune``, which imports it then.
"""
