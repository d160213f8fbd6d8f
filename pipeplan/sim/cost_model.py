"""Analytical cost model: a model + hardware scenario -> per-chunk costs of F, I (backward-input) and
W (backward-weight), activation and state bytes, and the step's tail (data-parallel reduction, optimizer step).

FLOPs and bytes per layer are counted per op (sim/layer_ops.py); each op's time is a roofline on the device
(sim/roofline.py); collectives run over the link their ranks share (sim/comm.py); activations follow
Korthikanti et al. 2022 (sim/activations.py); runtime memory (CUDA context, cuBLAS workspace, NCCL buffers,
allocator fragmentation) comes from sim/overheads.py. Model states per parameter follow Megatron-LM's
theoretical memory model: bf16 weights 2 + fp32 gradients 4 + fp32 master 4 + Adam m, v 8 = 18 bytes, with
ZeRO stage k sharding the last parts over dp (docs/cost-model.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeplan.common.units import GIB
from pipeplan.sim.activations import DTYPE_BYTES, boundary_bytes, layer_memory, logits_bytes, sequence_divisor
from pipeplan.sim.chunk_detail import ChunkDetail
from pipeplan.sim.comm import Links, all_gather_s, build_links, p2p_link, tp_link
from pipeplan.sim.config import Scenario
from pipeplan.sim.data_parallel import StepTail, effective_zero, root_params, step_tail, zero3_pass_comm_s
from pipeplan.sim.layer_ops import HeadTimes, LayerTimes, head_times, layer_flops, layer_times, op_checkpoint_bytes
from pipeplan.sim.layer_split import layers_per_chunk
from pipeplan.sim.overheads import loss_transient_bytes, runtime_bytes
from pipeplan.sim.p2p_buffers import p2p_buffers
from pipeplan.sim.roofline import DeviceSpec

FLASH_BACKWARD_FACTOR = 2.5  # FlashAttention-2 (Dao 2023): backward does 5 matmuls to the forward's 2


@dataclass(frozen=True)
class LayerCosts:
    """Costs of one decoder layer for one microbatch on one TP rank."""

    forward_flops: float
    backward_input_flops: float
    backward_weight_flops: float
    tp_comm_bytes: float  # bytes each of the 2 all-reduces of F (and of I) moves
    activation_bytes: float
    params: float  # parameters held by one TP rank
    checkpoint_bytes: float  # the layer input, all full recomputation keeps
    attention_activation_bytes: float  # the attention core's s² tensors (or LSE): what selective drops
    attention_forward_flops: float  # the attention core: what selective recomputation redoes
    weight_stash_bytes: float  # kept from I until W when the backward is split
    norm_output_bytes: float = 0.0  # what memory.recompute_norms frees, held again while a layer is recomputed


def layer_params(sc: Scenario) -> tuple[float, float]:
    """(TP-sharded, replicated) parameters of one layer. GPT adds biases (column-parallel ones shard) and
    LayerNorm's bias; LLaMA has two RMSNorm weights."""
    m = sc.model
    assert m is not None
    h, f = m.hidden, m.ffn_hidden
    h_kv = m.kv_heads * (h // m.heads)
    if m.architecture == "gpt":
        sharded = h * (h + 2 * h_kv) + (h + 2 * h_kv) + h * h + h * f + f + f * h
        return sharded, h + h + 4 * h  # proj and fc2 biases, two LayerNorms (weight + bias)
    return h * (h + 2 * h_kv) + h * h + 3 * h * f, 2 * h


def layer_costs(sc: Scenario) -> LayerCosts:
    m, tr, t = sc.model, sc.training, sc.parallel.tp
    assert m is not None
    fl = layer_flops(sc)
    mem = layer_memory(sc)
    sharded, replicated = layer_params(sc)
    e = DTYPE_BYTES[tr.dtype]
    return LayerCosts(
        forward_flops=fl.forward,
        backward_input_flops=fl.backward_input,
        backward_weight_flops=fl.backward_weight,
        tp_comm_bytes=e * tr.micro_batch_size * m.seq_len * m.hidden if t > 1 else 0.0,
        activation_bytes=mem.activation,
        params=sharded / t + replicated,
        checkpoint_bytes=mem.checkpoint,
        attention_activation_bytes=mem.attention_core,
        attention_forward_flops=fl.attention_forward,
        weight_stash_bytes=mem.weight_stash,
        norm_output_bytes=mem.norm_outputs,
    )


def embedding_params(sc: Scenario) -> tuple[float, float]:
    """(first chunk, last chunk) embedding-side parameters per TP rank. Tied embeddings with more than one
    chunk keep a copy on the last (Megatron's shared embedding, its gradient all-reduced between the two)."""
    m, t = sc.model, sc.parallel.tp
    assert m is not None
    vh = m.vocab * m.hidden / t
    pos = m.seq_len * m.hidden if m.architecture == "gpt" else 0  # learned positions, not TP-sharded
    norm = (2 if m.architecture == "gpt" else 1) * m.hidden
    single = sc.num_chunks == 1
    head = 0.0 if (m.tied_embeddings and single) else vh
    return vh + pos, head + norm


def state_bytes_per_param(sc: Scenario) -> dict[str, float]:
    """Model-state bytes per parameter by part, with ZeRO stage k sharding over dp:
    k >= 1 optimizer state and fp32 master, k >= 2 gradients, k = 3 the weights (FSDP keeps the sharded fp32
    master as the parameter, so no separate bf16 copy persists). With a pipeline, FSDP does not reshard after
    forward (torchtitan parallelize.py: reshard_after_forward = not pp_enabled) and torch's pipeline stages
    turn gradient sync off until the last microbatch, so the gathered weights (e bytes, 1 with Float8
    all-gathers) and the unsharded gradients, accumulated in the fp32 reduce dtype (4 bytes), stay for the
    whole step."""
    tr, dp = sc.training, sc.parallel.dp
    zero = effective_zero(sc)
    e = DTYPE_BYTES[tr.dtype]
    mixed = tr.dtype != "fp32"
    parts = {
        "weights": e if zero < 3 else (0 if mixed else e / dp),
        "gradients": 4 / (dp if zero >= 2 else 1),  # fp32 accumulation (Megatron main_grad, FSDP reduce dtype)
        "master_weights": (4 if mixed else 0) / (dp if zero >= 1 else 1),
        "optimizer": {"adam": 8, "sgd": 4}[tr.optimizer] / (dp if zero >= 1 else 1),  # Adam m, v; momentum
    }
    if mixed and tr.framework == "megatron" and zero < 3 and not tr.grad_reduce_in_fp32:
        parts["gradients"] = e / (dp if zero >= 2 else 1)  # main_grad in the training dtype
    if mixed and tr.framework != "megatron":
        parts.update(_framework_state_bytes(sc, zero, e))
    if zero == 3 and dp > 1 and sc.pipeline.stages > 1 and tr.framework != "deepspeed":
        # FSDP2 with float8 all-gather keeps the unsharded linear weights in fp8 (torchtitan's 405B config:
        # enable_fsdp_float8_all_gather); with gradient sync off and reduce_dtype fp32 it accumulates the
        # unsharded gradient in fp32 (torch _fsdp_param.py FSDPParam.to_accumulated_grad_if_needed)
        parts["weights"] += 1 if tr.float8_linears else e
        parts["gradients"] += 4
    return parts


def _framework_state_bytes(sc: Scenario, zero: int, e: int) -> dict[str, float]:
    """Model-state bytes per parameter where a framework's mixed-precision optimizer differs from Megatron's.

    DeepSpeed (engine.py `_do_optimizer_sanity_check` at 38327e0 picks the wrapper): bf16 with ZeRO 0 or 1 and
    fp32 gradient accumulation gets BF16_Optimizer (runtime/bf16_optimizer.py): bf16 weights, their bf16 .grad
    kept between micro-batches (zeroed, not freed: `_update_hp_grad`), a full, unpartitioned fp32 gradient
    accumulation buffer (`fp32_groups_gradients_flat = zeros_like(bf16_groups_flat, dtype=grad_acc_dtype)`)
    and the fp32 master and Adam states partitioned over data parallelism: 2e + 4 + 12/dp. ZeRO 1-3 otherwise
    (zero/stage_1_and_2.py, stage3.py): 16-bit grads (sharded from stage 2) and the fp32 gradient of the own
    partition at the step (`single_grad_partition`); fp16 without ZeRO, FP16_Optimizer (fp16/fused_optimizer.py:
    an fp32 master copy and its fp32 .grad beside the fp16 weights and grads).
    torch (autocast, torch.nn.parallel.DistributedDataParallel): the fp32 parameters are the master copy and
    their fp32 .grad the gradients, no 16-bit copy; with parallel.zero 3 (FSDP2) the shared FSDP rule holds."""
    tr, dp = sc.training, sc.parallel.dp
    opt = {"adam": 8, "sgd": 4}[tr.optimizer]
    if tr.framework == "torch":
        return {} if zero == 3 else {"weights": 0.0, "master_weights": 4.0, "gradients": 4.0}
    if tr.dtype == "bf16" and zero <= 1:  # BF16_Optimizer
        return {"weights": e, "gradients": e + 4.0, "master_weights": 4.0 / dp, "optimizer": opt / dp}
    if zero == 0:  # FP16_Optimizer
        return {"weights": e, "gradients": e + 4.0, "master_weights": 4.0, "optimizer": opt}
    return {"weights": e / (dp if zero == 3 else 1), "gradients": e / (dp if zero >= 2 else 1) + 4.0 / dp,
            "master_weights": 4.0 / dp, "optimizer": opt / dp}


def bytes_per_param(sc: Scenario) -> float:
    return sum(state_bytes_per_param(sc).values())


def device_spec(sc: Scenario) -> DeviceSpec:
    dev = sc.device.resolved()
    if sc.training.dtype == "fp8" and not dev.get("fp8_tflops"):
        from pipeplan.sim.errors import ScenarioError

        raise ScenarioError(f"training.dtype: 'fp8' needs a device with FP8 tensor cores; {sc.device.preset} has none")
    if sc.training.float8_linears and not dev.get("fp8_tflops"):
        from pipeplan.sim.errors import ScenarioError

        raise ScenarioError(f"training.float8_linears: needs a device with FP8 tensor cores (fp8_tflops); "
                            f"{sc.device.preset} has none: set it to false or pick an H100/H200 preset")
    # bf16 rates: only the layers' GEMMs run at the FP8 rate (layer_ops.layer_times asks DeviceSpec.fp8)
    return DeviceSpec.from_resolved(dev, sc.device.efficiency)


@dataclass(frozen=True)
class ChunkCosts:
    """Per-chunk arrays (length stages*virtual_stages) plus the derived throughput inputs."""

    forward_s: np.ndarray
    backward_input_s: np.ndarray
    backward_weight_s: np.ndarray
    activation_bytes: np.ndarray
    static_bytes: np.ndarray
    params: np.ndarray  # per TP rank
    p2p_s: float
    hbm_bytes: float
    flops_per_microbatch: float  # all chunks, F + I + W, all TP ranks
    tokens_per_microbatch: int
    peak_flops_per_gpu: float
    gpus_per_chunk: int
    detail: ChunkDetail
    tail: StepTail


def chunk_extra_times(sc: Scenario, head: HeadTimes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(F, I, W) seconds per chunk of the chunks' fixed work: the embedding on the first, the final norm,
    LM head and loss on the last."""
    chunks = sc.num_chunks
    extra_f, extra_i, extra_w = np.zeros(chunks), np.zeros(chunks), np.zeros(chunks)
    extra_f[0] += head.embedding_forward_s
    extra_i[0] += head.embedding_backward_s
    extra_f[-1] += head.forward_s
    extra_i[-1] += head.backward_input_s
    extra_w[-1] += head.backward_weight_s
    return extra_f, extra_i, extra_w


def place_layers(sc: Scenario, lt: LayerTimes, extra_s: np.ndarray) -> list[int]:
    """Decoder layers per chunk (model order) given one layer's times and each chunk's fixed work."""
    assert sc.model is not None
    layer_s = lt.forward_s + lt.backward_input_s + lt.backward_weight_s
    return layers_per_chunk(sc.pipeline, sc.model.layers, layer_s, list(extra_s))


def chunk_layers(sc: Scenario) -> list[int]:
    """Decoder layers per chunk, in model order, exactly as the cost model places them: the one placement rule
    that the simulator's costs and the runtime's stage modules (runtime/stages.py) both follow."""
    spec = device_spec(sc)
    tp = tp_link(sc, build_links(sc, sc.device.resolved()))
    lt = layer_times(sc, spec, tp)
    extra_f, extra_i, extra_w = chunk_extra_times(sc, head_times(sc, spec, tp))
    return place_layers(sc, lt, extra_f + extra_i + extra_w)


def p2p_transfer_s(sc: Scenario, links: Links) -> float:
    """One hop of the boundary tensor between pipeline neighbours (an activation forward, its gradient back),
    as each TP rank sees it: it sends its copy to its counterpart on the neighbouring stage.

    With sequence parallelism that copy is the sequence shard, e·b·s·h/t (boundary_bytes, which the P2P
    buffers hold too; Megatron-LM's get_tensor_shapes divides seq_length by t only with SP,
    megatron/core/pipeline_parallel/schedules.py lines 2140-2143 at d98e8a64dd). Without it every TP rank holds
    the whole tensor, and
      - tp_style "megatron" sends it with Megatron-LM's scatter-gather (Narayanan et al. 2021, §4.1; on by
        default since commit 72e4230bb5, February 2021): each rank sends 1/t of it
        (split_tensor_into_1d_equal_chunks) and the receiver all-gathers the whole tensor over the TP group
        before using it (gather_split_1d_tensor), megatron/p2p_communication.py `_communicate` lines 148-164,
        187-195 and 233-249 at 0b44909c1a. Megatron-LM dropped it when the schedules moved into megatron/core
        (3c92fa93b5, March 2023; since then each rank sends the whole tensor): pipeplan models the Megatron
        of the papers it validates against (2021-2022);
      - tp_style "dtensor" (torch.distributed.pipelining) sends the stage's output as it is, whole
        (PipelineStage.get_fwd_send_ops, torch/distributed/pipelining/stage.py).
    `parallel.p2p_scatter_gather` overrides the style's default: false models Megatron-Core's whole-tensor hop.
    Even on, Megatron scatter-gathers only when the tensor's element count s·b·h divides by t, else it sends
    the whole tensor (`override_scatter_gather_tensors_in_pipeline`, lines 148-162 at 0b44909c1a); so does
    this. With tp dividing model.heads (sim/limits.py) and heads dividing hidden that count always divides."""
    m = sc.model
    assert m is not None
    elements = sc.training.micro_batch_size * m.seq_len * m.hidden
    full = DTYPE_BYTES[sc.training.dtype] * elements
    t = sc.parallel.tp
    link = p2p_link(sc, links)
    if t > 1 and not sc.parallel.sequence_parallel and sc.parallel.scatter_gather_p2p and elements % t == 0:
        return link.transfer_s(full / t) + all_gather_s(full, t, tp_link(sc, links))
    return link.transfer_s(boundary_bytes(sc))


def model_chunk_costs(sc: Scenario) -> ChunkCosts:
    """Resolve a model-derived scenario into per-chunk costs."""
    # a context-parallel rank is the seq_len / cp scenario, corrected: sim.costs asks sim/context_parallel.py
    assert sc.parallel.cp == 1, "parallel.cp > 1 resolves through sim.context_parallel.context_parallel_costs"
    m, tr, t = sc.model, sc.training, sc.parallel.tp
    assert m is not None
    dev = sc.device.resolved()
    spec = device_spec(sc)
    links = build_links(sc, dev)
    chunks = sc.num_chunks
    e = DTYPE_BYTES[tr.dtype]
    b, s, h, v = tr.micro_batch_size, m.seq_len, m.hidden, m.vocab
    lc = layer_costs(sc)
    tp = tp_link(sc, links)
    lt: LayerTimes = layer_times(sc, spec, tp)
    head = head_times(sc, spec, tp)
    emb_params, head_params = embedding_params(sc)

    extra_f, extra_i, extra_w = chunk_extra_times(sc, head)
    counts = np.asarray(place_layers(sc, lt, extra_f + extra_i + extra_w), dtype=float)

    fwd = counts * lt.forward_s + extra_f
    bwi = counts * lt.backward_input_s + extra_i
    bww = counts * lt.backward_weight_s + extra_w
    act = counts * lc.activation_bytes
    params = counts * lc.params
    params[0] += emb_params
    params[-1] += head_params
    # ZeRO-3 without a pipeline: each pass takes max(compute, parameter traffic) (sim.data_parallel
    # zero3_pass_comm_s), the pattern of tp_comm_overlap = "full". B's excess goes on I (the gather precedes
    # dX); the recomputation the memory plan adds before B fills it first (backward_comm_slack_s)
    gather_f, traffic_b = zero3_pass_comm_s(sc, links, counts, lc.params, params)
    fwd = np.maximum(fwd, gather_f)
    slack_b = np.maximum(traffic_b - (bwi + bww), 0.0)
    bwi = bwi + slack_b
    sp = sequence_divisor(sc)
    # the LM head's saved input: Megatron's ColumnParallelLinear keeps the sequence shard; torch's ColwiseParallel
    # (tp_style "dtensor": torchtitan's "output" plan, input_layouts=Shard(1)) the gathered input, in bf16 (the
    # head is not Float8)
    head_in = e * b * s * h / (1 if sc.parallel.tp_style == "dtensor" else sp)
    # last chunk: final-norm input, LM-head input and the fp32 logits the cross-entropy keeps (Korthikanti §4.1)
    act[-1] += boundary_bytes(sc) + head_in + 4 * b * s * v / t
    # first chunk: token ids (int64) and, with dropout, the embedding dropout mask (Megatron's count)
    act[0] += 8 * s * b + (s * b * h / sp if tr.dropout > 0 else 0)
    if sc.memory.activation_model == "megatron" and tr.dropout == 0:
        act[0] += s * b * h / t  # theoretical_memory_usage.py counts the embedding dropout mask regardless
    # torch.distributed.pipelining's P2P buffers (pipeline.p2p_buffers, sim/p2p_buffers.py): the stage input
    # lives in a receive buffer allocated for the whole run, so it leaves the per-microbatch activations
    buffers = p2p_buffers(sc)
    act -= buffers.input_bytes

    frag = 1.0 / (1.0 - sc.memory.fragmentation)
    stash = counts * lc.weight_stash_bytes
    # the LM head's W needs its input and the logits' gradient (e bytes, cast back from the fp32 loss): a split
    # backward keeps both from the last chunk's I until its W, like every other GEMM's
    stash[-1] += head_in + logits_bytes(sc)
    states = {k: params * per for k, per in state_bytes_per_param(sc).items()}
    n_ranks = sc.pipeline.stages
    root = root_params(counts, lc.params, params)  # embedding, final norm, LM head per chunk
    if effective_zero(sc) == 3 and sc.parallel.dp > 1 and n_ranks > 1 and tr.float8_linears:
        # the kept unsharded embedding and LM head are not Float8 (torchtitan's float8.py skips `output` and
        # embeddings): the training dtype, where state_bytes_per_param counts 1 byte for every parameter
        states["weights"] = states["weights"] + (e - 1) * root
    lm_head = m.vocab * m.hidden / sc.parallel.tp  # tied or not, B's first op writes this weight's gradient
    # the root module's sum over chunks: only read without a pipeline, where one rank holds them all
    runtime = runtime_bytes(sc, dev, lc.params, float(root.sum()), lm_head)
    states["runtime"] = np.full(chunks, runtime / sc.pipeline.virtual_stages)
    states["p2p_buffers"] = buffers.static_bytes
    transient = np.zeros(chunks)
    transient[-1] = loss_transient_bytes(sc)
    tail = step_tail(sc, spec, links, params, bwi + bww, n_ranks, lc.params, counts, slack_b)
    detail = ChunkDetail(
        layers=counts,
        layer_activation_bytes=np.full(chunks, lc.activation_bytes * frag),
        layer_checkpoint_bytes=np.full(chunks, lc.checkpoint_bytes * frag),
        layer_norm_output_bytes=np.full(chunks, lc.norm_output_bytes * frag),
        layer_forward_s=np.full(chunks, lt.forward_s - lt.norm_recompute_s),  # B/I already redoes the norms
        attention_activation_bytes=np.full(chunks, lc.attention_activation_bytes * frag),
        attention_forward_s=np.full(chunks, lt.attention_forward_s),
        state_bytes=states,
        host_link_bps=dev["host_link_gbps"] * 1e9,
        dram_bytes=dev["dram_gib"] * GIB,
        dram_bps=dev["dram_gbps"] * 1e9,
        nvme_bytes=dev["nvme_gib"] * GIB,
        nvme_bps=dev["nvme_gbps"] * 1e9,
        weight_stash_bytes=stash * frag,
        backward_transient_bytes=transient * frag,
        step_transient_bytes=tail.transient_bytes_per_chunk,
        op_checkpoint_bytes=np.full(chunks, op_checkpoint_bytes(sc) * frag),
        op_recompute_s=np.full(chunks, lt.op_recompute_s),
        forward_retained_bytes=buffers.output_bytes * frag,
        backward_retained_bytes=buffers.input_grad_bytes * frag,
        backward_comm_slack_s=slack_b,
    )
    flops_mb = t * (m.layers * (lc.forward_flops + lc.backward_input_flops + lc.backward_weight_flops)
                    + 3 * head.flops)
    static_parts = ("weights", "gradients", "master_weights", "optimizer", "p2p_buffers")
    return ChunkCosts(
        forward_s=fwd,
        backward_input_s=bwi,
        backward_weight_s=bww,
        activation_bytes=act * frag,
        static_bytes=sum((states[k] for k in static_parts[1:]), start=states[static_parts[0]]),
        params=params,
        p2p_s=p2p_transfer_s(sc, links),
        hbm_bytes=dev["hbm_gib"] * GIB,
        flops_per_microbatch=flops_mb,
        tokens_per_microbatch=b * s,
        peak_flops_per_gpu=spec.peak_flops,
        gpus_per_chunk=t,
        detail=detail,
        tail=tail,
    )
