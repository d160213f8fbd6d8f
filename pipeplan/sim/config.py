"""The scenario: one typed, documented config tree for one training step, validated once at load.

A scenario has a `[pipeline]` table and then either explicit `[costs]` (schedule what-ifs, calibrated runs)
or a model with hardware (`[model]`, `[training]`, `[parallel]`, `[device]`, `[interconnect]`). Both forms
resolve to one `CostTable` (sim/costs.py), so everything downstream is form-agnostic. Units are in key names.
"""

from __future__ import annotations

import itertools
import math
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeplan.common.io import InputError, read_input_bytes
from pipeplan.sim.devices import device_presets
from pipeplan.sim.errors import ScenarioError
from pipeplan.sim.field_errors import describe_validation_error
from pipeplan.sim.limits import MAX_NAME_CHARS, MAX_SCENARIO_BYTES, check_scenario_limits

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing.TypeIs from Python 3.13

NonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Pos = Annotated[float, Field(gt=0, allow_inf_nan=False)]
PosInt = Annotated[int, Field(gt=0)]
NonNegInt = Annotated[int, Field(ge=0)]
PerChunk = NonNeg | list[NonNeg]  # a scalar, or one value per model chunk (stages * virtual_stages)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class PipelineConfig(_Section):
    stages: PosInt
    """Pipeline ranks p."""
    microbatches: PosInt
    """Microbatches m per step (per pipeline replica)."""
    schedule: str = "1f1b"
    """A name registered in sim.schedules (`pipeplan simulate --help` lists them)."""
    virtual_stages: PosInt = 1
    """Model chunks per rank v; when omitted, what the schedule takes (zbv, v-half, interleaved-1f1b and
    chronos: 2; the others: 1)."""
    layers_per_stage: Literal["even", "balanced"] | list[NonNegInt] = "even"
    """Decoder layers per model chunk: "even" (as even as possible; when they do not divide, the last chunk,
    then the first, take the smaller count: they carry the LM head and the embedding), "balanced" (the split
    that minimises the slowest chunk's F+B time, embedding, LM head and loss included), or one count per chunk
    (stages * virtual_stages entries summing to model.layers)."""
    account_for_embedding: bool = False
    """Count the embedding as one layer in the split (Megatron --account-for-embedding-in-pipeline-split)."""
    account_for_loss: bool = False
    """Count the LM head + loss as one layer in the split (Megatron --account-for-loss-in-pipeline-split)."""
    admission_cap: PosInt | None = None
    """chronos only: the most chunk-activations a rank may hold or reserve (its list scheduler's cap); default:
    the smallest cap within 5% of the uncapped step (unit costs). 2 * ((stages + 2) // 2) at virtual_stages = 2
    is V-Half's cap; with stash_limit set to it as well, it gives v-half's order."""
    stash_limit: NonNegInt | None = None
    """chronos only: once a rank holds this many chunk-activations whose W has not run (live, or kept for W
    after I: the W stash), its pending W runs before new forwards; default virtual_stages * (stages + 1). Set
    to admission_cap, the stash counts against the same cap; 0 keeps no stash at all: the backward is not
    split (B instead of I + W)."""
    order_timing: Literal["unit", "costs"] = "unit"
    """chronos only: the clock its list scheduler builds the order on. "unit": T_F = T_I = T_W = 1, T_B = 2 and
    nothing on the wire, one order for any costs. "costs": this scenario's cost table (each chunk's F, I and W
    times and the P2P hop), so each greedy choice is made at the moment the step will really reach it; the
    default cap is then chosen on that clock too (docs/schedules.md)."""
    p2p_buffers: Literal["per-exchange", "per-microbatch"] = "per-exchange"
    """What a rank's sends and receives hold. "per-exchange": a buffer allocated for each message and freed
    with the tensor it becomes, a sent output freed after its send (Megatron-LM's p2p_communication.py and
    deallocate_output_tensor, pipeplan's runtime/p2p.py). "per-microbatch": torch.distributed.pipelining as of
    torch 1963fc8 (December 2024, torchtitan's pipeline): every stage allocates, once for the whole run, one
    activation receive buffer per microbatch (not the first stage; the buffer is the stage's input) and one
    gradient receive buffer per microbatch (not the last stage), and keeps every microbatch's output
    (`output_chunks`) and input gradient (the buffer's `.grad`) until the next step starts
    (sim/p2p_buffers.py, docs/cost-model.md). Needs a [model] scenario."""

    @model_validator(mode="before")
    @classmethod
    def _default_virtual_stages(cls, data: Any) -> Any:
        if isinstance(data, dict) and "virtual_stages" not in data and isinstance(data.get("schedule"), str):
            from pipeplan.sim.schedules import default_virtual_stages

            data = {**data, "virtual_stages": default_virtual_stages(data["schedule"])}
        return data

    @model_validator(mode="after")
    def _known_schedule(self) -> PipelineConfig:
        from pipeplan.sim.schedules import schedule_names

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
    checkpoint_bytes: PerChunk = 0.0
    """What a chunk keeps per microbatch under full recomputation (its input); default 0."""
    hbm_gib: Pos | None = None
    """HBM capacity per rank; omitted means unbounded (no OOM check)."""


