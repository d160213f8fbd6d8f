"""Device presets (sim/devices.py): sim/devices.toml is validated like a scenario, and a CUDA device is known by
the name the driver gives it, not by its memory size."""

from __future__ import annotations

import pytest

from pipeplan.analysis.cli import main
from pipeplan.sim import devices
from pipeplan.sim.devices import PresetError, load_presets, read_presets, recognise_preset

SHIPPED = devices.DEVICES_TOML.read_text()


def edited(tmp_path, old: str, new: str):
    """sim/devices.toml with one edit, written to a scratch file."""
    assert old in SHIPPED
    path = tmp_path / "devices.toml"
    path.write_text(SHIPPED.replace(old, new, 1))
    return path


@pytest.mark.parametrize(("old", "new", "message"), [
    ("hbm_gbps = 3350.0", "hbm_gbs = 3350.0",
     r"devices\.toml \[H100-SXM-80GB\]: hbm_gbs: unknown key; allowed: cuda_names, peak_tflops, hbm_gib, hbm_gbps"),
    ("hbm_gbps = 2039.0\n", "", r"devices\.toml \[A100-80GB\]: hbm_gbps: missing required key"),
    ("gemm_efficiency = 0.51", "gemm_efficiency = 51.0",
     r"\[H100-HBM2e-96GB-500W\]: gemm_efficiency: input should be less than or equal to 1 \(got 51\.0\)"),
    ("sm_count = 108", 'sm_count = "108"', r"\[A100-80GB\]: sm_count: input should be a valid integer"),
    ('cuda_names = ["NVIDIA H200"]', 'cuda_names = ["NVIDIA H100 80GB HBM3"]',
     r"\[H200-141GB\]: cuda_names: 'NVIDIA H100 80GB HBM3' is already \[H100-SXM-80GB\]'s"),
])
def test_a_bad_preset_names_the_preset_and_the_key(tmp_path, old, new, message):
    with pytest.raises(PresetError, match=message):
        read_presets(edited(tmp_path, old, new))


def test_a_mistyped_preset_key_ends_simulate_with_exit_2_and_one_line(tmp_path, monkeypatch, capsys):
    """Before the schema, `simulate` read the figures by key and ended with "unexpected KeyError: hbm_gbps"."""
    monkeypatch.setattr(devices, "DEVICES_TOML", edited(tmp_path, "hbm_gbps = 3350.0", "hbm_gbs = 3350.0"))
    assert main(["simulate", "tiny-cpu", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("pipeplan simulate: error: devices.toml [H100-SXM-80GB]: hbm_gbs: unknown key; allowed: ")
    assert not (tmp_path / "out").exists()


def test_the_shipped_presets_load_with_their_figures():
    presets = load_presets()
    assert list(presets) == ["H100-SXM-80GB", "H100-HBM2e-96GB-500W", "H200-141GB", "A100-80GB", "A100-40GB"]
    assert presets["A100-80GB"].fp8_tflops is None  # no FP8 tensor cores: the key is absent, not 0
    assert "cuda_names" not in presets["H200-141GB"].figures()


@pytest.mark.parametrize(("device_name", "preset"), [
    ("NVIDIA H100 80GB HBM3", "H100-SXM-80GB"),  # the old 20 GiB memory window also matched the 96 GB part
    ("NVIDIA H200", "H200-141GB"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA H100 PCIe", None),  # 756 TFLOP/s, 2.0 TB/s: not the SXM part's datasheet
    ("NVIDIA H100 NVL", None),
    ("NVIDIA H200 NVL", None),
    ("NVIDIA A100 80GB PCIe", None),
    ("NVIDIA A100-PCIE-40GB", None),
    ("NVIDIA GeForce RTX 4090", None),
    ("", None),
])
def test_a_cuda_device_is_recognised_by_its_name(device_name, preset):
    assert recognise_preset(device_name) == preset
