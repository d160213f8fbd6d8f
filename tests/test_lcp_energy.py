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


def test_nvml_finds_the_card_by_uuid_then_bus_id_not_by_index(monkeypatch):
    """Under CUDA_VISIBLE_DEVICES torch's index is not NVML's: the meter asks NVML for torch's card by its
    UUID, or by its PCI bus id when the UUID is unknown to NVML (a fake pynvml records the calls)."""
    import sys
    import types

    import torch

    from pipeplan.lcp import energy

    calls = []

    class NVMLError(Exception):
        pass

    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: pytest.fail("selected by index"),
        nvmlDeviceGetTotalEnergyConsumption=lambda h: {"by-bus": 7_000}[h],
    )

    def by_uuid(u):
        calls.append(("uuid", u))
        raise NVMLError("not found")

    def by_bus(b):
        calls.append(("bus", b))
        return "by-bus"

    fake.nvmlDeviceGetHandleByUUID, fake.nvmlDeviceGetHandleByPciBusId_v2 = by_uuid, by_bus
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    props = types.SimpleNamespace(uuid="58b2b3f2-aaaa", pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    meter = energy.open_meter(torch.device("cuda", 1))
    assert calls == [("uuid", "GPU-58b2b3f2-aaaa"), ("bus", "00000000:3B:00.0")]
    assert meter is not None and meter.name == "nvml" and meter.joules() == 7.0


def test_device_memory_is_checked_before_a_build(monkeypatch):
    """A CUDA build asks the device for its free memory first and refuses, naming the size, when short
    (mem_get_info faked: no GPU here); the arithmetic is build_bytes'."""
    import torch

    from pipeplan.lcp import LCPError, limits
    from pipeplan.lcp.index import batch_bytes, build_bytes

    rows = torch.zeros((1000, 256), dtype=torch.uint16)
    cuda = torch.device("cuda")
    need = build_bytes(rows, cuda)
    assert need == 1000 * 256 * 2 + 3 * 1000 * 64 * 8 + 64 * 1000  # moved rows, 3 × words, sort and tree
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (need, 80 << 30))
    with pytest.raises(LCPError, match=r"building needs about .* on cuda, more than the .* free there"):
        limits.check_device_fits("building", need, cuda)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (2 * need, 80 << 30))
    limits.check_device_fits("building", need, cuda)  # fits: no error
    assert batch_bytes(torch.zeros((4, 3), dtype=torch.uint8), 10, 99) == 4 * 3 * 9 + 16 * 40 + 12 * 8 * (1 << 21)
