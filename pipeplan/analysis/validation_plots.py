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

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
BAND = 0.10  # the ±10% band drawn around y = x
MAX_REASONS = 12


def parity_plot(predictions: list[Prediction], path: str | Path) -> None:
    """Predicted against published, one panel per metric (each point in its row's published unit), log axes,
    one marker per source, y = x and a ±10% band."""
    shown = [p for p in predictions if p.figure.scored and p.predicted is not None]
    sources = sorted({p.figure.source for p in predictions})
    marker = {s: MARKERS[i % len(MARKERS)] for i, s in enumerate(sources)}
    fig, axes = plt.subplots(2, 2, figsize=(10, 9))
    for ax, metric in zip(axes.flat, METRICS, strict=True):
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
