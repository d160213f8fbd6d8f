"""Sizes checked before work starts: what this machine can hold, and refusals that name the field.

Every allocation that grows with user input (rows, queries, k, file sizes) is compared with the memory
available now (MemAvailable from /proc/meminfo), so a bad flag or a forged file is refused in one line
instead of swapping, being killed, or reading forever.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

import torch

from pipeplan.common.units import GIB
from pipeplan.lcp.errors import LCPError


def available_bytes() -> int:
    """Host memory available now (MemAvailable), or the free pages where /proc/meminfo is absent."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"]
    except (OSError, KeyError, ValueError, IndexError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def check_fits(what: str, need_bytes: int, fraction: float = 0.8) -> None:
    """LCPError naming `what` when `need_bytes` exceed `fraction` of the available host memory."""
    have = int(available_bytes() * fraction)
    if need_bytes > have:
        raise LCPError(f"{what} needs about {gib(need_bytes)}, more than the {gib(have)} this machine can spare now")


def check_results(batch: int, k: int) -> None:
    """Refuse a top-k whose results alone (lcps and ids, int64 [batch, k]) would not fit in memory."""
    if batch * k > 1 << 24:  # below 256 MiB of results nothing is worth a look at /proc/meminfo
        check_fits(f"k = {k} for {batch} queries (results: 2 × {batch} × {k} int64)", 16 * batch * k)


def check_device_fits(what: str, need_bytes: int, device: torch.device, fraction: float = 0.9) -> None:
    """check_fits for a CUDA device: its free memory now (cudaMemGetInfo, which sees every process on the
    card, not only this one's allocator), refused in one line naming `what` and the bytes needed; host
    memory for a CPU device."""
    if device.type != "cuda":
        check_fits(what, need_bytes)
        return
    free, total = torch.cuda.mem_get_info(device)
    if need_bytes > int(free * fraction):
        raise LCPError(
            f"{what} needs about {gib(need_bytes)} on {device}, more than the {gib(free * fraction)} free there "
            f"now ({gib(total)} in all)"
        )


def trim_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere). A build's
    temporaries (sort keys, the tree's merge columns) are freed into malloc's heap, which keeps them
    mapped; the arrays moved into fresh mappings next would otherwise add to them: measured, the build's
    peak at L = 32 fell from 3.5x to 2.5x the raw rows (tests/test_lcp_travel.py)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
