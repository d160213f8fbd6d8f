"""`pipeplan simulate`: simulate one training step of a scenario and write its trace, plots and summary.

    pipeplan simulate                                        # the built-in LLaMA-3 8B on 4 x H100, 1F1B
    pipeplan simulate llama3-8b-pp4-h100 --schedule zbv      # zbv takes 2 chunks per rank: no flag needed
    pipeplan simulate my.toml --set pipeline.microbatches=32 --set memory.recompute=full --out out/sim32
    pipeplan simulate explicit-unit --schedule-csv torch_schedule.csv   # an action order from torch
"""

from __future__ import annotations

import argparse

from pipeplan.analysis.console import print_simulation
from pipeplan.analysis.outputs import add_force_argument, output_folder, scenario_title, write_simulation
from pipeplan.sim.config import load_scenario
from pipeplan.sim.schedules import schedule_names
from pipeplan.solver.step import simulate_with_memory_policy

VIRTUAL_STAGES_HELP = (
    "chunks per rank (default: the scenario's when the schedule takes it, else the schedule's own: 2 for zbv, "
    "v-half, interleaved-1f1b, chronos; 1 for the others)"
)


def add_scenario_argument(parser: argparse.ArgumentParser, default: str = "llama3-8b-pp4-h100") -> None:
    """The SCENARIO positional; `default` is the shipped scenario the command uses without one."""
    parser.add_argument("scenario", nargs="?", default=None,
                        help=f"scenario TOML or a shipped scenario's name (pipeplan scenarios); default: {default}")
    parser.set_defaults(default_scenario=default)  # what pipeplan.json records when no SCENARIO is given


def add_schedule_arguments(parser: argparse.ArgumentParser, default_scenario: str = "llama3-8b-pp4-h100") -> None:
    """The scenario, and the flags that replace its schedule (read back by `scenario_overrides`)."""
    add_scenario_argument(parser, default_scenario)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--schedule", help=f"override pipeline.schedule ({', '.join(schedule_names())})")
    group.add_argument("--schedule-csv", help="run this action order (torch action-string CSV, one row per rank)")
    parser.add_argument("--virtual-stages", type=int, help=VIRTUAL_STAGES_HELP)
    add_set_argument(parser)


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any scenario key, TOML value (repeatable), e.g. "
                             "--set memory.offload_activations=0.5 --set memory.optimizer=dram")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)
    parser.add_argument("--out", default="out/simulate", help="output folder (default: out/simulate)")
    add_force_argument(parser)


def scenario_overrides(args: argparse.Namespace) -> dict[str, object]:
    """Flags that replace scenario keys: --set KEY=VALUE, then --schedule and --virtual-stages."""
    from pipeplan.analysis.sweep import parse_scalar
    from pipeplan.sim.errors import PipeplanError

    out: dict[str, object] = {}
    for item in getattr(args, "set", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise PipeplanError(f"--set {item!r}: expected KEY=VALUE, e.g. memory.offload_activations=0.5")
        out[key.strip()] = parse_scalar(value.strip())
    if getattr(args, "schedule", None) is not None:
        if not args.schedule.strip():
            raise PipeplanError("--schedule: empty; give a schedule name, e.g. 1f1b")
        out["pipeline.schedule"] = args.schedule
    if getattr(args, "virtual_stages", None) is not None:
        out["pipeline.virtual_stages"] = args.virtual_stages
    return out


def run(args: argparse.Namespace) -> int:
    overrides = scenario_overrides(args)
    scenario = load_scenario(args.scenario, overrides)
    result, extra = simulate_with_memory_policy(scenario, args.schedule_csv)
    title = f"{scenario_title(scenario, args.scenario)} - {result.schedule.name}: p={result.schedule.num_ranks} " \
            f"m={result.schedule.num_microbatches} v={result.schedule.virtual_stages}"
    with output_folder(args) as stage:
        summary = write_simulation(result, stage, title, extra)
    print_simulation(summary, title)
    print(f"wrote {args.out}/: summary.json timeline.csv memory.csv schedule.csv trace.json gantt.png memory.png")
    return 0
