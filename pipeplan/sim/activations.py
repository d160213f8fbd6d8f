"""Activation bytes per layer and microbatch on one tensor-parallel rank (Korthikanti et al. 2022, §4).

Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198) count, for
a GPT layer in 16-bit with dropout and eager attention, sbh(34 + 5as/h) bytes: 11sbh + 5as²b in attention
(QKV input 2, Q and K 4, V 2, output-projection input 2, its dropout mask 1; softmax output 2as²b, its dropout
mask as²b, the dropout output 2as²b), 19sbh in the MLP (input 2, GeLU input 8, fc2 input 8, dropout mask 1)
and 4sbh in the two LayerNorms. With tensor parallelism the 10sbh of norm inputs, the QKV and MLP inputs and
the two hidden dropout masks stay whole unless sequence parallelism shards them (Table 2):

    no TP:        sbh(34 + 5as/h)
    TP:           sbh(10 + 24/t + 5as/(ht))
    TP + SP:      sbh(34/t + 5as/(ht))
    + selective:  the 5as²b terms are recomputed (their inputs Q, K, V stay)
    + norms:      the two norm outputs (QKV and MLP inputs, 2·2sbh of the replicated 10sbh) are recomputed
                  (Megatron-Core's recompute_modules = ["layernorm"], memory.recompute_norms)
    full:         the layer input only, 2sbh (2sbh/t with SP)
    selective-op: torchtitan's op-level policy keeps the layer input and the outputs of every other matmul and
                  of attention (sim/layer_ops.py op_checkpoint_bytes, which knows the matmuls' order)

The same count is written here for any element size e, GQA (K and V h_kv wide), any FFN width, LLaMA's SwiGLU
(four f-wide tensors) and flash attention, which keeps no s² tensor, only the output and an fp32 log-sum-exp
per head (4·a·s·b bytes), regenerating dropout masks from the RNG state (Dao 2023).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.sim.config import Scenario

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}  # fp8 runs keep bf16 activations and weights
MASK_BYTES = 1  # a dropout mask keeps one byte per element (torch's bool mask; Korthikanti's count)
LSE_BYTES = 4  # flash attention's fp32 log-sum-exp per query row and head
FLOAT8_BYTES = 1  # torchao's float8 all-gathers move e4m3 activations and e5m2 gradients: one byte each


@dataclass(frozen=True)
class LayerMemory:
    """Bytes per layer and microbatch on one TP rank."""

    activation: float  # kept from F until I/B, no recomputation
    checkpoint: float  # full recomputation keeps the layer input only
    attention_core: float  # what selective recomputation drops: the softmax/dropout s² tensors (or LSE)
    weight_stash: float  # what a deferred W keeps after I: its GEMMs' inputs and output gradients
    norm_outputs: float = 0.0  # what memory.recompute_norms took off `activation` (a recomputed layer holds it again)


def sequence_divisor(sc: Scenario) -> int:
    """What the replicated tensors (norm inputs, GEMM inputs, hidden dropout masks) divide by: t with SP."""
    t = sc.parallel.tp
    return t if sc.parallel.sequence_parallel else 1


def gathered_bytes_per_element(sc: Scenario) -> int:
    """Bytes per element of what a TP all-gather moves, and so of the gathered input a DTensor matmul keeps.

    With `tp_style = "dtensor"` and Float8 linears, torchao's PrepareFloat8ModuleInput and Float8ColwiseParallel
    cast the shard to float8 before `redistribute` gathers it (torchao/float8/float8_tensor_parallel.py), and
    Float8Linear saves the input it is given, that float8 tensor, for the backward (`matmul_with_hp_or_float8_args`:
    save_for_backward(input_hp, ...), torchao/float8/float8_linear.py, late 2024): one byte. Otherwise the
    training dtype's e."""
    if sc.parallel.tp_style == "dtensor" and sc.training.float8_linears:
        return FLOAT8_BYTES
    return DTYPE_BYTES[sc.training.dtype]


def boundary_bytes(sc: Scenario) -> float:
    """Bytes of the tensor one TP rank passes between stages: the residual stream, sequence-sharded with SP."""
    m = sc.model
    assert m is not None
    e = DTYPE_BYTES[sc.training.dtype]
    return e * sc.training.micro_batch_size * m.seq_len * m.hidden / sequence_divisor(sc)


def logits_bytes(sc: Scenario) -> float:
    """The LM head's output on one TP rank, in the training dtype (vocabulary-sharded: loss parallelism)."""
    m = sc.model
    assert m is not None
    e = DTYPE_BYTES[sc.training.dtype]
    return e * sc.training.micro_batch_size * m.seq_len * m.vocab / sc.parallel.tp


def mlp_widths(sc: Scenario) -> tuple[int, int]:
    """(elements kept inside the MLP per token, the up-projection's output width): GeLU keeps its input and
    the fc2 input (2f); SwiGLU keeps gate, up, SiLU(gate) and gate*up (4f) and projects to 2f."""
    m = sc.model
    assert m is not None
    return (2 * m.ffn_hidden, m.ffn_hidden) if m.architecture == "gpt" else (4 * m.ffn_hidden, 2 * m.ffn_hidden)


