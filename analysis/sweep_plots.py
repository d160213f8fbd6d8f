"""Sweep figures (Pareto front of tokens/s against peak HBM, a heatmap over two grid axes) and the ranking."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
from rich.table import Table

from analysis.console import console
from analysis.plots import plt, save
from analysis.sweep import pareto_front


def save_atomic(fig, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp.png")
    save(fig, tmp)
    os.replace(tmp, path)


def fitting(df: pd.DataFrame) -> pd.DataFrame:
    return df[(df["status"] == "ok") & (df["fits"].astype(str) == "True")]


def pareto_plot(df: pd.DataFrame, path: Path) -> None:
    ok = df[df["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    fits = ok["fits"].astype(str) == "True"
    ax.scatter(ok.loc[fits, "max_peak_hbm_bytes"] / 2**30, ok.loc[fits, "tokens_per_s"], s=10, color="#4C78A8",
               label="fits")
    ax.scatter(ok.loc[~fits, "max_peak_hbm_bytes"] / 2**30, ok.loc[~fits, "tokens_per_s"], s=10, color="#BBBBBB",
               label="out of memory")
    front = pareto_front(df)
    ax.plot(front["max_peak_hbm_bytes"] / 2**30, front["tokens_per_s"], "o-", color="#E45756", label="Pareto front")
    ax.set_xlabel("max peak HBM per rank (GiB)")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
    save_atomic(fig, path)


def heatmap_plot(df: pd.DataFrame, x: str, y: str, path: Path) -> None:
    """Best tokens/s among fitting configurations for each (x, y); blank where nothing fits."""
    ok = fitting(df)
    table = ok.pivot_table(index=y, columns=x, values="tokens_per_s", aggfunc="max")
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
            ax.text(j, i, f"{v / 1e3:.1f}k", ha="center", va="center", fontsize=7, color="white")
    fig.colorbar(im, ax=ax, label="best tokens/s that fits")
    save_atomic(fig, path)


def _order(v):
    return (0, v, "") if isinstance(v, int | float) else (1, 0, str(v))


def print_ranked(df: pd.DataFrame, keys: list[str], top: int) -> None:
    ok = fitting(df).sort_values("tokens_per_s", ascending=False).head(top)
    t = Table(title=f"best {len(ok)} configurations that fit (of {len(df)}; "
                    f"{int((df['status'] == 'invalid').sum())} invalid)", header_style="bold")
    metrics = ["tokens/s", "step (s)", "bubble", "peak HBM (GiB)", "MFU", "freeze x"]
    for k in ["#", *(k.split(".")[-1] for k in keys), *metrics]:
        t.add_column(k, justify="right")
    for n, r in enumerate(ok.to_dict("records"), 1):
        fz = r.get("freeze_speedup")
        t.add_row(str(n), *[str(r[k]) for k in keys], f"{r['tokens_per_s']:,.0f}", f"{r['step_time_s']:.3g}",
                  f"{r['bubble_ratio']:.1%}", f"{r['max_peak_hbm_bytes'] / 2**30:.1f}",
                  "-" if pd.isna(r["mfu"]) else f"{r['mfu']:.1%}", "-" if pd.isna(fz) else f"{fz:.2f}")
    console.print(t)
