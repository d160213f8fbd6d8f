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
all-gather + reduce-scatter pair each, the same bytes). Sequence parallelism keeps only the shard of the
column-parallel GEMMs' inputs (QKV, MLP up), so the backward all-gathers them again for W (Megatron-LM
megatron/core/tensor_parallel/layers.py, LinearWithGradAccumulationAndAsyncCommunication: forward runs
save_for_backward(input, weight) on the shard, backward all-gathers it before the weight-gradient GEMM): two
more all-gathers of e·bsh, half an all-reduce each, on the W pass. Megatron issues them asynchronously, as
it does the backward all-reduce without sequence parallelism. Which collectives each pass runs, what they move
under torch's DTensor TP, and how much of them `parallel.tp_comm_overlap` hides (none, full, or torch's
micro-pipeline TP) is sim/tp_comm.py's job.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.sim.activations import DTYPE_BYTES, LSE_BYTES, MASK_BYTES, mlp_widths, sequence_divisor
from pipeplan.sim.comm import Link
from pipeplan.sim.config import Scenario
from pipeplan.sim.roofline import DeviceSpec, attention_s, flash_shape_factor, gemm_s, kernels_s, memory_bound_s
from pipeplan.sim.tp_comm import collective_s, head_collectives, layer_collectives, pass_with_comm_s

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
    op_recompute_s: float  # what op-level selective recomputation redoes (sim/memory.py "selective-op")
    norm_recompute_s: float = 0.0  # the two norms' forward, redone before the backward (memory.recompute_norms)


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


def _norm_bytes_per_element(sc: Scenario) -> int:
    """Forward bytes one norm reads + writes per element: fused 2e (read x, write y); torchtitan's eager RMSNorm
    (x.float(), pow, mean, x * rsqrt, type_as, * weight) 28 + 4e; F.layer_norm is one kernel either way."""
    e = DTYPE_BYTES[sc.training.dtype]
    eager = not sc.training.compile and sc.model is not None and sc.model.architecture == "llama"
    return 28 + 4 * e if eager else 2 * e


def norms_forward_bytes(sc: Scenario) -> float:
    """Forward bytes of one layer's two norms on one TP rank (replicated over TP without sequence parallelism):
    what Megatron-Core's layernorm recomputation (memory.recompute_norms) redoes before the backward."""
    m, tr = sc.model, sc.training
    assert m is not None
    return 2 * _norm_bytes_per_element(sc) * tr.micro_batch_size * m.seq_len * m.hidden / sequence_divisor(sc)


