"""benchmarks/search/search_efficiency.py's comparison with the best peer: the peer is chosen
on other seeds than it is scored on, and the difference is paired per seed."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

SEARCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks",
                      "search")


@pytest.fixture(scope="module")
def efficiency():
    sys.path[:0] = [SEARCH, os.path.dirname(SEARCH)]
    try:
        yield importlib.import_module("search_efficiency")
    finally:
        del sys.path[:2]


def test_the_best_peer_is_chosen_on_the_other_half_of_the_seeds(efficiency):
    # "lucky" is best on seeds 0-3 only, "steady" on 4-7: each half scores the other's choice.
    ours = [0.9] * 8
    peers = {"lucky": [1.0] * 4 + [0.5] * 4, "steady": [0.6] * 4 + [0.95] * 4}
    diff, se, chosen = efficiency.cross_fit(ours, peers)
    assert chosen == ["steady", "lucky"]  # Scored on 0-3: chosen on 4-7, and back.
    assert diff == pytest.approx((4 * (0.9 - 0.6) + 4 * (0.9 - 0.5)) / 8)
    assert se > 0


def test_a_paired_difference_has_the_noise_of_the_difference_not_of_the_scores(efficiency):
    shared = [0.5, 0.9, 0.6, 1.0, 0.55, 0.95, 0.7, 0.8]  # Seeds' draws, shared by everyone.
    ours = [s + 0.02 for s in shared]
    diff, se, _ = efficiency.cross_fit(ours, {"peer": shared})
    assert diff == pytest.approx(0.02) and se == pytest.approx(0.0, abs=1e-12)
