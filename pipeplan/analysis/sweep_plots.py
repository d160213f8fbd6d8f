"""Sweep figures (Pareto front of tokens/s per GPU against peak HBM, a heatmap over two grid axes) and the
console's ranking and summary of invalid combinations."""

from __future__ import annotations

import numbers
from pathlib import Path

import numpy as np
import pandas as pd
from rich.markup import escape
from rich.table import Table

from pipeplan.analysis.console import console
from pipeplan.analysis.plots import plt
from pipeplan.analysis.sweep import fitting, invalid_reasons, pareto_front, ranked, speed_column, with_speed
from pipeplan.common.io import atomic_file
from pipeplan.common.units import GIB

SPEED_LABELS = {"tokens_per_s_per_gpu": "tokens/s per GPU", "tokens_per_s": "tokens/s", "steps_per_s": "steps/s",
                "samples_per_s_per_gpu": "sequences/s per GPU"}
CLIP_QUANTILE = 0.9
"""The Pareto plot's x axis shows up to this quantile of peak HBM, widened to capacity; points beyond are drawn
at the right edge as arrows (a configuration needing 610 GiB must not squash the 40-90 GiB that matter)."""


def save_atomic(fig, path: Path) -> None:
    """Draw `fig` into a temporary created exclusively beside `path` (a unique name: a link planted there is never
    followed), then rename it over `path`; a resumed sweep writes into a folder others may have touched."""
    try:
        with atomic_file(path) as f:
            fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)


def pareto_plot(df: pd.DataFrame, path: Path, title: str = "") -> None:
    """Throughput per GPU against max peak HBM per rank: fitting points, out-of-memory points, the Pareto front
    of fitting configurations, and the capacity line; far outliers clipped to the right edge and marked."""
    df = with_speed(df)
    ok = df[df["status"] == "ok"].copy()
    col = speed_column(df)
    ok = ok[ok[col].notna()]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    x = ok["max_peak_hbm_bytes"].astype(float) / GIB
    y = ok[col].astype(float)
    cap = capacity_gib(ok)
    hi = float(x.quantile(CLIP_QUANTILE)) if len(x) else 1.0
    hi = max(hi, (cap or 0) * 1.15, float(x[ok["fits"].astype(str) == "True"].max()) * 1.05 if len(x) else 0)
    clipped = x > hi
    xs = x.clip(upper=hi)
    fits = ok["fits"].astype(str) == "True"
    ax.scatter(xs[fits & ~clipped], y[fits & ~clipped], s=14, color="#4C78A8", label="fits")
    ax.scatter(xs[~fits & ~clipped], y[~fits & ~clipped], s=14, color="#BBBBBB", label="out of memory")
    if clipped.any():
        ax.scatter(xs[clipped], y[clipped], s=30, marker=">", color="#999999",
                   label=f"beyond {hi:.0f} GiB ({int(clipped.sum())}, up to {x.max():.0f} GiB)")
    front = pareto_front(df)
    if len(front):
        ax.plot(front["max_peak_hbm_bytes"] / GIB, front[col], "o-", color="#E45756", label="Pareto front")
    if cap:
        ax.axvline(cap, color="black", linestyle="--", linewidth=1, label=f"HBM capacity ({cap:.1f} GiB)")
    ax.set_xlim(0, hi * 1.03)
    ax.set_xlabel("max peak HBM per rank (GiB)")
    ax.set_ylabel(SPEED_LABELS[col])
    ax.set_title(f"sweep: throughput against memory - {title}" if title else "sweep: throughput against memory",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    save_atomic(fig, path)


def capacity_gib(ok: pd.DataFrame) -> float | None:
    """The HBM capacity the rows were checked against (one device per sweep unless device.* varies)."""
    if "hbm_limit_bytes" in ok and ok["hbm_limit_bytes"].notna().any():
        return float(ok["hbm_limit_bytes"].dropna().iloc[0]) / GIB
    over = ok[ok["over_capacity_bytes"].astype(float) > 0] if "over_capacity_bytes" in ok else ok.iloc[:0]
    if len(over):  # peak - over is the limit for any row that does not fit
        r = over.iloc[0]
        return (float(r["max_peak_hbm_bytes"]) - float(r["over_capacity_bytes"])) / GIB
    return None


def heatmap_plot(df: pd.DataFrame, x: str, y: str, path: Path, title: str = "") -> None:
    """Best tokens/s per GPU among fitting configurations for each (x, y); blank where nothing fits."""
    df = with_speed(df)
    ok = fitting(df)
    col = speed_column(df)
    table = ok.pivot_table(index=y, columns=x, values=col, aggfunc="max")
    xs = sorted(df[x].dropna().unique(), key=_order)
    ys = sorted(df[y].dropna().unique(), key=_order)
    table = table.reindex(index=ys, columns=xs)
    fig, ax = plt.subplots(figsize=(1.2 * len(xs) + 3, 0.6 * len(ys) + 2))
    im = ax.imshow(table.to_numpy(dtype=float), cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(xs)), [str(v) for v in xs], rotation=30, ha="right")
    ax.set_yticks(range(len(ys)), [str(v) for v in ys])
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    for (i, j), v in np.ndenumerate(table.to_numpy(dtype=float)):
        if not np.isnan(v):
            ax.text(j, i, f"{v / 1e3:.1f}k" if v >= 1e3 else f"{v:.3g}", ha="center", va="center", fontsize=7,
                    color="white")
    fig.colorbar(im, ax=ax, label=f"best {SPEED_LABELS[col]} that fits")
    ax.set_title(f"best that fits (blank: nothing fits) - {title}" if title else "best that fits", fontsize=10)
    save_atomic(fig, path)


