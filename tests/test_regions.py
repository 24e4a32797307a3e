"""The regime diagram's regions along λ (`fastdiag.analysis.regions`), on counts with known answers."""
from __future__ import annotations

import math

import pytest

from fastdiag.analysis.regions import collapse_edge, regime_counts, regime_regions


def _runs(spec: dict[float, list[str]]) -> list[dict]:
    return [{"config": {"weight_decay": lam}, "result": {"regime": r}} for lam, regimes in spec.items() for r in regimes]


def test_counts_leave_out_zero_lambda_and_unfinished_runs():
    runs = _runs({0.0: ["memorization"], 0.1: ["grok", "grok", "memorization"]}) + [
        {"config": {"weight_decay": 1.0}, "result": {}}]
    assert regime_counts(runs) == {0.1: {"grok": 2, "memorization": 1}}


def test_collapse_begins_between_the_last_grokking_lambda_and_the_first_mostly_collapsed_one():
    counts = regime_counts(_runs({0.1: ["grok"], 1.0: ["grok", "collapse"], 3.0: ["collapse", "no-fit", "no-fit"],
                                  10.0: ["collapse", "collapse", "no-fit"]}))
    # 3.0 has one collapse in three (< half): the region starts between 3 and 10
    assert collapse_edge(counts) == pytest.approx(math.sqrt(3.0 * 10.0))
    assert collapse_edge(regime_counts(_runs({1.0: ["grok"], 10.0: ["collapse"]}))) == pytest.approx(math.sqrt(10.0))
    assert collapse_edge(regime_counts(_runs({10.0: ["collapse"]}))) is None               # nothing grokked
    assert collapse_edge(regime_counts(_runs({1.0: ["grok"], 0.5: ["collapse"]}))) is None  # none above


def test_regions_within_the_axis():
    counts = regime_counts(_runs({0.01: ["memorization"], 0.1: ["grok"], 10.0: ["collapse"]}))
    edge = math.sqrt(0.1 * 10.0)
    assert regime_regions(counts, 0.03, 0.005, 20.0) == [("memorization", 0.005, 0.03), ("developmental", 0.03, edge),
                                                         ("collapse", edge, 20.0)]
    assert regime_regions(counts, None, 0.005, 20.0) == [("collapse", edge, 20.0)]            # no λ_c fit
    assert regime_regions(counts, 0.001, 0.005, 20.0)[0] == ("developmental", 0.005, edge)    # λ_c left of the axis
