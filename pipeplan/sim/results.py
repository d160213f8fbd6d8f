"""What one simulated step produced (SimResult) and its parts: over-capacity moments, copies, HBM peaks."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeplan.sim.copy_rules import CopyKind, Stream
from pipeplan.sim.costs import CostTable
from pipeplan.sim.graph import CopyOrder
from pipeplan.sim.ir import Action, Schedule

# (rank, time_s, hbm_bytes, static_hbm, activation_hbm, dram, nvme): one rank's memory after a change
MemoryRecord = tuple[int, float, float, float, float, float, float]


@dataclass(frozen=True)
class OOMEvent:
    rank: int
    time_s: float
    action: str
    hbm_bytes: float
    capacity_bytes: float

    @property
    def excess_bytes(self) -> float:
        return self.hbm_bytes - self.capacity_bytes


@dataclass(frozen=True)
class CopyRecord:
    """One copy-engine transfer, in the order the engine granted its stream: an activation offload after F
    (`action` is the F), a prefetch before B/I (`action` is the B/I), or an optimizer-step copy of `stage`."""

    rank: int
    stream: Stream
    # "offload", "prefetch", "stash-offload" (after an I), "stash-prefetch" (before a W), "weights" (a weight
    # prefetch: `action` is the next use) or "step"
    what: CopyKind
    action: Action | None  # None for the optimizer step's copies
    stage: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class PeakMoment:
    """A rank's HBM peak: when, during what, and its parts (static states + runtime, activations, step work)."""

    rank: int
    time_s: float
    during: str  # the action that allocated last ("1F3"), or "optimizer step"
    static_bytes: float
    activation_bytes: float
    step_bytes: float

    def as_dict(self) -> dict[str, int | float | str]:
        return {"rank": self.rank, "time_s": self.time_s, "during": self.during, "static_bytes": self.static_bytes,
                "activation_bytes": self.activation_bytes, "step_bytes": self.step_bytes}


@dataclass
class SimResult:
    """Everything one simulated step produced; tables use the trace schema shared with measured runs."""

    schedule: Schedule
    costs: CostTable
    makespan_s: float
    # timeline, one entry per action, in completion order
    rank: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    kind: list[str]
    start_s: np.ndarray
    end_s: np.ndarray
    busy_s: np.ndarray  # per rank
    peak_activation_bytes: np.ndarray  # per rank
    peak_hbm_bytes: np.ndarray  # per rank
    static_bytes: np.ndarray  # per rank
    memory: list[MemoryRecord]  # at every change
    transfers: list[tuple[int, int, str, float, float]]  # (src_rank, dst_rank, action, start_s, end_s)
    oom_events: list[OOMEvent] = field(default_factory=list)
    sim_wall_s: float = 0.0
    stall_s: np.ndarray | None = None  # per rank: time backwards waited for late prefetches
    peak_dram_bytes: np.ndarray | None = None
    peak_nvme_bytes: np.ndarray | None = None
    hbm_limit_bytes: float = float("inf")
    copies: list[CopyRecord] = field(default_factory=list)  # per copy stream in grant order (FIFO)
    peak_at: list[PeakMoment] = field(default_factory=list)  # per rank: when its HBM peak happens, what is live
    step_end_s: float = 0.0  # when the last rank's DP reduction and optimizer step end (costs.step_tail_s)
    p2p_wait_s: np.ndarray | None = None  # per rank: time idle only because an input was still on the link
    rank_span_s: np.ndarray | None = None  # per rank: its first action's start to its optimizer step's end

    @property
    def step_time_s(self) -> float:
        """The whole training step: the pipeline's makespan, or later if a rank's step tail ends later. With
        optimizer post-validation (costs.post_validation) no barrier ends the step: each rank starts its next
        step once its own optimizer step is done, so steps overlap across ranks and the steady-state time per
        step is the longest rank's own span (first action's start to optimizer step's end), each rank's
        timeline repeating shifted by it: every dependency inside the step keeps its slack and no rank runs
        two steps at once."""
        if self.costs.post_validation and self.rank_span_s is not None and len(self.rank_span_s):
            return float(self.rank_span_s.max())
        return max(self.makespan_s, self.step_end_s)

    def copy_order(self) -> CopyOrder | None:
        """Per rank and stream, the copies in the order the engine granted them; None if the step made none."""
        if not self.copies:
            return None
        order: CopyOrder = {}
        for c in self.copies:
            order.setdefault((c.rank, c.stream), []).append((c.what, c.action if c.action is not None else c.stage))
        return order

    @property
    def bubble_ratio(self) -> float:
        """Idle share of all rank-time over the step."""
        total = self.makespan_s * self.schedule.num_ranks
        return float(1.0 - self.busy_s.sum() / total) if total > 0 else 0.0

    @property
    def p2p_wait_share(self) -> float:
        """Share of all rank-time over the step spent idle only because an input was still in transit (the
        part of the bubble that faster links would remove; fill/drain and waits on compute are the rest)."""
        total = self.makespan_s * self.schedule.num_ranks
        return float(self.p2p_wait_s.sum() / total) if total > 0 and self.p2p_wait_s is not None else 0.0

    @property
    def oom_over_limit(self) -> bool:
        """Peak HBM above capacity minus the plan's margin (capacity itself: `oom`)."""
        return bool((self.peak_hbm_bytes > self.hbm_limit_bytes + 1e-6).any())

    @property
    def oom(self) -> bool:
        return bool(self.oom_events)

    @property
    def tokens_per_s(self) -> float | None:
        c = self.costs
        if c.tokens_per_microbatch is None or self.makespan_s <= 0:
            return None
        return c.tokens_per_microbatch * self.schedule.num_microbatches * c.data_parallel / self.step_time_s

    @property
    def mfu(self) -> float | None:
        c = self.costs
        if c.flops_per_microbatch is None or c.peak_flops_per_gpu is None or self.makespan_s <= 0:
            return None
        gpus = self.schedule.num_ranks * c.gpus_per_rank
        return c.flops_per_microbatch * self.schedule.num_microbatches / (
            self.step_time_s * gpus * c.peak_flops_per_gpu
        )

