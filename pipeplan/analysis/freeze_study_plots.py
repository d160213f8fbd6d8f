"""The freeze study's figure: training loss against tokens and against wall time, one line per cap."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from pipeplan.analysis.plots import save

SMOOTH_STEPS = 5  # a rolling mean over this many steps: one step's loss is one batch's


def loss_curves(metrics: dict[float, pd.DataFrame], tokens_per_step: int, path: str | Path, title: str) -> None:
    """`metrics[cap]` is that run's metrics.csv; faint lines are per step, bold ones the rolling mean."""
    import matplotlib.pyplot as plt

    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for i, (cap, m) in enumerate(sorted(metrics.items())):
        color = f"C{i}"
        tokens = (m["step"] + 1) * tokens_per_step
        wall = m["step_time_s"].cumsum()
        smooth = m["loss"].rolling(SMOOTH_STEPS, min_periods=1).mean()
        for ax, x in ((by_tokens, tokens), (by_time, wall)):
            ax.plot(x, m["loss"], color=color, alpha=0.25, linewidth=0.8)
            ax.plot(x, smooth, color=color, label=f"cap {cap:g}")
    by_tokens.set_xlabel("tokens")
    by_time.set_xlabel("wall time of the steps (s)")
    by_tokens.set_ylabel(f"training loss (rolling mean of {SMOOTH_STEPS} steps)")
    by_tokens.legend()
    fig.suptitle(title, fontsize=10)
    save(fig, path)
