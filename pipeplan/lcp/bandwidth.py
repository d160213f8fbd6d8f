"""A STREAM-like measurement of what one thread (or the GPU) can move: the ceiling for bytes per query.

Two kernels over arrays much larger than any cache (256 MiB by default): *read* (sum of an int64 array,
bytes read / time) and *copy* (y <- x, counted as read + write, as STREAM's Copy counts it). Each is the
median of `repeats` timed runs after one warm-up run, in process CPU time on the CPU (as the bench's
latencies are) and in synchronised wall time on CUDA, where the same kernels run on the device.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Bandwidth:
    """Measured memory bandwidth of this device and thread count, in GB/s (10^9 bytes per second)."""

    read_gbps: float
    copy_gbps: float
    nbytes: int  # size of one array


def measure_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> Bandwidth:
    x = torch.ones(nbytes // 8, dtype=torch.int64, device=device)
    y = torch.empty_like(x)

    now = time.process_time if device.type == "cpu" else time.perf_counter

    def timed(fn: object) -> float:
        times = []
        for i in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = now()
            fn()  # type: ignore[operator]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:  # the first run warms pages and caches
                times.append(now() - t0)
        return statistics.median(times)

    read = timed(lambda: x.sum())
    copy = timed(lambda: y.copy_(x))
    return Bandwidth(read_gbps=x.nbytes / read / 1e9, copy_gbps=2 * x.nbytes / copy / 1e9, nbytes=x.nbytes)
