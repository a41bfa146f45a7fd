"""Will a candidate run, and what would it cost? Read off the traced ``pallas_call``\\ s.

- :mod:`.inspect`: traces a function abstractly and reads each pallas_call's grid, blocks,
  buffering and scratch; the TPU block rules.
- :mod:`.model`: the VMEM/SMEM/VREG model per chip and its verdicts.
- :mod:`.compile`: deviceless TPU compiles (libtpu) and the classification of compiler errors.
- :mod:`.roofline`: a roofline time model, to rank and to seed searches (never a measurement).

Imports only :mod:`pallas_tune.chips` and the leaves below it; never the decorator or the tuner.
"""
