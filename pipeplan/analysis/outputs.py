"""Output folders: whose they are (the manifest), how they are swapped in, and the outputs of one simulated
step (used by simulate, plan, capacity)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from pipeplan.analysis.chrome_trace import chrome_trace
from pipeplan.analysis.plots import gantt, memory_plot
from pipeplan.analysis.version import pipeplan_version
from pipeplan.common.io import atomic_write_json, atomic_write_text, staged_output
from pipeplan.sim.config import Scenario
from pipeplan.sim.engine import SimResult
from pipeplan.sim.errors import PipeplanError
from pipeplan.sim.trace import memory_frame, simulation_summary, timeline_frame


def scenario_title(sc: Scenario, source: str | None = None, count: bool = True) -> str:
    """What a figure is about: 'llama3-8b on 4 x H100-SXM-80GB' (model, GPUs, device; `count=False` leaves out
    the GPUs, for sweeps that vary them), or the scenario's file name for explicit costs."""
    if sc.model is None:
        from pipeplan.sim.config import resolve_scenario_path

        return f"{resolve_scenario_path(source).stem} (explicit costs)"
    gpus = sc.pipeline.stages * sc.parallel.tp * sc.parallel.dp
    return f"{sc.model.name} on {f'{gpus} x ' if count else ''}{device_label(sc)}"


def device_label(sc: Scenario) -> str:
    """The device preset's name, or "custom device (from PRESET)" when the [device] table overrides any of its
    figures (tiny-cpu's 4 GiB, 0.1 TFLOP/s "H100" is a CPU core, not an H100)."""
    custom = any(v is not None for k, v in sc.device.model_dump().items() if k != "preset")
    return f"custom device (from {sc.device.preset})" if custom else sc.device.preset


def write_simulation(result: SimResult, folder: Path, title: str, extra: dict[str, Any] | None = None) -> dict:
    """summary.json, timeline.csv, memory.csv, schedule.csv, trace.json, gantt.png, memory.png."""
    folder.mkdir(parents=True, exist_ok=True)
    summary = simulation_summary(result) | (extra or {})
    check_finite(summary)
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


def add_force_argument(parser: argparse.ArgumentParser) -> None:
    """--force: replace an --out folder that holds another command's outputs (or files pipeplan did not write)."""
    parser.add_argument("--force", action="store_true",
                        help="replace --out even if it holds another command's outputs (as a whole)")


def command_name(args: argparse.Namespace) -> str:
    """'simulate', 'plan', 'bench sim', ...: the writer recorded in an output folder's manifest."""
    sub = getattr(args, "bench", None) or getattr(args, "lcp_command", None)
    return f"{args.command} {sub}" if sub else str(args.command)


def manifest(args: argparse.Namespace) -> dict[str, Any]:
    """pipeplan.json: the command, scenario and pipeplan version that wrote a folder."""
    scenario = getattr(args, "scenario", None) or getattr(args, "default_scenario", None)
    return {"command": command_name(args), "scenario": None if scenario is None else str(scenario),
            "pipeplan_version": pipeplan_version()}


def output_folder(args: argparse.Namespace, out: str | Path | None = None) -> AbstractContextManager[Path]:
    """`staged_output` for this command's --out (or `out`), with its manifest and --force."""
    return staged_output(args.out if out is None else out, manifest(args), bool(getattr(args, "force", False)))


def check_finite(summary: dict[str, Any]) -> None:
    """Refuse a result with an infinite or NaN number (inputs so large that the arithmetic overflowed)."""
    bad = next((k for k, v in _numbers(summary) if not math.isfinite(v)), None)
    if bad is not None:
        raise PipeplanError(
            f"result {bad}: is not a finite number; costs or sizes this large overflow (see docs/reliability.md)"
        )


def _numbers(obj: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    if isinstance(obj, float):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _numbers(v, f"{prefix}[{i}]")
