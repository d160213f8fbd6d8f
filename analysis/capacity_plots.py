"""The capacity figure (max layers and throughput per layer, per policy) and its console table."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from rich.table import Table

from analysis.console import console
from analysis.plots import plt, save


def capacity_plot(df: pd.DataFrame, path: str | Path) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ax1.barh(df["policy"], df["max_layers"], color="#4C78A8")
    if "scenario_layers" in df:
        ax1.axvline(df["scenario_layers"].iloc[0], color="black", linestyle="--", linewidth=1,
                    label=f"scenario: {df['scenario_layers'].iloc[0]} layers")
        ax1.legend(fontsize=8)
    ax1.set_xlabel("max layers that fit HBM")
    ax1.invert_yaxis()
    if "layer_tokens_per_s" in df:
        ax2.barh(df["policy"], df["layer_tokens_per_s"].fillna(0) / 1e6, color="#54A24B")
        ax2.set_xlabel("tokens/s x layers (millions): throughput per unit of depth")
        ax2.invert_yaxis()
        ax2.set_yticklabels([])
    fig.suptitle("capacity per memory policy", fontsize=10)
    save(fig, path)


def print_capacity(df: pd.DataFrame) -> None:
    t = Table(title="capacity", header_style="bold")
    target = int(df["target_layers"].iloc[0]) if "target_layers" in df and len(df) else None
    for col in ("policy", "max layers", "params (B)", "tokens/s", "layers vs 1f1b", "thr/layer vs 1f1b",
                "scenario fits", f"fits ~{target}", f"thr/layer @~{target}"):
        t.add_column(col, justify="left" if col == "policy" else "right")

    def fmt(x, spec: str) -> str:
        return "-" if x is None or pd.isna(x) else format(x, spec)

    for r in df.to_dict("records"):
        t.add_row(r["policy"], str(r["max_layers"]), fmt(r.get("params", 0) / 1e9, ".1f"),
                  fmt(r.get("tokens_per_s"), ",.0f"), fmt(r.get("layers_vs_1f1b"), ".2f"),
                  fmt(r.get("layer_throughput_vs_1f1b"), ".2f"), str(r.get("fits_scenario_layers")),
                  f"{r.get('fits_target')} ({r.get('target_layers')})",
                  fmt(r.get("target_layer_throughput_vs_1f1b"), ".2f"))
    console.print(t)
