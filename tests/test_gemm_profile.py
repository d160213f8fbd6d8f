"""`pipeplan profile --gemm`: the curve fit (sim/gemm_fit.py) recovers the parameters of timings the curve
itself generated, matches a brute-force search on noisy ones, and the command runs end to end on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from pipeplan.sim.config import load_scenario
from pipeplan.sim.cost_model import model_chunk_costs
from pipeplan.sim.gemm_fit import curve_terms, fit_gemm_curve
from pipeplan.sim.roofline import DeviceSpec, gemm_s

# H100-like: a compute-bound tail (big squares), wave-quantised middles and thin-K memory-bound GEMMs
SHAPES = [(d, d, d) for d in (256, 512, 1024, 2048, 4096, 8192)] + [
    (d, d, k) for d in (1024, 4096, 8192) for k in (16, 64)] + [(8192, 1536, 4096), (8192, 4096, 14336),
                                                               (8192, 128256, 4096), (4096, 14336, 8192)]
TRUE = DeviceSpec(peak_flops=989.5e12, hbm_bps=2950e9, sm_count=132, gemm_efficiency=0.63, attention_efficiency=1.0)


def curve_times(spec: DeviceSpec, e: int = 2) -> np.ndarray:
    return np.array([gemm_s(m, n, k, e, spec) for m, n, k in SHAPES])


def test_fit_recovers_the_parameters_of_the_curves_own_timings():
    fit = fit_gemm_curve(SHAPES, curve_times(TRUE), 2, peak_tflops=989.5, sm_count=132)
    assert fit.gemm_efficiency == pytest.approx(0.63, rel=1e-9)
    assert fit.hbm_gbps == pytest.approx(2950, rel=1e-9)
    assert fit.rms_log_error < 1e-9
    assert 0 < fit.compute_bound < len(SHAPES)  # both parameters were identifiable
    np.testing.assert_allclose(fit.predict_s(SHAPES, 2), curve_times(TRUE), rtol=1e-9)


def test_fit_on_noisy_timings_is_the_brute_force_least_squares_optimum():
    """5% log-normal noise: the fit's objective equals the least over a fine (g, B) grid (within its step),
    and the parameters land near the truth."""
    rng = np.random.default_rng(0)
    t = curve_times(TRUE) * np.exp(rng.normal(0, 0.05, len(SHAPES)))
    fit = fit_gemm_curve(SHAPES, t, 2, peak_tflops=989.5, sm_count=132)
    c, m = (np.log(v) for v in curve_terms(SHAPES, 2, 989.5, 132))
    xs, ys = np.linspace(np.log(0.3), 0, 601), np.log(np.linspace(1000e9, 6000e9, 601))
    obj = ((np.maximum(c[:, None, None] - xs[None, :, None], m[:, None, None] - ys[None, None, :])
            - np.log(t)[:, None, None]) ** 2).sum(axis=0)
    assert len(SHAPES) * fit.rms_log_error**2 <= obj.min() + 1e-12
    assert fit.gemm_efficiency == pytest.approx(0.63, rel=0.05)
    assert fit.hbm_gbps == pytest.approx(2950, rel=0.1)


def test_fit_is_never_beaten_by_a_grid_over_many_noisy_cases():
    """Brute force over 300 seeded noisy cases (2-7 random GEMMs, 20% log noise, random g and B): no point of
    a fine 2-D grid in (ln g, ln B) has a lower objective than the fit. Splitting the points at n + 1
    thresholds and taking per-side means alone loses here when a point sits on the kink or the g <= 1 cap
    binds (15 of these 300 cases, by up to 50% in loss)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(2, 8))
        shapes = [tuple(int(v) for v in 2 ** rng.integers(6, 13, 3)) for _ in range(n)]
        big_c, big_m = curve_terms(shapes, 2, 100.0, 1)
        bw = rng.uniform(100e9, 2000e9)
        t = np.maximum(big_c / rng.uniform(0.3, 1.0), big_m / bw) * np.exp(rng.normal(0, 0.2, n))
        fit = fit_gemm_curve(shapes, t, 2, peak_tflops=100.0, sm_count=1)
        c, m, lt = np.log(big_c), np.log(big_m), np.log(t)
        xs, ys = np.linspace(-4, 0, 401), np.linspace(np.log(bw) - 3, np.log(bw) + 3, 401)
        grid = ((np.maximum(c[:, None, None] - xs[None, :, None], m[:, None, None] - ys[None, None, :])
                 - lt[:, None, None]) ** 2).sum(axis=0)
        assert n * fit.rms_log_error**2 <= grid.min() + 1e-12


def test_fit_with_a_point_on_the_kink_beats_the_split_means():
    """The reviewer's case: per-side means give g = 1, B = 262.5 GB/s, loss 0.5095; a grid finds g = 0.458,
    B = 278.7 GB/s, loss 0.3907; the optimum puts the first GEMM on the kink."""
    shapes = [(512, 4096, 256), (2048, 512, 128), (4096, 256, 1024)]
    fit = fit_gemm_curve(shapes, [1.4184e-05, 1.2307e-05, 6.2897e-05], 2, peak_tflops=100.0, sm_count=1)
    assert 3 * fit.rms_log_error**2 <= 0.3907
    assert fit.gemm_efficiency == pytest.approx(0.458, abs=0.01)
    assert fit.hbm_gbps == pytest.approx(278.7, rel=0.01)


def test_efficiency_is_capped_at_one():
    fast = DeviceSpec(989.5e12, 2950e9, 132, 1.0, 1.0)
    t = curve_times(fast) / 1.5  # faster than the peak allows
    assert fit_gemm_curve(SHAPES, t, 2, 989.5, 132).gemm_efficiency == 1.0


def test_profile_gemm_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "gemm"
    proc = subprocess.run([sys.executable, "-m", "pipeplan.analysis.cli", "profile", "--gemm", "--device", "cpu",
                           "--dtype", "fp32", "--max-dim", "128", "--repeats", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rms log error" in proc.stdout
    df = pd.read_csv(out / "gemm.csv")
    assert list(df.columns[:7]) == ["m", "n", "k", "dtype", "seconds", "tflops", "predicted_s"]
    assert (df.seconds > 0).all() and set(df.dtype) == {"fp32"}
    np.testing.assert_allclose(df.tflops, 2 * df.m * df.n * df.k / df.seconds / 1e12)
    fit = json.loads((out / "gemm.json").read_text())
    assert fit["rms_log_error"] == pytest.approx(np.sqrt(np.mean(np.log(df.predicted_s / df.seconds) ** 2)))
    assert (out / "gemm.png").stat().st_size > 0
    # the [device] table is a valid scenario override that the cost model runs with
    import tomllib

    device = tomllib.loads((out / "device.toml").read_text())["device"]
    sc = load_scenario("tiny-cpu", {f"device.{k}": v for k, v in device.items()} | {"device.efficiency": None})
    assert sc.device.resolved()["gemm_efficiency"] == device["gemm_efficiency"]
    assert model_chunk_costs(sc).forward_s.min() > 0


def test_profile_gemm_rejects_bad_flags(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipeplan.analysis.cli", "profile", "--gemm", "--device", "cpu",
                           "--max-dim", "8", "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--max-dim" in proc.stderr and "Traceback" not in proc.stderr