class ModelConfig(_Section):
    """A decoder-only transformer. `architecture` picks the layer (docs/cost-model.md):

    llama  RMSNorm, RoPE, GQA attention, SwiGLU MLP (ffn_hidden required), untied embedding and LM head.
    gpt    LayerNorm with bias, learned position embeddings, MHA, GeLU MLP (ffn_hidden = 4 * hidden by default),
           biases, tied embedding and LM head (Megatron's GPT, the Megatron-LM and Zero Bubble papers' model).

    `config` names a local Hugging Face config.json whose shape fills the keys not given here (sim/hf_config.py).
    """

    name: Annotated[str, Field(max_length=MAX_NAME_CHARS)] = "llama"
    architecture: Literal["llama", "gpt"] = "llama"
    config: str | None = None
    """Path of a Hugging Face config.json (relative to the scenario file); explicit keys win over it."""
    layers: PosInt
    hidden: PosInt
    ffn_hidden: PosInt
    heads: PosInt
    kv_heads: PosInt
    vocab: PosInt
    seq_len: PosInt
    tied_embeddings: bool
    """Embedding and LM head share one matrix (default: false for llama, true for gpt)."""

    @model_validator(mode="before")
    @classmethod
    def _architecture_defaults(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        out = dict(raw)
        arch = out.get("architecture", "llama")
        if isinstance(out.get("heads"), int) and "kv_heads" not in out:
            out["kv_heads"] = out["heads"]  # multi-head attention unless GQA is asked for
        if arch == "gpt" and isinstance(out.get("hidden"), int) and "ffn_hidden" not in out:
            out["ffn_hidden"] = 4 * out["hidden"]
        out.setdefault("tied_embeddings", arch == "gpt")
        return out

    @model_validator(mode="after")
    def _shapes(self) -> ModelConfig:
        if self.hidden % self.heads:
            raise ValueError(f"hidden: {self.hidden} must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: {self.kv_heads} must divide heads ({self.heads})")
        return self


class TrainingConfig(_Section):
    micro_batch_size: PosInt = 1
    dtype: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"
    """fp8: GEMMs at the device's FP8 rate (Transformer Engine), everything stored as bf16."""
    optimizer: Literal["adam", "sgd"] = "adam"
    distributed_optimizer: bool = False
    """Shard fp32 master weights and optimizer state across data-parallel ranks (ZeRO-1; = parallel.zero 1)."""
    optimizer_post_validation: bool = False
    """No barrier before the optimizer step (the Zero Bubble fork's `--enable-optimizer-post-validation`): each
    rank steps its optimizer as soon as its own backward work is done and validates the global gradient norm
    and inf/NaN check afterwards, rolling back if needed, so the next step starts per rank and consecutive
    steps overlap across ranks. The step time becomes the longest rank's own span (SimResult.step_time_s).
    false: Megatron-LM's all-reduce of those checks across the pipeline ends every step on every rank."""
    framework: Literal["megatron", "deepspeed", "torch"] = "megatron"
    """Whose mixed-precision optimizer holds the model states (sim/cost_model.state_bytes_per_param cites each):
    megatron (fp32 main_grad beside the 16-bit weights; parallel.zero 1 is the distributed optimizer) |
    deepspeed (bf16 with ZeRO 0-1: the BF16_Optimizer wrapper, which keeps the bf16 grads beside a full fp32
    gradient accumulation buffer; otherwise the ZeRO optimizer or FP16_Optimizer, 16-bit grads) | torch
    (autocast: fp32 parameters are the master copy, no 16-bit copy; FSDP2 with parallel.zero 3)."""
    fp8_recipe: Literal["delayed", "current"] = "delayed"
    """Transformer Engine's FP8 scaling (training.dtype = "fp8"): delayed (DelayedScaling: the scale from the amax
    history, the new amax recorded inside the cast) | current (Float8CurrentScaling, NeMo's "FP8-CS": each
    tensor's own amax, a reduction pass before its cast)."""
    grad_reduce_in_fp32: bool = True
    """Megatron-Core's gradient buffer (main_grad) and its data-parallel reduction in fp32 (the default); false:
    in the training dtype, 2 bytes per parameter instead of 4 (`ddp.grad_reduce_in_fp32 = False`, which
    Megatron-Bridge's Llama3 performance recipes set). Framework megatron, ZeRO 0-2."""
    optimizer_impl: Literal["fused", "foreach"] = "fused"
    """fused: one kernel per tensor group, no temporaries (Apex/TE FusedAdam in Megatron, torch fused AdamW);
    foreach: torch's multi-tensor Adam, which allocates one fp32 temporary per parameter during the step."""
    attention: Literal["flash", "eager"] = "flash"
    """flash keeps no s x s tensors; eager keeps the softmax output (and, with dropout, its mask and output)."""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Attention and hidden dropout probability; above 0 each dropout keeps a 1-byte mask (Korthikanti)."""
    compile: bool = True
    """Element-wise work runs fused: torch.compile's Inductor kernels, or Megatron-LM's hand-fused kernels (fused
    norms, bias-GeLU, bias-dropout-add), so true describes Megatron runs too. false: PyTorch eager, every
    element-wise op its own kernel with its own reads, writes and saved tensors (torchtitan's
    `training.compile = false`; sim/layer_ops.py counts both)."""
    float8_linears: bool = False
    """The transformer layers' linears run as Float8 GEMMs at the device's FP8 rate with dynamic tensor-wise
    scaling (torchao Float8Linear, torchtitan `float8.enable_float8_linear`): bf16 weights and activations, plus
    the memory-bound amax and cast of every operand. The LM head stays bf16. Needs a device with fp8_tflops."""
    loss_impl: Literal["fused", "torch-fp32"] = "fused"
    """The cross entropy's memory (sim/overheads.py). "fused": Megatron's vocab-parallel cross entropy: keeps
    fp32 logits (4 bytes per logit) and, while the backward starts, a bf16 and an fp32 gradient (e + 4 more).
    "torch-fp32": torchtitan's `cross_entropy(pred.float(), labels)` (train.py at 9dec370): log_softmax keeps
    its fp32 output (4); the backward holds two more fp32 tensors (8), or three under loss_parallel, which
    torchtitan turns on with TP (12)."""


class ParallelConfig(_Section):
    tp: PosInt = 1
    dp: PosInt = 1
    cp: PosInt = 1
    """Context parallelism: each sequence split over cp ranks (load-balanced causal chunks), attention exchanging
    K and V among them (sim/context_parallel.py). GPUs = stages x tp x dp x cp; the cp ranks share weights,
    so gradients reduce and ZeRO/FSDP shards over dp x cp. Needs flash attention and seq_len divisible by 2 cp."""
    cp_comm: Literal["p2p-ring", "all-gather"] = "p2p-ring"
    """How K and V move between context-parallel ranks. p2p-ring: Megatron-Core / Transformer Engine's ring of
    send/recv, each step's transfer overlapped with the previous chunk's attention. all-gather: torch's
    context_parallel as torchtitan ran it in 2024 (rotate method ALL_GATHER), one all-gather overlapped with
    the local chunk only, the K/V gradients reduce-scattered in fp32 after the backward."""
    sequence_parallel: bool = True
    """With tp > 1, shard norm/residual activations over TP too (Korthikanti et al. 2022)."""
    zero: Literal[0, 1, 2, 3] = 0
    """Data-parallel sharding: 1 optimizer state + fp32 master (Megatron distributed optimizer), 2 + gradients,
    3 + parameters (FSDP / ZeRO-3, parameters all-gathered per layer)."""
    zero3_prefetch: Literal["one-layer", "hidden"] = "one-layer"
    """ZeRO-3 without a pipeline re-gathers every layer's parameters in each microbatch's F and B and
    reduce-scatters its gradients after each B (FSDP2's default reshard_after_forward, DeepSpeed stage 3).
    "one-layer": each gather is prefetched one layer ahead on its own stream, so a pass over a chunk takes
    max(compute, its parameter traffic) (sim.data_parallel.zero3_pass_comm_s). "hidden": the traffic is free, an
    upper bound on any overlap (pipeplan before this key). With a pipeline (stages > 1) the parameters stay
    gathered for the whole step (torchtitan: reshard_after_forward = not pp_enabled) and neither applies."""
    gpus_per_node: PosInt = 8
    """Ranks are laid out TP innermost, then PP, then DP (Megatron's order); a group inside one node talks
    over NVLink, one spanning nodes over the network."""
    overlap_grad_reduce: bool = True
    """Bucketed data-parallel gradient reduction overlapped with the backward (Megatron --overlap-grad-reduce,
    torch DDP/FSDP); false reduces after the last backward."""
    tp_style: Literal["megatron", "dtensor"] = "megatron"
    """How the TP linears are written, which decides what their collectives move and what the backward needs
    again. "megatron": Megatron-LM's layers, which with sequence parallelism save the input shard and
    all-gather it again for the weight gradient; collectives in the training dtype. "dtensor": torch's
    ColwiseParallel / RowwiseParallel (torchtitan): the matmul saves the gathered input, so nothing is
    re-gathered, and with `training.float8_linears` the all-gathers move float8 (torchao's
    PrepareFloat8ModuleInput / Float8ColwiseParallel cast before gathering, Float8RowwiseParallel casts the
    output gradient before its backward all-gather). sim/tp_comm.py. Without sequence parallelism it also decides
    how a pipeline hop moves: "megatron" by Megatron-LM's scatter-gather of 2021-2022 (1/t per TP rank, then an
    all-gather over TP on the receiver), "dtensor" whole (sim.cost_model.p2p_transfer_s); `p2p_scatter_gather`
    overrides that."""
    p2p_scatter_gather: bool | None = None
    """Without sequence parallelism, whether a pipeline hop goes by Megatron-LM's scatter-gather of 2021-2022
    (`--scatter-gather-tensors-in-pipeline`: each TP rank sends 1/t of the boundary tensor and the receiver
    all-gathers it over TP) or whole (Megatron-Core since 3c92fa93b5, March 2023, and torch pipelining). None:
    on for tp_style "megatron", off for "dtensor". true needs tp_style "megatron" and, with tp > 1, sequence
    parallelism off (Megatron skips the scatter-gather under SP; at tp = 1 there is nothing to split). Even on,
    a hop whose element count s·b·h does not divide by t goes whole, as Megatron's `_communicate` does
    (megatron/p2p_communication.py lines 148-162 at 0b44909c1a; sim.cost_model.p2p_transfer_s)."""
    tp_comm_overlap: Literal["none", "full", "async-tp"] = "none"
    """How the TP collectives overlap the GEMMs. "none": each adds to its pass. "full": a pass takes
    max(GEMMs, collectives), an upper bound (Megatron --tp-comm-overlap with Transformer Engine's
    userbuffers). "async-tp": torch's micro-pipeline TP (torchtitan's AsyncTP; needs tp_style = "dtensor" and
    sequence parallelism): only the all-gather -> matmul and matmul -> reduce-scatter pairs the Inductor pass
    matches are decomposed into tp chunks, each hiding all but one chunk's GEMM of its communication; the rest
    stays exposed (sim/tp_comm.py). true and false mean "full" and "none"."""

    @model_validator(mode="before")
    @classmethod
    def _overlap_from_bool(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("tp_comm_overlap"), bool):
            data = {**data, "tp_comm_overlap": "full" if data["tp_comm_overlap"] else "none"}
        return data

    @model_validator(mode="after")
    def _async_tp_needs_dtensor(self) -> ParallelConfig:
        if self.tp_comm_overlap == "async-tp" and self.tp_style != "dtensor":
            raise ValueError('tp_comm_overlap: "async-tp" is torch\'s micro-pipeline TP, which fuses DTensor '
                             'TP\'s collectives; set parallel.tp_style = "dtensor" (or use "full" or "none")')
        if self.tp_comm_overlap == "async-tp" and self.tp > 1 and not self.sequence_parallel:
            raise ValueError('tp_comm_overlap: "async-tp" fuses the all-gathers and reduce-scatters of sequence '
                             'parallelism; set parallel.sequence_parallel = true (or use "full" or "none")')
        if self.p2p_scatter_gather and self.tp_style != "megatron":
            raise ValueError('p2p_scatter_gather: true is Megatron-LM\'s scatter-gather; it needs '
                             'parallel.tp_style = "megatron"; or set it false or omit it')
        if self.p2p_scatter_gather and self.tp > 1 and self.sequence_parallel:
            raise ValueError("p2p_scatter_gather: true needs parallel.sequence_parallel = false (with SP each "
                             "TP rank sends only its shard); or set it false or omit it")
        return self

    @property
    def scatter_gather_p2p(self) -> bool:
        """p2p_scatter_gather resolved: as given, else on for tp_style "megatron"."""
        if self.p2p_scatter_gather is not None:
            return self.p2p_scatter_gather
        return self.tp_style == "megatron"


class DeviceConfig(_Section):
    """A preset from sim/devices.toml; any key given here overrides the preset's value."""

    preset: str = "H100-SXM-80GB"
    peak_tflops: Pos | None = None
    efficiency: Annotated[float, Field(gt=0, le=1)] | None = None
    """Flat share of peak for GEMMs and attention alike: replaces the per-GEMM curve (sim/roofline.py)."""
    gemm_efficiency: Annotated[float, Field(gt=0, le=1)] | None = None
    """The curve's large-GEMM asymptote: the one calibration per device (`pipeplan profile` measures it)."""
    attention_efficiency: Annotated[float, Field(gt=0, le=1)] | None = None
    fp8_gemm_ratio: Annotated[float, Field(gt=0, le=1)] | None = None
    """An FP8 GEMM's share of the FP8 peak over a bf16 GEMM's share of the bf16 peak (sim/devices.toml)."""
    hbm_gib: Pos | None = None
    hbm_gbps: Pos | None = None
    sm_count: PosInt | None = None
    """Streaming multiprocessors that wave quantisation fills (sim/roofline.py); `pipeplan profile --gemm`
    writes the device's own count with the curve it fits."""
    host_link_gbps: Pos | None = None
    dram_gib: NonNeg | None = None
    dram_gbps: Pos | None = None
    nvme_gib: NonNeg | None = None
    nvme_gbps: Pos | None = None
    nvlink_efficiency: Annotated[float, Field(gt=0, le=1)] | None = None
    """Share of the NVLink line rate NCCL sustains (large-message nccl-tests busbw / line rate)."""
    nic_efficiency: Annotated[float, Field(gt=0, le=1)] | None = None
    """Share of the NIC line rate NCCL sustains between nodes (large-message busbw / line rate)."""

    @model_validator(mode="after")
    def _known_preset(self) -> DeviceConfig:
        presets = device_presets()
        if self.preset not in presets:
            raise ValueError(f"preset: unknown device {self.preset!r}; allowed: {', '.join(presets)}")
        return self

    def resolved(self) -> dict[str, float]:
        """The preset's figures with this table's overrides applied (`efficiency` only when given)."""
        values = dict(device_presets()[self.preset])
        values.update({k: v for k, v in self.model_dump(exclude={"preset"}).items() if v is not None})
        return values


class InterconnectConfig(_Section):
    """Link figures per GPU and direction; omitted ones come from the [device] preset (its node's NVLink and
    NICs). A group of ranks inside one node uses the intra-node figures, one spanning nodes the inter-node ones."""

    intra_node_gbps: Pos | None = None
    """NVLink bandwidth per GPU and direction, as NCCL sustains it: taken as given (the preset's figure is
    nvlink_gbps x nvlink_efficiency; this one gets no efficiency applied)."""
    intra_node_latency_us: NonNeg | None = None
    inter_node_gbps: Pos | None = None
    """InfiniBand/RoCE bandwidth per GPU and direction (one NIC per GPU on DGX nodes), taken as given (the
    preset's figure is nic_gbps x nic_efficiency)."""
    inter_node_latency_us: NonNeg | None = None
    p2p_gbps: Pos | None = None
    """Explicit override: bandwidth between adjacent pipeline ranks, wherever they sit."""
    p2p_latency_us: NonNeg | None = None
    tp_gbps: Pos | None = None
    """Explicit override: per-direction bandwidth inside a tensor-parallel group."""
    p2p_blocking: bool = False
    """The pipeline runtime waits for each P2P send to complete before the rank computes again, as Megatron-LM's
    1F1B and interleaved schedules do (p2p_communication.py `_communicate` waits on every request it posts).
    False: sends overlap the sender's next action (the Zero Bubble fork's runtime waits only on receives)."""


Unit = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
CurvePoint = Annotated[list[Unit], Field(min_length=2, max_length=2)]
FreezeCurve = Annotated[list[CurvePoint], Field(min_length=2)]


class FreezeConfig(_Section):
    """Freeze planning (`pipeplan plan`): what freezing may do and what it saves (docs/freeze-planner.md).

    An action's freeze ratio r in [0, 1] is the share of its weight-gradient work skipped; its duration falls
    from w_max (unfrozen) to w_min (fully frozen), linearly unless `curve` is given.
    """

    cap: Annotated[float, Field(ge=0, le=1)] = 0.9
    """Per stage, the mean freeze ratio over its freezable actions (B, or W when backward is split) may not
    exceed this; 0 plans no freezing."""
    max_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    """Per action, the largest freeze ratio allowed."""
    backward_min_s: PerChunk | None = None
    """Duration of a fully frozen B per chunk; default backward_input_s. Must not exceed the unfrozen B."""
    weight_min_s: PerChunk | None = None
    """Duration of a fully frozen W per chunk; default 0. Must not exceed backward_weight_s."""
    curve: FreezeCurve | list[FreezeCurve] | None = None
    """Optional convex time(r), e.g. [[0, 1], [0.5, 0.3], [1, 0]]: (ratio, share of w_max - w_min still
    spent) points from [0, 1] to [1, 0], non-increasing and convex; or one such list per chunk."""

    @model_validator(mode="after")
    def _convex_curves(self) -> FreezeConfig:
        if self.curve is None:
            return self
        if not self.curve:
            raise ValueError("curve: empty; give points from [0, 1] to [1, 0], e.g. [[0, 1], [1, 0]], or omit it")
        per_chunk = _per_chunk_curves(self.curve)
        curves = self.curve if _per_chunk_curves(self.curve) else [self.curve]  # (the call narrows the type)
        for k, pts in enumerate(curves):
            where = f"curve (chunk {k})" if per_chunk else "curve"
            _check_freeze_curve(where, pts)
        return self

    def curves(self, chunks: int) -> list[list[tuple[float, float]]] | None:
        """One (ratio, share still spent) curve per chunk, or None for the linear model."""
        if self.curve is None:
            return None
        if _per_chunk_curves(self.curve):
            return [[(float(x), float(y)) for x, y in pts] for pts in self.curve]
        return [[(float(x), float(y)) for x, y in self.curve]] * chunks


def _per_chunk_curves(curve: list[list[float]] | list[list[list[float]]]) -> TypeIs[list[list[list[float]]]]:
    """Whether freeze.curve is one curve per chunk (its first point is itself a list) rather than one curve."""
    return isinstance(curve[0][0], list)


def _check_freeze_curve(where: str, pts: list[list[float]]) -> None:
    """time(r) runs from (0, 1) to (1, 0), never rises, and is convex: the LP takes it as a max of lines."""
    if (tuple(pts[0]), tuple(pts[-1])) != ((0.0, 1.0), (1.0, 0.0)):
        raise ValueError(
            f"{where}: must start at [0, 1] and end at [1, 0] (ratio, share of w_max - w_min still spent); "
            f"got {pts[0]} ... {pts[-1]}"
        )
    if any(b[0] <= a[0] for a, b in itertools.pairwise(pts)):
        ratios = [p[0] for p in pts]
        raise ValueError(f"{where}: ratios must increase strictly from point to point; got {ratios}")
    slopes = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(pts)]
    if any(s > 0 for s in slopes):
        raise ValueError(f"{where}: time(r) rises between some points; freezing more must never take longer")
    bend = next((k for k, (s0, s1) in enumerate(itertools.pairwise(slopes)) if s1 < s0 - 1e-12), None)
    if bend is not None:
        raise ValueError(
            f"{where}: time(r) is not convex at point {pts[bend + 1]} (slopes must not decrease); "
            f"the LP models time(r) as the maximum of its segments"
        )


