"""What a planner is judged by (issue #41): does it order a published table's configurations as the measurements
do, pick the measured-fastest one, and say truthfully whether a configuration fits?

Ranking: rows sharing a `group` (one table, one model, one GPU count) whose metric is time or throughput are
one group; with at least MIN_GROUP_ROWS predicted rows it gets Spearman's rho between predicted and published
step time (throughput is turned into time per unit of work, 1 / value, so both rank fastest first) and whether
the configuration predicted fastest is the published fastest or within BEST_TOLERANCE of it.

Fits: rows with metric `oom` (published true: ran out of memory) form a confusion table against the predicted
fit (sim.trace.hbm_fit: the simulated peak against capacity less memory.hbm_margin_gib).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from pipeplan.analysis.validation import FIT_METRIC, Prediction

MIN_GROUP_ROWS = 4  # issue #41: rho and best pick are reported per group of >= 4 rows
BEST_TOLERANCE = 0.03  # the predicted best counts as right within 3% of the published best's time
RHO_TARGET = 0.8  # issue #41: Spearman rho >= 0.8 in every group
PICKS_BEST_TARGET = 0.8  # ... and the predicted best right in >= 80% of groups
RANKED_METRICS = ("time", "throughput")
RANKING_COLUMNS = ("group", "metric", "rows", "spearman", "predicted_best", "published_best", "best_gap",
                   "picks_best")
FIT_COLUMNS = ("source", "table", "case", "group", "published_oom", "predicted_oom", "agrees")


def spearman(x: Iterable[float], y: Iterable[float]) -> float:
    """Spearman's rank correlation: Pearson's r of the ranks (ties get their mean rank, as pandas ranks them).
    NaN when either side is constant."""
    rx = pd.Series(list(x), dtype=float).rank().to_numpy()
    ry = pd.Series(list(y), dtype=float).rank().to_numpy()
    if len(rx) < 2 or np.ptp(rx) == 0 or np.ptp(ry) == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


@dataclass(frozen=True)
class GroupRanking:
    """One group's ranking against its published order."""

    group: str
    metric: str
    rows: int
    spearman: float  # predicted vs published time; NaN when undefined (a constant side)
    predicted_best: str  # case predicted fastest
    published_best: str  # case measured fastest
    best_gap: float  # published time of the predicted best over the published best, minus 1 (0: the same)

    @property
    def picks_best(self) -> bool:
        return self.best_gap <= BEST_TOLERANCE

    @property
    def meets_rho(self) -> bool:
        return bool(np.isfinite(self.spearman) and self.spearman >= RHO_TARGET - 1e-9)  # rounding of the ranks

    def row(self) -> dict[str, object]:
        return {"group": self.group, "metric": self.metric, "rows": self.rows, "spearman": self.spearman,
                "predicted_best": self.predicted_best, "published_best": self.published_best,
                "best_gap": self.best_gap, "picks_best": self.picks_best}


def _time_like(p: Prediction, value: float) -> float:
    """Lower is faster: a time as it is, a throughput as its inverse."""
    return value if p.figure.metric == "time" else 1.0 / value


def rank_groups(predictions: Iterable[Prediction]) -> list[GroupRanking]:
    """Per group of >= MIN_GROUP_ROWS predicted time or throughput rows, in group order of first appearance.
    A group mixing quantities (step time with throughput, or two throughput units) ranks its largest part."""
    groups: dict[str, list[Prediction]] = {}
    for p in predictions:
        if p.figure.group and p.figure.metric in RANKED_METRICS and p.predicted is not None:
            groups.setdefault(p.figure.group, []).append(p)
    out = []
    for name, rows in groups.items():
        by_quantity: dict[str, list[Prediction]] = {}
        for p in rows:
            by_quantity.setdefault(p.figure.quantity + "|" + p.figure.unit, []).append(p)
        rows = max(by_quantity.values(), key=len)
        if len(rows) < MIN_GROUP_ROWS:
            continue
        assert all(p.predicted is not None for p in rows)
        published = np.array([_time_like(p, p.figure.published) for p in rows])
        predicted = np.array([_time_like(p, float(p.predicted)) for p in rows])  # type: ignore[arg-type]
        i_pred, i_pub = int(np.argmin(predicted)), int(np.argmin(published))
        out.append(GroupRanking(
            group=name, metric=rows[0].figure.metric, rows=len(rows), spearman=spearman(predicted, published),
            predicted_best=rows[i_pred].figure.case, published_best=rows[i_pub].figure.case,
            best_gap=float(published[i_pred] / published[i_pub] - 1.0)))
    return out


@dataclass(frozen=True)
class FitTable:
    """Confusion table of the oom rows: published (ran out of memory or not) against predicted."""

    rows: list[dict[str, object]]

    def count(self, published_oom: bool, predicted_oom: bool) -> int:
        return sum(r["published_oom"] == published_oom and r["predicted_oom"] == predicted_oom for r in self.rows)

    @property
    def missed_ooms(self) -> int:
        """Published OOMs predicted to fit: the unsafe error (issue #41: none allowed)."""
        return self.count(True, False)

    @property
    def false_ooms(self) -> int:
        """Configurations that ran, predicted not to fit."""
        return self.count(False, True)


def fit_table(predictions: Iterable[Prediction]) -> FitTable:
    """The predicted oom rows (unpredicted ones are listed among validate's missing rows)."""
    rows = []
    for p in predictions:
        f = p.figure
        if f.metric != FIT_METRIC or p.predicted is None:
            continue
        published, predicted = f.published > 0.5, p.predicted > 0.5
        rows.append({"source": f.source, "table": f.table, "case": f.case, "group": f.group,
                     "published_oom": published, "predicted_oom": predicted, "agrees": published == predicted})
    return FitTable(rows)


def ranking_frame(rankings: list[GroupRanking]) -> pd.DataFrame:
    """ranking.csv: one row per ranked group."""
    return pd.DataFrame([r.row() for r in rankings], columns=list(RANKING_COLUMNS))
