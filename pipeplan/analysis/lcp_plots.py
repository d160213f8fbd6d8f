"""Plots of `pipeplan lcp bench`: per-query latency vs N, and memory vs N with the pairwise wall."""

from __future__ import annotations

from pathlib import Path

import matplotlib

from pipeplan.common.units import GIB

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from pipeplan.lcp.baselines import pairwise_bytes

_STYLE = {"index": "o-", "numpy": "d-", "marisa": "v-", "scan": "s-", "trie": "^-", "pairwise": "x-"}


def plot_latency(df: pd.DataFrame, path: str | Path) -> None:
    """p50 per-query latency (bars to p95) against N, log-log, one line per method."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method, rows in df.dropna(subset=["p50_ms"]).groupby("method"):
        rows = rows.sort_values("n")
        err = np.vstack([np.zeros(len(rows)), (rows["p95_ms"] - rows["p50_ms"]).clip(lower=0)])
        ax.errorbar(rows["n"], rows["p50_ms"], yerr=err, fmt=_STYLE.get(method, ".-"), label=method, capsize=3)
    ax.set(xscale="log", yscale="log", xlabel="N (rows)", ylabel="latency per query, ms (p50, bar to p95)")
    ax.set_title("LCP top-k: per-query latency in batched calls")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_memory(df: pd.DataFrame, path: str | Path, budget_bytes: int, batch: int, length: int) -> None:
    """Bytes held against N; dashed: what pairwise materialisation needs; the budget line is the wall."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ran = df.dropna(subset=["p50_ms"])
    for method, rows in ran.groupby("method"):
        rows = rows.sort_values("n")
        ax.plot(rows["n"], rows["index_bytes"], _STYLE.get(method, ".-"), label=f"{method} (ran)")
    refused = df[df["p50_ms"].isna() & (df["method"] == "pairwise")]
    if len(refused):
        ax.plot(refused["n"], refused["index_bytes"], "rX", markersize=10, label="pairwise refused")
    ns = np.geomspace(max(1, df["n"].min() / 2), df["n"].max() * 2, 50)
    ax.plot(ns, [pairwise_bytes(batch, int(n), length) for n in ns], "k--", lw=1, label=f"pairwise {batch}×N int16")
    ax.plot(ns, [pairwise_bytes(int(n), int(n), length) for n in ns], "k:", lw=1, label="all-pairs N×N int16")
    ax.axhline(budget_bytes, color="r", lw=1, label=f"memory budget {budget_bytes / GIB:.3g} GiB")
    ax.set(xscale="log", yscale="log", xlabel="N (rows)", ylabel="bytes")
    ax.set_title(f"LCP top-k: memory (L = {length} bytes)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
