"""Checkpoint and resume: each rank saves its chunks, optimizer, freezer, step, RNG and measured history.

    DIR/step-000004/rank-0.pt ... rank-{p-1}.pt     one file per rank, written atomically
    DIR/latest                                      "4": written by rank 0 once every rank has saved

A checkpoint is complete only when `latest` names it, so a job killed mid-save resumes from the previous
one. Data is a function of (seed, step), so resuming at step k reads what the uninterrupted run read, and a
resumed run reproduces the uninterrupted run's losses exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from sim.errors import PipeplanError


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def save(root: str | Path, step: int, rank: int, state: dict) -> None:
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{rank}.pt"
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    dist.barrier()
    if rank == 0:
        latest = Path(root) / "latest"
        tmp_latest = latest.with_suffix(".tmp")
        tmp_latest.write_text(f"{step}\n")
        os.replace(tmp_latest, latest)
    dist.barrier()


def latest_step(root: str | Path) -> int:
    marker = Path(root) / "latest"
    if not marker.exists():
        raise PipeplanError(f"--resume: no complete checkpoint in {root} (no 'latest' file)")
    return int(marker.read_text().strip())


def load(root: str | Path, rank: int, device: torch.device) -> dict:
    path = step_dir(root, latest_step(root)) / f"rank-{rank}.pt"
    if not path.exists():
        raise PipeplanError(f"--resume: {path} is missing; was the checkpoint written with this many ranks?")
    return torch.load(path, map_location=device, weights_only=False)
