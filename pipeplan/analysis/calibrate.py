"""The one calibration per device (issue #12): fit a device's `gemm_efficiency` to its anchor rows.

    python -m pipeplan.analysis.calibrate            # prints the fit per device and each anchor's residual

Anchors are the rows of scenarios/validation/published.csv marked `scored = calibration`; they are never scored
as validation. Each device's constant is fitted alone, by one-parameter least squares on the log error,

    g* = argmin_g  sum_i ln(predicted_i(g) / published_i)^2 ,

over the rows whose scenario uses that device preset, with every other constant as shipped. The predictions
are not exactly proportional to 1/g (memory-bound ops, the roofline's max, wave quantisation), so g is found by
a bounded scalar search rather than in closed form. sim/devices.toml carries the rounded result and
tests/test_calibration.py checks that it equals this fit to two decimals.

Anchors by device, and why they are the most direct measurement of compute in the set:
- A100-80GB (also used for A100-40GB, the same SMs and clocks): Korthikanti et al. 2022, Table 4, the 22B
  model's per-layer forward and backward times for its five techniques (10 rows). One transformer layer at
  TP 8 measured alone, with no pipeline bubble, data-parallel traffic or optimizer step in it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from pipeplan.analysis.validation import VALIDATION_DIR, PublishedFigure, Setting, load_published, predict_all

BOUNDS = (0.3, 1.0)  # a large bf16 GEMM sustains between 30% and 100% of the datasheet peak


@dataclass(frozen=True)
class Fit:
    device: str
    gemm_efficiency: float
    anchors: tuple[PublishedFigure, ...]
    rel_errors: tuple[float, ...]  # (predicted - published) / published at the fitted value

    @property
    def rms_log_error(self) -> float:
        return math.sqrt(sum(math.log1p(e) ** 2 for e in self.rel_errors) / len(self.rel_errors))


def anchors_by_device(figures: Iterable[PublishedFigure], folder: Path = VALIDATION_DIR
                      ) -> dict[str, list[PublishedFigure]]:
    """The calibration rows grouped by the device preset their scenario resolves to."""
    out: dict[str, list[PublishedFigure]] = {}
    for f in figures:
        if f.calibration and f.ratio_of is None:
            preset = Setting(folder / f.scenario, f.overrides).scenario.device.preset
            out.setdefault(preset, []).append(f)
    return out


def _log_errors(anchors: list[PublishedFigure], g: float, folder: Path) -> list[float]:
    moved = [replace(f, overrides={**f.overrides, "device.gemm_efficiency": g}) for f in anchors]
    out = []
    for p in predict_all(moved, folder):
        if p.predicted is None:
            raise ValueError(f"calibration row {p.figure.case!r} is not predicted: {p.reason}")
        out.append(math.log(p.predicted / p.figure.published))
    return out


def fit_device(device: str, anchors: list[PublishedFigure], folder: Path = VALIDATION_DIR) -> Fit:
    """Least squares on ln(predicted / published) over one device's anchors, g in BOUNDS."""
    from scipy.optimize import minimize_scalar

    res = minimize_scalar(lambda g: sum(e * e for e in _log_errors(anchors, g, folder)),
                          bounds=BOUNDS, method="bounded", options={"xatol": 1e-4})
    g = float(res.x)
    errors = tuple(math.expm1(e) for e in _log_errors(anchors, g, folder))
    return Fit(device, g, tuple(anchors), errors)


def fit_all(published: str | Path | None = None) -> list[Fit]:
    figures = load_published(published)
    folder = Path(published).parent if published is not None else VALIDATION_DIR
    return [fit_device(d, a, folder) for d, a in sorted(anchors_by_device(figures, folder).items())]


def main() -> None:
    for fit in fit_all():
        print(f"{fit.device}: gemm_efficiency = {fit.gemm_efficiency:.4f} (rounded {fit.gemm_efficiency:.2f}), "
              f"{len(fit.anchors)} anchors, rms log error {fit.rms_log_error:.3f}")
        for f, e in zip(fit.anchors, fit.rel_errors, strict=True):
            print(f"  {f.source} {f.table} {f.case}: {e:+.1%}")


if __name__ == "__main__":
    main()
