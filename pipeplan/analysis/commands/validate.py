"""`pipeplan validate`: predict every published measurement of the validation set and report the errors.

    pipeplan validate                          # the shipped set: scenarios/validation/published.csv
    pipeplan validate --published my.csv       # another set (scenario paths relative to that file)
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--published", default=None, metavar="CSV",
                        help="published figures (default: scenarios/validation/published.csv); its scenario "
                             "column names TOML files next to it")
    parser.add_argument("--out", default="out/validate", help="output folder (default: out/validate)")
    from pipeplan.analysis.outputs import add_force_argument

    add_force_argument(parser)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import pandas as pd

    from pipeplan.analysis.console import transient_bar
    from pipeplan.analysis.outputs import output_folder
    from pipeplan.analysis.validation import (
        OUTPUT_COLUMNS,
        PUBLISHED_CSV,
        load_published,
        predict_all,
        summarize,
        validation_table,
    )
    from pipeplan.analysis.validation_plots import parity_plot, print_ranking, print_summary
    from pipeplan.analysis.validation_ranking import FIT_COLUMNS, fit_table, rank_groups, ranking_frame
    from pipeplan.common.io import atomic_write_text, csv_text

    if args.published is not None and not args.published.strip():  # '' is a mistake, not "the default set"
        from pipeplan.sim.errors import PipeplanError

        raise PipeplanError("--published: empty path; give a CSV file, or leave the flag out for the shipped set")
    path = Path(args.published) if args.published else PUBLISHED_CSV
    figures = load_published(path)  # bad input is one line, before any progress bar
    with transient_bar() as bar:
        task = bar.add_task("validate", total=None)

        def step(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=f"validate: {what[:60]}")

        predictions = predict_all(figures, folder=path.parent, progress=step)
    table = pd.DataFrame(validation_table(predictions), columns=list(OUTPUT_COLUMNS))
    rankings, fits = rank_groups(predictions), fit_table(predictions)
    with output_folder(args) as stage:
        atomic_write_text(stage / "validation.csv", csv_text(table))
        atomic_write_text(stage / "ranking.csv", csv_text(ranking_frame(rankings)))
        atomic_write_text(stage / "fits.csv", csv_text(pd.DataFrame(fits.rows, columns=list(FIT_COLUMNS))))
        parity_plot(predictions, stage / "parity.png")
    print_summary(summarize(predictions), predictions)
    print_ranking(rankings, fits)
    print(f"wrote {args.out}/: validation.csv ranking.csv fits.csv parity.png")
    return 0
