"""What `pipeplan profile --gemm` writes: the measured GEMMs (gemm.csv), the fitted curve over them (gemm.png),
the fit (gemm.json) and a [device] table a scenario can paste (device.toml)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd

from pipeplan.analysis.plots import plt, save
from pipeplan.common.io import atomic_write_json, atomic_write_text
from pipeplan.runtime.gemm_bench import GemmProfile
from pipeplan.sim.activations import DTYPE_BYTES


def gemm_frame(p: GemmProfile) -> pd.DataFrame:
    """Tidy: one row per GEMM, m,n,k,dtype,seconds,tflops,predicted_s (+ which grid it came from)."""
    shapes = np.array(p.shapes, dtype=float)
    seconds = np.array(p.seconds)
    return pd.DataFrame({
        "m": shapes[:, 0].astype(int), "n": shapes[:, 1].astype(int), "k": shapes[:, 2].astype(int),
        "dtype": p.dtype, "seconds": seconds, "tflops": 2 * shapes.prod(axis=1) / seconds / 1e12,
        "predicted_s": p.fit.predict_s(p.shapes, DTYPE_BYTES[p.dtype]),
        "source": ["scenario" if o else "sweep" for o in p.own],
    })


def device_snippet(p: GemmProfile) -> str:
    """A [device] table with the fitted curve (TOML)."""
    f = p.fit
    lines = [
        f"# pipeplan profile --gemm on {p.device_name} ({p.dtype}): {len(p.shapes)} GEMMs, rms log error "
        f"{f.rms_log_error:.3f} (max {f.max_log_error:.3f})",
        f"# peak_tflops from {p.peak_source}; gemm_efficiency and hbm_gbps fitted (sim/gemm_fit.py).",
        "# Merge into a scenario's [device] table; drop any `efficiency` there, which would replace this curve.",
        "[device]",
    ]
    if p.preset is not None:
        lines.append(f'preset = "{p.preset}"')
    lines += [f"peak_tflops = {f.peak_tflops:.6g}", f"gemm_efficiency = {f.gemm_efficiency:.4f}",
              f"hbm_gbps = {f.hbm_gbps:.6g}", f"sm_count = {f.sm_count}"]
    return "\n".join(lines) + "\n"


def gemm_plot(df: pd.DataFrame, path: str | Path, title: str) -> None:
    """Achieved TFLOP/s against GEMM FLOPs, measured (dots) and the fitted curve's prediction (crosses)."""
    flops = 2.0 * df.m * df.n * df.k
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for source, marker in (("scenario", "o"), ("sweep", "s")):
        sel = df.source == source
        ax.scatter(flops[sel], df.tflops[sel], marker=marker, label=f"measured ({source})", alpha=0.8)
    ax.scatter(flops, flops / df.predicted_s / 1e12, marker="x", color="k", label="fitted curve")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("GEMM FLOPs (2mnk)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(title)
    ax.legend()
    save(fig, path)


def write_gemm_profile(p: GemmProfile, folder: Path) -> pd.DataFrame:
    """gemm.csv, gemm.png, gemm.json, device.toml into `folder`."""
    df = gemm_frame(p)
    atomic_write_text(folder / "gemm.csv", df.to_csv(index=False))
    atomic_write_text(folder / "device.toml", device_snippet(p))
    atomic_write_json(folder / "gemm.json", {**asdict(p.fit), "holdout_rms_log_error": p.holdout_rms_log_error,
                                            "device": p.device_name, "preset": p.preset, "dtype": p.dtype,
                                            "peak_source": p.peak_source, "gemms": len(p.shapes)})
    gemm_plot(df, folder / "gemm.png", f"GEMMs on {p.device_name} ({p.dtype}), fit rms log error "
                                       f"{p.fit.rms_log_error:.3f}")
    return df