Tier = Literal["hbm", "dram", "nvme"]
# sim.memory.RECOMPUTE implements exactly these
RecomputePolicy = Literal["none", "full", "selective", "selective-op", "chronos"]
RECOMPUTE_POLICIES: tuple[str, ...] = get_args(RecomputePolicy)


HBM_MARGIN_SHARE = 0.05
"""Default share of HBM capacity kept free when memory.hbm_margin_gib is not given (MemoryConfig.margin_bytes)."""


class MemoryConfig(_Section):
    """Where activations and model states live: recomputation and the HBM -> DRAM -> NVMe offload tiers."""

    recompute: RecomputePolicy | list[RecomputePolicy] = "none"
    """none | full (keep layer inputs, recompute each layer before its backward) | selective (Megatron's: drop
    the attention core's tensors, recompute only the core) | selective-op (torchtitan's op-level selective
    checkpointing: keep the outputs of every other matmul and of attention, recompute the rest) | chronos (full
    recomputation of the longest-lived chunks only); or one per chunk."""
    offload_activations: Annotated[float, Field(ge=0, le=1)] = 0.0
    """Share of each kept activation copied to host after its forward and prefetched before its backward."""
    activations_tier: Literal["dram", "nvme"] = "dram"
    offload_stash: Annotated[float, Field(ge=0, le=1)] | Literal["auto"] = 0.0
    """Share of each split backward's W stash (the weight GEMMs' inputs and output gradients, kept from I's end
    to W's end) copied to DRAM after its I and prefetched before its W; "auto": the memory MILP chooses per
    chunk (needs plan = true)."""
    optimizer: Tier = "hbm"
    """Where Adam's m and v live; off HBM, the optimizer step runs on the host after each chunk's last backward."""
    master_weights: Tier = "hbm"
    """Where the fp32 master copy lives; it goes with the optimizer step, so left unset it follows `optimizer`."""
    gradients: Tier = "hbm"
    """Where the fp32 gradient accumulation buffer lives (HBM keeps a bf16 buffer, copied out at the end)."""
    hbm_margin_gib: NonNeg | None = None
    """HBM kept free, GiB: `fits` compares each rank's peak with capacity minus this. None (the default):
    HBM_MARGIN_SHARE of the device's capacity, 4 GiB of an 80 GB part. The memory model's mean |error| over the
    82 published peak-memory rows is 4.8% (docs/validation.md), and where it under-predicts, it does so by up
    to 4.6% (torchtitan's 70B 2D run) outside the 405B 1F1B outlier (-21%): a configuration predicted within 5%
    of capacity is not called a fit. 0 trusts the model to the byte."""
    fragmentation: Annotated[float, Field(ge=0, lt=1)] = 0.15
    """Share of the caching allocator's reserved activation memory lost to fragmentation: activations take
    1 / (1 - fragmentation) of their bytes. 0.15 is GMLake's mean over eight LLMs on A100-80GB (Guo et al.,
    ASPLOS 2024, arXiv 2401.08156: fragmentation reduced by 15% on average, up to 33%)."""
    runtime_overheads: bool = True
    """Count the CUDA context, cuBLAS workspace and NCCL buffers in HBM (docs/cost-model.md)."""
    activation_model: Literal["llama", "megatron"] = "llama"
    """Bytes per layer: pipeplan's LLaMA count, or Megatron-LM's theoretical sbh(18 + 4f/h)."""
    prefetch_lookahead: PosInt = 2
    """A backward's offloaded activations are fetched back when the rank starts the action this many before it."""
    offload_weights: Literal["none", "all", "auto"] | list[bool] = "none"
    """Chronos-Offload of weights: a chunk's bf16 working weights leave HBM between uses that are more than
    prefetch_lookahead actions apart (and across the step boundary) and are prefetched on the copy engine
    before the next use. none | all | auto (the memory MILP chooses per chunk; needs plan = true) | one bool
    per chunk."""
    copy_granularity: Literal["chunk", "layer"] = "chunk"
    """How an offloaded activation or W-stash copy moves: chunk (one copy per chunk and microbatch, after the
    producing action ends and before the consumer starts) | layer (layer by layer: the copy out starts when the
    producer's first offloaded layer is done, and the consumer runs its layers that need nothing from the host
    while the rest comes back; sim.graph.layer_copy). The freeze planner takes chunk only."""
    recompute_norms: bool = False
    """Drop each layer's two norm outputs (the QKV and MLP-up GEMMs' inputs) after their GEMMs' forward and redo
    the norms before the backward needs them, on every layer not recomputed whole or op-level: Megatron-Core's
    `recompute_modules = ["layernorm"]` (output-discarding checkpointing, megatron/core/transformer/
    transformer_layer.py). Without sequence parallelism the norm outputs are replicated over TP, about a third
    of a LLaMA layer's bytes, for a memory-bound pass of ~1 % of its compute (docs/memory.md)."""
    plan: bool = False
    """Let the MILP memory planner choose recompute/offload per chunk (ignores recompute/offload_activations)."""
    plan_recompute: Literal["full", "full+op"] = "full+op"
    """What the planner may recompute per layer: full (whole layers only) | full+op (whole layers, or op-level
    as selective-op does: keep every other matmul's output and attention's, redo the rest; on LLaMA-2 70B it
    frees 66 % of a layer's bytes for 50 % of the time, docs/memory.md)."""

    def margin_bytes(self, capacity_bytes: float) -> float:
        """The HBM kept free on a device of `capacity_bytes`: hbm_margin_gib, or by default HBM_MARGIN_SHARE of
        the capacity (none for an unbounded one)."""
        if self.hbm_margin_gib is not None:
            return self.hbm_margin_gib * 2**30
        return HBM_MARGIN_SHARE * capacity_bytes if math.isfinite(capacity_bytes) else 0.0

    @model_validator(mode="before")
    @classmethod
    def _master_weights_follow_the_optimizer(cls, data: Any) -> Any:
        if isinstance(data, dict) and "master_weights" not in data and "optimizer" in data:
            data = {**data, "master_weights": data["optimizer"]}
        return data


