"""Figures of the freeze planner: the freeze-ratio heatmap, the cap sweep and the LP benchmark."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from pipeplan.analysis.plots import plt, save  # plt with the Agg backend selected


def freeze_heatmap(ratio: np.ndarray, path: str | Path, title: str = "") -> None:
    """ratio: (stages, microbatches) freeze ratio of each stage's freezable action per microbatch."""
    stages, mbs = ratio.shape
    fig, ax = plt.subplots(figsize=(min(2 + 0.35 * mbs, 16), min(1.2 + 0.35 * stages, 10)))
    im = ax.imshow(ratio, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto", interpolation="nearest")
    if ratio.size <= 400:
        for (s, m), r in np.ndenumerate(ratio):
            ax.text(
                m, s, f"{r:.2f}", ha="center", va="center", fontsize=6, color="white" if r < 0.6 else "black"
            )
    ax.set_xlabel("microbatch")
    ax.set_ylabel("stage (model chunk)")
    ax.set_xticks(range(0, mbs, max(1, mbs // 16)))
    ax.set_yticks(range(0, stages, max(1, stages // 16)))
    fig.colorbar(im, ax=ax, label="freeze ratio")
    ax.set_title(title, fontsize=10)
    save(fig, path)


def sweep_plot(sweep: pd.DataFrame, path: str | Path, title: str = "") -> None:
    """Speedup of the LP plan against the cap, one line per schedule."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, rows in sweep.groupby("schedule", sort=False):
        ax.plot(rows["cap"], rows["speedup"], "o-", label=str(name), markersize=4)
    ax.axhline(1.4, color="grey", linestyle=":", linewidth=1, label='TimelyFreeze "up to 40%"')
    ax.set_xlabel("cap (mean freeze ratio per stage)")
    ax.set_ylabel("step speedup (baseline / planned makespan)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    save(fig, path)


def bench_plot(bench: pd.DataFrame, path: str | Path, title: str = "") -> None:
    """LP build + solve time against DAG size: pipeplan's HiGHS LP and TimelyFreeze's scipy formulation."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.loglog(bench["actions"], bench["pipeplan_wall_s"], "o-", label="pipeplan (highspy, lexicographic)")
    ok = bench.dropna(subset=["scipy_wall_s"])
    if len(ok):
        ax.loglog(ok["actions"], ok["scipy_wall_s"], "s--", label="TimelyFreeze-style scipy linprog (big-M)")
    ax.axhline(10.0, color="grey", linestyle=":", linewidth=1, label="10 s target")
    ax.set_xlabel("actions in the DAG")
    ax.set_ylabel("LP build + solve (s)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    ax.set_title(title, fontsize=10)
    save(fig, path)
