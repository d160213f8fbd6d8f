"""Memory a real job pays beyond weights, states and activations (per GPU).

    CUDA context         the driver's context and loaded kernels, outside the caching allocator
                         (devices.toml cuda_context_mib)
    cuBLAS workspace     one per (handle, stream); PyTorch's default is 32 MiB on Hopper and 8.125 MiB before
                         (aten/src/ATen/cuda/CublasHandlePool.cpp); compute and communication streams: 2
    NCCL buffers         per communicator, NCCL_BUFFSIZE (default 4 MiB, NCCL environment-variable docs) for
                         each of the send and receive sides of each channel: each channel has its own buffer
                         for collectives (NVIDIA/nccl#1450) and the footprint grows linearly with the channel
                         count (NVIDIA/nccl#986). The count (NCCL_CHANNELS) is ASSUMED, not sourced or measured:
                         NCCL picks it per topology and algorithm. 2 * 16 * 4 MiB = 128 MiB per communicator
                         this rank uses (TP, PP, DP)
    FSDP (ZeRO-3)        without a pipeline, the all-gathered parameters of the current and the prefetched
                         layer (bf16, Float8 linears in fp8) and the current layer's fp32 unsharded gradient
                         before its reduce-scatter (torch FSDP2); with a pipeline every weight stays gathered
                         and every gradient unsharded for the step, counted with the model states instead.
                         Without a pipeline also the root module (embedding, final norm, LM head), which
                         FSDP2 does not reshard after forward ("The root FSDP state has its value specially
                         set to False", fully_shard's reshard_after_forward docs): its gathered weights from
                         F to the end of B, in the training dtype (torchtitan gathers only Float8 linears in
                         fp8), and the LM head's unsharded gradient in the same dtype, written by B's first
                         backward op and held until the root's reduce-scatter after B's last (FSDP2 casts to
                         the fp32 reduce dtype only then, when the activations are gone: not counted)
    data-parallel bucket with ZeRO-2/3 the gradient bucket being reduced (Megatron: max(40M, 1M * dp)
                         parameters, distributed_data_parallel.py) is fp32 and unsharded
    loss transient       while the last chunk's backward starts, the bf16 logits' gradient and the fp32
                         working copy of the cross-entropy over V/t (Megatron's vocab-parallel cross entropy)
"""

from __future__ import annotations

from pipeplan.common.units import MIB
from pipeplan.sim.activations import DTYPE_BYTES
from pipeplan.sim.config import Scenario
from pipeplan.sim.data_parallel import bucket_params, effective_zero, zero3_gather_bytes, zero3_reshards

NCCL_BUFFSIZE_BYTES = 4 * MIB  # NCCL_BUFFSIZE default
NCCL_CHANNELS = 16  # assumed (module docstring); to measure: device memory before and after a first collective
CUBLAS_STREAMS = 2  # compute + communication stream each get a cuBLAS workspace


def nccl_communicators(sc: Scenario) -> int:
    """Communicators one rank uses: TP group, pipeline neighbours (one per direction), DP group."""
    p = sc.pipeline.stages
    return int(sc.parallel.tp > 1) + (2 if p > 2 else int(p > 1)) + int(sc.parallel.dp > 1)


def runtime_bytes(sc: Scenario, dev: dict[str, float], layer_params: float, root_params: float = 0.0,
                  head_params: float = 0.0) -> float:
    """Per rank: context, workspaces, communication buffers and ZeRO-2/3 working buffers (`layer_params`: one
    layer's parameters on this TP rank; `root_params`: the rank's parameters outside its decoder layers,
    `head_params` the LM head's weight among them, both only read by ZeRO-3 without a pipeline)."""
    total = 0.0
    if sc.memory.runtime_overheads:
        total += dev["cuda_context_mib"] * MIB + CUBLAS_STREAMS * dev["cublas_workspace_mib"] * MIB
        total += nccl_communicators(sc) * 2 * NCCL_CHANNELS * NCCL_BUFFSIZE_BYTES
    zero, dp = effective_zero(sc), sc.parallel.dp
    e = DTYPE_BYTES[sc.training.dtype]
    if zero >= 2 and dp > 1:
        total += 4 * bucket_params(dp)  # one fp32 gradient bucket
    if zero3_reshards(sc):
        # with a pipeline every weight stays gathered and every gradient unsharded for the step, which
        # sim.cost_model.state_bytes_per_param counts: no per-layer buffers on top
        total += 2 * zero3_gather_bytes(sc) * layer_params + 4 * layer_params
        total += e * (root_params + head_params)
    return total


TORCH_CE_BACKWARD_BYTES = 4 + 4  # nll_loss_backward's dense fp32 gradient, then _log_softmax_backward_data's
LOSS_PARALLEL_BACKWARD_BYTES = 4 + 4 + 4  # zeros_like(x), then (grad_input + exp(x)) and its product with dY


def loss_transient_bytes(sc: Scenario) -> float:
    """Extra HBM while the last chunk's backward starts, beside the 4 bytes per logit the loss keeps.

    "fused" (Megatron's vocab-parallel cross entropy): bf16 + fp32 copies of the logits' gradient, e + 4.
    "torch-fp32" (torchtitan's `cross_entropy(pred.float(), labels)`: log_softmax, which keeps its fp32 output,
    then nll_loss). Without TP, nll_loss_backward writes a dense fp32 gradient (zeros, -1 scattered at the
    labels) and _log_softmax_backward_data the fp32 input gradient while it is live: 8 bytes. With TP,
    torchtitan runs it under loss_parallel, whose backward (torch/distributed/tensor/parallel/loss.py,
    `_nll_loss_and_log_softmax_backward`, 2024) computes `(grad_input + torch.exp(x)) * grad_output` with
    grad_input = zeros_like(x) still referenced: at the product, grad_input, the sum and the product are
    live beside the saved x (the exp is freed after the sum): 12 bytes."""
    m = sc.model
    assert m is not None
    tokens = sc.training.micro_batch_size * m.seq_len
    if sc.training.loss_impl == "torch-fp32":
        per_logit = LOSS_PARALLEL_BACKWARD_BYTES if sc.parallel.tp > 1 else TORCH_CE_BACKWARD_BYTES
    else:
        per_logit = DTYPE_BYTES[sc.training.dtype] + 4
    return per_logit * tokens * m.vocab / sc.parallel.tp
