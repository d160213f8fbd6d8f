"""`pipeplan scenarios`: the shipped scenarios, each usable by name wherever a scenario is read.

    pipeplan scenarios
    pipeplan simulate llama3-8b-pp4-h100
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from pipeplan.analysis.console import console
    from pipeplan.analysis.outputs import device_label
    from pipeplan.scenarios import scenario_description, scenario_names
    from pipeplan.sim.config import load_scenario

    t = Table(title="shipped scenarios (give the name to any command, e.g. pipeplan show tiny-cpu)",
              header_style="bold")
    for col in ("name", "model", "pipeline", "device", "description"):
        t.add_column(col)
    for name in scenario_names():
        sc = load_scenario(name)
        p = sc.pipeline
        model = f"{sc.model.name}, {sc.model.layers} layers" if sc.model is not None else "explicit costs"
        par = f" x tp{sc.parallel.tp}" if sc.parallel.tp > 1 else ""
        par += f" x dp{sc.parallel.dp}" if sc.parallel.dp > 1 else ""
        device = device_label(sc) + par if sc.model is not None else "-"
        t.add_row(name, model, f"{p.schedule} p={p.stages} v={p.virtual_stages} m={p.microbatches}", device,
                  scenario_description(name))
    console.print(t)
    return 0
