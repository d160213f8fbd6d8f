"""Figures people would rather look at than read: per-rank Gantt charts and HBM timelines."""

from __future__ import annotations

from pathlib import Path

import matplotlib

from pipeplan.common.units import GIB

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

KIND_COLORS = {"F": "#4C78A8", "B": "#E45756", "I": "#F58518", "W": "#54A24B"}
MAX_LABELLED_ACTIONS = 600


def save(fig: plt.Figure, path: str | Path) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def gantt(timeline: pd.DataFrame, path: str | Path, title: str = "", color_by: str = "kind") -> None:
    """One row per rank, one bar per action; white gaps are bubbles; bars labelled with the microbatch."""
    ranks = int(timeline["rank"].max()) + 1 if len(timeline) else 1
    fig, ax = plt.subplots(figsize=(12, 0.45 * ranks + 1.4))
    label = len(timeline) <= MAX_LABELLED_ACTIONS
    span = float(timeline["end_s"].max()) if len(timeline) else 1.0
    for (kind, rank), rows in timeline.groupby(["kind", "rank"]):
        bars = list(zip(rows["start_s"], rows["end_s"] - rows["start_s"], strict=True))
        ax.broken_barh(bars, (rank - 0.4, 0.8), facecolors=KIND_COLORS.get(str(kind), "grey"),
                       edgecolor="white", linewidth=0.3)
    if label:
        wide = timeline[(timeline["end_s"] - timeline["start_s"]) > span / 120]
        for row in wide.itertuples(index=False):
            ax.text((row.start_s + row.end_s) / 2, row.rank, str(row.microbatch), ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_xlim(0, span * 1.005)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for k, c in KIND_COLORS.items() if k in set(timeline["kind"])]
    names = [k for k in KIND_COLORS if k in set(timeline["kind"])]
    ax.legend(handles, names, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, title="action",
              title_fontsize=8)  # outside the axes: a legend inside would hide bars
    ax.set_title(title, fontsize=10)
    save(fig, path)


def memory_plot(memory: pd.DataFrame, path: str | Path, capacity_bytes: float | None = None, title: str = "") -> None:
    """HBM in use per rank over the step against capacity: solid the total, dotted its static part (weights,
    gradients, optimizer); a second panel shows DRAM and NVMe when anything lives there."""
    host = [c for c in ("dram_bytes", "nvme_bytes") if c in memory and memory[c].any()]
    fig, axes = plt.subplots(1 + bool(host), 1, figsize=(10, 4 + 2.5 * bool(host)), sharex=True, squeeze=False)
    ax = axes[0, 0]
    for rank, rows in memory.groupby("rank"):
        line = ax.step(rows["time_s"], rows["hbm_bytes"] / GIB, where="post", label=f"rank {rank}", linewidth=1)
        if "static_hbm_bytes" in rows:
            ax.step(rows["time_s"], rows["static_hbm_bytes"] / GIB, where="post", linewidth=0.8,
                    linestyle=":", color=line[0].get_color())
    if capacity_bytes is not None:
        ax.axhline(capacity_bytes / GIB, color="black", linestyle="--", linewidth=1, label="HBM capacity")
    ax.set_ylabel("HBM in use (GiB)\nsolid: total, dotted: static")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title, fontsize=10)
    if host:
        hx = axes[1, 0]
        for rank, rows in memory.groupby("rank"):
            for col, style in zip(host, ("-", "--"), strict=False):
                hx.step(rows["time_s"], rows[col] / GIB, where="post", linestyle=style, linewidth=1,
                        label=f"rank {rank} {col.removesuffix('_bytes').upper()}")
        hx.set_ylabel("host memory (GiB)")
        hx.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0), ncols=2)
    axes[-1, 0].set_xlabel("time (s)")
    save(fig, path)
