"""The validation parity plot and its console table (`pipeplan validate`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from matplotlib.ticker import NullFormatter
from rich.markup import escape
from rich.table import Table

from pipeplan.analysis.console import console
from pipeplan.analysis.plots import plt, save
from pipeplan.analysis.validation import METRICS, ErrorSummary, Prediction
from pipeplan.analysis.validation_ranking import (
    BEST_TOLERANCE,
    PICKS_BEST_TARGET,
    RHO_TARGET,
    FitTable,
    GroupRanking,
    fit_table,
    rank_groups,
)

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
BAND = 0.10  # the ±10% band drawn around y = x
MAX_REASONS = 12


def parity_plot(predictions: list[Prediction], path: str | Path) -> None:
    """Predicted against published, one panel per metric (each point in its row's published unit), log axes,
    one marker per source, y = x and a ±10% band; below them the ranking per group (Spearman rho, best pick)
    and the fit confusion table."""
    shown = [p for p in predictions if p.figure.scored and p.predicted is not None]
    sources = sorted({p.figure.source for p in predictions})
    marker = {s: MARKERS[i % len(MARKERS)] for i, s in enumerate(sources)}
    fig, axes = plt.subplots(3, 2, figsize=(10, 13))
    _ranking_panel(axes[2, 0], rank_groups(predictions))
    _fit_panel(axes[2, 1], fit_table(predictions))
    for ax, metric in zip(axes.flat[:4], METRICS, strict=True):
        points = [p for p in shown if p.figure.metric == metric]
        for source in sources:
            mine = [p for p in points if p.figure.source == source]
            if mine:
                ax.scatter([p.figure.published for p in mine], [p.predicted for p in mine], marker=marker[source],
                           s=22, alpha=0.8, label=f"{source} ({len(mine)})")
        ax.set_title(metric if points else f"{metric}: no predictions yet", fontsize=10)
        if points:
            values = [v for p in points for v in (p.figure.published, p.predicted)]
            lo, hi = min(values) / 1.5, max(values) * 1.5
            x = np.geomspace(lo, hi, 50)
            ax.plot(x, x, color="black", linewidth=0.8, label="y = x")
            ax.fill_between(x, x * (1 - BAND), x * (1 + BAND), color="grey", alpha=0.2, label="±10%")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
            for axis in (ax.xaxis, ax.yaxis):  # narrow ranges (ratios) would otherwise label every minor tick
                axis.set_minor_formatter(NullFormatter())
            ax.legend(fontsize=7, loc="upper left")
        ax.set_xlabel("published (paper's unit)")
        ax.set_ylabel("predicted")
    fig.suptitle("pipeplan against published measurements", fontsize=11)
    fig.tight_layout()
    save(fig, path)


def _ranking_panel(ax: plt.Axes, rankings: list[GroupRanking]) -> None:
    """Spearman rho per group as bars (hatched where the predicted best misses the published best by > 3%)."""
    ax.set_title(f"ranking per group (rho target >= {RHO_TARGET:g})" if rankings else "ranking: no groups",
                 fontsize=10)
    if not rankings:
        ax.axis("off")
        return
    rho = [r.spearman if np.isfinite(r.spearman) else 0.0 for r in rankings]
    y = np.arange(len(rankings))
    bars = ax.barh(y, rho, color=["tab:green" if r.meets_rho else "tab:red" for r in rankings])
    for bar, r in zip(bars, rankings, strict=True):
        if not r.picks_best:
            bar.set_hatch("//")
    ax.axvline(RHO_TARGET, color="black", linewidth=0.8)
    ax.set_yticks(y, [r.group for r in rankings], fontsize=6)
    ax.set_xlim(-1, 1)
    ax.invert_yaxis()
    ax.set_xlabel("Spearman rho, predicted vs published time (hatched: best pick off by > 3%)")


def _fit_panel(ax: plt.Axes, fits: FitTable) -> None:
    """The 2 x 2 confusion table of the oom rows."""
    ax.set_title("fits: published vs predicted" if fits.rows else "fits: no oom rows", fontsize=10)
    if not fits.rows:
        ax.axis("off")
        return
    counts = np.array([[fits.count(pub, pred) for pred in (False, True)] for pub in (False, True)])
    ax.imshow(counts, cmap="Blues")
    for (i, j), n in np.ndenumerate(counts):
        ax.text(j, i, str(n), ha="center", va="center", fontsize=14,
                color="red" if (i, j) == (1, 0) and n else "black")
    ax.set_xticks([0, 1], ["predicted fits", "predicted OOM"])
    ax.set_yticks([0, 1], ["ran", "published OOM"])


def print_ranking(rankings: list[GroupRanking], fits: FitTable) -> None:
    """Per group: rho and the best pick against issue #41's targets; then the fit confusion table."""
    if rankings:
        t = Table(title=f"ranking: Spearman rho (target >= {RHO_TARGET:g}) and the predicted best "
                        f"(right within {BEST_TOLERANCE:.0%})", header_style="bold")
        for col in ("group", "rows", "rho", "predicted best", "published best", "gap"):
            t.add_column(col, justify="right" if col in ("rows", "rho", "gap") else "left")
        for r in rankings:
            rho = "-" if not np.isfinite(r.spearman) else f"{r.spearman:+.2f}"
            t.add_row(r.group, str(r.rows), rho if r.meets_rho else f"[red]{rho}[/]", r.predicted_best,
                      r.published_best, _pct(r.best_gap) if r.picks_best else f"[red]{r.best_gap:.1%}[/]")
        console.print(t)
        share = sum(r.picks_best for r in rankings) / len(rankings)
        meets = sum(r.meets_rho for r in rankings)
        console.print(f"ranking: rho >= {RHO_TARGET:g} in {meets} of {len(rankings)} groups; predicted best right in "
                      f"{share:.0%} of groups (target >= {PICKS_BEST_TARGET:.0%})", highlight=False)
    if fits.rows:
        console.print(f"fits ({len(fits.rows)} oom rows): published OOM predicted OOM {fits.count(True, True)}, "
                      f"[{'red' if fits.missed_ooms else 'green'}]published OOM predicted to fit "
                      f"{fits.missed_ooms}[/], ran predicted OOM {fits.false_ooms}, ran predicted to fit "
                      f"{fits.count(False, False)}")


def print_summary(summaries: list[ErrorSummary], predictions: list[Prediction]) -> None:
    """Mean and max |error| per metric and source against issue #12's targets, then what was not predicted."""
    t = Table(title="validation: |predicted - published| / published (scored rows)", header_style="bold")
    for col in ("metric", "source", "cases", "predicted", "mean |err|", "max |err|", "target", "meets"):
        t.add_column(col, justify="left" if col in ("metric", "source") else "right")
    for s in summaries:
        mean, bound = s.target
        target = f"<= {mean:.0%}" + (f" / {bound:.0%}" if bound is not None else "")
        meets = {True: "[green]yes[/]", False: "[red]no[/]", None: "-"}[s.meets_target]
        t.add_row(s.metric, s.source if s.source != "all" else "[bold]all[/]", str(s.cases), str(s.predicted),
                  _pct(s.mean_abs_error), _pct(s.max_abs_error), target, meets)
    console.print(t)
    missing = [p for p in predictions if p.figure.scored and p.predicted is None]
    if missing:
        reasons = Counter(p.reason for p in missing).most_common()
        console.print(f"[yellow]{len(missing)} scored rows not predicted on this build[/] (rows, why):")
        for reason, n in reasons[:MAX_REASONS]:
            console.print(f"  {n:4d}  {escape(str(reason))}", highlight=False)
        if len(reasons) > MAX_REASONS:
            console.print(f"  ... and {len(reasons) - MAX_REASONS} more reasons")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"
