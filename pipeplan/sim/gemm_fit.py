"""Fit the GEMM roofline curve of sim/roofline.py to measured GEMM times (`pipeplan profile --gemm`).

The curve's time for a GEMM i of (m x k) @ (k x n) is

    t_i(g, B) = max(C_i / g, M_i / B)      C_i = 2 m n k / (peak * wave_i),   M_i = e (m k + k n + m n)

with g the large-GEMM efficiency `gemm_efficiency`, B the memory bandwidth `hbm_gbps`, and peak and the SM
count (wave quantisation) fixed: C_i and M_i are read off `sim.roofline.gemm_s` itself, so the fit and the
simulator share one curve. The fit minimises the squared error in log space,

    min over x = ln g, y = ln B of  sum_i (max(c_i - x, m_i - y) - l_i)^2,    c_i = ln C_i, m_i = ln M_i, l_i = ln t_i

(relative errors, so a 10 us GEMM counts as much as a 10 ms one). GEMM i is compute-bound exactly when
d_i = c_i - m_i >= x - y, so the points sorted by d split into a memory-bound head and a compute-bound tail at
one of n + 1 thresholds. Inside one split's region, d_(s-1) <= x - y <= d_(s), the objective is the separable
convex quadratic sum_compute (c_i - l_i - x)^2 + sum_memory (m_i - l_i - y)^2, and with the cap x <= 0
(g <= 1) its minimum is one of a handful of KKT points: the two means, the means projected onto either edge
x - y = d (a point sitting on the kink), or x = 0 with y clipped into the region. The regions cover the plane,
so the least of these candidates over all splits is the global least-squares optimum: exact, with no starting
point and no solver.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeplan.sim.roofline import DeviceSpec, gemm_s

Shape = tuple[int, int, int]  # (m, n, k): (m x k) @ (k x n)


@dataclass(frozen=True)
class GemmFit:
    """The fitted curve parameters and how well they reproduce the measured times."""

    gemm_efficiency: float
    hbm_gbps: float
    peak_tflops: float  # held fixed, as given
    sm_count: int  # held fixed, as given
    rms_log_error: float  # sqrt(mean (ln predicted - ln measured)^2)
    max_log_error: float
    compute_bound: int  # GEMMs the fitted curve calls compute-bound (the rest memory-bound)

    def spec(self) -> DeviceSpec:
        return DeviceSpec(peak_flops=self.peak_tflops * 1e12, hbm_bps=self.hbm_gbps * 1e9, sm_count=self.sm_count,
                          gemm_efficiency=self.gemm_efficiency, attention_efficiency=1.0)

    def predict_s(self, shapes: Sequence[Shape], bytes_per_element: int) -> np.ndarray:
        spec = self.spec()
        return np.array([gemm_s(m, n, k, bytes_per_element, spec) for m, n, k in shapes])


def curve_terms(shapes: Sequence[Shape], bytes_per_element: int, peak_tflops: float,
                sm_count: int) -> tuple[np.ndarray, np.ndarray]:
    """(C_i, M_i) of each GEMM: its compute time at g = 1 and its bytes moved, from sim.roofline.gemm_s."""
    compute_only = DeviceSpec(peak_tflops * 1e12, math.inf, sm_count, 1.0, 1.0)
    bytes_only = DeviceSpec(math.inf, 1.0, sm_count, 1.0, 1.0)
    c = np.array([gemm_s(m, n, k, bytes_per_element, compute_only) for m, n, k in shapes])
    b = np.array([gemm_s(m, n, k, bytes_per_element, bytes_only) for m, n, k in shapes])
    return c, b


def fit_gemm_curve(shapes: Sequence[Shape], seconds: Sequence[float], bytes_per_element: int,
                   peak_tflops: float, sm_count: int) -> GemmFit:
    """Least-squares fit in log space of (gemm_efficiency, hbm_gbps) to measured GEMM times."""
    if len(shapes) != len(seconds) or len(shapes) < 2:
        raise ValueError("fit_gemm_curve: needs at least two GEMMs, one time each")
    t = np.asarray(seconds, dtype=float)
    if not (np.isfinite(t).all() and (t > 0).all()):
        raise ValueError("fit_gemm_curve: times must be positive and finite")
    big_c, big_m = curve_terms(shapes, bytes_per_element, peak_tflops, sm_count)
    c, m, lt = np.log(big_c), np.log(big_m), np.log(t)
    order = np.argsort(c - m)  # memory-bound first
    u, w, d = (c - lt)[order], (m - lt)[order], (c - m)[order]
    n = len(t)

    def loss(x: float, y: float) -> float:
        return float(np.sum((np.maximum(c - x, m - y) - lt) ** 2))

    best: tuple[float, float, float] | None = None
    for split in range(n + 1):  # GEMMs order[:split] memory-bound, order[split:] compute-bound
        lo = float(d[split - 1]) if split > 0 else -math.inf  # the region: lo <= x - y <= hi
        hi = float(d[split]) if split < n else math.inf
        for x, y in _region_candidates(u[split:], w[:split], lo, hi):
            value = loss(x, y)
            if best is None or value < best[0]:
                best = (value, x, y)
    assert best is not None
    _, x, y = best
    residual = np.maximum(c - x, m - y) - lt
    return GemmFit(
        gemm_efficiency=math.exp(x),
        hbm_gbps=math.exp(y) / 1e9,
        peak_tflops=peak_tflops,
        sm_count=sm_count,
        rms_log_error=float(np.sqrt(np.mean(residual**2))),
        max_log_error=float(np.max(np.abs(residual))),
        compute_bound=int(np.sum(c - x >= m - y)),
    )


def _region_candidates(u: np.ndarray, w: np.ndarray, lo: float, hi: float) -> list[tuple[float, float]]:
    """The KKT points of min sum (u_i - x)^2 + sum (w_j - y)^2 subject to lo <= x - y <= hi and x <= 0 that lie
    in that region: the convex quadratic's minimum is the feasible one of least objective. With no u (no
    compute-bound GEMM) x only has to stay feasible; with no w, y is pinned at the region's edge (the least B
    that keeps every GEMM compute-bound)."""
    a, b = float(u.size), float(w.size)
    p = float(u.mean()) if u.size else 0.0
    q = float(w.mean()) if w.size else 0.0
    out: list[tuple[float, float]] = []
    # no constraint active (a free coordinate takes the value nearest the other's that keeps it feasible)
    if a and b:
        out.append((p, q))
    elif a:
        out.append((min(p, 0.0), min(p, 0.0) - hi if math.isfinite(hi) else min(p, 0.0)))
    elif b:
        out.append((min(0.0, q + hi), q))
    # on an edge x - y = e: a point sits on the kink
    for e in (lo, hi):
        if math.isfinite(e) and a + b:
            x = (a * p + b * (e + q)) / (a + b)
            out.append((x, x - e))
    # on the cap x = 0, y clipped into the region
    y = min(max(q if b else -hi, -hi), -lo)
    out.append((0.0, y if math.isfinite(y) else q))
    tol = 1e-12
    return [(x, y) for x, y in out
            if math.isfinite(x) and math.isfinite(y) and x <= tol and lo - tol <= x - y <= hi + tol]
