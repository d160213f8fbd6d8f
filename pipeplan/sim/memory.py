"""Memory policies: what each chunk keeps in HBM, what it recomputes, what it offloads, where states live.

A `MemoryPlan` holds per-chunk arrays the engine consumes. Recomputation policies are looked up by name:

    none       keep every activation (Korthikanti et al.'s "no recomputation")
    full       keep each layer's input, recompute the layer's forward right before its backward
    selective  Megatron's selective recomputation (Korthikanti et al. 2022): drop the attention core's tensors
               (scores, softmax, its dropout mask; with flash, the softmax statistics), redo only the core
    selective-op  torchtitan's op-level selective checkpointing (selective_ac_option = "op"): keep the layer
               input and the outputs of every other matmul and of flash attention, recompute everything else
    chronos    lifetime-aware: full recomputation for the chunks whose activations live longest in HBM (mean
               time from F end to B/I start at or above the median over all chunks), nothing for the rest

Offload: a share of each kept activation goes to DRAM (or NVMe) after its forward and is prefetched before
its backward; model states (optimizer m/v, fp32 master weights, fp32 gradients) can live off HBM, with the
optimizer step's copies run on the copy engines after each chunk's last backward (docs/memory.md). A
chunk's bf16 working weights can leave HBM while the chunk is idle (`with_weight_offload`, the windows of
sim.graph.weight_windows) and come back ahead of their next use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from pipeplan.common.units import GIB
from pipeplan.sim.config import RECOMPUTE_POLICIES, MemoryConfig, Scenario
from pipeplan.sim.costs import ChunkDetail, CostTable
from pipeplan.sim.engine import SimResult, simulate
from pipeplan.sim.errors import ScenarioError
from pipeplan.sim.graph import has_windows, splits_backward, starts_away
from pipeplan.sim.ir import BACKWARD_KINDS, Kind, Schedule
from pipeplan.sim.memory_plan import MemoryPlan, keep_everything, or_zeros

__all__ = ["GIB", "HOST_ADAM_BYTES_PER_PARAM", "RECOMPUTE", "MemoryPlan", "activation_arrays", "build_memory_plan",
           "exposed_recompute_s", "keep_everything", "weight_offload_mask", "with_states", "with_weight_offload"]

# Bytes of host memory traffic per parameter for one fp32 Adam step on the host: read the gradient (4), read
# and write the master weight (8), the first moment m (8) and the second moment v (8). torch.optim.Adam's
# update (`_single_tensor_adam`) touches exactly these four fp32 tensors; the step is memory-bound on a CPU,
# so its time is this traffic over the DRAM (or NVMe) bandwidth, as ZeRO-Offload (Ren et al., 2021, sec. 4)
# models its CPU optimizer.
HOST_ADAM_BYTES_PER_PARAM = 4 + 2 * 4 + 2 * 4 + 2 * 4


def activation_arrays(
    costs: CostTable, full_layers: np.ndarray, selective_layers: np.ndarray, op_layers: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kept, transient, extra time) per chunk when `full_layers` are recomputed whole, `selective_layers`
    recompute attention only and `op_layers` follow torchtitan's op-level policy (keep every other matmul's
    output and attention's, redo the rest). Linear in the layer counts, which is what lets the MILP choose them."""
    d = _detail(costs)
    n = costs.num_chunks
    op_layers = np.zeros(n) if op_layers is None else op_layers
    saved_full = d.layer_activation_bytes - d.layer_checkpoint_bytes
    saved_op = d.layer_activation_bytes - or_zeros(d.op_checkpoint_bytes, n)
    kept = (costs.activation_bytes - full_layers * saved_full - selective_layers * d.attention_activation_bytes
            - op_layers * saved_op)
    extra = (full_layers * d.layer_forward_s + selective_layers * d.attention_forward_s
             + op_layers * or_zeros(d.op_recompute_s, n))
    transient = np.where((full_layers > 0) | (op_layers > 0), d.recompute_working_bytes,
                         np.where(selective_layers > 0, d.attention_activation_bytes, 0.0))
    # the loss's working set (last chunk) is freed before the first layer's recomputation starts: autograd runs
    # the loss and LM-head backward, then reaches the last checkpointed layer, so the two never coexist
    transient = np.maximum(transient, or_zeros(d.backward_transient_bytes, costs.num_chunks))
    return np.maximum(kept, 0.0), transient, extra


