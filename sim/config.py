"""The scenario: one typed, documented config tree for one training step, validated once at load.

A scenario has a `[pipeline]` table and then either explicit `[costs]` (schedule what-ifs, calibrated runs)
or a model with hardware (`[model]`, `[training]`, `[parallel]`, `[device]`, `[interconnect]`). Both forms
resolve to one `CostTable` (sim/costs.py), so everything downstream is form-agnostic. Units are in key names.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sim.errors import ScenarioError

NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Pos = Annotated[float, Field(gt=0, allow_inf_nan=False)]
PosInt = Annotated[int, Field(gt=0)]
PerChunk = NonNeg | list[NonNeg]  # a scalar, or one value per model chunk (stages * virtual_stages)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class PipelineConfig(_Section):
    stages: PosInt
    """Pipeline ranks p."""
    microbatches: PosInt
    """Microbatches m per step (per pipeline replica)."""
    schedule: str = "1f1b"
    """A name from sim.schedules (gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv, ...)."""
    virtual_stages: PosInt = 1
    """Model chunks per rank v; interleaved-1f1b and zbv use 2 or more."""

    @model_validator(mode="after")
    def _known_schedule(self) -> PipelineConfig:
        from sim.schedules import schedule_names

        names = schedule_names()
        if self.schedule not in names:
            raise ValueError(f"schedule: unknown schedule {self.schedule!r}; allowed: {', '.join(names)}")
        return self


class CostsConfig(_Section):
    forward_s: PerChunk
    backward_input_s: PerChunk
    """A full backward B takes backward_input_s + backward_weight_s."""
    backward_weight_s: PerChunk
    activation_bytes: PerChunk
    """Held from a chunk's forward until its backward frees it."""
    p2p_s: NonNeg = 0.0
    """Time to move one activation or gradient between two ranks."""
    static_bytes: PerChunk = 0.0
    """Weights, gradients and optimizer state of each chunk (resident in HBM for the whole step)."""
    hbm_gib: Pos | None = None
    """HBM capacity per rank; omitted means unbounded (no OOM check)."""


class ModelConfig(_Section):
    """A LLaMA-style decoder: RMSNorm, RoPE, GQA attention, SwiGLU MLP, untied embedding and LM head."""

    name: str = "llama"
    layers: PosInt
    hidden: PosInt
    ffn_hidden: PosInt
    heads: PosInt
    kv_heads: PosInt
    vocab: PosInt
    seq_len: PosInt

    @model_validator(mode="after")
    def _shapes(self) -> ModelConfig:
        if self.hidden % self.heads:
            raise ValueError(f"hidden: {self.hidden} must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: {self.kv_heads} must divide heads ({self.heads})")
        return self


class TrainingConfig(_Section):
    micro_batch_size: PosInt = 1
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    optimizer: Literal["adam", "sgd"] = "adam"
    distributed_optimizer: bool = False
    """Shard fp32 master weights and optimizer state across data-parallel ranks (ZeRO-1)."""


class ParallelConfig(_Section):
    tp: PosInt = 1
    dp: PosInt = 1
    sequence_parallel: bool = True
    """With tp > 1, shard norm/residual activations over TP too (Korthikanti et al. 2022)."""


class DeviceConfig(_Section):
    """A preset from sim/devices.toml; any key given here overrides the preset's value."""

    preset: str = "H100-SXM-80GB"
    peak_tflops: Pos | None = None
    efficiency: Annotated[float, Field(gt=0, le=1)] | None = None
    hbm_gib: Pos | None = None
    hbm_gbps: Pos | None = None
    host_link_gbps: Pos | None = None
    dram_gib: NonNeg | None = None
    dram_gbps: Pos | None = None
    nvme_gib: NonNeg | None = None
    nvme_gbps: Pos | None = None

    @model_validator(mode="after")
    def _known_preset(self) -> DeviceConfig:
        presets = device_presets()
        if self.preset not in presets:
            raise ValueError(f"preset: unknown device {self.preset!r}; allowed: {', '.join(presets)}")
        return self

    def resolved(self) -> dict[str, float]:
        """The preset's figures with this table's overrides applied."""
        values = dict(device_presets()[self.preset])
        values.update({k: v for k, v in self.model_dump(exclude={"preset"}).items() if v is not None})
        return values


class InterconnectConfig(_Section):
    p2p_gbps: Pos = 50.0
    """Bandwidth per direction between adjacent pipeline ranks (default: 400 Gb/s InfiniBand NDR)."""
    p2p_latency_us: NonNeg = 10.0
    tp_gbps: Pos = 450.0
    """Per-direction bandwidth inside a tensor-parallel group (default: H100 NVLink, 900 GB/s bidirectional)."""


