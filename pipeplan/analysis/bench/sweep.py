"""Sweep speed: 1,000 configurations of the 8B scenario on up to 8 stages, in parallel worker processes."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pandas as pd

GRID = {
    "pipeline.stages": [1, 2, 4, 8],
    "pipeline.microbatches": [8, 16, 32, 64, 128],
    "pipeline.schedule": ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "zbv"],
    "pipeline.virtual_stages": [1, 2],
    "training.micro_batch_size": [1, 2, 4, 8, 16],
}  # 4 * 5 * 5 * 2 * 5 = 1,000 configurations


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: all cores)")


def run(args: argparse.Namespace, out_dir: Path) -> str:
    from rich.progress import Progress

    from pipeplan.analysis.sweep import run_sweep
    from pipeplan.scenarios import scenario_path

    work = out_dir / "sweep"
    t0 = time.perf_counter()
    with Progress() as bar:
        task = bar.add_task("bench sweep", total=None)
        rows = run_sweep(str(scenario_path("llama3-8b-pp4-h100")), GRID, work, args.jobs, plan_freeze=False,
                         progress=lambda d, n: bar.update(task, completed=d, total=n))
    wall = time.perf_counter() - t0
    ok = int((rows["status"] == "ok").sum())
    summary = pd.DataFrame([{
        "configurations": len(rows), "simulated": ok, "invalid": len(rows) - ok, "jobs": args.jobs,
        "wall_s": wall, "configs_per_s": len(rows) / wall, "sim_wall_s_total": rows["sim_wall_s"].sum(),
    }])
    (out_dir / "bench_sweep.csv").write_text(summary.to_csv(index=False))
    invalid = len(rows) - ok
    return f"{len(rows)} configurations ({ok} simulated, {invalid} invalid) in {wall:.1f} s with {args.jobs} jobs"
