"""Energy meters read real counters or nothing: RAPL deltas with wrap-around, from a fake powercap tree."""

from __future__ import annotations

import pytest

from pipeplan.lcp.energy import _rapl_meter


def _domain(root, name, energy_uj, max_uj=10_000):
    d = root / name
    d.mkdir()
    (d / "energy_uj").write_text(f"{energy_uj}\n")
    (d / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return d


def test_rapl_sums_package_domains_and_survives_wraparound(tmp_path):
    pkg0 = _domain(tmp_path, "intel-rapl:0", 1_000)
    pkg1 = _domain(tmp_path, "intel-rapl:1", 5_000)
    _domain(tmp_path, "intel-rapl:0:0", 123)  # a sub-domain (core): already inside package 0, not counted
    meter = _rapl_meter(str(tmp_path))
    assert meter is not None and meter.name == "rapl"
    assert meter.joules() == 0.0
    (pkg0 / "energy_uj").write_text("3000\n")
    (pkg1 / "energy_uj").write_text("6000\n")
    assert meter.joules() == pytest.approx(0.003)  # 2000 + 1000 µJ
    (pkg0 / "energy_uj").write_text("500\n")  # wrapped past 10 000: 7500 µJ more
    assert meter.joules() == pytest.approx(0.0105)


def test_no_readable_counter_means_no_meter(tmp_path):
    assert _rapl_meter(str(tmp_path)) is None