class FreezeConfig(_Section):
    cap: Annotated[float, Field(ge=0, le=1)] = 0.9
    """Per stage, the mean freeze ratio over its freezable actions may not exceed this."""
    max_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    """Per action, the largest freeze ratio allowed."""
    backward_min_s: PerChunk | None = None
    """Duration of a fully frozen B per chunk; default backward_input_s."""
    weight_min_s: PerChunk | None = None
    """Duration of a fully frozen W per chunk; default 0."""
    curve: list[tuple[Annotated[float, Field(ge=0, le=1)], NonNeg]] | None = None
    """Optional convex time(r): (ratio, share of w_max - w_min still spent) points from (0, 1) to (1, 0)."""


class Scenario(_Section):
    pipeline: PipelineConfig
    costs: CostsConfig | None = None
    model: ModelConfig | None = None
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    interconnect: InterconnectConfig = Field(default_factory=InterconnectConfig)
    freeze: FreezeConfig = Field(default_factory=FreezeConfig)

    @model_validator(mode="after")
    def _one_form(self) -> Scenario:
        if (self.costs is None) == (self.model is None):
            raise ValueError("scenario: give exactly one of [costs] (explicit) or [model] (model-derived)")
        chunks = self.pipeline.stages * self.pipeline.virtual_stages
        if self.costs is not None:
            for key in ("forward_s", "backward_input_s", "backward_weight_s", "activation_bytes", "static_bytes"):
                _check_per_chunk(f"costs.{key}", getattr(self.costs, key), chunks)
        if self.model is not None and self.model.layers % chunks:
            raise ValueError(
                f"model.layers: {self.model.layers} is not divisible by pipeline.stages * "
                f"pipeline.virtual_stages = {chunks}; choose layers, stages and virtual_stages to divide"
            )
        for key in ("backward_min_s", "weight_min_s"):
            _check_per_chunk(f"freeze.{key}", getattr(self.freeze, key), chunks)
        return self

    @property
    def num_chunks(self) -> int:
        return self.pipeline.stages * self.pipeline.virtual_stages


def _check_per_chunk(field: str, value: Any, chunks: int) -> None:
    if isinstance(value, list) and len(value) != chunks:
        raise ValueError(
            f"{field}: has {len(value)} values; give a scalar or one per chunk "
            f"(pipeline.stages * pipeline.virtual_stages = {chunks})"
        )


def device_presets() -> dict[str, dict[str, float]]:
    with (Path(__file__).parent / "devices.toml").open("rb") as f:
        return tomllib.load(f)


def default_scenario_path() -> Path:
    from scenarios import scenario_path

    return scenario_path("llama3-8b-pp4-h100")


def load_scenario(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Scenario:
    """Read and validate a scenario TOML (None: the built-in default); `overrides` maps dotted keys to values."""
    path = Path(path) if path is not None else default_scenario_path()
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ScenarioError(f"scenario {path}: file not found") from None
    except IsADirectoryError:
        raise ScenarioError(f"scenario {path}: is a folder; give a .toml file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"scenario {path}: not valid TOML ({exc})") from None
    except UnicodeDecodeError:
        raise ScenarioError(f"scenario {path}: not valid TOML (not UTF-8 text)") from None
    for key, value in (overrides or {}).items():
        set_dotted(raw, key, value)
    return parse_scenario(raw, source=str(path))


def parse_scenario(raw: dict[str, Any], source: str = "scenario") -> Scenario:
    try:
        return Scenario.model_validate(raw)
    except ValidationError as exc:
        raise ScenarioError(f"{source}: {describe_validation_error(exc)}") from None


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set `raw["a"]["b"] = value` for key "a.b", creating tables as needed."""
    *tables, leaf = key.split(".")
    node = raw
    for t in tables:
        node = node.setdefault(t, {})
        if not isinstance(node, dict):
            raise ScenarioError(f"override {key}: {t} is not a table")
    node[leaf] = value


def describe_validation_error(exc: ValidationError) -> str:
    """One line for the first error: the dotted field, what is wrong and what is allowed."""
    errors = exc.errors(include_url=False)
    # a misspelt key explains the "missing" error that comes with it, so report unknown keys first
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = [str(p) for p in err["loc"] if not str(p).startswith(("function-", "tuple[", "list[", "float"))]
    field = ".".join(loc) or "scenario"
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        return f"{field}: unknown key; allowed: {', '.join(allowed)}"
    if kind == "missing":
        return f"{field}: missing required key"
    msg = err["msg"]
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
        # validators phrase their own message starting with the field they name
        head = msg.split(":", 1)[0]
        if "." in head or head in {"scenario"}:
            return msg
        return f"{'.'.join([*loc, head]) if loc else head}:{msg.split(':', 1)[1]}" if ":" in msg else msg
    given = err.get("input")
    shown = "" if isinstance(given, dict) else f" (got {given!r})"
    return f"{field}: {msg.lower()}{shown}"


def _allowed_keys(loc: list[str]) -> list[str]:
    model: type[BaseModel] = Scenario
    for part in loc:
        field = model.model_fields.get(part)
        if field is None:
            break
        ann = field.annotation
        options = getattr(ann, "__args__", (ann,))
        inner = next((a for a in options if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if inner is None:
            break
        model = inner
    return list(model.model_fields)

