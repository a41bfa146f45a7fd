"""Tunable Pallas kernels shipped with pallas-tune (installed as ``pallas_tune.kernels``).

Each kernel is a ``@pallas_tune.tunable`` function with a plain-JAX ``*_reference`` and a search
space under ``search_spaces/``. Import a kernel module directly (``pallas_tune.kernels.matmul``);
this package imports nothing eagerly.
"""
