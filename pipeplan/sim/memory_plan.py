"""The memory plan the engine runs under: per-chunk arrays of what each chunk keeps, recomputes and offloads,
and where model states live (sim/memory.py resolves a scenario's [memory] table into one)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeplan.sim.chunk_detail import EXPLICIT_HOST_LINK_BPS, EXPLICIT_NVME_BPS
from pipeplan.sim.costs import CostTable


@dataclass(frozen=True)
class MemoryPlan:
    kept_bytes: np.ndarray  # HBM per microbatch from F until B/I ends (before offload)
    transient_bytes: np.ndarray  # extra HBM while B/I runs (recomputation working set)
    recompute_s: np.ndarray  # extra time before B/I
    offload_bytes: np.ndarray  # part of kept_bytes copied to host after F, prefetched before B/I
    offload_nvme: np.ndarray | None = None  # per chunk: True if its offloaded activations go to NVMe, not DRAM
    static_hbm_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    static_host_bytes: dict[str, np.ndarray] = field(default_factory=dict)  # "dram"/"nvme" -> per chunk
    step_d2h_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))  # after each chunk's last backward
    step_host_s: np.ndarray = field(default_factory=lambda: np.zeros(0))  # host optimizer work per chunk
    step_h2d_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    prefetch_lookahead: int = 2
    hbm_limit_bytes: float = float("inf")  # capacity - margin
    policy: tuple[str, ...] = ()  # per chunk, for reports
    host_link_bps: float = EXPLICIT_HOST_LINK_BPS  # sim.memory.with_states sets the cost table's figures
    nvme_bps: float = EXPLICIT_NVME_BPS
    stash_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per chunk: held from I end to W end
    step_transient_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))  # per chunk, during the step
    # per chunk: bf16 working weights that leave HBM in the chunk's idle windows (sim.graph.weight_windows); 0 keeps
    weight_offload_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # per chunk: offloaded weights that are off HBM at the step's end and return for a GPU optimizer's update
    # (sim.memory.with_weight_offload); the engine holds them in HBM during the optimizer step
    step_weight_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # per chunk and microbatch: part of stash_bytes copied to DRAM after I ends and prefetched before W (the W
    # stash offload; sim/engine.py); 0 keeps the whole stash in HBM from I's end to W's end
    stash_offload_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # per chunk and microbatch, under every plan (torch pipelining, sim/p2p_buffers.py; empty: none): held from
    # its F's start to the step's end (the stage outputs torch keeps) and from its B/I's end to the step's end
    # (the input gradients kept as the receive buffers' .grad)
    forward_retained_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    backward_retained_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # memory.copy_granularity = "layer" (sim.graph.layer_copy): per chunk its layers, and one layer's activation
    # and W-stash bytes per microbatch (the pieces a copy moves); empty: copies move whole chunks
    copy_layers: np.ndarray = field(default_factory=lambda: np.zeros(0))
    activation_piece_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))
    stash_piece_bytes: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def offloads(self) -> bool:
        return bool(self.offload_bytes.any())

    @property
    def offloads_stash(self) -> bool:
        return bool(self.stash_offload_bytes.any())

    @property
    def offloads_weights(self) -> bool:
        return bool(self.weight_offload_bytes.any())

    @property
    def layer_copies(self) -> bool:
        """Activation and W-stash copies move layer by layer (memory.copy_granularity = "layer")."""
        return bool(len(self.copy_layers))

    @property
    def has_step_copies(self) -> bool:
        return bool(self.step_d2h_bytes.any() or self.step_h2d_bytes.any())

    @property
    def uses_copy_engines(self) -> bool:
        """Activation, W stash or weight offload or the optimizer step's copies: the step's timing depends on
        the copy engines."""
        return self.offloads or self.has_step_copies or self.offloads_weights or self.offloads_stash


def keep_everything(costs: CostTable) -> MemoryPlan:
    """The default plan: every activation stays in HBM, every model state too."""
    n = costs.num_chunks
    d = costs.detail
    return MemoryPlan(
        kept_bytes=costs.activation_bytes.astype(float),
        transient_bytes=or_zeros(d.backward_transient_bytes if d else None, n),
        recompute_s=np.zeros(n),
        offload_bytes=np.zeros(n),
        offload_nvme=np.zeros(n, dtype=bool),
        static_hbm_bytes=costs.static_bytes.astype(float) + (d.state_bytes.get("runtime", 0.0) if d else 0.0),
        step_d2h_bytes=np.zeros(n),
        step_host_s=np.zeros(n),
        step_h2d_bytes=np.zeros(n),
        hbm_limit_bytes=costs.hbm_bytes,
        policy=("none",) * n,
        stash_bytes=or_zeros(d.weight_stash_bytes if d else None, n),
        step_transient_bytes=or_zeros(d.step_transient_bytes if d else None, n),
        forward_retained_bytes=or_zeros(d.forward_retained_bytes if d else None, n),
        backward_retained_bytes=or_zeros(d.backward_retained_bytes if d else None, n),
    )


def or_zeros(values: np.ndarray | None, n: int) -> np.ndarray:
    """A per-chunk array as floats, or n zeros where there is none: None (a cost table without that detail,
    explicit costs) or empty (a MemoryPlan field left at its default: the plan holds nothing of that kind)."""
    return np.zeros(n) if values is None or not len(values) else np.asarray(values, dtype=float)