class Scenario(_Section):
    pipeline: PipelineConfig
    costs: CostsConfig | None = None
    model: ModelConfig | None = None
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    device: DeviceConfig = Field(default_factory=DeviceConfig)
    interconnect: InterconnectConfig = Field(default_factory=InterconnectConfig)
    freeze: FreezeConfig = Field(default_factory=FreezeConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)

    @model_validator(mode="after")
    def _one_form(self) -> Scenario:
        if (self.costs is None) == (self.model is None):
            raise ValueError("scenario: give exactly one of [costs] (explicit) or [model] (model-derived)")
        check_scenario_limits(self)  # sizes first: the per-chunk checks below are O(chunks)
        chunks = self.pipeline.stages * self.pipeline.virtual_stages
        if self.costs is not None:
            keys = ("forward_s", "backward_input_s", "backward_weight_s", "activation_bytes", "static_bytes")
            for key in (*keys, "checkpoint_bytes"):
                _check_per_chunk(f"costs.{key}", getattr(self.costs, key), chunks)
            if self.pipeline.p2p_buffers != "per-exchange":
                raise ValueError(f"pipeline.p2p_buffers: '{self.pipeline.p2p_buffers}' needs a [model] scenario "
                                 "(explicit [costs] give no boundary tensor to size the buffers); use 'per-exchange'")
        if self.model is not None:
            _check_layer_split(self.pipeline, self.model.layers, chunks)
        _check_per_chunk("memory.recompute", self.memory.recompute, chunks)
        _check_per_chunk("memory.offload_weights", self.memory.offload_weights, chunks)
        if self.memory.offload_stash == "auto" and not self.memory.plan:
            raise ValueError("memory.offload_stash: 'auto' lets the memory MILP choose; set memory.plan = true, "
                             "or give a share in [0, 1]")
        if self.memory.recompute_norms and self.model is None:
            raise ValueError("memory.recompute_norms: needs a [model] scenario (explicit [costs] have no norms); "
                             "set it to false")
        if self.memory.recompute_norms and not self.norms_recomputable:
            raise ValueError('memory.recompute_norms: with parallel.tp_style = "dtensor" and sequence parallelism or '
                             "Float8 linears, torch's ColwiseParallel keeps the gathered norm output, which "
                             'recomputing the norm does not free; use tp_style = "megatron" or set it to false')
        if self.memory.offload_weights == "auto" and not self.memory.plan:
            raise ValueError("memory.offload_weights: 'auto' lets the memory MILP choose; set memory.plan = true, "
                             "or give none | all | one bool per chunk")
        for key in ("backward_min_s", "weight_min_s"):
            _check_per_chunk(f"freeze.{key}", getattr(self.freeze, key), chunks)
        return self

    @property
    def num_chunks(self) -> int:
        return self.pipeline.stages * self.pipeline.virtual_stages

    @property
    def norms_recomputable(self) -> bool:
        """Whether recomputing the norms frees their outputs (memory.recompute_norms): not where torch's TP
        keeps a gathered copy of them instead (sim.activations.layer_memory's `gathered`)."""
        p, tr = self.parallel, self.training
        gathers = p.tp > 1 and (p.sequence_parallel or tr.float8_linears)
        return self.model is not None and not (p.tp_style == "dtensor" and gathers)


