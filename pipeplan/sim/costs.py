"""The cost table: one form-agnostic description of what each model chunk costs, consumed by everything else.

A scenario with explicit `[costs]` and one derived from a model and hardware both resolve here. Arrays are
indexed by stage (model chunk) 0..stages*virtual_stages-1; static bytes are summed per rank by placement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from pipeplan.common.units import GIB
from pipeplan.sim.chunk_detail import ChunkDetail
from pipeplan.sim.config import CostsConfig, Scenario
from pipeplan.sim.context_parallel import context_parallel_costs
from pipeplan.sim.cost_model import model_chunk_costs
from pipeplan.sim.ir import Action, Kind

__all__ = ["ChunkDetail", "CostTable", "build_cost_table", "per_rank_sum"]


@dataclass(frozen=True)
class CostTable:
    ranks: int
    virtual_stages: int
    microbatches: int
    forward_s: np.ndarray
    backward_input_s: np.ndarray
    backward_weight_s: np.ndarray
    activation_bytes: np.ndarray
    static_bytes: np.ndarray  # per chunk: weights + gradients + optimizer state
    p2p_s: float
    hbm_bytes: float = math.inf  # capacity per rank; inf = unbounded
    tokens_per_microbatch: int | None = None  # per pipeline replica
    data_parallel: int = 1
    flops_per_microbatch: float | None = None  # model FLOPs of one microbatch through all chunks (F+I+W)
    peak_flops_per_gpu: float | None = None
    gpus_per_rank: int = 1  # tensor-parallel degree
    params: np.ndarray | None = field(default=None)  # per chunk, per TP rank
    detail: ChunkDetail | None = None
    step_tail_s: np.ndarray | None = None  # per rank: DP reduction + optimizer step after its last action
    p2p_blocking: bool = False  # a rank waits for each message it sends to arrive (interconnect.p2p_blocking)
    post_validation: bool = False  # no end-of-step barrier (training.optimizer_post_validation; step_time_s)

    @property
    def num_chunks(self) -> int:
        return self.ranks * self.virtual_stages

    def duration(self, action: Action) -> float:
        s = action.stage
        if action.kind is Kind.F:
            return float(self.forward_s[s])
        if action.kind is Kind.I:
            return float(self.backward_input_s[s])
        if action.kind is Kind.W:
            return float(self.backward_weight_s[s])
        return float(self.backward_input_s[s] + self.backward_weight_s[s])

    def with_microbatches(self, m: int) -> CostTable:
        return replace(self, microbatches=m)


def per_rank_sum(per_chunk: np.ndarray, stage_to_rank: tuple[int, ...] | np.ndarray, n_ranks: int) -> np.ndarray:
    """Sum a per-chunk array over the chunks each rank holds."""
    out = np.zeros(n_ranks)
    if len(per_chunk):
        np.add.at(out, np.asarray(stage_to_rank), per_chunk)
    return out


def _per_chunk(value: float | list[float], chunks: int) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    return np.full(chunks, float(arr)) if arr.ndim == 0 else arr.copy()


def build_cost_table(sc: Scenario) -> CostTable:
    """Resolve either scenario form into a CostTable whose every cost is finite and within sim/limits.py."""
    from pipeplan.sim.limits import check_cost_table

    return check_cost_table(_build_cost_table(sc))


def _build_cost_table(sc: Scenario) -> CostTable:
    p, v, m = sc.pipeline.stages, sc.pipeline.virtual_stages, sc.pipeline.microbatches
    chunks = p * v
    if sc.costs is not None:
        c: CostsConfig = sc.costs
        return CostTable(
            ranks=p,
            virtual_stages=v,
            microbatches=m,
            forward_s=_per_chunk(c.forward_s, chunks),
            backward_input_s=_per_chunk(c.backward_input_s, chunks),
            backward_weight_s=_per_chunk(c.backward_weight_s, chunks),
            activation_bytes=_per_chunk(c.activation_bytes, chunks),
            static_bytes=_per_chunk(c.static_bytes, chunks),
            p2p_s=float(c.p2p_s),
            p2p_blocking=sc.interconnect.p2p_blocking,
            post_validation=sc.training.optimizer_post_validation,
            hbm_bytes=c.hbm_gib * GIB if c.hbm_gib is not None else math.inf,
            detail=ChunkDetail(
                layers=np.ones(chunks),
                layer_activation_bytes=_per_chunk(c.activation_bytes, chunks),
                layer_checkpoint_bytes=_per_chunk(c.checkpoint_bytes, chunks),
                layer_forward_s=_per_chunk(c.forward_s, chunks),
                attention_activation_bytes=np.zeros(chunks),
                attention_forward_s=np.zeros(chunks),
                state_bytes={"weights": _per_chunk(c.static_bytes, chunks)},
            ),
        )
    mc = context_parallel_costs(sc) if sc.parallel.cp > 1 else model_chunk_costs(sc)
    return CostTable(
        ranks=p,
        virtual_stages=v,
        microbatches=m,
        forward_s=mc.forward_s,
        backward_input_s=mc.backward_input_s,
        backward_weight_s=mc.backward_weight_s,
        activation_bytes=mc.activation_bytes,
        static_bytes=mc.static_bytes,
        p2p_s=mc.p2p_s,
        p2p_blocking=sc.interconnect.p2p_blocking,
        post_validation=sc.training.optimizer_post_validation,
        hbm_bytes=mc.hbm_bytes,
        tokens_per_microbatch=mc.tokens_per_microbatch,
        data_parallel=sc.parallel.dp * sc.parallel.cp,  # a context-parallel group shares one sequence's tokens
        flops_per_microbatch=mc.flops_per_microbatch,
        peak_flops_per_gpu=mc.peak_flops_per_gpu,
        gpus_per_rank=mc.gpus_per_chunk,
        params=mc.params,
        detail=mc.detail,
        step_tail_s=mc.tail.tail_s,
    )
