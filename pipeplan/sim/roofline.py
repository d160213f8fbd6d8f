"""Time of one operation on one GPU: a roofline per op, with GEMM efficiency that depends on the GEMM's shape.

    t(op) = max(FLOPs / (peak * efficiency(op)), bytes moved / HBM bandwidth)

GEMMs (M x K) @ (K x N): FLOPs 2MNK, bytes e(MK + KN + MN). Their efficiency is the device's large-GEMM
asymptote `gemm_efficiency` times the wave-quantisation factor: cuBLAS tiles the output into
TILE_M x TILE_N blocks, one per SM at a time, so a GEMM of T tiles runs ceil(T / SMs) full waves and uses
T / (ceil(T / SMs) * SMs) of the SMs (NVIDIA, "Matrix Multiplication Background User's Guide", sections
"Tile Quantization" and "Wave Quantization"). Small GEMMs (few tiles, or small K so that bytes dominate)
therefore run well below the asymptote and large ones approach it: the efficiency rises with GEMM size.
Attention runs as one fused kernel on its own curve: the device's `attention_efficiency` (its long-sequence,
head-dim-128 asymptote, FlashAttention-2/-3 papers) times `flash_shape_factor(head_dim, seq_len)`, the published
kernel throughput at that shape over the asymptote's (shorter sequences and smaller heads run slower).
Element-wise work (norms, activations, dropout, residual adds, RoPE) is memory-bound: bytes / bandwidth.

FP8 GEMMs (`DeviceSpec.fp8`) run at the device's dense FP8 rate times `fp8_gemm_ratio`: the share of the bf16
asymptote an FP8 GEMM of the same shape sustains (sim/devices.toml cites the measurement), read 1-byte operands
and write a bf16 output (torch._scaled_mm's out_dtype and Transformer Engine's GEMMs; torchao's float8
roofline, torchao/testing/float8/roofline_utils.py, counts the same bytes). Everything else stays at bf16 rates.

A [device] `efficiency` given by the scenario replaces the curve with one flat factor for GEMMs and
attention alike (one calibration per device); the memory-bound terms stay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# cuBLAS' largest bf16 tensor-core tile for big GEMMs on Ampere/Hopper (NVIDIA's GEMM guide uses 256 x 128).
TILE_M, TILE_N = 256, 128
# The smallest kernel's time on an H100: a one-element Triton kernel measured from the trace (torchao
# torchao/testing/float8/roofline_utils.py KERNEL_LAUNCH_OVERHEAD_SEC = 0.002 ms); floors each cast kernel.
KERNEL_FLOOR_S = 2e-6
BF16_OUT_BYTES = 2  # what an FP8 GEMM writes

# FlashAttention-2's causal forward on an H100 SXM5 in bf16, TFLOP/s as labelled on the bars of Shah et al. 2024,
# "FlashAttention-3", arXiv 2407.08608, Figure 5 (causal, head dim 64 and 128; B x S = 16k tokens, H x D = 2048),
# per sequence length (read from a transcription of the bar labels). The paper's backward (non-causal only,
# Figure 6) follows the same curve within ~6% (d = 128: 214, 260, 291, 310, 318, 322), so one curve serves both
# passes. Head dims beyond 128 fall off as the non-causal forward's d = 256 over d = 128 (Figure 5: 208/309 ...
# 298/370), the only d = 256 series published.
FLASH_SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384)
FLASH_CAUSAL_TFLOPS = {64: (180, 229, 262, 284, 295, 299), 128: (191, 260, 298, 319, 333, 335)}
FLASH_NONCAUSAL_TFLOPS = {128: (309, 350, 362, 368, 370, 370), 256: (208, 251, 278, 293, 297, 298)}


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
    fp8_gemm_ratio: float = 1.0  # an FP8 GEMM's asymptote over the bf16 one (sim/devices.toml cites it)
    out_bytes: int | None = None  # bytes per output element when not the operands' (FP8 GEMMs write bf16)

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
            fp8_gemm_ratio=float(dev.get("fp8_gemm_ratio", 1.0)),
        )

    def fp8(self) -> DeviceSpec:
        """The same device for FP8 GEMMs: the dense FP8 rate at fp8_gemm_ratio of the bf16 asymptote, bf16
        output (the caller checks the device has FP8 tensor cores)."""
        assert self.fp8_peak_flops is not None, "no FP8 tensor cores on this device"
        return replace(self, peak_flops=self.fp8_peak_flops, out_bytes=BF16_OUT_BYTES,
                       gemm_efficiency=self.gemm_efficiency * self.fp8_gemm_ratio)


def wave_efficiency(m: float, n: float, sm_count: int, batch: float = 1.0) -> float:
    """Share of SM-time doing useful tiles: T / (ceil(T / SMs) * SMs) for T output tiles (over a batch)."""
    tiles = math.ceil(m / TILE_M) * math.ceil(n / TILE_N) * max(1, math.ceil(batch))
    return tiles / (math.ceil(tiles / sm_count) * sm_count)


def gemm_efficiency(m: float, n: float, dev: DeviceSpec, batch: float = 1.0) -> float:
    """Achieved share of peak of one (m x k) @ (k x n) GEMM: the asymptote times wave quantisation."""
    if dev.flat_efficiency is not None:
        return dev.flat_efficiency
    return dev.gemm_efficiency * wave_efficiency(m, n, dev.sm_count, batch)


def gemm_s(m: float, n: float, k: float, e: int, dev: DeviceSpec, count: float = 1.0) -> float:
    """A batch of `count` GEMMs of (m x k) @ (k x n) with e-byte operands (and dev.out_bytes outputs)."""
    if m <= 0 or n <= 0 or k <= 0 or count <= 0:
        return 0.0
    compute = 2 * m * n * k / (dev.peak_flops * gemm_efficiency(m, n, dev, count))
    out = dev.out_bytes if dev.out_bytes is not None else e
    memory = (e * (m * k + k * n) + out * m * n) / dev.hbm_bps
    return count * max(compute, memory)


def _interp_seq(series: tuple[int, ...], seq_len: float) -> float:
    """A published series at seq_len: linear in log2(seq_len), held flat outside 512..16k."""
    x = min(max(math.log2(max(seq_len, 1.0)), math.log2(FLASH_SEQ_LENS[0])), math.log2(FLASH_SEQ_LENS[-1]))
    xs = [math.log2(v) for v in FLASH_SEQ_LENS]
    i = min(max(0, sum(1 for v in xs if v <= x) - 1), len(xs) - 2)
    w = (x - xs[i]) / (xs[i + 1] - xs[i])
    return series[i] * (1 - w) + series[i + 1] * w


def flash_shape_factor(head_dim: float, seq_len: float) -> float:
    """Flash attention's throughput at (head_dim, seq_len) over its d = 128, 16k asymptote (FLASH_* tables):
    0.54 at d = 64, s = 512; 0.89 at d = 128, s = 2048; 1 at d = 128, s >= 16k. Below d = 64 held at 64's."""
    asymptote = FLASH_CAUSAL_TFLOPS[128][-1]
    at64, at128 = (_interp_seq(FLASH_CAUSAL_TFLOPS[d], seq_len) for d in (64, 128))
    if head_dim <= 128:
        w = (min(max(head_dim, 64), 128) - 64) / 64
        return (at64 * (1 - w) + at128 * w) / asymptote
    drop = _interp_seq(FLASH_NONCAUSAL_TFLOPS[256], seq_len) / _interp_seq(FLASH_NONCAUSAL_TFLOPS[128], seq_len)
    w = (min(head_dim, 256) - 128) / 128
    return at128 * (1 - w + w * drop) / asymptote


def attention_s(flops: float, nbytes: float, dev: DeviceSpec, shape: float = 1.0) -> float:
    """A fused attention kernel doing `flops` and moving `nbytes`, at `shape` (flash_shape_factor) of the
    device's attention asymptote; a scenario's flat efficiency replaces both."""
    eff = dev.flat_efficiency if dev.flat_efficiency is not None else dev.attention_efficiency * shape
    return max(flops / (dev.peak_flops * eff), nbytes / dev.hbm_bps)


def memory_bound_s(nbytes: float, dev: DeviceSpec) -> float:
    return nbytes / dev.hbm_bps


def kernels_s(nbytes: list[float], dev: DeviceSpec) -> float:
    """Memory-bound kernels run one after another, each at least KERNEL_FLOOR_S."""
    return sum(max(b / dev.hbm_bps, KERNEL_FLOOR_S) for b in nbytes)