def _order(v):
    """Sort key for axis values: numbers by value (numpy's integers and floats too, as pandas hands them back),
    then the rest as text, so 8 comes before 16 rather than after it."""
    return (0, v, "") if isinstance(v, numbers.Real) and not isinstance(v, bool) else (1, 0, str(v))


def print_ranked(df: pd.DataFrame, keys: list[str], top: int) -> None:
    ok = ranked(fitting(df)).head(top)
    by = SPEED_LABELS[speed_column(with_speed(df))]
    t = Table(title=f"best {len(ok)} configurations that fit, by {by} (of {len(df)}; "
                    f"{int((df['status'] == 'invalid').sum())} invalid)", header_style="bold")
    metrics = ["GPUs", "global batch", "tokens/s/GPU", "tokens/s", "step (s)", "bubble", "peak HBM (GiB)", "MFU",
               "freeze x"]
    for k in ["#", *(k.split(".")[-1] for k in keys), *metrics]:
        t.add_column(k, justify="right")

    def fmt(v, spec: str) -> str:
        return "—" if v is None or pd.isna(v) else format(v, spec)

    for n, r in enumerate(ok.to_dict("records"), 1):
        t.add_row(str(n), *[escape(str(r[k])) for k in keys], fmt(r.get("gpus"), ".0f"),
                  fmt(r.get("global_batch"), ".0f"),
                  fmt(r.get("tokens_per_s_per_gpu"), ",.0f"), fmt(r["tokens_per_s"], ",.0f"),
                  fmt(r["step_time_s"], ".3g"), fmt(r["bubble_ratio"], ".1%"),
                  fmt(r["max_peak_hbm_bytes"] / GIB, ".1f"), fmt(r["mfu"], ".1%"),
                  fmt(r.get("freeze_speedup"), ".2f"))
    console.print(t)


def print_invalid(df: pd.DataFrame) -> None:
    """Invalid combinations grouped by reason: how many, and one example each."""
    reasons = invalid_reasons(df)
    if not reasons:
        return
    console.print(f"[bold]{sum(r.count for r in reasons)} invalid combinations[/] (not simulated), by reason:")
    for r in reasons:  # a reason names scenario tables ("[model]"), which rich would take for markup and drop
        console.print(f"  {r.count:>5} x {escape(str(r.reason))}  [dim](e.g. {escape(str(r.example))})[/]")