def _check_layer_split(p: PipelineConfig, layers: int, chunks: int) -> None:
    split = p.layers_per_stage
    if isinstance(split, list):
        if len(split) != chunks:
            raise ValueError(
                f"pipeline.layers_per_stage: has {len(split)} entries; give one per chunk "
                f"(pipeline.stages * pipeline.virtual_stages = {chunks})"
            )
        if sum(split) != layers:
            raise ValueError(f"pipeline.layers_per_stage: sums to {sum(split)}; must sum to model.layers = {layers}")
        return
    slots = layers + int(p.account_for_embedding) + int(p.account_for_loss)
    if slots < chunks:
        raise ValueError(
            f"model.layers: {layers} layers cannot fill pipeline.stages * pipeline.virtual_stages = {chunks} "
            f"chunks; use fewer stages or give pipeline.layers_per_stage explicitly"
        )


def _check_per_chunk(field: str, value: Any, chunks: int) -> None:
    if isinstance(value, list) and len(value) != chunks:
        raise ValueError(
            f"{field}: has {len(value)} values; give a scalar or one per chunk "
            f"(pipeline.stages * pipeline.virtual_stages = {chunks})"
        )


def default_scenario_path() -> Path:
    from pipeplan.scenarios import scenario_path

    return Path(scenario_path("llama3-8b-pp4-h100"))  # Path(): mypy cannot see pipeplan.scenarios


