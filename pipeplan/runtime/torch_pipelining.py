"""The same chunks and schedule through torch.distributed.pipelining: a cross-check of the executor.

Two ways in, both with torch's `PipelineStage` wrapping our chunks:

    own     torch's own schedule class for the name (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble for zb-h1, ScheduleZBVZeroBubble for zbv)
    csv     `_PipelineScheduleRuntime` loading our schedule.csv through `_load_csv`: torch lowers our action
            order (adds its sends and receives) and runs it with its own stage and P2P code

Both take the whole step's batch, split it into microbatches along dim 0 and scale gradients by 1/m, which
is what our executor does with loss / m.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from pipeplan.runtime.model import cross_entropy
from pipeplan.sim.ir import Schedule

TORCH_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}


def build_torch_schedule(schedule: Schedule, chunks: Mapping[int, nn.Module], device: torch.device,
                         how: str = "csv"):
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as ts

    stages = [PipelineStage(chunks[s], s, schedule.num_stages, device) for s in sorted(chunks)]
    m = schedule.num_microbatches
    if how == "own":
        cls = getattr(ts, TORCH_CLASSES[schedule.name])
        if issubclass(cls, ts.PipelineScheduleSingle):
            return cls(stages[0], n_microbatches=m, loss_fn=cross_entropy)
        return cls(stages, n_microbatches=m, loss_fn=cross_entropy)
    runtime = ts._PipelineScheduleRuntime(stages, n_microbatches=m, loss_fn=cross_entropy)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "schedule.csv"
        path.write_text(schedule.to_csv_text())
        runtime._load_csv(str(path))
    return runtime


def torch_step(torch_schedule, schedule: Schedule, stages: Sequence[int],
               batches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None, device: torch.device) -> list[float]:
    """One step through torch's schedule; the per-microbatch losses on the rank holding the last stage."""
    last = schedule.num_stages - 1
    inputs = target = None
    if 0 in stages or last in stages:
        assert batches is not None  # the ranks holding the first or the last stage are given the data
        inputs = torch.cat([b[0] for b in batches]).to(device) if 0 in stages else None
        target = torch.cat([b[1] for b in batches]).to(device) if last in stages else None
    losses: list[torch.Tensor] = []
    if inputs is not None:
        torch_schedule.step(inputs, target=target, losses=losses)
    else:
        torch_schedule.step(target=target, losses=losses)
    return [float(x.detach()) for x in losses]
