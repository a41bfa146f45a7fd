"""Search strategies over a finite space of configs; they know nothing of kernels.

- :mod:`.gp`: the default sampler (a Gaussian process's expected improvement over every
  candidate), also as an Optuna sampler.
- :mod:`.replay`: replays strategies on exhaustively measured landscapes (Kernel Tuner files).
"""
