"""Device presets: sim/devices.toml's parts, each validated like a scenario table and looked up by name.

A preset is one part's datasheet figures (units in the key names) plus the names CUDA reports for it
(`torch.cuda.get_device_name`), so `pipeplan profile --gemm` knows the device it runs on by what it is called, not
by how much memory it has. A mistyped, missing or out-of-range key is a PresetError naming the preset and the
key, raised when the file is first read; sources for every figure are in devices.toml.
"""

from __future__ import annotations

import functools
import tomllib
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeplan.sim.errors import PipeplanError
from pipeplan.sim.field_errors import describe_validation_error

DEVICES_TOML = Path(__file__).parent / "devices.toml"

Pos = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Share = Annotated[float, Field(gt=0, le=1)]


class PresetError(PipeplanError):
    """A sim/devices.toml preset that fails its schema (a packaging or editing mistake, not a scenario's)."""


class DevicePreset(BaseModel):
    """One part's per-GPU figures (fields in devices.toml's order, which `pipeplan show` prints them in)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    cuda_names: list[str] = Field(default_factory=list)
    """Exactly what `torch.cuda.get_device_name` reports for this part; empty when that is not known."""
    peak_tflops: Pos
    """Dense bf16 tensor-core peak."""
    hbm_gib: Pos
    hbm_gbps: Pos
    host_link_gbps: Pos
    dram_gib: NonNeg
    dram_gbps: Pos
    nvme_gib: NonNeg
    nvme_gbps: Pos
    sm_count: Annotated[int, Field(gt=0)]
    gemm_efficiency: Share
    attention_efficiency: Share
    fp8_tflops: Pos | None = None
    """Dense FP8 peak; omitted for parts without FP8 tensor cores."""
    fp8_gemm_ratio: Share | None = None
    """An FP8 GEMM's share of the FP8 peak over a bf16 GEMM's share of the bf16 peak (devices.toml cites it)."""
    nvlink_gbps: Pos
    nvlink_latency_us: NonNeg
    nic_gbps: Pos
    nic_latency_us: NonNeg
    cublas_workspace_mib: NonNeg
    cuda_context_mib: NonNeg

    def figures(self) -> dict[str, float]:
        """The numeric figures by key, as a scenario's [device] table overrides them (absent ones left out)."""
        return self.model_dump(exclude={"cuda_names"}, exclude_none=True)


def load_presets() -> dict[str, DevicePreset]:
    """Every preset in sim/devices.toml, validated (read once per process)."""
    return read_presets(DEVICES_TOML)


@functools.cache
def read_presets(path: Path) -> dict[str, DevicePreset]:
    """Every preset in `path`, validated; a CUDA name claimed by two presets is refused (it must identify one)."""
    with path.open("rb") as f:
        raw = tomllib.load(f)
    presets: dict[str, DevicePreset] = {}
    owner: dict[str, str] = {}
    for name, table in raw.items():
        if not isinstance(table, dict):
            raise PresetError(f"{path.name} [{name}]: must be a table of figures (got {table!r})")
        try:
            preset = DevicePreset.model_validate(table)
        except ValidationError as exc:
            raise PresetError(f"{path.name} [{name}]: {describe_validation_error(exc, DevicePreset)}") from None
        for cuda_name in preset.cuda_names:
            if cuda_name in owner:
                raise PresetError(f"{path.name} [{name}]: cuda_names: {cuda_name!r} is already [{owner[cuda_name]}]'s; "
                                  "a CUDA name must identify one preset")
            owner[cuda_name] = name
        presets[name] = preset
    return presets


def device_presets() -> dict[str, dict[str, float]]:
    """Preset name -> its figures (a fresh dict per call: callers may update it with a scenario's overrides)."""
    return {name: p.figures() for name, p in load_presets().items()}


def recognise_preset(device_name: str) -> str | None:
    """The preset whose cuda_names lists `device_name` exactly (e.g. "NVIDIA H100 80GB HBM3"), else None: a
    part with other figures (an H100 PCIe, an H200 NVL) must not borrow a sibling's datasheet."""
    return next((name for name, p in load_presets().items() if device_name.strip() in p.cuda_names), None)