def resolve_scenario_path(path: str | Path | None) -> Path:
    """A file path as given; a bare name that is no file but a shipped scenario's stem, that scenario."""
    if path is None:
        return default_scenario_path()
    path = Path(path)
    if not path.exists() and path.suffix == "" and len(path.parts) == 1:
        from pipeplan.scenarios import scenario_names, scenario_path

        if path.name in scenario_names():
            return Path(scenario_path(path.name))
        raise ScenarioError(
            f"scenario {path}: no such file and no shipped scenario of that name; shipped: "
            f"{', '.join(scenario_names())} (pipeplan scenarios lists them)"
        )
    return path


def load_scenario(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Scenario:
    """Read and validate a scenario TOML (None: the built-in default; a shipped scenario's name, e.g.
    "tiny-cpu", also works); `overrides` maps dotted keys to values."""
    path = resolve_scenario_path(path)
    try:  # a regular file of bounded size: a fifo is refused before it is opened, 2 GiB before it is read
        raw = tomllib.loads(read_input_bytes(path, MAX_SCENARIO_BYTES, "scenario").decode().removeprefix("\ufeff"))
    except InputError as exc:
        raise ScenarioError(str(exc).replace("is a folder, not a regular file; give a file", "is a folder; give a "
                                             ".toml file")) from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"scenario {path}: not valid TOML ({exc})") from None
    except UnicodeDecodeError:
        raise ScenarioError(f"scenario {path}: not valid TOML (not UTF-8 text)") from None
    except RecursionError:
        raise ScenarioError(f"scenario {path}: not valid TOML (tables or arrays nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits
        raise ScenarioError(f"scenario {path}: not valid TOML ({str(exc)[:80]})") from None
    for key, value in (overrides or {}).items():
        set_dotted(raw, key, value)
    if "pipeline.schedule" in (overrides or {}) and "pipeline.virtual_stages" not in (overrides or {}):
        _fit_virtual_stages(raw)
    try:
        return parse_scenario(raw, source=str(path), base_dir=path.parent)
    except ScenarioError as exc:  # a bad value that an override gave is not the file's: name the override
        rest = str(exc).removeprefix(f"{path}: ")
        if any(rest.startswith(f"{key}:") for key in overrides or {}):
            raise ScenarioError(f"override {rest}") from None
        raise


def _fit_virtual_stages(raw: dict[str, Any]) -> None:
    """A schedule given as an override keeps the file's virtual_stages if it takes them, else gets its
    default: `--schedule zbv` on a 1-chunk scenario means zbv's 2 chunks, not an error."""
    from pipeplan.sim.schedules import virtual_stages_for

    p = raw.get("pipeline")
    if not isinstance(p, dict) or not isinstance(p.get("schedule"), str):
        return
    stages, mbs, v = p.get("stages"), p.get("microbatches"), p.get("virtual_stages")
    if not (isinstance(stages, int) and isinstance(mbs, int) and stages > 0 and mbs > 0):
        return
    p["virtual_stages"] = virtual_stages_for(p["schedule"], stages, mbs, v if isinstance(v, int) and v > 0 else None)


def parse_scenario(raw: dict[str, Any], source: str = "scenario", base_dir: Path | None = None) -> Scenario:
    """Validate a scenario dict; a `model.config` path is read first (relative to `base_dir`)."""
    from pipeplan.sim.hf_config import merge_hf_config

    raw = merge_hf_config(raw, base_dir, source)
    try:
        return Scenario.model_validate(raw)
    except ValidationError as exc:
        raise ScenarioError(f"{source}: {describe_validation_error(exc, Scenario)}") from None


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set `raw["a"]["b"] = value` for key "a.b", creating tables as needed."""
    *tables, leaf = key.split(".")
    node = raw
    for t in tables:
        node = node.setdefault(t, {})
        if not isinstance(node, dict):
            raise ScenarioError(f"override {key}: {t} is not a table")
    node[leaf] = value
