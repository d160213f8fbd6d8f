"""Short human-readable tables on the console (rich)."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(width=None if sys.stdout.isatty() else 160)  # logs and pipes get full tables


def gib(x: float) -> str:
    return f"{x / 2**30:.2f}"


def print_simulation(summary: dict[str, Any], title: str) -> None:
    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("rank", justify="right")
    t.add_column("peak activations (GiB)", justify="right")
    t.add_column("peak HBM (GiB)", justify="right")
    for r, (a, h) in enumerate(zip(summary["peak_activation_bytes"], summary["peak_hbm_bytes"], strict=True)):
        t.add_row(str(r), gib(a), gib(h))
    console.print(t)
    line = (
        f"makespan {summary['makespan_s']:.6g} s · bubble {summary['bubble_ratio']:.1%} · "
        f"{summary['actions']} actions simulated in {summary['sim_wall_s'] * 1e3:.1f} ms"
    )
    if "tokens_per_s" in summary:
        line += f" · {summary['tokens_per_s']:,.0f} tokens/s · MFU {summary['mfu']:.1%}"
    console.print(line)
    if summary["oom"]:
        d = summary["oom_detail"]
        console.print(
            f"[bold red]OOM[/]: rank {d['rank']} exceeds HBM by {gib(d['excess_bytes'])} GiB at "
            f"t={d['time_s']:.4g} s ({d['action']}); ranks over capacity: {d['ranks']}"
        )
