"""`pipeplan sweep`: simulate every combination of a grid of scenario keys; resumable; ranked, plotted.

    pipeplan sweep llama3-8b-pp4-h100 --grid pipeline.schedule=1f1b,zb-h1,zbv --grid pipeline.microbatches=8,16,32
    pipeplan sweep llama3-8b-pp4-h100 --grid pipeline.stages=2,4,8 --set training.micro_batch_size=2
    pipeplan sweep llama3-8b-pp4-h100 --grid pipeline.microbatches=8,16 --scheduler tcp://10.0.0.1:8786
    pipeplan sweep tiny-cpu --grid pipeline.stages=2,4 --grid parallel.dp=1,2 --grid pipeline.microbatches=4,8 \
        --gpus 8 --global-batch 16
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pipeplan.sim.errors import PipeplanError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipeplan.analysis.commands.simulate import add_set_argument

    parser.add_argument("scenario", help="scenario TOML, or a shipped scenario's name, whose keys the grid varies")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="a scenario key and its values, e.g. pipeline.stages=2,4,8 (repeatable)")
    add_set_argument(parser)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help=f"worker processes (default: all cores, here {os.cpu_count() or 1})")
    parser.add_argument("--scheduler", metavar="ADDRESS",
                        help="run on a Dask distributed cluster, e.g. tcp://host:8786 (default: local processes)")
    parser.add_argument("--plan", action="store_true",
                        help="also solve the freeze LP per configuration (on by default when freeze.cap varies)")
    parser.add_argument("--gpus", help="keep only configurations of this many GPUs (stages x tp x dp); a comma "
                        "list allowed, e.g. 64 or 32,64")
    parser.add_argument("--global-batch", type=int,
                        help="keep only configurations of this global batch (microbatches x micro_batch_size x dp)")
    parser.add_argument("--heatmap", metavar="X,Y", help="two grid keys for the heatmap (default: the first two)")
    parser.add_argument("--top", type=int, default=10, help="rows of the ranked table (default: 10)")
    parser.add_argument("--out", default="out/sweep", help="output folder; rerunning resumes (default: out/sweep)")
    parser.add_argument("--force", action="store_true",
                        help="replace --out even if it holds another command's outputs (as a whole)")


def run(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from pipeplan.analysis.commands.simulate import scenario_overrides
    from pipeplan.analysis.console import console
    from pipeplan.analysis.outputs import scenario_title
    from pipeplan.analysis.sweep import parse_grid, run_sweep, validate_grid
    from pipeplan.analysis.sweep_plots import heatmap_plot, pareto_plot, print_invalid, print_ranked
    from pipeplan.sim.limits import MAX_JOBS

    grid = parse_grid(args.grid)
    validate_grid(grid)
    base = scenario_overrides(args)
    if not 1 <= args.jobs <= MAX_JOBS:
        raise PipeplanError(f"--jobs: {args.jobs}; must be 1..{MAX_JOBS}")
    if args.top < 1:
        raise PipeplanError(f"--top: {args.top}; must be >= 1")
    clash = sorted(set(base) & set(grid))
    if clash:
        raise PipeplanError(f"--set {clash[0]}: also a --grid key; give it in one of them")
    axes = [k for k in grid if len(grid[k]) > 1]
    if args.heatmap:
        axes = [a.strip() for a in args.heatmap.split(",")]
        bad = [a for a in axes if a not in grid]
        if len(axes) != 2 or bad:
            raise PipeplanError(f"--heatmap {args.heatmap!r}: name two --grid keys; allowed: {', '.join(grid)}")
    from pipeplan.sim.config import load_scenario

    load_scenario(args.scenario, base)  # bad input is one line, before any progress bar
    if args.scheduler:
        check_scheduler_address(args.scheduler)
    out = Path(args.out)
    claim_sweep_folder(args)
    from pipeplan.analysis.commands.search import parse_gpus

    gpus = set(parse_gpus(args.gpus)) if args.gpus else None
    if args.global_batch is not None and args.global_batch < 1:
        raise PipeplanError(f"--global-batch: {args.global_batch}; must be >= 1")
    with Progress(console=console) as bar:
        task = bar.add_task("sweep" + (f" on {args.scheduler}" if args.scheduler else ""), total=None)
        rows = run_sweep(args.scenario, grid, out, args.jobs, args.plan or "freeze.cap" in grid,
                         progress=lambda done, total: bar.update(task, completed=done, total=total),
                         base=base, scheduler=args.scheduler, gpus=gpus, global_batch=args.global_batch)
    sizes = {"pipeline.stages", "parallel.tp", "parallel.dp"}
    title = scenario_title(load_scenario(args.scenario, base), args.scenario, count=not sizes & set(grid))
    pareto_plot(rows, out / "pareto.png", title)
    if len(axes) >= 2:
        heatmap_plot(rows, axes[0], axes[1], out / "heatmap.png", title)
    print_ranked(rows, list(grid), args.top)
    print_invalid(rows)
    print(f"wrote {out}/: sweep.csv pareto.png" + (" heatmap.png" if len(axes) >= 2 else ""))
    return 0


def claim_sweep_folder(args: argparse.Namespace) -> None:
    """A sweep resumes in its own folder; any other folder (absent, empty, or another command's with --force)
    is replaced as a whole by an empty one holding the sweep's manifest."""
    from pipeplan.analysis.outputs import output_folder
    from pipeplan.common.io import output_manifest

    if (output_manifest(args.out) or {}).get("command") != "sweep":
        with output_folder(args):
            pass


def check_scheduler_address(address: str) -> None:
    """Refuse a malformed --scheduler address before the output folder is claimed. Dask's Client refuses it
    only inside its constructor, whose half-built object then prints a traceback from its __del__."""
    try:
        from distributed.comm.addressing import parse_address, parse_host_port
        from distributed.comm.registry import get_backend
    except ImportError:
        raise PipeplanError("--scheduler: needs Dask distributed; install pipeplan[cluster]") from None
    try:
        scheme, location = parse_address(address)
        get_backend(scheme)
        if scheme != "inproc":  # an in-process address has no host and port
            parse_host_port(location)
    except ValueError as exc:
        raise PipeplanError(f"--scheduler {address}: not a Dask scheduler address ({exc}); "
                            "give SCHEME://HOST:PORT, e.g. tcp://10.0.0.1:8786") from None
    from pipeplan.analysis.sweep import probe_scheduler

    probe_scheduler(address, in_process=False)  # a silent scheduler is refused before the folder is claimed too