def layer_memory(sc: Scenario) -> LayerMemory:
    m, tr, t = sc.model, sc.training, sc.parallel.tp
    assert m is not None
    b, s, h, a = tr.micro_batch_size, m.seq_len, m.hidden, m.heads
    h_kv = m.kv_heads * (h // a)
    e = DTYPE_BYTES[tr.dtype]
    mask = MASK_BYTES if tr.dropout > 0 else 0
    sp = sequence_divisor(sc)
    mlp_kept, mlp_up = mlp_widths(sc)

    replicated = (4 * e + 2 * mask) * s * b * h  # two norm inputs, QKV and MLP inputs, two hidden dropout masks
    sharded = e * s * b * (h + 2 * h_kv) + e * s * b * h + e * s * b * mlp_kept  # Q K V, O, MLP
    if tr.attention == "flash":
        core = LSE_BYTES * a * s * b
    else:  # softmax output; with dropout also its mask and output
        core = e * a * s * s * b + ((MASK_BYTES + e) * a * s * s * b if tr.dropout > 0 else 0)
    activation = replicated / sp + (sharded + core) / t
    te_fp8 = tr.dtype == "fp8"
    if te_fp8:
        # Transformer Engine keeps each linear's input for the weight gradient as its FP8 copy, column-wise data
        # only (module/linear.py _Linear.forward at d0067d0: `inputmat.update_usage(rowwise_usage=False,
        # columnwise_usage=True)`, then `saved_inputmat = inputmat`): the QKV and MLP-up inputs (the norm
        # outputs) and the down projection's input at 1 byte instead of e; the out-proj keeps an FP8 copy of the
        # attention output beside flash attention's own e-byte output
        activation += (FLOAT8_BYTES - e) * s * b * (2 * h / sp + m.ffn_hidden / t) + FLOAT8_BYTES * s * b * h / t
    gathered = 0.0
    float8_tp = sc.parallel.tp_style == "dtensor" and tr.float8_linears and t > 1
    if sc.parallel.tp_style == "dtensor" and (sp > 1 or float8_tp):
        # torch's ColwiseParallel matmul saves the all-gathered input, not its shard (nothing is re-gathered
        # for the weight gradient, sim/tp_comm.py): the QKV and MLP-up inputs are kept whole, at the element
        # size the all-gather moved (float8 with Float8 linears, cast before it even without SP), instead of
        # their e-byte shards
        gathered = 2 * s * b * h * (gathered_bytes_per_element(sc) - e / sp)
        activation += gathered
    row_inputs = 0.0
    if float8_tp:
        # torchao's Float8RowwiseParallel casts the out-proj and MLP down-projection inputs to float8 before the
        # matmul (float8_tensor_parallel.py `_prepare_input_fn`: hp_tensor_to_float8_dynamic), and Float8Linear
        # saves the input it is given (float8_linear.py, late 2024: matmul_with_hp_or_float8_args,
        # save_for_backward(input_hp, ...)): 1 byte, not e. Flash SDPA keeps its own e-byte output beside the
        # out-proj's float8 copy; eager attention's output is saved by the out-proj alone
        down = (FLOAT8_BYTES - e) * s * b * m.ffn_hidden / t
        out_proj = FLOAT8_BYTES * s * b * h / t if tr.attention == "flash" else (FLOAT8_BYTES - e) * s * b * h / t
        activation += down + out_proj
        row_inputs = (FLOAT8_BYTES - e) * s * b * (h + m.ffn_hidden) / t  # what a deferred W keeps of them
    if not tr.compile and m.architecture == "llama":
        # PyTorch eager keeps what each unfused op saves for its backward (torchtitan's model at 9dec370): each
        # RMSNorm its fp32 copy of x (pow and x * rsqrt save it) beside the bf16 output; RoPE's complex multiply
        # its fp32 Q and K; SDPA the K and V repeated to all heads by repeat_kv rather than the h_kv-wide ones
        activation += (2 * 4 * s * b * h / sp + 4 * s * b * (h + h_kv) / t + 2 * e * s * b * (h - h_kv) / t)
    if sc.memory.activation_model == "megatron":
        # theoretical_memory_usage.py: sbh(18 + 4f/h) per layer, i.e. Table 2's 34/t with SP (f = 4h);
        # without SP the 10sbh of replicated tensors do not divide (Table 2, "tensor parallel")
        per = s * b * h
        activation = per * (18 + 4 * m.ffn_hidden / h) / t if sp == t else per * (10 + (8 + 4 * m.ffn_hidden / h) / t)
    norm_outputs = 0.0
    if sc.memory.recompute_norms:
        # Megatron-Core's "layernorm" recomputation frees the two norm outputs (the QKV and MLP-up inputs) and,
        # with eager kernels, what each unfused RMSNorm saves besides (its fp32 copy of x); the norm inputs stay
        norm_e = FLOAT8_BYTES if te_fp8 else e  # Transformer Engine keeps the norm outputs as FP8 copies
        norm_outputs = (2 * norm_e + (2 * 4 if not tr.compile and m.architecture == "llama" else 0)) * s * b * h / sp
        activation -= norm_outputs
    # the W GEMMs' inputs: QKV and fc1 (replicated; Megatron keeps the SP shard and re-gathers it for W), proj,
    # fc2; their output gradients: QKV and fc1 (h-sharded), proj and fc2 whole: with SP a row-parallel layer's
    # dY arrives gathered (the reduce-scatter's backward is an all-gather, _ReduceScatterToSequenceParallelRegion)
    # and the W keeps that grad_output (the Zero Bubble fork's layers.py: WeightGradStore.put(weight,
    # partial(pre_process, grad_output, input), ...), pre_process re-gathers the input only)
    stash = e * s * b * (2 * h / sp + (h + m.ffn_hidden) / t
                         + (h + 2 * h_kv + mlp_up) / t + 2 * h)
    stash += gathered + row_inputs
    return LayerMemory(
        activation=activation,
        checkpoint=boundary_bytes(sc),
        attention_core=core / t,
        weight_stash=stash,
        norm_outputs=norm_outputs,
    )
