"""Write the full set of outputs of one simulated step into a folder (used by simulate, plan, capacity)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from analysis.chrome_trace import chrome_trace
from analysis.plots import gantt, memory_plot
from common.io import atomic_write_json, atomic_write_text
from sim.config import Scenario
from sim.engine import SimResult
from sim.trace import memory_frame, simulation_summary, timeline_frame


def scenario_title(sc: Scenario, source: str | None = None, count: bool = True) -> str:
    """What a figure is about: 'llama3-8b on 4 x H100-SXM-80GB' (model, GPUs, device; `count=False` leaves out
    the GPUs, for sweeps that vary them), or the scenario's file name for explicit costs."""
    if sc.model is None:
        from sim.config import resolve_scenario_path

        return f"{resolve_scenario_path(source).stem} (explicit costs)"
    gpus = sc.pipeline.stages * sc.parallel.tp * sc.parallel.dp
    return f"{sc.model.name} on {f'{gpus} x ' if count else ''}{sc.device.preset}"


def write_simulation(result: SimResult, folder: Path, title: str, extra: dict[str, Any] | None = None) -> dict:
    """summary.json, timeline.csv, memory.csv, schedule.csv, trace.json, gantt.png, memory.png."""
    folder.mkdir(parents=True, exist_ok=True)
    summary = simulation_summary(result) | (extra or {})
    timeline = timeline_frame(result)
    memory = memory_frame(result)
    atomic_write_json(folder / "summary.json", summary)
    atomic_write_text(folder / "timeline.csv", timeline.to_csv(index=False))
    atomic_write_text(folder / "memory.csv", memory.to_csv(index=False))
    atomic_write_text(folder / "schedule.csv", result.schedule.to_csv_text())
    atomic_write_json(folder / "trace.json", chrome_trace(timeline, memory, result.transfers, title, result.copies))
    gantt(timeline, folder / "gantt.png", title)
    cap = result.costs.hbm_bytes
    memory_plot(memory, folder / "memory.png", cap if cap != float("inf") else None, title)
    return summary
