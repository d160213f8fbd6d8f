"""`pipeplan capacity`: per memory policy, the deepest model of the scenario's width that fits, and its speed.

    pipeplan capacity llama2-70b-48l-pp8-tp8-a100               # the ChronosPipe setting, every policy (~35 min)
    pipeplan capacity llama2-70b-48l-pp8-tp8-a100 --frontier --min-throughput 0.95   # ~65 min on 2 cores
    pipeplan capacity --policies 1f1b,zbv --set training.micro_batch_size=2 --out out/cap-mbs2   # seconds
    pipeplan capacity --policies 1f1b,1f1b+recompute,zbv --micro-batch-sizes 4,2,1 --frontier   # same global batch
    pipeplan capacity llama2-70b-48l-pp8-tp8-a100 --interleaved-v 2,3,4,6   # + v = 6: minutes more per deep depth

Stopped part-way (Ctrl-C, a crash), the same command resumes from --out's evaluations.jsonl.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pipeplan.analysis.commands.simulate import add_scenario_argument, add_set_argument, scenario_overrides

if TYPE_CHECKING:
    from pipeplan.analysis.capacity_journal import Journal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipeplan.analysis.outputs import add_force_argument
    from pipeplan.solver.capacity import DEFAULT_POLICIES, INTERLEAVED_V, POLICIES

    add_scenario_argument(parser)
    add_set_argument(parser)
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help="comma-separated policies (default: all but "
                        + ", ".join(sorted(set(POLICIES) - set(DEFAULT_POLICIES))) + "): " + ", ".join(POLICIES))
    parser.add_argument("--target-ratio", type=float, default=2.4,
                        help="also test each policy at this multiple of plain 1F1B's max depth (default: 2.4)")
    parser.add_argument("--frontier", action="store_true",
                        help="also trace depth against speed per policy, from 1F1B's deepest fit to the policy's: "
                             "frontier.csv, frontier.png, and the deepest model at >= --min-throughput "
                             "(on the console and in frontier_answers.csv)")
    parser.add_argument("--min-throughput", type=float, default=0.95,
                        help="with --frontier: per-layer throughput relative to plain 1F1B at its deepest fit "
                             "that the answer must keep (default: 0.95)")
    parser.add_argument("--points", type=int, default=24,
                        help="with --frontier: depths per policy at most, log-spaced (default: 24)")
    parser.add_argument("--micro-batch-sizes", default="",
                        help="comma-separated micro-batch sizes (sequences) every policy, plain 1F1B's reference "
                             "included, may choose from per depth, the global batch (micro_batch_size x "
                             "microbatches) fixed: the fastest that fits wins (default: the scenario's size)")
    parser.add_argument("--interleaved-v", default=",".join(map(str, INTERLEAVED_V)),
                        help="comma-separated chunks per rank of the interleaved 1F1B orders the chronos policies "
                             "also try (default: " + ",".join(map(str, INTERLEAVED_V)) + "; 6 plans faster at some "
                             "depths, but its MILP takes minutes at others: docs/memory.md)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="worker processes: each policy's depth search in one, the target and frontier depths "
                             "spread over all; the same answer as --jobs 1 (default: this machine's CPUs)")
    parser.add_argument("--out", default="out/capacity",
                        help="output folder (default: out/capacity); every depth evaluated is kept in its "
                             "evaluations.jsonl as it finishes, and the same command run again resumes from it")
    add_force_argument(parser)


def run(args: argparse.Namespace) -> int:
    import pandas as pd

    from pipeplan.analysis.capacity import (
        ANSWER_COLUMNS,
        FRONTIER_COLUMNS,
        answer_rows,
        capacity_table,
        deepest_at,
        frontier_table,
    )
    from pipeplan.analysis.capacity_journal import JOURNAL
    from pipeplan.analysis.capacity_plots import capacity_plot, frontier_plot, print_capacity, print_frontier
    from pipeplan.analysis.console import transient_bar
    from pipeplan.analysis.outputs import output_folder, scenario_title
    from pipeplan.common.io import atomic_write_text, csv_text
    from pipeplan.sim.errors import ScenarioError
    from pipeplan.sim.limits import MAX_JOBS
    from pipeplan.solver.capacity import PolicyDepths, checked_scenario

    if not 0 < args.min_throughput <= 10 or args.min_throughput != args.min_throughput:
        raise ScenarioError(f"--min-throughput: {args.min_throughput} must be in (0, 10] (1.0 = plain 1F1B's)")
    if not 2 <= args.points <= 256:
        raise ScenarioError(f"--points: {args.points} must be from 2 to 256")
    if not 0 < args.target_ratio <= 1000:  # NaN fails too
        raise ScenarioError(f"--target-ratio: {args.target_ratio}; give a multiple of 1F1B's depth in (0, 1000]")
    if not 1 <= args.jobs <= MAX_JOBS:
        raise ScenarioError(f"--jobs: {args.jobs}; must be 1..{MAX_JOBS}")
    policies = list(dict.fromkeys(p.strip() for p in args.policies.split(",") if p.strip()))  # once each
    sizes = parse_sizes(args.micro_batch_sizes)
    interleaved_v = parse_interleaved_v(args.interleaved_v)
    if args.frontier and "1f1b" not in policies:
        policies.insert(0, "1f1b")  # the reference every frontier row is measured against
    base = checked_scenario(args.scenario, policies, scenario_overrides(args))  # one line, before any work
    depths: dict[str, PolicyDepths] = {}
    journal = open_journal(args)
    try:
        with transient_bar() as bar:
            task = bar.add_task("capacity", total=len(policies) * (2 if args.frontier else 1))

            def step(name: str) -> None:
                bar.update(task, advance=1, description=f"capacity: {name}")

            def detail(what: str) -> None:  # every depth evaluated: the MILP policies take seconds per depth
                bar.update(task, description=f"capacity: {what}")

            rows = capacity_table(args.scenario, policies, progress=step, target_ratio=args.target_ratio,
                                  depths=depths, overrides=scenario_overrides(args), detail=detail, jobs=args.jobs,
                                  micro_batch_sizes=sizes, journal=journal, interleaved_v=interleaved_v)
            frontier = (frontier_table(rows, depths, args.points, progress=step, jobs=args.jobs, detail=detail)
                        if args.frontier else None)
            if frontier is not None:  # the bisection towards each answer evaluates depths too
                ref = next(r for r in rows if r["policy"] == "1f1b")
                answers = {p: deepest_at(frontier, depths[p], args.min_throughput, ref["layer_tokens_per_s"])
                           for p in policies}
    except KeyboardInterrupt:
        kept = f"the depths evaluated are kept in {journal.path}; run the same command again to resume" \
            if journal.live and journal.path.is_file() else "nothing was written"
        print(f"pipeplan capacity: interrupted; {kept}", file=sys.stderr)
        return 130
    resumed = sum(d.resumed for d in depths.values())
    if resumed:
        print(f"resumed {resumed} evaluation(s) from {journal.path}")
    if journal.damaged:
        print(f"warning: {journal.damage_report()}", file=sys.stderr)
    df = pd.DataFrame(rows)
    written = ["capacity.csv", "capacity.png", JOURNAL]
    with output_folder(args) as stage:
        journal.write_to(stage)
        atomic_write_text(stage / "capacity.csv", csv_text(df))
        capacity_plot(df, stage / "capacity.png",
                      scenario_title(base, args.scenario))
        if frontier is not None:
            fdf = pd.DataFrame(frontier, columns=FRONTIER_COLUMNS)
            atomic_write_text(stage / "frontier.csv", fdf.to_csv(index=False))
            adf = pd.DataFrame(answer_rows(answers, args.min_throughput, ref["max_layers"]), columns=ANSWER_COLUMNS)
            adf = adf.astype({"layers": "Int64", "micro_batch_size": "Int64"})  # whole numbers, empty where none
            atomic_write_text(stage / "frontier_answers.csv", csv_text(adf))
            frontier_plot(fdf, answers, args.min_throughput, stage / "frontier.png")
            written += ["frontier.csv", "frontier_answers.csv", "frontier.png"]
    print_capacity(df)
    if frontier is not None:
        print_frontier(df, answers, args.min_throughput)
    print(f"wrote {args.out}/: {' '.join(written)}")
    return 0


def parse_sizes(text: str) -> tuple[int, ...]:
    """`--micro-batch-sizes 4,2,1` as positive ints, in the order given (the planner prunes by the first)."""
    from pipeplan.sim.errors import ScenarioError

    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not all(t.isdigit() and int(t) > 0 for t in parts):
        raise ScenarioError(f"--micro-batch-sizes: {text!r}; give positive integers separated by commas, e.g. 4,2,1")
    return tuple(dict.fromkeys(int(t) for t in parts))


MAX_INTERLEAVED_V = 32


def parse_interleaved_v(text: str) -> tuple[int, ...]:
    """`--interleaved-v 2,3,4,6` as ints from 2 to MAX_INTERLEAVED_V, in ascending order (empty: none)."""
    from pipeplan.sim.errors import ScenarioError

    parts = [t.strip() for t in text.split(",") if t.strip()]
    if not all(t.isdigit() and 2 <= int(t) <= MAX_INTERLEAVED_V for t in parts):
        raise ScenarioError(f"--interleaved-v: {text!r}; give chunks per rank from 2 to {MAX_INTERLEAVED_V} "
                            "separated by commas, e.g. 2,3,4,6")
    return tuple(sorted({int(t) for t in parts}))


def open_journal(args: argparse.Namespace) -> Journal:
    """The evaluations journal in --out: live (appended as the run goes, read to resume) when the folder is absent,
    empty or capacity's own; held in memory until the end when --force replaces another command's folder."""
    from pipeplan.analysis.capacity_journal import Journal
    from pipeplan.analysis.outputs import command_name, manifest
    from pipeplan.common.io import OutputPathError, check_folder_owner

    out = Path(args.out)
    try:
        check_folder_owner(out, command_name(args), force=False)
        ours = True
    except OutputPathError:  # only with --force (main refused it before): replaced as a whole at the end
        ours = False
    return Journal(out, manifest(args), live=ours).check()
