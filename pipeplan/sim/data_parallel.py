"""The step's tail after a rank's last backward: data-parallel gradient reduction and the optimizer step.

Per pipeline rank r holding P_r parameters (per TP rank), with d data-parallel replicas over `dp_link`:

    ZeRO 0      all-reduce the fp32 gradients (4 P_r bytes): 2(d-1)/d * 4P_r / bw
    ZeRO 1, 2   reduce-scatter them ((d-1)/d * 4P_r / bw), step on the 1/d shard, all-gather the updated bf16
                weights ((d-1)/d * 2P_r / bw; Megatron's distributed optimizer, not overlapped by default)
    ZeRO 3      with a pipeline (stages > 1): reduce-scatter the gradients once per step, as above; the
                parameters are gathered once and kept (torchtitan: reshard_after_forward = not pp_enabled), and
                that gather is not counted.
                Without one (zero3_per_microbatch): every microbatch re-gathers each layer in F and in B and
                reduce-scatters its gradients after B (FSDP2 `fully_shard`'s default reshard_after_forward and
                per-backward reduce-scatter; DeepSpeed stage 3 fetches each submodule in its pre-forward and
                pre-backward hooks and reduces every micro-step). The gathers are prefetched one layer ahead on
                their own stream (FSDP2: implicit forward prefetch by CPU run-ahead, explicit backward prefetch
                of the next layer; DeepSpeed: PartitionedParameterCoordinator.fetch_sub_module prefetches along
                the recorded trace), so a pass over a chunk takes max(compute, traffic): zero3_pass_comm_s,
                charged in sim.cost_model.model_chunk_costs. The tail keeps what the step still waits for: the
                reduce-scatters of the first layer and then of the root module (FSDP2's root post-backward,
                issued last), less what B's slack already covers (step_tail). `parallel.zero3_prefetch = "hidden"`
                counts no gather (the tail as for a pipeline), an upper bound on overlap.

With overlap_grad_reduce the reduction runs bucket by bucket while the backward still computes (Megatron
--overlap-grad-reduce, torch DDP): buckets become ready during the rank's last backward pass of each of its
chunks, so what is exposed is max(one bucket's reduction, reduction - that backward time).

The optimizer step is memory-bound: fused Adam reads the fp32 gradient (4) and reads and writes the fp32
master (8), m (8) and v (8), writes the bf16 weight (2), and the gradient-norm clipping reads the gradient
again (4): 34 bytes per parameter of the rank's shard; zeroing the gradient buffer writes 4 bytes per local
gradient. Time = bytes / HBM bandwidth. torch's foreach Adam also allocates one fp32 temporary per parameter
of the shard while it runs (the step's transient memory); fused kernels allocate none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeplan.sim.activations import DTYPE_BYTES
from pipeplan.sim.comm import Links, all_gather_s, all_reduce_s, dp_link, reduce_scatter_s
from pipeplan.sim.config import Scenario
from pipeplan.sim.roofline import DeviceSpec

GRAD_BYTES = 4  # fp32 gradient reduction (Megatron accumulate-allreduce-grads-in-fp32; FSDP reduce_dtype)
ADAM_STEP_BYTES = 4 + 8 + 8 + 8 + 2 + 4  # grad in, master/m/v in+out, bf16 weight out, clip-norm read
SGD_STEP_BYTES = 4 + 8 + 4 + 2 + 4  # grad in, master in+out, momentum in+out, bf16 out, clip-norm read
ZERO_GRAD_BYTES = 4
FOREACH_TEMP_BYTES = 4  # torch _multi_tensor_adam: sqrt(v) temporary in fp32
BUCKET_PARAMS = 40_000_000
"""Megatron-Core's default DDP bucket floor: bucket_size = max(40,000,000, 1,000,000 * dp) parameters
(DistributedDataParallelConfig.bucket_size, megatron/core/distributed/distributed_data_parallel.py)."""


def bucket_params(dp: int) -> int:
    """Parameters per data-parallel gradient bucket at `dp` replicas (Megatron-Core's default, BUCKET_PARAMS)."""
    return max(BUCKET_PARAMS, 1_000_000 * dp)


@dataclass(frozen=True)
class StepTail:
    tail_s: np.ndarray  # per rank: exposed DP communication + optimizer step
    comm_s: np.ndarray  # per rank: exposed DP communication alone
    optimizer_s: np.ndarray  # per rank
    transient_bytes_per_chunk: np.ndarray  # HBM the step allocates while it runs


def effective_zero(sc: Scenario) -> int:
    """The ZeRO stage in force: parallel.zero, or 1 for training.distributed_optimizer."""
    return max(sc.parallel.zero, 1 if sc.training.distributed_optimizer else 0)


def chunk_ranks(sc: Scenario) -> np.ndarray:
    """The rank each chunk sits on under the scenario's schedule (loop or V placement), read from the schedule
    itself built for one microbatch; loop placement if the schedule cannot be built that small."""
    from pipeplan.sim.errors import ScheduleError
    from pipeplan.sim.schedules import build_schedule

    p, v = sc.pipeline.stages, sc.pipeline.virtual_stages
    try:
        return np.asarray(build_schedule(sc.pipeline.schedule, p, 1, v).stage_to_rank)
    except ScheduleError:
        return np.arange(p * v) % p


def zero3_reshards(sc: Scenario) -> bool:
    """Whether ZeRO-3 re-gathers the parameters in every microbatch's F and B and reduce-scatters after every B:
    no pipeline (with one, torchtitan keeps the parameters gathered for the step: reshard_after_forward =
    not pp_enabled, and turns gradient sync off until the last microbatch) and more than one data-parallel
    rank. What HBM holds follows from it (sim.overheads.runtime_bytes), whatever the overlap assumed."""
    return effective_zero(sc) == 3 and sc.parallel.dp > 1 and sc.pipeline.stages == 1


def zero3_per_microbatch(sc: Scenario) -> bool:
    """Whether that traffic bounds each pass: zero3_reshards and `parallel.zero3_prefetch = "one-layer"`."""
    return zero3_reshards(sc) and sc.parallel.zero3_prefetch == "one-layer"


def zero3_gather_bytes(sc: Scenario) -> float:
    """Bytes per decoder-layer parameter a ZeRO-3 all-gather moves: the training dtype, or 1 for Float8 linears
    (torchtitan's enable_fsdp_float8_all_gather; as sim.cost_model.state_bytes_per_param counts the gathered
    weights). The embedding and LM head gather in the training dtype (zero3_pass_comm_s)."""
    return 1.0 if sc.training.float8_linears else float(DTYPE_BYTES[sc.training.dtype])


def zero3_pass_comm_s(sc: Scenario, links: Links, layers: np.ndarray, layer_params: float,
                      params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(F, B) seconds of ZeRO-3 parameter traffic per chunk and microbatch over `dp_link`, zeros unless
    zero3_per_microbatch. Per decoder layer (one FSDP unit, one all-gather each: per-layer ring latency):
    F all-gathers its parameters; B all-gathers them again (resharded after forward) and reduce-scatters their
    fp32 gradients, except that B does not re-gather the last block (torchtitan's apply_fsdp at 9dec370, the
    version of the validation rows: reshard_after_forward = int(layer_id) < len(model.layers) - 1 without a
    pipeline, "since FSDP would prefetch it immediately"; later torchtitan, from #1094, reshards every block
    and keeps [norm, output] instead; DeepSpeed stage 3 keeps a module only within its max reuse distance,
    5e8 parameters in 2021 and 1e9 later, which a 175B LM head's 629M in between may exceed: for those rows
    one layer's gather per B too few at most). A full recomputation's forward reuses B's gather (FSDP2
    `FSDPState._pre_forward` returns early in TrainingState.PRE_BACKWARD: "the pre-backward hook is
    responsible for the unshard"). The chunk's other parameters (embedding, final norm, LM head: torchtitan's
    root module, which FSDP2 does not reshard after forward) are gathered once, in F, and reduce-scattered
    in B."""
    n = len(layers)
    if not zero3_per_microbatch(sc):
        return np.zeros(n), np.zeros(n)
    d, link = sc.parallel.dp, dp_link(sc, links)
    g = zero3_gather_bytes(sc)
    gather = all_gather_s(g * layer_params, d, link)
    reduce = reduce_scatter_s(GRAD_BYTES * layer_params, d, link)
    other = root_params(layers, layer_params, params)
    # the embedding and LM head are no Float8 linears (torchtitan float8.py at 9dec370: module_filter_fn
    # `fqn != "output"`; nn.Embedding is not swapped): gathered in the training dtype
    e = float(DTYPE_BYTES[sc.training.dtype])
    other_gather = np.array([all_gather_s(e * x, d, link) for x in other])
    other_reduce = np.array([reduce_scatter_s(GRAD_BYTES * x, d, link) for x in other])
    kept = np.zeros(n)
    kept[-1] = float(layers[-1] > 0)  # the last block stays gathered from its forward into its backward
    return layers * gather + other_gather, (layers - kept) * gather + layers * reduce + other_reduce


def root_params(layers: np.ndarray, layer_params: float, params: np.ndarray) -> np.ndarray:
    """Per chunk, the parameters outside its decoder layers (embedding, final norm, LM head: FSDP2's root
    module in torchtitan)."""
    return np.maximum(params - layers * layer_params, 0.0)


def step_tail(sc: Scenario, dev: DeviceSpec, links: Links, params: np.ndarray, backward_s: np.ndarray,
              n_ranks: int, layer_params: float = 0.0, layers: np.ndarray | None = None,
              slack_b: np.ndarray | None = None) -> StepTail:
    """The step's tail per rank (module docstring). ZeRO-3 per microbatch needs `layer_params`, the chunks'
    decoder `layers` and B's `slack_b` (its traffic beyond its compute, zero3_pass_comm_s)."""
    chunk_rank = chunk_ranks(sc)
    p_rank = np.zeros(n_ranks)
    np.add.at(p_rank, chunk_rank, params)
    window = np.zeros(n_ranks)
    np.add.at(window, chunk_rank, backward_s)  # one microbatch's backward of every chunk on the rank
    d, zero = sc.parallel.dp, effective_zero(sc)
    link = dp_link(sc, links)
    # the gradient buffer's dtype: fp32, or the training dtype with training.grad_reduce_in_fp32 = false
    grad_bytes = GRAD_BYTES if sc.training.grad_reduce_in_fp32 else DTYPE_BYTES[sc.training.dtype]
    grads = grad_bytes * p_rank
    if zero == 0:
        reduce = np.array([all_reduce_s(g, d, link) for g in grads])
        bucket = np.array([all_reduce_s(grad_bytes * min(bucket_params(d), pr), d, link) for pr in p_rank])
    else:
        reduce = np.array([reduce_scatter_s(g, d, link) for g in grads])
        bucket = np.array([reduce_scatter_s(grad_bytes * min(bucket_params(d), pr), d, link) for pr in p_rank])
    exposed = np.maximum(bucket, reduce - window) if sc.parallel.overlap_grad_reduce else reduce
    if zero3_per_microbatch(sc):
        # every B reduce-scatters its gradients inside its own bound (zero3_pass_comm_s); what follows the
        # backward's last computation on the one reduce-scatter stream is the first layer's reduce-scatter and
        # then the root module's (FSDP2 runs the root's post-backward in _root_post_backward_final_callback: its
        # forward inputs, the token ids, need no gradient). A traffic-bound B already lasts as long as all its
        # traffic, these included: what is left is what exceeds B's slack on the chunk that ends the backward
        # without `layers` the root module's reduce-scatter would be dropped silently
        assert layers is not None, "step_tail needs the layers per chunk under per-microbatch ZeRO-3"
        root = np.zeros(n_ranks)
        np.add.at(root, chunk_rank, root_params(np.asarray(layers, float), layer_params, params))
        slack = np.zeros(len(params)) if slack_b is None else np.asarray(slack_b, float)
        # each rank's first chunk in model order, where its backward ends, and B's slack there
        ends_backward = {int(r): c for c, r in reversed(list(enumerate(chunk_rank)))}
        end_slack = np.array([slack[ends_backward[r]] if r in ends_backward else 0.0 for r in range(n_ranks)])
        trailing = np.array([reduce_scatter_s(GRAD_BYTES * layer_params, d, link)
                             + reduce_scatter_s(GRAD_BYTES * x, d, link) for x in root])
        exposed = np.maximum(trailing - end_slack, 0.0)
    exposed = np.where(d > 1, exposed, 0.0)
    gather = np.array([all_gather_s(2 * pr, d, link) for pr in p_rank]) if zero in (1, 2) else np.zeros(n_ranks)
    shard = p_rank / d if zero >= 1 else p_rank
    local_grads = p_rank / d if zero >= 2 else p_rank
    per_param = ADAM_STEP_BYTES if sc.training.optimizer == "adam" else SGD_STEP_BYTES
    on_gpu = sc.memory.optimizer == "hbm"
    opt = (shard * per_param + local_grads * ZERO_GRAD_BYTES) / dev.hbm_bps if on_gpu else np.zeros(n_ranks)
    temp_per_param = FOREACH_TEMP_BYTES if (sc.training.optimizer_impl == "foreach" and on_gpu) else 0
    shard_chunk = params / d if zero >= 1 else params
    return StepTail(
        tail_s=exposed + gather + opt,
        comm_s=exposed + gather,
        optimizer_s=opt,
        transient_bytes_per_chunk=shard_chunk * temp_per_param,
    )
