"""A whole program's tunable calls, tuned at once, and the step's figures.

``program`` (``pallas_tune.autotune``: every tunable call a program traces, forward and
backward, tuned together; the result applies its configs), ``figures`` (the step's time under
default, tuned and XLA configs: wall clock, summed compiler estimates, or composed) and
``glue`` (a step with its tunable calls stubbed, for composed estimates of steps too large to
compile whole). Nothing here runs on the production path.
"""
