"""`pipeplan profile`: measure what each chunk costs on the hardware at hand, as an explicit-costs scenario.

The job trains for a few steps with the scenario's own schedule, under the same launcher, the same number
of processes and the same threads as `pipeplan run`, so the per-action times include whatever the machine
does when all ranks run at once (on a CPU with fewer cores than ranks, time-sharing). Every full backward
runs as I then W back to back, so one run gives F, I and W per chunk; the saved-activation meter gives
activation bytes; a ping-pong between neighbouring ranks gives p2p_s. Medians over the steady steps
(runtime/report.py) go into `scenario.toml`, which `pipeplan simulate` reads like any other scenario.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from pipeplan.runtime.p2p import shares_gpus

PING_PONGS = 20


def measure_p2p(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, rank: int,
                world: int) -> float | None:
    """One-way time of one activation between ranks r and r+1 (half a ping-pong round trip, median); ranks
    that share GPUs stage it through host memory, as their pipeline does (runtime/p2p.py)."""
    staged = shares_gpus(device)
    buf = torch.zeros(shape, dtype=dtype, device="cpu" if staged else device)
    on_device = torch.zeros(shape, dtype=dtype, device=device)
    samples = []
    for even in (True, False):  # pairs (0,1), (2,3), ... then (1,2), (3,4), ...
        first = rank - rank % 2 if even else rank - (rank + 1) % 2
        peer = first + 1 if rank == first else first
        active = first >= 0 and first + 1 < world and rank in (first, first + 1)
        dist.barrier()
        if not active:
            continue
        for _ in range(PING_PONGS):
            t0 = time.perf_counter()
            if rank == first:
                _send(buf, on_device, peer, staged)
                _recv(buf, on_device, peer, staged)
            else:
                _recv(buf, on_device, peer, staged)
                _send(buf, on_device, peer, staged)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append((time.perf_counter() - t0) / 2)
    dist.barrier()
    return statistics.median(samples) if samples else None


def _send(buf: torch.Tensor, on_device: torch.Tensor, peer: int, staged: bool) -> None:
    if staged:
        buf.copy_(on_device)
    dist.send(buf, peer)


def _recv(buf: torch.Tensor, on_device: torch.Tensor, peer: int, staged: bool) -> None:
    dist.recv(buf, peer)
    if staged:
        on_device.copy_(buf)