def exposed_recompute_s(costs: CostTable, extra: np.ndarray) -> np.ndarray:
    """The recomputation time B/I still adds once it has filled the time B waits on its ZeRO-3 parameter
    traffic anyway (ChunkDetail.backward_comm_slack_s): the pass takes max(compute + recomputation, traffic)."""
    slack = None if costs.detail is None else costs.detail.backward_comm_slack_s
    return extra if slack is None else np.maximum(extra - slack, 0.0)


def _detail(costs: CostTable) -> ChunkDetail:
    if costs.detail is None:
        raise ScenarioError("memory: this cost table has no per-layer detail; build it from a scenario")
    return costs.detail


# ---- recomputation policies: name -> (costs, schedule) -> (full, selective, op-level layers) per chunk -------
RecomputeRule = Callable[[CostTable, Schedule], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _none(costs: CostTable, _s: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    zero = np.zeros(costs.num_chunks)
    return zero, zero, zero


def _full(costs: CostTable, _s: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    zero = np.zeros(costs.num_chunks)
    return _detail(costs).layers.astype(float), zero, zero


def _selective(costs: CostTable, _s: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _detail(costs)
    if not d.attention_activation_bytes.any():
        raise ScenarioError("memory.recompute: 'selective' needs a [model] scenario (explicit costs have no attention)")
    zero = np.zeros(costs.num_chunks)
    return zero, d.layers.astype(float), zero


def _selective_op(costs: CostTable, _s: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _detail(costs)
    if d.op_checkpoint_bytes is None:
        raise ScenarioError("memory.recompute: 'selective-op' needs a [model] scenario (explicit costs have no ops)")
    zero = np.zeros(costs.num_chunks)
    return zero, zero, d.layers.astype(float)


def _chronos(costs: CostTable, schedule: Schedule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    life = activation_lifetimes(schedule, costs)
    long_lived = life >= np.median(life)
    zero = np.zeros(costs.num_chunks)
    return np.where(long_lived, _detail(costs).layers, 0).astype(float), zero, zero


RECOMPUTE: dict[str, RecomputeRule] = {"none": _none, "full": _full, "selective": _selective,
                                       "selective-op": _selective_op, "chronos": _chronos}
if tuple(RECOMPUTE) != RECOMPUTE_POLICIES:  # the scenario schema's names (sim.config) and these rules are one list
    raise ImportError(f"sim.memory.RECOMPUTE {tuple(RECOMPUTE)} differs from sim.config.RECOMPUTE_POLICIES")


def activation_lifetimes(schedule: Schedule, costs: CostTable) -> np.ndarray:
    """Mean time per chunk from a forward's end to its backward's start, in a keep-everything simulation."""
    life: np.ndarray = hbm_waits(simulate(schedule, costs)).mean(axis=1)
    return life


def hbm_waits(result: SimResult) -> np.ndarray:
    """(chunks, microbatches): how long each activation waits in HBM, from its F's end to its B/I's start."""
    kinds = np.asarray(result.kind)
    fwd = kinds == Kind.F.value
    bwd = np.isin(kinds, [k.value for k in BACKWARD_KINDS])
    shape = (result.schedule.num_stages, result.schedule.num_microbatches)
    f_end, b_start = np.zeros(shape), np.zeros(shape)
    f_end[result.stage[fwd], result.microbatch[fwd]] = result.end_s[fwd]
    b_start[result.stage[bwd], result.microbatch[bwd]] = result.start_s[bwd]
    return b_start - f_end


def build_memory_plan(sc: Scenario, costs: CostTable, schedule: Schedule) -> MemoryPlan:
    """Resolve the scenario's [memory] table into a MemoryPlan for this schedule."""
    mem: MemoryConfig = sc.memory
    n = costs.num_chunks
    names = mem.recompute if isinstance(mem.recompute, list) else [mem.recompute] * n
    full, selective, op = np.zeros(n), np.zeros(n), np.zeros(n)
    for name in sorted(set(names)):
        f, s, o = RECOMPUTE[name](costs, schedule)
        mask = np.array([x == name for x in names])
        full[mask], selective[mask], op[mask] = f[mask], s[mask], o[mask]
    kept, transient, extra = activation_arrays(costs, full, selective, op)
    policy = tuple(
        "chronos:full" if nm == "chronos" and full[c] else ("chronos:none" if nm == "chronos" else nm)
        for c, nm in enumerate(names)
    )
    plan = with_states(
        sc,
        costs,
        MemoryPlan(
            kept_bytes=kept,
            transient_bytes=transient,
            recompute_s=exposed_recompute_s(costs, extra),
            offload_bytes=kept * mem.offload_activations,
            offload_nvme=np.full(n, mem.activations_tier == "nvme"),
            prefetch_lookahead=mem.prefetch_lookahead,
            policy=policy,
        ),
    )
    if splits_backward(schedule) and mem.offload_stash != "auto":  # without a split backward, no stash to move
        plan = dataclasses.replace(plan, stash_offload_bytes=plan.stash_bytes * mem.offload_stash)
    plan = with_copy_granularity(sc, costs, plan)
    return with_weight_offload(plan, costs, weight_offload_mask(sc, n), np.full(n, mem.optimizer != "hbm"), schedule)


def with_copy_granularity(sc: Scenario, costs: CostTable, plan: MemoryPlan) -> MemoryPlan:
    """`plan` with memory.copy_granularity's pieces: with "layer", a copy moves one layer's activations (or one
    layer's share of the W stash) at a time (sim.graph.layer_copy); with "chunk" (or no per-layer detail) it
    is returned unchanged."""
    if sc.memory.copy_granularity != "layer" or costs.detail is None:
        return plan
    d = costs.detail
    layers = np.maximum(np.asarray(d.layers, dtype=float), 1.0)
    stash = or_zeros(plan.stash_bytes, costs.num_chunks)
    return dataclasses.replace(plan, copy_layers=layers,
                               activation_piece_bytes=np.asarray(d.layer_activation_bytes, dtype=float),
                               stash_piece_bytes=stash / layers)


def weight_offload_mask(sc: Scenario, n: int) -> np.ndarray:
    """Per chunk, whether memory.offload_weights offloads its weights ("auto" is the planner's to decide)."""
    value = sc.memory.offload_weights
    if isinstance(value, list):
        return np.asarray(value, bool)
    return np.full(n, value == "all")


def with_weight_offload(plan: MemoryPlan, costs: CostTable, chunks: np.ndarray, host_optimizer: np.ndarray,
                        schedule: Schedule) -> MemoryPlan:
    """`plan` with the bf16 weights of `chunks` off HBM in their idle windows (sim.graph.weight_windows).

    The one rule for the step boundary and the optimizer step. Leaving HBM costs no copy: the host keeps a
    current copy (pinned, counted in DRAM). A chunk that starts the step away (sim.graph.starts_away: its
    first use is far enough in for an in-step prefetch) is off HBM from its last use to that prefetch:
      - optimizer on the host: the update writes the host copy, nothing returns; the step's weights-back
        copy is dropped for that chunk only (its in-step prefetch pays for bringing them back instead);
      - optimizer on the GPU: the weights return for the update (h2d, `step_weight_bytes` in HBM during the
        optimizer step), the host copy is refreshed after it (d2h) and they leave again.
    Any other offloading chunk stays in HBM across the boundary: with the optimizer on the host its
    weights-back copy stays; with it on the GPU the host copy is refreshed after the update (d2h), since its
    in-step windows fetch from it. A chunk without any window is not offloaded. So no chunk's weights come
    back at the boundary without a copy charged, and offloading never shortens a step for free."""
    chunks = chunks & has_windows(schedule, plan.prefetch_lookahead)
    if not chunks.any():
        return plan
    weights = _detail(costs).state_bytes.get("weights", np.zeros(costs.num_chunks))
    w = np.where(chunks, weights, 0.0)
    away = np.where(starts_away(schedule, plan.prefetch_lookahead), w, 0.0)
    dram = plan.static_host_bytes.get("dram", np.zeros(costs.num_chunks))
    return dataclasses.replace(
        plan,
        weight_offload_bytes=w,
        static_host_bytes={**plan.static_host_bytes, "dram": dram + w},  # the pinned host copy
        step_h2d_bytes=np.maximum(or_zeros(plan.step_h2d_bytes, len(w)) + np.where(host_optimizer, -away, away), 0.0),
        step_d2h_bytes=or_zeros(plan.step_d2h_bytes, len(w)) + np.where(host_optimizer, 0.0, w),
        step_weight_bytes=np.where(host_optimizer, 0.0, away),
        policy=tuple(f"{p}, weights offloaded" if chunks[c] else p for c, p in enumerate(plan.policy)),
    )


def with_states(sc: Scenario, costs: CostTable, plan: MemoryPlan) -> MemoryPlan:
    """Place model states by tier and derive the optimizer step's copies; fill in capacity and bandwidths."""
    mem = sc.memory
    d = _detail(costs)
    n = costs.num_chunks
    parts = d.state_bytes
    zero = np.zeros(n)
    tiers = {"optimizer": mem.optimizer, "master_weights": mem.master_weights, "gradients": mem.gradients}
    if set(parts) == {"weights"} and any(t != "hbm" for t in tiers.values()):
        raise ScenarioError("memory.optimizer: model-state offload needs a [model] scenario (explicit costs lump "
                            "all states into static_bytes)")
    if mem.optimizer != "hbm" and mem.master_weights != mem.optimizer:
        raise ScenarioError(f"memory.master_weights: must live with the host optimizer step ('{mem.optimizer}'), "
                            f"got '{mem.master_weights}'")
    # + CUDA context, NCCL, ... and a runtime's run-long P2P receive buffers (sim/p2p_buffers.py)
    static_hbm = parts.get("weights", zero).copy() + parts.get("runtime", zero) + parts.get("p2p_buffers", zero)
    host: dict[str, np.ndarray] = {"dram": zero.copy(), "nvme": zero.copy()}
    params = costs.params if costs.params is not None else zero
    for part, tier in tiers.items():
        b = parts.get(part, zero)
        if tier == "hbm":
            static_hbm += b
        else:
            host[tier] = host[tier] + b
    if mem.gradients != "hbm":
        static_hbm += 2 * params  # the bf16 buffer that accumulates on the GPU and is copied out at the end
    d2h, h2d, host_s = zero.copy(), zero.copy(), zero.copy()
    if mem.optimizer != "hbm":
        d2h += 0 if mem.gradients != "hbm" else parts.get("gradients", zero)
        d2h += 2 * params if mem.gradients != "hbm" else 0
        bw = d.dram_bps if mem.optimizer == "dram" else d.nvme_bps
        host_s += params * HOST_ADAM_BYTES_PER_PARAM / bw
        h2d += parts.get("weights", zero)
    elif mem.master_weights != "hbm" or mem.gradients != "hbm":
        # GPU optimizer with host-resident master weights / gradient buffer: stream them in and out once
        h2d += (parts.get("master_weights", zero) if mem.master_weights != "hbm" else 0) + (
            parts.get("gradients", zero) if mem.gradients != "hbm" else 0)
        d2h += parts.get("master_weights", zero) if mem.master_weights != "hbm" else 0
    margin = mem.margin_bytes(costs.hbm_bytes)
    return MemoryPlan(
        kept_bytes=plan.kept_bytes,
        transient_bytes=plan.transient_bytes,
        recompute_s=plan.recompute_s,
        offload_bytes=plan.offload_bytes,
        offload_nvme=plan.offload_nvme if plan.offload_nvme is not None else np.zeros(n, dtype=bool),
        static_hbm_bytes=static_hbm,
        static_host_bytes=host,
        step_d2h_bytes=d2h,
        step_host_s=host_s,
        step_h2d_bytes=h2d,
        prefetch_lookahead=plan.prefetch_lookahead,
        hbm_limit_bytes=costs.hbm_bytes - margin,
        policy=plan.policy,
        host_link_bps=d.host_link_bps,
        nvme_bps=min(d.nvme_bps, d.host_link_bps),
        stash_bytes=or_zeros(d.weight_stash_bytes, n),
        step_transient_bytes=or_zeros(d.step_transient_bytes, n),
        forward_retained_bytes=or_zeros(d.forward_retained_bytes, n),
        backward_retained_bytes=or_zeros(d.backward_retained_bytes, n),
    )