def _elementwise_bytes(sc: Scenario) -> float:
    """Forward bytes read + written by one layer's memory-bound ops on one TP rank.

    Fused (`training.compile`, or Megatron's fused kernels): each norm, activation and residual add reads its
    input and writes its output once. Eager (torchtitan with `training.compile = false`, its model code at
    9dec370): every op is its own kernel. RMSNorm (models/norms.py) runs x.float(), pow, mean, x * rsqrt,
    type_as and * weight: (28 + 4e) bytes per element instead of 2e; RoPE (apply_rotary_emb) casts Q and K to
    fp32, multiplies complex numbers and casts back: 16 + 2e instead of 2e; SiLU(gate) * up is two kernels:
    5e instead of 3e. For GPT, bias + dropout + residual are three kernels (7e + mask, fused 3e + mask) and
    bias + GeLU two (4e, fused 2e). Eager LLaMA also copies K and V to all heads (repeat_kv) and the attention
    output to a contiguous layout before wo; fused implementations avoid both (flash attention takes GQA's
    K and V as they are and returns the layout the projection reads), so the fused count is unchanged."""
    m, tr, t = sc.model, sc.training, sc.parallel.tp
    assert m is not None
    e = DTYPE_BYTES[tr.dtype]
    sb, h, f = tr.micro_batch_size * m.seq_len, m.hidden, m.ffn_hidden
    h_kv = m.kv_heads * (h // m.heads)
    mask = MASK_BYTES if tr.dropout > 0 else 0
    sp = sequence_divisor(sc)
    eager = not tr.compile
    norm = _norm_bytes_per_element(sc)
    if m.architecture == "gpt":
        residual = (7 * e if eager else 3 * e) + mask  # bias, dropout, residual add
        replicated = (2 * norm + 2 * residual) * sb * h
        sharded = (4 * e if eager else 2 * e) * sb * f  # bias + GeLU
        return replicated / sp + sharded / t
    replicated = (2 * norm + 2 * (3 * e + mask)) * sb * h  # two RMSNorms, two (dropout +) residual adds
    rope = (16 + 2 * e if eager else 2 * e) * sb * (h + h_kv)
    swiglu = (5 * e if eager else 3 * e) * sb * f
    copies = 0.0
    if eager:  # expand + reshape of K and of V to all heads; output.transpose(1, 2).contiguous()
        copies = (2 * e * sb * (h_kv + h) if h_kv < h else 0.0) + 2 * e * sb * h
    return replicated / sp + (rope + swiglu + copies) / t


def _float8_cast_kernels(sc: Scenario) -> tuple[list[float], list[float], list[float]]:
    """(F, I, W) bytes of each memory-bound kernel that scales and casts one layer's FP8 GEMM operands.

    Float8 linears (`training.float8_linears`, torchao Float8Linear with dynamic tensor-wise scaling): the
    kernels torchao's own roofline counts (torchao/testing/float8/roofline_utils.py,
    get_tensor_memory_traffic_ovhd_s, "tensorwise"). Each activation (a GEMM input X in F, the output gradient
    dY in I) takes amax(|x|) in two stages (the first reads x; under torch.compile Inductor fuses it into the
    kernel that produced x, so 0 bytes, but the launch remains) and one cast that reads x and writes it twice
    in fp8, row- and column-major, for the two GEMMs that use it; each weight takes its amax (never fused) and
    one cast per pass that uses it (F's W, I's W transposed). The W pass finds every operand cast already.

    FP8 training through Transformer Engine (`training.dtype = "fp8"`, Megatron-LM / NeMo): delayed scaling
    takes the scale from the amax history and records the new amax inside the cast kernel (Transformer Engine
    docs, "Using FP8 with Transformer Engine": delayed scaling), so each activation costs one cast (read e,
    write the fp8 copy and its transpose, 2 bytes); the weights' fp8 copies are made on a step's first
    microbatch and reused by the others (TE modules' `is_first_microbatch`), so none per microbatch here.
    Current scaling (`training.fp8_recipe = "current"`, TE's Float8CurrentScaling recipe, common/recipe/
    __init__.py: per-tensor current amax) first reduces each activation to its amax (reads e bytes per element,
    then a one-element scale kernel) before the same cast.
    Each kernel costs at least KERNEL_FLOOR_S (roofline.kernels_s)."""
    e = DTYPE_BYTES[sc.training.dtype]
    f: list[float] = []
    i: list[float] = []
    te = sc.training.dtype == "fp8"
    fused_amax = sc.training.compile
    for mm, n, k in _gemms(sc):
        x, w, dy = mm * k, k * n, mm * n  # elements of X, W and dY
        if te:
            for act, out in ((x, f), (dy, i)):  # current scaling: an amax pass (two stages) before the cast
                out += [e * act, 0.0, (e + 2) * act] if sc.training.fp8_recipe == "current" else [(e + 2) * act]
            continue
        for act, out in ((x, f), (dy, i)):
            out += [0.0 if fused_amax else e * act, 0.0, (e + 2) * act]  # amax stage 1 and 2, the cast
        f += [e * w, 0.0, (e + 1) * w]  # the weight's amax (two stages) and its cast for F
        i.append((e + 1) * w)  # ... and transposed for I
    return f, i, []


def projections(sc: Scenario) -> list[tuple[float, float, float, bool]]:
    """The layer's forward matmuls on one TP rank in the order they run, as (M, N, K, saved): saved is what
    torchtitan's op-level selective checkpointing keeps. LLaMA follows torchtitan's model (wq, wk, wv, wo; then
    w1, w3, w2, from `w2(silu(w1(x)) * w3(x))`), GPT Megatron's (fused QKV, proj, fc1, fc2). The policy
    (torchtitan parallelize_llama.py `_custom_policy` at 9dec370) counts aten.mm calls in a layer's forward and
    saves the outputs of the odd-numbered ones, recomputing "every second mm". Each output is M x N: for the
    row-parallel ones (wo, w2) the partial sums, h wide, before their reduction."""
    m, t = sc.model, sc.parallel.tp
    assert m is not None
    tokens = sc.training.micro_batch_size * m.seq_len
    h, f = m.hidden, m.ffn_hidden
    h_kv = m.kv_heads * (h // m.heads)
    if m.architecture == "gpt":
        shapes = [((h + 2 * h_kv) / t, h), (h, h / t), (f / t, h), (h, f / t)]
    else:
        shapes = [(h / t, h), (h_kv / t, h), (h_kv / t, h), (h, h / t), (f / t, h), (f / t, h), (h, f / t)]
    return [(tokens, n, k, i % 2 == 0) for i, (n, k) in enumerate(shapes)]


def op_checkpoint_bytes(sc: Scenario) -> float:
    """Bytes one layer keeps per microbatch under torchtitan's op-level selective checkpointing: its input (the
    checkpoint's argument) and the outputs of the ops in the policy's save list (parallelize_llama.py
    `_save_list` at 9dec370): every other aten.mm (`projections`), flash/efficient SDPA (its output and fp32
    log-sum-exp; eager attention is bmm + softmax, not in the list, so nothing), and with sequence
    parallelism the reduce-scatters of the two row-parallel outputs. Float8 GEMMs are torch._scaled_mm, not
    aten.mm, so with Float8 linears no GEMM output is kept; the list's aten.abs keeps |x| of each activation
    the GEMMs cast (torchao's amax is max(abs(x))), one per distinct input under torch.compile's common
    subexpression elimination. The weights' |W| is assumed not kept: torchtitan precomputes FSDP weight scales
    (precompute_float8_dynamic_scale_for_fsdp), outside the checkpointed layer."""
    m, tr, t = sc.model, sc.training, sc.parallel.tp
    assert m is not None
    e = DTYPE_BYTES[tr.dtype]
    b, s, h = tr.micro_batch_size, m.seq_len, m.hidden
    sp = sequence_divisor(sc)
    kept = e * b * s * h / sp
    if tr.float8_linears:  # aten.abs of each distinct bf16 input the GEMMs cast (QKV, out-proj, MLP up, down)
        kept += sum(e * mm * k for mm, _, k in _gemms(sc))
    else:
        kept += sum(e * mm * n for mm, n, _, saved in projections(sc) if saved)
    if tr.attention == "flash":
        kept += e * b * s * h / t + LSE_BYTES * m.heads * s * b / t
    if t > 1 and sc.parallel.sequence_parallel:
        kept += 2 * e * b * s * h / t
    return kept


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
        shape = flash_shape_factor(d, s)  # short sequences and small heads run below the asymptote
        return attention_s(flops, io, dev, shape), attention_s(FLASH_BACKWARD * flops, 2 * io, dev, shape)
    heads = b * a / t
    scores = e * a * s * s * b / t
    drop = (2 * e + MASK_BYTES) * a * s * s * b / t if tr.dropout > 0 else 0.0
    gemms_f = gemm_s(s, s, d, e, dev, heads) + gemm_s(s, d, s, e, dev, heads)  # QK^T, AV
    softmax_f = 2 * scores + drop  # fused scale-mask-softmax reads and writes the scores; dropout
    softmax_b = EAGER_SOFTMAX_BACKWARD_PASSES * scores + drop
    return gemms_f + memory_bound_s(softmax_f, dev), 2 * gemms_f + memory_bound_s(softmax_b, dev)


def attention_core_s(sc: Scenario, dev: DeviceSpec) -> tuple[float, float]:
    """(forward, backward-input) time of one layer's attention core on one TP rank (sim/context_parallel.py)."""
    return _attention_s(sc, dev)


def layer_times(sc: Scenario, dev: DeviceSpec, tp: Link) -> LayerTimes:
    tr = sc.training
    float8 = tr.float8_linears or tr.dtype == "fp8"
    e = 1 if float8 else DTYPE_BYTES[tr.dtype]
    gdev = dev.fp8() if float8 else dev  # only the layers' GEMMs run at the FP8 rate
    f_gemm = sum(gemm_s(mm, n, k, e, gdev) for mm, n, k in _gemms(sc))
    i_gemm = sum(gemm_s(mm, k, n, e, gdev) for mm, n, k in _gemms(sc))
    w_gemm = sum(gemm_s(k, n, mm, e, gdev) for mm, n, k in _gemms(sc))
    cast_f, cast_i, cast_w = (kernels_s(x, dev) for x in _float8_cast_kernels(sc)) if float8 \
        else (0.0, 0.0, 0.0)
    attn_f, attn_i = _attention_s(sc, dev)
    elem = memory_bound_s(_elementwise_bytes(sc), dev)
    colls = layer_collectives(sc, _gemms(sc))
    t = sc.parallel.tp

    def with_comm(gemm: float, pass_name: str) -> float:
        return pass_with_comm_s(sc, gemm, colls[pass_name], tp, e, gdev)

    # op-level selective recomputation redoes every op whose output it does not save: the unsaved matmuls,
    # all element-wise work and casts, the TP all-gathers (the reduce-scatters are saved; without sequence
    # parallelism the all-reduces are not), and eager attention (flash attention's output is saved). Float8
    # GEMMs are torch._scaled_mm, not the aten.mm the policy saves, so with Float8 every projection is redone.
    unsaved = sum(gemm_s(mm, n, k, e, gdev) for mm, n, k, saved in projections(sc)
                  if not saved or tr.float8_linears)
    # the recomputed TP all-gathers (without SP, the all-reduces), exposed as in "none": an upper bound
    redo_comm = sum(collective_s(c, t, tp) for c in colls["F"]
                    if c.kind != "reduce-scatter")
    op_recompute = unsaved + elem + cast_f + redo_comm + (attn_f if tr.attention == "eager" else 0.0)
    # layernorm recomputation redoes the two norms before each backward (I, or B: where Megatron-Core's grad hook
    # fires, so a split backward's W finds its inputs restored); full and op-level recomputation already redo them
    norms = memory_bound_s(norms_forward_bytes(sc), dev) if sc.memory.recompute_norms else 0.0
    return LayerTimes(
        forward_s=with_comm(f_gemm, "F") + cast_f + attn_f + elem,
        backward_input_s=with_comm(i_gemm, "I") + cast_i + attn_i + ELEMENTWISE_BACKWARD_FACTOR * elem + norms,
        backward_weight_s=with_comm(w_gemm, "W") + cast_w,
        attention_forward_s=attn_f,
        op_recompute_s=op_recompute - norms,
        norm_recompute_s=norms,
    )


def head_times(sc: Scenario, dev: DeviceSpec, tp: Link) -> HeadTimes:
    """LM head GEMM (T x h @ h x V/t), the loss (fp32 softmax over V/t: read bf16 logits, write and re-read fp32
    copies) and the embedding lookup (a gather forward, a scatter-add backward: memory-bound), with their TP
    collectives over `tp` (sim/tp_comm.py `head_collectives`, under parallel.tp_comm_overlap like the layers')."""
    m, tr, t = sc.model, sc.training, sc.parallel.tp
    assert m is not None
    e = DTYPE_BYTES[tr.dtype]
    tokens, h, v = tr.micro_batch_size * m.seq_len, m.hidden, m.vocab
    ge = e  # the LM head stays bf16 (Megatron's output layer is no Transformer Engine module; torchao skips it)
    loss_f = memory_bound_s((e + 3 * 4) * tokens * v / t, dev)  # bf16 in, fp32 copy, max/exp pass, log-sum
    loss_b = memory_bound_s((4 + 4 + e) * tokens * v / t, dev)  # softmax - one-hot, scale, cast to bf16
    norm = memory_bound_s(2 * e * tokens * h / sequence_divisor(sc), dev)
    emb = memory_bound_s(2 * e * tokens * h / sequence_divisor(sc), dev)
    head = (tokens, v / t, h)
    colls = head_collectives(sc, head)

    def with_comm(gemm: float, pass_name: str) -> float:
        return pass_with_comm_s(sc, gemm, colls[pass_name], tp, ge, dev) if colls[pass_name] else gemm

    return HeadTimes(
        forward_s=with_comm(gemm_s(*head, ge, dev), "F") + loss_f + norm,
        backward_input_s=with_comm(gemm_s(tokens, h, v / t, ge, dev), "I") + loss_b + 2 * norm,
        backward_weight_s=with_comm(gemm_s(h, v / t, tokens, ge, dev), "W"),
        embedding_forward_s=with_comm(0.0, "EF") + emb,
        embedding_backward_s=with_comm(0.0, "EI") + 2 * emb,
        flops=2 * tokens * h * v / t,
    )


def gemm_shapes(sc: Scenario) -> list[tuple[float, float, float]]:
    """(M, N, K) of every GEMM one layer and the LM head run per microbatch on one TP rank, F's then I's
    (dX = dY Wᵀ) then W's (dW = Xᵀ dY), as layer_times and head_times time them: the transformer's own shapes
    `pipeplan profile --gemm` measures."""
    m = sc.model
    assert m is not None
    forward = [*_gemms(sc), (sc.training.micro_batch_size * m.seq_len, m.vocab / sc.parallel.tp, m.hidden)]
    return [*forward, *[(mm, k, n) for mm, n, k in forward], *[(k, n, mm) for mm, n, k in forward]]
