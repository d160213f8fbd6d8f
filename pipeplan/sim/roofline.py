"""Time of one operation on one GPU: a roofline per op, with GEMM efficiency that depends on the GEMM's shape.

    t(op) = max(FLOPs / (peak * efficiency(op)), bytes moved / HBM bandwidth)

GEMMs (M x K) @ (K x N): FLOPs 2MNK, bytes e(MK + KN + MN). Their efficiency is the device's large-GEMM
asymptote `gemm_efficiency` times the wave-quantisation factor: cuBLAS tiles the output into
TILE_M x TILE_N blocks, one per SM at a time, so a GEMM of T tiles runs ceil(T / SMs) full waves and uses
T / (ceil(T / SMs) * SMs) of the SMs (NVIDIA, "Matrix Multiplication Background User's Guide", sections
"Tile Quantization" and "Wave Quantization"). Small GEMMs (few tiles, or small K so that bytes dominate)
therefore run well below the asymptote and large ones approach it: the efficiency rises with GEMM size.
Attention runs as one fused kernel on its own curve (`attention_efficiency`, FlashAttention-2/-3 papers).
Element-wise work (norms, activations, dropout, residual adds, RoPE) is memory-bound: bytes / bandwidth.

A [device] `efficiency` given by the scenario replaces the curve with one flat factor for GEMMs and
attention alike (one calibration per device); the memory-bound terms stay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# cuBLAS' largest bf16 tensor-core tile for big GEMMs on Ampere/Hopper (NVIDIA's GEMM guide uses 256 x 128).
TILE_M, TILE_N = 256, 128


@dataclass(frozen=True)
class DeviceSpec:
    """What op timing needs from a [device] table (sim/devices.toml, overridden by the scenario)."""

    peak_flops: float  # dense bf16/fp16 FLOP/s
    hbm_bps: float
    sm_count: int
    gemm_efficiency: float  # large-GEMM asymptote of achieved / peak
    attention_efficiency: float  # fused attention kernel, achieved / peak
    flat_efficiency: float | None = None  # a scenario's [device] efficiency: replaces both curves
    fp8_peak_flops: float | None = None  # dense FP8 FLOP/s, where the device has FP8 tensor cores

    @classmethod
    def from_resolved(cls, dev: dict[str, float], flat: float | None, fp8: bool = False) -> DeviceSpec:
        fp8_peak = dev["fp8_tflops"] * 1e12 if dev.get("fp8_tflops") else None
        peak = fp8_peak if fp8 and fp8_peak else dev["peak_tflops"] * 1e12
        return cls(
            peak_flops=peak,
            hbm_bps=dev["hbm_gbps"] * 1e9,
            sm_count=int(dev["sm_count"]),
            gemm_efficiency=dev["gemm_efficiency"],
            attention_efficiency=dev["attention_efficiency"],
            flat_efficiency=flat,
            fp8_peak_flops=fp8_peak,
        )

    def fp8(self) -> DeviceSpec:
        """The same device with GEMMs at its dense FP8 rate (the caller checks the device has one)."""
        assert self.fp8_peak_flops is not None, "no FP8 tensor cores on this device"
        return replace(self, peak_flops=self.fp8_peak_flops)


def wave_efficiency(m: float, n: float, sm_count: int, batch: float = 1.0) -> float:
    """Share of SM-time doing useful tiles: T / (ceil(T / SMs) * SMs) for T output tiles (over a batch)."""
    tiles = math.ceil(m / TILE_M) * math.ceil(n / TILE_N) * max(1, math.ceil(batch))
    return tiles / (math.ceil(tiles / sm_count) * sm_count)


def gemm_efficiency(m: float, n: float, dev: DeviceSpec, batch: float = 1.0) -> float:
    if dev.flat_efficiency is not None:
        return dev.flat_efficiency
    return dev.gemm_efficiency * wave_efficiency(m, n, dev.sm_count, batch)


def gemm_s(m: float, n: float, k: float, e: int, dev: DeviceSpec, count: float = 1.0) -> float:
    """A batch of `count` GEMMs of (m x k) @ (k x n) with e-byte operands."""
    if m <= 0 or n <= 0 or k <= 0 or count <= 0:
        return 0.0
    compute = 2 * m * n * k / (dev.peak_flops * gemm_efficiency(m, n, dev, count))
    memory = e * (m * k + k * n + m * n) / dev.hbm_bps
    return count * max(compute, memory)


def attention_s(flops: float, nbytes: float, dev: DeviceSpec) -> float:
    """A fused attention kernel doing `flops` and moving `nbytes`."""
    eff = dev.flat_efficiency if dev.flat_efficiency is not None else dev.attention_efficiency
    return max(flops / (dev.peak_flops * eff), nbytes / dev.hbm_bps)


def memory_bound_s(nbytes: float, dev: DeviceSpec) -> float:
    return nbytes / dev.hbm_bps
