"""Analytical cost model of a LLaMA-style decoder chunk: FLOPs, time, activation and model-state bytes.

Formulas (derivations and sources in docs/cost-model.md). Per layer and microbatch, with micro-batch b,
sequence s, hidden h, FFN f, heads a, KV heads g, head dim d = h/a, KV width h_kv = g*d, TP degree t:

    linear FLOPs (forward)     2bs·[h(h + 2h_kv) + h² + 3hf]           (QKV, out-proj, SwiGLU gate/up/down)
    attention core (forward)   2bs²h                                    (QKᵀ and AV, causal: half of 4bs²h)
    backward-input             linear + 2.5 × attention core            (FlashAttention-2 backward ≈ 2.5× fwd)
    backward-weight            linear                                   (dW = Xᵀ dY, same FLOPs as Y = XW)
    LM head (last chunk)       2bsVh forward, the same again for input and for weight gradients

Time = FLOPs / (t · peak · efficiency) + tensor-parallel all-reduces (2 per layer in F and in I, ring:
2(t-1)/t · e·bsh / tp_bandwidth). Activation bytes per layer (e bytes per element, flash attention, no
dropout; Korthikanti et al. 2022 Table 2 adapted to RMSNorm + GQA + SwiGLU):

    e·sb(6h + 2h_kv + 4f) + 4·abs                                        (/t with sequence parallelism)

Model states per parameter: bf16/fp16 + Adam = 2 (weights) + 4 (fp32 grads) + 12 (fp32 master, m, v) = 18
bytes, as Megatron-LM's theoretical memory model; with a distributed optimizer 6 + 12/dp.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.chunk_detail import ChunkDetail
from sim.config import Scenario

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
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
    attention_activation_bytes: float  # Q, K, V, O and LSE: what selective recomputation drops
    attention_forward_flops: float  # QKV projection + attention core: what selective recomputation redoes


def layer_costs(sc: Scenario) -> LayerCosts:
    m, tr, t = sc.model, sc.training, sc.parallel.tp
    assert m is not None
    b, s, h, f, a = tr.micro_batch_size, m.seq_len, m.hidden, m.ffn_hidden, m.heads
    h_kv = m.kv_heads * (h // a)
    e = DTYPE_BYTES[tr.dtype]
    linear = 2 * b * s * (h * (h + 2 * h_kv) + h * h + 3 * h * f)
    attn = 2 * b * s * s * h
    sharded = e * s * b * (2 * h + 2 * h_kv + 4 * f) + 4 * a * b * s  # Q,K,V,O, MLP intermediates, LSE
    replicated = e * s * b * 4 * h  # the two norm inputs and the QKV/MLP inputs: sharded only with SP
    act = (sharded + replicated) / t if (sc.parallel.sequence_parallel or t == 1) else sharded / t + replicated
    if sc.memory.activation_model == "megatron":
        act = s * b * h * (18 + 4 * f / h) / t  # Megatron-LM theoretical_memory_usage.py, per layer
    attn_bytes = (e * s * b * (2 * h + 2 * h_kv) + 4 * a * b * s) / t
    attn_flops = (2 * b * s * h * (h + 2 * h_kv) + attn) / t
    params = (h * (h + 2 * h_kv) + h * h + 3 * h * f) / t + 2 * h
    return LayerCosts(
        forward_flops=(linear + attn) / t,
        backward_input_flops=(linear + FLASH_BACKWARD_FACTOR * attn) / t,
        backward_weight_flops=linear / t,
        tp_comm_bytes=e * b * s * h if t > 1 else 0.0,
        activation_bytes=act,
        params=params,
        checkpoint_bytes=e * s * b * h / t,
        attention_activation_bytes=attn_bytes,
        attention_forward_flops=attn_flops,
    )


def state_bytes_per_param(sc: Scenario) -> dict[str, float]:
    """Model-state bytes per parameter by part: weights, gradients, master_weights, optimizer."""
    tr, dp = sc.training, sc.parallel.dp
    shard = dp if tr.distributed_optimizer else 1
    return {
        "weights": DTYPE_BYTES[tr.dtype],
        "gradients": 4,  # fp32 gradient accumulation (Megatron main_grad), also for fp32 training
        "master_weights": (0 if tr.dtype == "fp32" else 4) / shard,
        "optimizer": {"adam": 8, "sgd": 4}[tr.optimizer] / shard,  # Adam m, v; SGD momentum; all fp32
    }


def bytes_per_param(sc: Scenario) -> float:
    return sum(state_bytes_per_param(sc).values())


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


def model_chunk_costs(sc: Scenario) -> ChunkCosts:
    """Resolve a model-derived scenario into per-chunk costs."""
    m, tr, t = sc.model, sc.training, sc.parallel.tp
    assert m is not None
    dev = sc.device.resolved()
    net = sc.interconnect
    chunks = sc.num_chunks
    per_chunk_layers = m.layers // chunks
    lc = layer_costs(sc)
    flops_rate = dev["peak_tflops"] * 1e12 * dev["efficiency"]
    e = DTYPE_BYTES[tr.dtype]
    b, s, h, v = tr.micro_batch_size, m.seq_len, m.hidden, m.vocab

    allreduce_s = 2 * (t - 1) / t * lc.tp_comm_bytes / (net.tp_gbps * 1e9) if t > 1 else 0.0
    f_layer = lc.forward_flops / flops_rate + 2 * allreduce_s
    i_layer = lc.backward_input_flops / flops_rate + 2 * allreduce_s
    w_layer = lc.backward_weight_flops / flops_rate

    fwd = np.full(chunks, per_chunk_layers * f_layer)
    bwi = np.full(chunks, per_chunk_layers * i_layer)
    bww = np.full(chunks, per_chunk_layers * w_layer)
    act = np.full(chunks, per_chunk_layers * lc.activation_bytes)
    params = np.full(chunks, per_chunk_layers * lc.params)

    head_flops = 2 * b * s * h * v / t
    fwd[-1] += head_flops / flops_rate
    bwi[-1] += head_flops / flops_rate
    bww[-1] += head_flops / flops_rate
    # last chunk keeps the final-norm input, the LM-head input and fp32 logits for the cross-entropy
    act[-1] += (2 * e * b * s * h) / t + 4 * b * s * v / t
    params[0] += v * h / t  # embedding (untied)
    params[-1] += v * h / t + h  # LM head and final norm

    if sc.memory.activation_model == "megatron":
        act[0] += (8 * s * b + s * b * h) / t  # Megatron: embedding input ids and dropout mask, first stage
    detail = ChunkDetail(
        layers=np.full(chunks, per_chunk_layers),
        layer_activation_bytes=np.full(chunks, lc.activation_bytes),
        layer_checkpoint_bytes=np.full(chunks, lc.checkpoint_bytes),
        layer_forward_s=np.full(chunks, f_layer),
        attention_activation_bytes=np.full(chunks, lc.attention_activation_bytes),
        attention_forward_s=np.full(chunks, lc.attention_forward_flops / flops_rate),
        state_bytes={k: params * v for k, v in state_bytes_per_param(sc).items()},
        host_link_bps=dev["host_link_gbps"] * 1e9,
        dram_bytes=dev["dram_gib"] * 2**30,
        dram_bps=dev["dram_gbps"] * 1e9,
        nvme_bytes=dev["nvme_gib"] * 2**30,
        nvme_bps=dev["nvme_gbps"] * 1e9,
    )
    flops_mb = t * (
        m.layers * (lc.forward_flops + lc.backward_input_flops + lc.backward_weight_flops) + 3 * head_flops
    )
    p2p_bytes = e * b * s * h / t
    return ChunkCosts(
        forward_s=fwd,
        backward_input_s=bwi,
        backward_weight_s=bww,
        activation_bytes=act,
        static_bytes=params * bytes_per_param(sc),
        params=params,
        p2p_s=net.p2p_latency_us * 1e-6 + p2p_bytes / (net.p2p_gbps * 1e9),
        hbm_bytes=dev["hbm_gib"] * 2**30,
        flops_per_microbatch=flops_mb,
        tokens_per_microbatch=b * s,
        peak_flops_per_gpu=dev["peak_tflops"] * 1e12,
        gpus_per_chunk=t,
        detail=detail,
    )
