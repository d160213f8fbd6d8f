"""The one calibration per device (issue #12): sim/devices.toml's fitted constants are what
`python -m analysis.calibrate` computes from the anchor rows, and anchors are never scored as validation."""

from __future__ import annotations

import pytest

from pipeplan.analysis.calibrate import anchors_by_device, fit_device
from pipeplan.analysis.validation import load_published
from pipeplan.sim.config import device_presets

TORCHTITAN_PART = "H100-HBM2e-96GB-500W"  # torchtitan's Grand Teton H100 (96 GB HBM2e, 500 W)


@pytest.fixture(scope="module")
def anchors():
    return anchors_by_device(load_published())


def test_anchors_are_korthikanti_table4_per_layer_times_and_not_scored(anchors):
    assert set(anchors) == {"A100-80GB", TORCHTITAN_PART}
    rows = anchors["A100-80GB"]
    assert len(rows) == 10
    assert {(f.source, f.table) for f in rows} == {("korthikanti2022", "Table 4")}
    assert {f.quantity for f in rows} == {"layer_forward", "layer_backward"}
    assert not any(f.scored for f in rows)


def test_devices_toml_holds_the_fitted_a100_gemm_efficiency(anchors):
    fit = fit_device("A100-80GB", anchors["A100-80GB"])
    presets = device_presets()
    for name in ("A100-80GB", "A100-40GB"):  # the same SMs and clocks: one calibration
        assert presets[name]["gemm_efficiency"] == pytest.approx(round(fit.gemm_efficiency, 2), abs=1e-9)
    assert fit.rms_log_error < 0.10  # one constant explains the ten per-layer times to within ~5% rms


def test_torchtitan_part_is_fitted_to_one_host_rows_only(anchors):
    """The 500 W H100's anchors are torchtitan Table 1 (8 GPUs, one host): eager, compile, compile + Float8.
    One constant has to explain all three, so compile's and Float8's modelled speed-ups are tested by the fit."""
    rows = anchors[TORCHTITAN_PART]
    assert {(f.source, f.table) for f in rows} == {("torchtitan2024", "Table 1")}
    assert len(rows) == 3 and not any(f.scored for f in rows)
    fit = fit_device(TORCHTITAN_PART, rows)
    assert device_presets()[TORCHTITAN_PART]["gemm_efficiency"] == pytest.approx(round(fit.gemm_efficiency, 2),
                                                                                 abs=1e-9)
    assert max(abs(e) for e in fit.rel_errors) < 0.05  # eager, compile and Float8 within 5% with one constant
