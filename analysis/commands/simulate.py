"""`pipeplan simulate`: simulate one training step of a scenario and write its trace, plots and summary."""

from __future__ import annotations

import argparse

from analysis.console import print_simulation
from analysis.io import staged_output
from analysis.outputs import write_simulation
from sim.config import load_scenario
from sim.step import simulate_scenario


def add_scenario_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", nargs="?", default=None, help="scenario TOML (default: the built-in 8B scenario)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_scenario_argument(parser)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--schedule", help="override pipeline.schedule (gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv)")
    group.add_argument("--schedule-csv", help="run this action order (torch action-string CSV, one row per rank)")
    parser.add_argument("--out", default="out/simulate", help="output folder (default: out/simulate)")


def run(args: argparse.Namespace) -> int:
    overrides = {"pipeline.schedule": args.schedule} if args.schedule else {}
    scenario = load_scenario(args.scenario, overrides)
    result = simulate_scenario(scenario, args.schedule_csv)
    title = f"{result.schedule.name}: p={result.schedule.num_ranks} m={result.schedule.num_microbatches} " \
            f"v={result.schedule.virtual_stages}"
    with staged_output(args.out) as stage:
        summary = write_simulation(result, stage, title)
    print_simulation(summary, title)
    print(f"wrote {args.out}/: summary.json timeline.csv memory.csv schedule.csv trace.json gantt.png memory.png")
    return 0
