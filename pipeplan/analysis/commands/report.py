"""`pipeplan report DIR`: one readable page (report.html, self-contained, and report.md) from an output folder.

    pipeplan report out/sweep       # the best configuration that fits, what limits it, the ranking
    pipeplan report out/plan        # the freeze plan's speedup and whether it fits
    pipeplan report out/plan-sweep  # plan --sweep-cap: the fastest planned step, speedup per schedule and cap
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="an output folder of simulate, plan, capacity, sweep, run or lcp bench")
    parser.add_argument("--force", action="store_true",
                        help="replace report.html and report.md in the folder even if pipeplan did not write them")


def run(args: argparse.Namespace) -> int:
    from pipeplan.analysis.report import OUTPUTS, render
    from pipeplan.common.io import atomic_write_text, check_file_owner, check_output_file

    folder = Path(args.folder)
    for name, start in OUTPUTS.items():  # both checked before either is written
        path = check_output_file(folder / name, flag="report")
        check_file_owner(path, start.encode(), "a pipeplan report", args.force, flag="report")
    page, md = render(folder)
    atomic_write_text(folder / "report.html", page)
    atomic_write_text(folder / "report.md", md)
    print(f"wrote {folder}/report.html and {folder}/report.md")
    return 0
