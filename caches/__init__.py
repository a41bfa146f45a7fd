"""Tuned-config caches shipped with pallas-tune: ``<chip>/<kernel>.json``, read after the user's."""
