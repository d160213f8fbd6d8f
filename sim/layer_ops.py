"""One decoder layer as a list of ops per pass, with FLOPs, bytes and time on one tensor-parallel rank.

Per microbatch of T = b*s tokens, with t-way tensor parallelism (Megatron's column/row split):

    GEMM (M x K @ K x N)     F                      I (dX = dY W^T)        W (dW = X^T dY)
    QKV projection           T x h @ h x (h+2h_kv)/t  T x (h+2h_kv)/t @ .. h  h x T @ T x (h+2h_kv)/t
    output projection        T x h/t @ h/t x h        ...                     ...
    MLP up (GPT fc1 f, LLaMA gate+up 2f), MLP down (f -> h)

Attention core: QK^T and AV are 4bs²h/t FLOPs for the full s x s; eager attention computes all of it (masked),
causal flash attention skips the upper triangle (2bs²h/t); its backward does 5 matmuls to the forward's 2
(FlashAttention-2, Dao 2023): 2.5x. Eager attention's softmax, dropout and their backwards are memory-bound
passes over the a·s²·b/t scores.

Memory-bound element-wise work per layer (bytes read + written, forward; the backward moves about twice as
much: the saved input and the incoming gradient in, the gradient out): two norms (4e·sbh), two
bias-dropout-residual adds (2·(3e + mask)·sbh), the MLP activation (GeLU: 2e·sbf; SwiGLU: 3e·sbf) and, for
LLaMA, RoPE on Q and K (2e·sb(h + h_kv)). Norms and residual adds divide by t only with sequence parallelism.

Tensor-parallel communication: F and I each run two all-reduces of e·bsh (with sequence parallelism an
all-gather + reduce-scatter pair each, the same bytes); with sequence parallelism the backward re-gathers the
inputs of the column-parallel GEMMs for W, which Megatron overlaps with the input-gradient GEMMs (not
counted). With tp_comm_overlap the collectives hide behind the GEMMs: a pass takes max(GEMMs, comms).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.activations import DTYPE_BYTES, MASK_BYTES, mlp_widths, sequence_divisor
from sim.comm import Link, all_reduce_s
from sim.config import Scenario
from sim.roofline import DeviceSpec, attention_s, gemm_s, memory_bound_s

FLASH_BACKWARD = 2.5  # FlashAttention-2 (Dao 2023): backward does 5 matmuls to the forward's 2
ELEMENTWISE_BACKWARD_FACTOR = 2.0  # backward of an element-wise op reads input + grad and writes grad
EAGER_SOFTMAX_BACKWARD_PASSES = 3  # softmax backward reads probs and grad, writes grad (e bytes each)


@dataclass(frozen=True)
class LayerFlops:
    forward: float
    backward_input: float
    backward_weight: float
    attention_forward: float  # the attention core alone (what selective recomputation redoes)


@dataclass(frozen=True)
class LayerTimes:
    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    attention_forward_s: float


@dataclass(frozen=True)
class HeadTimes:
    """The LM head + loss (last chunk) and the embedding (first chunk)."""

    forward_s: float
    backward_input_s: float
    backward_weight_s: float
    embedding_forward_s: float
    embedding_backward_s: float
    flops: float  # LM-head GEMM FLOPs per pass, one TP rank


def _gemms(sc: Scenario) -> list[tuple[float, float, float]]:
    """Forward GEMMs of one layer on one TP rank as (M, N, K)."""
    m, t = sc.model, sc.parallel.tp
    assert m is not None
    tokens = sc.training.micro_batch_size * m.seq_len
    h, f = m.hidden, m.ffn_hidden
    h_kv = m.kv_heads * (h // m.heads)
    _, up = mlp_widths(sc)
    return [
        (tokens, (h + 2 * h_kv) / t, h),  # QKV projection (column parallel)
        (tokens, h, h / t),  # output projection (row parallel)
        (tokens, up / t, h),  # MLP up: GPT fc1 (f), LLaMA gate + up (2f)
        (tokens, h, f / t),  # MLP down
    ]


def _attention_flops(sc: Scenario) -> float:
    """Forward FLOPs of QK^T and AV on one TP rank as executed (causal flash skips half)."""
    m = sc.model
    assert m is not None
    full = 4 * sc.training.micro_batch_size * m.seq_len**2 * m.hidden / sc.parallel.tp
    return full / 2 if sc.training.attention == "flash" else full


def layer_flops(sc: Scenario) -> LayerFlops:
    linear = sum(2 * mm * n * k for mm, n, k in _gemms(sc))
    attn = _attention_flops(sc)
    back = FLASH_BACKWARD if sc.training.attention == "flash" else 2.0  # eager: 4 matmuls to the forward's 2
    return LayerFlops(linear + attn, linear + back * attn, linear, attn)


def _elementwise_bytes(sc: Scenario) -> float:
    """Forward bytes read + written by one layer's memory-bound ops on one TP rank."""
    m, tr, t = sc.model, sc.training, sc.parallel.tp
    assert m is not None
    e = DTYPE_BYTES[tr.dtype]
    sb, h, f = tr.micro_batch_size * m.seq_len, m.hidden, m.ffn_hidden
    h_kv = m.kv_heads * (h // m.heads)
    mask = MASK_BYTES if tr.dropout > 0 else 0
    sp = sequence_divisor(sc)
    replicated = (4 * e + 2 * (3 * e + mask)) * sb * h  # 2 norms, 2 bias-dropout-residual adds
    gelu = 2 * e * sb * f  # bias + GeLU
    swiglu_rope = 3 * e * sb * f + 2 * e * sb * (h + h_kv)  # SiLU(gate) * up, RoPE on Q and K
    sharded = gelu if m.architecture == "gpt" else swiglu_rope
    return replicated / sp + sharded / t


def _attention_s(sc: Scenario, dev: DeviceSpec) -> tuple[float, float]:
    """(forward, backward-input) time of the attention core on one TP rank."""
    m, tr, t = sc.model, sc.training, sc.parallel.tp
    assert m is not None
    e = DTYPE_BYTES[tr.dtype]
    b, s, h, a = tr.micro_batch_size, m.seq_len, m.hidden, m.heads
    h_kv = m.kv_heads * (h // a)
    d = h // a
    flops = _attention_flops(sc)
    if tr.attention == "flash":
        io = e * b * s * (2 * h + 2 * h_kv) / t  # Q, K, V in, O out
        return attention_s(flops, io, dev), attention_s(FLASH_BACKWARD * flops, 2 * io, dev)
    heads = b * a / t
    scores = e * a * s * s * b / t
    drop = (2 * e + MASK_BYTES) * a * s * s * b / t if tr.dropout > 0 else 0.0
    gemms_f = gemm_s(s, s, d, e, dev, heads) + gemm_s(s, d, s, e, dev, heads)  # QK^T, AV
    softmax_f = 2 * scores + drop  # fused scale-mask-softmax reads and writes the scores; dropout
    softmax_b = EAGER_SOFTMAX_BACKWARD_PASSES * scores + drop
    return gemms_f + memory_bound_s(softmax_f, dev), 2 * gemms_f + memory_bound_s(softmax_b, dev)


def layer_times(sc: Scenario, dev: DeviceSpec, tp: Link) -> LayerTimes:
    e = 1 if sc.training.dtype == "fp8" else DTYPE_BYTES[sc.training.dtype]
    f_gemm = sum(gemm_s(mm, n, k, e, dev) for mm, n, k in _gemms(sc))
    i_gemm = sum(gemm_s(mm, k, n, e, dev) for mm, n, k in _gemms(sc))
    w_gemm = sum(gemm_s(k, n, mm, e, dev) for mm, n, k in _gemms(sc))
    attn_f, attn_i = _attention_s(sc, dev)
    elem = memory_bound_s(_elementwise_bytes(sc), dev)
    comm = 0.0
    t = sc.parallel.tp
    if t > 1:
        m = sc.model
        assert m is not None
        nbytes = DTYPE_BYTES[sc.training.dtype] * sc.training.micro_batch_size * m.seq_len * m.hidden
        comm = 2 * all_reduce_s(nbytes, t, tp)  # two all-reduces (or AG + RS pairs) per pass

    def with_comm(gemm: float) -> float:
        return max(gemm, comm) if sc.parallel.tp_comm_overlap else gemm + comm

    return LayerTimes(
        forward_s=with_comm(f_gemm) + attn_f + elem,
        backward_input_s=with_comm(i_gemm) + attn_i + ELEMENTWISE_BACKWARD_FACTOR * elem,
        backward_weight_s=w_gemm,
        attention_forward_s=attn_f,
    )


def head_times(sc: Scenario, dev: DeviceSpec) -> HeadTimes:
    """LM head GEMM (T x h @ h x V/t), the loss (fp32 softmax over V/t: read bf16 logits, write and re-read fp32
    copies) and the embedding lookup (a gather forward, a scatter-add backward: memory-bound)."""
    m, tr, t = sc.model, sc.training, sc.parallel.tp
    assert m is not None
    e = DTYPE_BYTES[tr.dtype]
    tokens, h, v = tr.micro_batch_size * m.seq_len, m.hidden, m.vocab
    ge = 1 if tr.dtype == "fp8" else e
    loss_f = memory_bound_s((e + 3 * 4) * tokens * v / t, dev)  # bf16 in, fp32 copy, max/exp pass, log-sum
    loss_b = memory_bound_s((4 + 4 + e) * tokens * v / t, dev)  # softmax - one-hot, scale, cast to bf16
    norm = memory_bound_s(2 * e * tokens * h / sequence_divisor(sc), dev)
    emb = memory_bound_s(2 * e * tokens * h / sequence_divisor(sc), dev)
    return HeadTimes(
        forward_s=gemm_s(tokens, v / t, h, ge, dev) + loss_f + norm,
        backward_input_s=gemm_s(tokens, h, v / t, ge, dev) + loss_b + 2 * norm,
        backward_weight_s=gemm_s(h, v / t, tokens, ge, dev),
        embedding_forward_s=emb,
        embedding_backward_s=2 * emb,
        flops=2 * tokens * h * v / t,
    )
