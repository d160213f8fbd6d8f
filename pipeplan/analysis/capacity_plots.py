"""The capacity figure (max layers and throughput per layer, per policy) and its console table."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter
from rich.table import Table

from pipeplan.analysis.console import console
from pipeplan.analysis.plots import plt, save


def capacity_plot(df: pd.DataFrame, path: str | Path, title: str = "") -> None:
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
    fig.suptitle("capacity per memory policy" + (f" - {title}" if title else ""), fontsize=10)
    save(fig, path)


def print_capacity(df: pd.DataFrame) -> None:
    t = Table(title="capacity", header_style="bold")
    target = int(df["target_layers"].iloc[0]) if "target_layers" in df and len(df) else None
    for col in ("policy", "max layers", "params (B)", "mbs", "tokens/s", "layers vs 1f1b", "thr/layer vs 1f1b",
                "scenario fits", f"fits ~{target}", f"thr/layer @~{target}"):
        t.add_column(col, justify="left" if col == "policy" else "right")

    def fmt(x, spec: str) -> str:
        return "-" if x is None or pd.isna(x) else format(x, spec)

    for r in df.to_dict("records"):
        t.add_row(r["policy"], str(r["max_layers"]), fmt(r.get("params", 0) / 1e9, ".1f"),
                  fmt(r.get("micro_batch_size"), ".0f"), fmt(r.get("tokens_per_s"), ",.0f"),
                  fmt(r.get("layers_vs_1f1b"), ".2f"),
                  fmt(r.get("layer_throughput_vs_1f1b"), ".2f"), str(r.get("fits_scenario_layers")),
                  f"{r.get('fits_target')} ({r.get('target_layers')})",
                  fmt(r.get("target_layer_throughput_vs_1f1b"), ".2f"))
    console.print(t)


def frontier_plot(df: pd.DataFrame, answers: dict, min_throughput: float, path: str | Path) -> None:
    """Per policy, per-layer throughput (relative to plain 1F1B at its deepest fit) against depth."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for policy, g in df[df["fits"].astype(bool)].groupby("policy", sort=False):
        line, = ax.plot(g["layers"], g["layer_throughput_vs_1f1b"], marker=".", label=policy)
        best = answers.get(policy)
        if best is not None:
            ax.plot([best["layers"]], [best["layer_throughput_vs_1f1b"]], marker="*", markersize=12,
                    color=line.get_color(), linestyle="none")
    ax.axhline(min_throughput, color="black", linestyle="--", linewidth=1,
               label=f"{min_throughput:.0%} of plain 1F1B (★: deepest at or above)")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=2))  # 16, 32, 64, ...: a decade's ticks would label only 100
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("layers (log scale)")
    ax.set_ylabel("tokens/s x layers, relative to 1F1B's deepest fit")
    ax.set_title("depth against per-layer throughput, per memory policy", fontsize=10)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    save(fig, path)


def print_frontier(df: pd.DataFrame, answers: dict, min_throughput: float) -> None:
    ref = int(df.set_index("policy").loc["1f1b", "max_layers"])
    t = Table(title=f"deepest model at >= {min_throughput:.0%} of plain 1F1B's per-layer throughput "
                    f"(1F1B: {ref} layers)", header_style="bold")
    for col in ("policy", "layers", "x 1f1b depth", "thr/layer vs 1f1b", "tokens/s", "chosen"):
        t.add_column(col, justify="left" if col in ("policy", "chosen") else "right")
    for policy, best in answers.items():
        if best is None:
            t.add_row(policy, "none", "-", "-", "-", "")
        else:
            t.add_row(policy, str(best["layers"]), f"{best['layers'] / ref:.2f}",
                      f"{best['layer_throughput_vs_1f1b']:.2f}", f"{best['tokens_per_s']:,.0f}",
                      best.get("variant") or "")
    console.print(t)
