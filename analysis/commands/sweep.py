"""`pipeplan sweep`: simulate every combination of a grid of scenario keys; resumable; ranked, plotted."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from sim.errors import PipeplanError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="scenario TOML whose keys the grid varies")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="a scenario key and its values, e.g. pipeline.stages=2,4,8 (repeatable)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: all cores)")
    parser.add_argument("--plan", action="store_true",
                        help="also solve the freeze LP per configuration (on by default when freeze.cap varies)")
    parser.add_argument("--heatmap", metavar="X,Y", help="two grid keys for the heatmap (default: the first two)")
    parser.add_argument("--top", type=int, default=10, help="rows of the ranked table (default: 10)")
    parser.add_argument("--out", default="out/sweep", help="output folder; rerunning resumes (default: out/sweep)")


def run(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from analysis.sweep import parse_grid, run_sweep
    from analysis.sweep_plots import heatmap_plot, pareto_plot, print_ranked

    grid = parse_grid(args.grid)
    if args.jobs < 1:
        raise PipeplanError(f"--jobs: {args.jobs}; must be >= 1")
    axes = [k for k in grid if len(grid[k]) > 1]
    if args.heatmap:
        axes = [a.strip() for a in args.heatmap.split(",")]
        bad = [a for a in axes if a not in grid]
        if len(axes) != 2 or bad:
            raise PipeplanError(f"--heatmap {args.heatmap!r}: name two --grid keys; allowed: {', '.join(grid)}")
    from sim.config import load_scenario

    load_scenario(args.scenario)  # bad input is one line, before any progress bar
    out = Path(args.out)
    with Progress() as bar:
        task = bar.add_task("sweep", total=None)
        rows = run_sweep(args.scenario, grid, out, args.jobs, args.plan or "freeze.cap" in grid,
                         progress=lambda done, total: bar.update(task, completed=done, total=total))
    pareto_plot(rows, out / "pareto.png")
    if len(axes) >= 2:
        heatmap_plot(rows, axes[0], axes[1], out / "heatmap.png")
    print_ranked(rows, list(grid), args.top)
    print(f"wrote {out}/: sweep.csv pareto.png" + (" heatmap.png" if len(axes) >= 2 else ""))
    return 0
