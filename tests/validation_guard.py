"""Shared checks of the validation sets' regression guards (tests/test_validation_heldout.py and
tests/test_validation_production.py): every scored row predicted, and a metric's mean |error| within its bound."""

from __future__ import annotations

import math

from pipeplan.analysis.validation import summarize


def assert_every_scored_row_predicted(predictions, scored_rows: int) -> None:
    """No scored row lacks a prediction (the reasons are listed if one does), and the set has `scored_rows`."""
    missing = sorted({p.reason for p in predictions if p.figure.scored and p.predicted is None})
    assert not missing, missing
    assert sum(p.figure.scored for p in predictions) == scored_rows


def assert_mean_error_within(predictions, metric: str, bound: float) -> None:
    """The mean |relative error| of `metric` over the whole set is finite, covers every case, and is <= bound."""
    s = next(s for s in summarize(predictions) if s.metric == metric and s.source == "all")
    assert s.predicted == s.cases
    assert s.mean_abs_error is not None and math.isfinite(s.mean_abs_error)
    assert s.mean_abs_error <= bound, (metric, s.mean_abs_error, bound)
