"""Energy counters for the benchmark: NVML on CUDA, RAPL on CPU; None where neither can be read.

Both are cumulative hardware counters read before and after a timed region; nothing is estimated.
NVML: nvmlDeviceGetTotalEnergyConsumption (millijoules since driver load, Volta and newer), through
pynvml when importable, else ctypes. RAPL: /sys/class/powercap/intel-rapl:N/energy_uj (package domains,
microjoules, wrapping at max_energy_range_uj); usually readable only by root.
"""

from __future__ import annotations

import ctypes
import glob
import os
from collections.abc import Callable
from pathlib import Path

import torch


class EnergyMeter:
    """Reads a cumulative energy counter in joules; `name` says which."""

    def __init__(self, name: str, read: Callable[[], float]) -> None:
        self.name, self._read = name, read

    def joules(self) -> float:
        return self._read()


def _nvml_meter(index: int) -> EnergyMeter | None:
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        return EnergyMeter("nvml", lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3)
    except Exception:  # pynvml absent, or this GPU lacks the counter: try ctypes next
        pass
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
            return None
        mj = ctypes.c_ulonglong()

        def read() -> float:
            if lib.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(mj)) != 0:
                raise OSError("nvmlDeviceGetTotalEnergyConsumption failed")
            return mj.value / 1e3

        read()
        return EnergyMeter("nvml", read)
    except (OSError, AttributeError):
        return None


def _rapl_meter(root: str = "/sys/class/powercap") -> EnergyMeter | None:
    domains = [Path(p) for p in sorted(glob.glob(f"{root}/intel-rapl:*")) if p.count(":") == 1]
    readable = [d for d in domains if os.access(d / "energy_uj", os.R_OK)]
    if not readable:
        return None
    try:
        ranges = [int((d / "max_energy_range_uj").read_text()) for d in readable]
        last = [int((d / "energy_uj").read_text()) for d in readable]
    except (OSError, ValueError):
        return None
    total = [0.0]

    def read() -> float:
        for i, d in enumerate(readable):  # accumulate deltas so counter wrap-around is harmless
            now = int((d / "energy_uj").read_text())
            total[0] += ((now - last[i]) % ranges[i]) / 1e6
            last[i] = now
        return total[0]

    return EnergyMeter("rapl", read)


def open_meter(device: torch.device) -> EnergyMeter | None:
    """The energy meter for `device`, or None when no counter is readable here."""
    if device.type == "cuda":
        return _nvml_meter(device.index if device.index is not None else torch.cuda.current_device())
    if device.type == "cpu":
        return _rapl_meter()
    return None
