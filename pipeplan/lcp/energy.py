"""Energy counters for the benchmark: NVML on CUDA, RAPL on CPU; None where neither can be read.

Both are cumulative hardware counters read before and after a timed region; nothing is estimated.
NVML: nvmlDeviceGetTotalEnergyConsumption (millijoules since driver load, Volta and newer) of the card
found by its UUID or PCI bus id (never torch's index), through pynvml when importable, else ctypes.
RAPL: /sys/class/powercap/intel-rapl:N/energy_uj (package domains, microjoules, wrapping at
max_energy_range_uj); usually readable only by root.
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


def gpu_identity(device: torch.device) -> tuple[str | None, str | None]:
    """(UUID as NVML spells it, "GPU-..."; PCI bus id "DDDDDDDD:BB:DD.0") of a CUDA device, as torch sees it.

    torch's index counts only the cards CUDA_VISIBLE_DEVICES shows, in its order, while NVML's index counts
    every card on the machine: the two differ under CUDA_VISIBLE_DEVICES (or CUDA_DEVICE_ORDER unset), so
    the meter finds its card by these instead."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    uuid = None if uuid is None else str(uuid) if str(uuid).startswith("GPU-") else f"GPU-{uuid}"
    parts = [getattr(props, f"pci_{f}_id", None) for f in ("domain", "bus", "device")]
    bus = None if None in parts else f"{parts[0]:08X}:{parts[1]:02X}:{parts[2]:02X}.0"
    return uuid, bus


def _nvml_meter(uuid: str | None, bus: str | None) -> EnergyMeter | None:
    """NVML's energy counter of the card with this UUID, else this PCI bus id; None when neither is found."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        ways = ((uuid, pynvml.nvmlDeviceGetHandleByUUID), (bus, pynvml.nvmlDeviceGetHandleByPciBusId_v2))
        for key, get in ways:
            if key is None:
                continue
            try:
                handle = get(key)
            except pynvml.NVMLError:  # not found this way: try the other key
                continue
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            return EnergyMeter("nvml", lambda h=handle: pynvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1e3)
        return None
    except Exception:  # pynvml absent, or this GPU lacks the counter: try ctypes next
        pass
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
        handle = ctypes.c_void_p()
        found = (uuid is not None and lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)) == 0) or (
            bus is not None and lib.nvmlDeviceGetHandleByPciBusId_v2(bus.encode(), ctypes.byref(handle)) == 0
        )
        if not found:
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
        return _nvml_meter(*gpu_identity(device))
    if device.type == "cpu":
        return _rapl_meter()
    return None
