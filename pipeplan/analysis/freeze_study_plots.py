"""The freeze study's figure: training loss against tokens and against wall time, one line per method and cap
(the spread over seeds as a band)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from pipeplan.analysis.plots import save

SMOOTH_STEPS = 5  # a rolling mean over this many steps: one step's loss is one batch's


def loss_curves(metrics: dict[tuple[str, float, int], pd.DataFrame], tokens_per_step: int, path: str | Path,
                title: str) -> None:
    """`metrics[(method, cap, seed)]` is that run's metrics.csv. One line per (method, cap): the mean over
    seeds of the rolling-mean loss, against tokens and against the steps' cumulative wall time (the seeds'
    mean), with a band from the lowest to the highest seed."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    groups: dict[tuple[str, float], list[pd.DataFrame]] = {}
    for (method, cap, _seed), m in sorted(metrics.items()):
        groups.setdefault((method, cap), []).append(m)
    for i, ((method, cap), runs) in enumerate(groups.items()):
        color = f"C{i % 10}"
        n = min(len(m) for m in runs)
        smooth = np.array([m["loss"].rolling(SMOOTH_STEPS, min_periods=1).mean().to_numpy()[:n] for m in runs])
        wall = np.array([m["step_time_s"].cumsum().to_numpy()[:n] for m in runs]).mean(axis=0)
        tokens = (np.arange(n) + 1) * tokens_per_step
        label = method if method == "none" else f"{method} cap {cap:g}"
        for ax, x in ((by_tokens, tokens), (by_time, wall)):
            ax.plot(x, smooth.mean(axis=0), color=color, label=label)
            if len(runs) > 1:
                ax.fill_between(x, smooth.min(axis=0), smooth.max(axis=0), color=color, alpha=0.2, linewidth=0)
    by_tokens.set_xlabel("tokens")
    by_time.set_xlabel("wall time of the steps (s, mean over seeds)")
    by_tokens.set_ylabel(f"training loss (rolling mean of {SMOOTH_STEPS} steps; band: seeds' range)")
    by_tokens.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    save(fig, path)
