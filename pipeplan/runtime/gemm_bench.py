"""`pipeplan profile --gemm`: time GEMMs on this device and fit the roofline curve of sim/roofline.py to them.

The grid is the transformer's own GEMMs (one layer's and the LM head's F, I and W on one TP rank, from the
scenario: sim.layer_ops.gemm_shapes; those no bigger than the largest square) plus a sweep: square GEMMs from
64 up to `max_dim`, which climb the curve from a few tiles to many waves, and thin-K ones (K = 16, 64), which
are memory-bound and pin the bandwidth. Each GEMM is `torch.mm` into a preallocated output, warmed up, then
timed `repeats` times over enough back-to-back calls to last ~1 ms (CUDA events on a GPU, the host clock on a
CPU); its time is the median per call. sim/gemm_fit.py fits `gemm_efficiency` and `hbm_gbps` to the times,
with the peak and the SM count held fixed.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeplan.sim.activations import DTYPE_BYTES
from pipeplan.sim.config import Scenario
from pipeplan.sim.devices import device_presets, recognise_preset
from pipeplan.sim.errors import PipeplanError
from pipeplan.sim.gemm_fit import GemmFit, Shape, fit_gemm_curve
from pipeplan.sim.layer_ops import gemm_shapes

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
THIN_K = (16, 64)
SAMPLE_S = 1e-3  # each timed sample runs back-to-back calls for about this long (timer resolution, launch cost)
MAX_CALLS = 1000
CPU_SM_COUNT = 1
"""A CPU has no SM grid for 256 x 128 output tiles to quantise on: one "SM" turns wave quantisation off, which
leaves the plain roofline max(FLOPs / (peak g), bytes / bandwidth)."""


@dataclass(frozen=True)
class GemmProfile:
    """What `profile --gemm` measured and fitted."""

    shapes: list[Shape]
    seconds: list[float]
    own: list[bool]  # the scenario's own GEMM (else the sweep's)
    fit: GemmFit
    holdout_rms_log_error: float | None  # the scenario's GEMMs predicted by a fit to the sweep alone
    dtype: str
    device_name: str
    preset: str | None  # the sim/devices.toml preset this device is, when recognised
    peak_source: str


MIN_GEMM_DIM = 128
"""The smallest --max-dim whose sweep gives the fit more than one GEMM: squares 64 and 128 (at 64 the sweep is
one square, and the fit of a curve to one point fails)."""


def grid(sc: Scenario, max_dim: int) -> tuple[list[Shape], list[bool]]:
    """The scenario's GEMMs (dims rounded; those of more FLOPs than the max_dim cube dropped), then the sweep's."""
    own = list(dict.fromkeys((round(m), round(n), round(k)) for m, n, k in gemm_shapes(sc)))
    own = [s for s in own if s[0] * s[1] * s[2] <= max_dim**3 and min(s) > 0]
    squares = [2**j for j in range(6, 15) if 2**j <= max_dim]
    sweep = [(d, d, d) for d in squares] + [(d, d, k) for d in squares if d >= 256 for k in THIN_K]
    sweep = [s for s in dict.fromkeys(sweep) if s not in own]
    return own + sweep, [True] * len(own) + [False] * len(sweep)


def time_gemm(shape: Shape, dtype: torch.dtype, device: torch.device, repeats: int = 7, warmup: int = 3) -> float:
    """Median seconds of one (m x k) @ (k x n) on `device`."""
    m, n, k = shape
    a = torch.randn(m, k, device=device, dtype=dtype)  # drawn on the device: an LM head's operand is GiBs
    b = torch.randn(k, n, device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    for _ in range(warmup):
        torch.mm(a, b, out=out)
    calls = max(1, min(MAX_CALLS, int(SAMPLE_S / max(_run(a, b, out, 1, device), 1e-9))))
    return statistics.median(_run(a, b, out, calls, device) for _ in range(repeats))


def _run(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, calls: int, device: torch.device) -> float:
    """Seconds per call over `calls` back-to-back calls."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            torch.mm(a, b, out=out)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        torch.mm(a, b, out=out)
    return (time.perf_counter() - t0) / calls


def profile_gemms(sc: Scenario, device: torch.device, dtype: str, max_dim: int, peak_tflops: float | None = None,
                  sm_count: int | None = None, repeats: int = 7) -> GemmProfile:
    """Time the grid on `device` and fit the curve. Peak: as given, else the recognised preset's dense bf16 peak
    (bf16 on CUDA), else the best measured throughput (the fitted efficiency is then relative to it)."""
    if dtype not in DTYPES:
        raise PipeplanError(f"--dtype: unknown {dtype!r}; allowed: {', '.join(DTYPES)}")
    if max_dim < MIN_GEMM_DIM:
        raise PipeplanError(f"--max-dim: must be >= {MIN_GEMM_DIM} (got {max_dim}); the fit needs GEMMs of several "
                            "sizes")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name, preset, sms = props.name, recognise_preset(props.name), props.multi_processor_count
    else:
        name, preset, sms = "cpu", None, CPU_SM_COUNT
    shapes, own = grid(sc, max_dim)
    torch.manual_seed(0)
    seconds = [time_gemm(s, DTYPES[dtype], device, repeats) for s in shapes]
    if peak_tflops is not None:
        source = "--peak-tflops"
    elif preset is not None and dtype == "bf16":
        peak_tflops, source = device_presets()[preset]["peak_tflops"], f"{preset} datasheet (sim/devices.toml)"
    else:
        peak_tflops = max(2 * m * n * k / t for (m, n, k), t in zip(shapes, seconds, strict=True)) / 1e12
        source = "the best measured GEMM (no datasheet peak for this device and dtype)"
    sm = sm_count or sms
    e = DTYPE_BYTES[dtype]
    fit = fit_gemm_curve(shapes, seconds, e, peak_tflops, sm)
    holdout = _holdout(shapes, seconds, own, e, peak_tflops, sm)
    return GemmProfile(shapes, seconds, own, fit, holdout, dtype, name, preset, source)


def _holdout(shapes: Sequence[Shape], seconds: Sequence[float], own: Sequence[bool], e: int, peak_tflops: float,
             sm: int) -> float | None:
    """rms log error on the scenario's own GEMMs of the curve fitted to the sweep alone."""
    sweep = [i for i, o in enumerate(own) if not o]
    held = [i for i, o in enumerate(own) if o]
    if len(sweep) < 2 or not held:
        return None
    fit = fit_gemm_curve([shapes[i] for i in sweep], [seconds[i] for i in sweep], e, peak_tflops, sm)
    pred = fit.predict_s([shapes[i] for i in held], e)
    return statistics.fmean(math.log(p / seconds[i]) ** 2 for p, i in zip(pred, held, strict=True)) ** 0.5
