"""`pipeplan capacity`: per memory policy, the deepest model of the scenario's width that fits, and its speed."""

from __future__ import annotations

import argparse

from analysis.commands.simulate import add_scenario_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from analysis.capacity import POLICIES

    add_scenario_argument(parser)
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated policies (default: all): " + ", ".join(POLICIES))
    parser.add_argument("--target-ratio", type=float, default=2.4,
                        help="also test each policy at this multiple of plain 1F1B's max depth (default: 2.4)")
    parser.add_argument("--out", default="out/capacity", help="output folder (default: out/capacity)")


def run(args: argparse.Namespace) -> int:
    import pandas as pd
    from rich.progress import Progress

    from analysis.capacity import capacity_table
    from analysis.capacity_plots import capacity_plot, print_capacity
    from common.io import atomic_write_text, staged_output

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    with Progress(transient=True) as bar:
        task = bar.add_task("capacity", total=len(policies))

        def step(name: str) -> None:
            bar.update(task, advance=0 if bar.tasks[0].completed == 0 and name == policies[0] else 1,
                       description=f"capacity: {name}")

        rows = capacity_table(args.scenario, policies, progress=step, target_ratio=args.target_ratio)
        bar.update(task, completed=len(policies))
    df = pd.DataFrame(rows)
    with staged_output(args.out) as stage:
        atomic_write_text(stage / "capacity.csv", df.to_csv(index=False))
        capacity_plot(df, stage / "capacity.png")
    print_capacity(df)
    print(f"wrote {args.out}/: capacity.csv capacity.png")
    return 0
