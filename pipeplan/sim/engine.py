"""SimPy engine: one process per pipeline rank runs its actions in the schedule's order.

An action starts when its rank is free and its inputs have arrived: F needs the previous stage's F of that
microbatch; B or I needs the next stage's B/I and its own F; W needs its I. A result that crosses ranks is
sent over the directed link between them: each link is a FIFO single server (one transfer at a time, p2p_s
each), computed in closed form so a transfer costs one timeout event; transfers overlap compute unless the
costs say `p2p_blocking` (Megatron's schedules), where the sender waits for its send to arrive. HBM per
rank is the static bytes plus activations, allocated when F starts and freed when B or I ends; exceeding the
capacity is recorded (rank, time, by how much), not raised. A schedule whose ranks wait on each other forever
raises DeadlockError naming the blocked actions.

A MemoryPlan (sim/memory.py) changes what F keeps, adds recomputation time and working set to B/I, and may
offload with stream semantics: each rank has one copy engine per direction (SimPy resources, FIFO).
Every forward queues a device-to-host copy of its offloaded part (possibly empty) and the part leaves HBM
when the copy ends; a forward may not start while more than one earlier copy is unfinished (bounded pinned
buffers). Every backward queues a host-to-device prefetch when the rank starts the action
`prefetch_lookahead` places before it; the prefetch waits for its copy out, allocates HBM when it starts,
and the backward waits for it. Time a rank waits on copies is reported as stall. Model states off HBM add
the optimizer step's copies after each chunk's last backward. Weight offload (sim.graph.weight_windows):
an offloading chunk's weights leave HBM when the action that opens a window ends (the host keeps their
copy, so leaving costs no copy) and come back on the h2d engine, queued when the window's issuer starts
(before that action's activation prefetches), allocating HBM when the copy starts; the next use waits.
What the optimizer step does with weights away at the step's end is sim.memory.with_weight_offload's rule:
the engine holds `step_weight_bytes` in HBM during the step and runs the copies it priced in the side chains.
W stash offload (MemoryPlan.stash_offload_bytes) treats a split backward's stash as activations are treated:
every I queues a device-to-host copy of the stash's offloaded part on the d2h engine (FIFO with the forwards'
copies), which leaves HBM when the copy ends; an I may not start while more than one earlier stash copy is
unfinished; every W queues a prefetch when the rank starts the action `prefetch_lookahead` places before it
(in one rank-ordered list with the B/I prefetches that action issues), after the copy out, HBM allocated
when it starts; the W waits for it. With memory.copy_granularity = "layer" both kinds of copy move layer by
layer (sim.graph.LayerCopy): a copy out is queued when its producer's first layer is done and ends no
earlier than its last piece can, and a consumer starts once its prefetch has, as early as the pieces it
needs first and last allow.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import simpy

from pipeplan.sim.costs import CostTable, per_rank_sum
from pipeplan.sim.errors import ScheduleError
from pipeplan.sim.graph import (
    STASH_KINDS,
    CopyOrder,
    LayerCopy,
    SideTask,
    action_recompute_s,
    activation_layer_copies,
    prefetch_issuer,
    side_chains,
    stash_layer_copies,
    step_structure,
    weight_windows,
)
from pipeplan.sim.ir import BACKWARD_KINDS, Action, Kind, Schedule
from pipeplan.sim.memory_plan import MemoryPlan, keep_everything, or_zeros


class DeadlockError(ScheduleError):
    """The schedule cannot finish: some rank waits for an action that can never run."""


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
    stream: str  # "d2h" or "h2d"
    # "offload", "prefetch", "stash-offload" (after an I), "stash-prefetch" (before a W), "weights" (a weight
    # prefetch: `action` is the next use) or "step"
    what: str
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

    def as_dict(self) -> dict:
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
    memory: list[tuple]  # (rank, time_s, hbm_bytes, static_hbm, activation_hbm, dram, nvme) at every change
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


def simulate(
    schedule: Schedule,
    costs: CostTable,
    durations: Mapping[Action, float] | None = None,
    memory: MemoryPlan | None = None,
) -> SimResult:
    """Run one training step of `schedule` under `costs`; `durations` overrides single actions' whole times
    (recomputation included) and `memory` sets the activation/state policy (default: keep everything)."""
    t0 = time.perf_counter()
    # the step allocates ~10 small objects per action and frees none until the end: pausing the cyclic
    # collector keeps its repeated full scans (quadratic in the step's size) off the clock
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        result = _StepSimulation(schedule, costs, durations or {}, memory or keep_everything(costs)).run()
    finally:
        if gc_was_enabled:
            gc.enable()
    result.sim_wall_s = time.perf_counter() - t0
    return result


class _StepSimulation:
    """Event-efficient core: actions are integer indices; a rank yields one timeout per action (waiting for
    inputs whose arrival time is already known is folded into it) and an event only for a producer that
    has not finished yet, or for a prefetch."""

    def __init__(self, schedule: Schedule, costs: CostTable, overrides: Mapping[Action, float], mem: MemoryPlan):
        if costs.num_chunks != schedule.num_stages:
            raise ScheduleError(
                f"schedule has {schedule.num_stages} stages but the costs describe {costs.num_chunks} chunks"
            )
        self.sched, self.costs, self.mem = schedule, costs, mem
        self.env = simpy.Environment()
        s2r = schedule.stage_to_rank
        n_ranks = schedule.num_ranks
        st = step_structure(schedule)  # what each action waits for: the step's rules, sim/graph.py
        self.actions: tuple[Action, ...] = st.actions
        n = len(self.actions)
        # an override is the action's whole duration (a freeze plan's already includes any recomputation)
        recompute = mem.recompute_s.tolist()
        self.duration = [
            overrides[a] if a in overrides
            else costs.duration(a) + (recompute[a.stage] if a.kind in BACKWARD_KINDS else 0.0)
            for a in self.actions
        ]
        # deps[i]: (producer j, True if j's output crosses stages and so arrives at arrive[j])
        self.deps = st.deps
        self.consumer_rank = st.consumer_rank  # rank of the cross-stage consumer, -1 if none
        self.forward_of = st.forward_of  # for B/I: its own F
        self.rank_of = st.rank_of
        self.rank_slices = [st.rank_nodes(r) for r in range(n_ranks)]
        self.end: list[float | None] = [None] * n
        self.arrive: list[float | None] = [None] * n
        self.start: list[float] = [0.0] * n
        self.waiters: dict[int, simpy.Event] = {}
        self.link_free: dict[tuple[int, int], float] = {}
        # memory, per rank and tier
        # per-rank counters are Python lists: the hot path touches them once per action, and list items
        # are several times cheaper to read and update than NumPy scalars
        self.static = per_rank_sum(mem.static_hbm_bytes, s2r, n_ranks).tolist()
        self.kept = [float(mem.kept_bytes[a.stage]) for a in self.actions]
        self.transient = mem.transient_bytes.tolist()
        self.live = [0.0] * n_ranks
        self.away = [0.0] * n_ranks  # offloaded weights not in HBM now (static_hbm_bytes counts them)
        self.dram = per_rank_sum(mem.static_host_bytes.get("dram", np.zeros(0)), s2r, n_ranks).tolist()
        self.nvme = per_rank_sum(mem.static_host_bytes.get("nvme", np.zeros(0)), s2r, n_ranks).tolist()
        self.peak_act = [0.0] * n_ranks
        n_s = schedule.num_stages
        self.stash = or_zeros(mem.stash_bytes, n_s).tolist()
        # what a forward / a backward leaves behind until the step ends (torch pipelining's stage outputs and input
        # gradients, sim/p2p_buffers.py)
        self.f_left = or_zeros(mem.forward_retained_bytes, n_s).tolist()
        self.b_left = or_zeros(mem.backward_retained_bytes, n_s).tolist()
        self.step_transient = per_rank_sum(mem.step_transient_bytes, s2r, n_ranks).tolist()  # empty: zeros
        # offloaded weights that return for a GPU optimizer's update (sim.memory.with_weight_offload)
        self.step_weights = per_rank_sum(mem.step_weight_bytes, s2r, n_ranks).tolist()
        self.step_tail = costs.step_tail_s.tolist() if costs.step_tail_s is not None else [0.0] * n_ranks
        self.peak_dram, self.peak_nvme = list(self.dram), list(self.nvme)
        self.busy = [0.0] * n_ranks
        self.p2p_wait = [0.0] * n_ranks
        self.stall = [0.0] * n_ranks
        self.progress = [0] * n_ranks
        self.memory: list[tuple] = []
        # weight offload (sim.graph.weight_windows): release after a node, prefetch issued at a node's start
        self.weight_bytes = mem.weight_offload_bytes.tolist() if mem.offloads_weights else []
        self.release_weights: dict[int, list[int]] = {}  # node -> chunks whose weights leave as it ends
        self.issue_weights: dict[int, list[tuple[int, int]]] = {}  # issuer -> (next use, chunk)
        self.weights_back: dict[int, simpy.Event] = {}  # next use -> its weights are in HBM again
        if mem.offloads_weights:
            for w in weight_windows(schedule, mem.prefetch_lookahead, mem.weight_offload_bytes > 0):
                if w.release_after < 0:
                    self.away[s2r[w.chunk]] += self.weight_bytes[w.chunk]
                else:
                    self.release_weights.setdefault(w.release_after, []).append(w.chunk)
                if w.next_use >= 0:
                    self.issue_weights.setdefault(w.issuer, []).append((w.next_use, w.chunk))
        self.peak_hbm = [s - a for s, a in zip(self.static, self.away, strict=True)]
        self.peak_moment: list[tuple[float, str, float, float]] = [(0.0, "start", 0.0, h) for h in self.peak_hbm]
        for r in range(n_ranks):
            self._record(r, 0.0)
        self.transfers: list[tuple[int, int, str, float, float]] = []
        self.oom: list[OOMEvent] = []
        self.finished: list[int] = []
        # offload machinery (stream semantics), only when the plan moves anything
        self.offloads = mem.offloads
        self.stashes = mem.offloads_stash
        self.stash_off = mem.stash_offload_bytes.tolist() if self.stashes else []
        self.copying = mem.offloads or mem.offloads_weights or self.stashes  # some action may wait for a copy
        self.d2h = [simpy.Resource(self.env) for _ in range(n_ranks)]
        self.h2d = [simpy.Resource(self.env) for _ in range(n_ranks)]
        self.copied = {i: self.env.event() for i, a in enumerate(self.actions) if a.kind is Kind.F} \
            if self.offloads else {}  # F index -> its copy out finished
        self.prefetched: dict[int, simpy.Event] = {}  # B/I index -> its activations are back in HBM
        self.rank_forwards: list[list[int]] = [[] for _ in range(n_ranks)]  # F indices in the order they ran
        self.issuer = prefetch_issuer(schedule, mem.prefetch_lookahead) if self.offloads else {}  # B/I -> node
        if self.stashes:  # W -> the node whose start issues its stash prefetch
            self.issuer.update(prefetch_issuer(schedule, mem.prefetch_lookahead, STASH_KINDS))
        self.issues: dict[int, list[int]] = {}  # node -> the B/I and W prefetches its start issues, in rank order
        for b, at in sorted(self.issuer.items()):
            self.issues.setdefault(at, []).append(b)
        self.stash_copied = {i: self.env.event() for i, a in enumerate(self.actions) if a.kind is Kind.I} \
            if self.stashes else {}  # I index -> its stash copy out finished
        self.rank_splits: list[list[int]] = [[] for _ in range(n_ranks)]  # I indices in the order they ran
        self.copy_end = 0.0
        self.copy_log: list[list] = []  # [rank, stream, what, action index or -1, stage, start, end] at grant
        self.side_chains = side_chains(schedule, mem)  # work that follows an action off the compute stream
        self.layer_out, self.layer_in = self._layer_copies()  # memory.copy_granularity = "layer"
        self.granted: dict[int, simpy.Event] = {}  # layer-wise consumer -> its prefetch has started
        self.fetch_span: dict[int, tuple[float, float]] = {}  # consumer -> its prefetch's (start, end)

    # ---- memory ------------------------------------------------------------------------------------------
    def _record(self, rank: int, at: float, during: str = "") -> None:
        static, live = self.static[rank] - self.away[rank], self.live[rank]  # offloaded weights are not in HBM
        dram, nvme = self.dram[rank], self.nvme[rank]
        hbm = static + live
        self.memory.append((rank, at, hbm, static, live, dram, nvme))
        if hbm > self.peak_hbm[rank]:
            self.peak_hbm[rank] = hbm
            self.peak_moment[rank] = (at, during, live, static)
        if dram > self.peak_dram[rank]:
            self.peak_dram[rank] = dram
        if nvme > self.peak_nvme[rank]:
            self.peak_nvme[rank] = nvme

    def _allocate(self, rank: int, delta: float, at: float, i: int, grew: bool = False) -> None:
        """Activations change by `delta` (`grew`: something else, e.g. returning weights, grew HBM)."""
        self.live[rank] += delta
        grew = grew or delta > 0
        self._record(rank, at, str(self.actions[i]) if grew else "")
        if grew:
            self.peak_act[rank] = max(self.peak_act[rank], self.live[rank])
            hbm = self.static[rank] - self.away[rank] + self.live[rank]
            if hbm > self.costs.hbm_bytes:
                self.oom.append(OOMEvent(rank, at, str(self.actions[i]), float(hbm), self.costs.hbm_bytes))

    def _move_host(self, rank: int, stage: int, delta: float) -> None:
        if self.mem.offload_nvme[stage]:
            self.nvme[rank] += delta
        else:
            self.dram[rank] += delta

    def _copy_s(self, stage: int, nbytes: float) -> float:
        return nbytes / (self.mem.nvme_bps if self.mem.offload_nvme[stage] else self.mem.host_link_bps)

    def _copy_out(self, i: int, rank: int, label: str, nbytes: float, seconds: float, to_host, done,
                  lc: LayerCopy | None = None):
        """After action i (layer by layer, `lc`: from its first layer on, sim.graph.LayerCopy): copy `nbytes`
        to host on the d2h engine (FIFO), then `to_host(nbytes)` and release them from HBM; `done` fires
        either way."""
        end_at = 0.0
        if lc is not None:  # spawned as i starts: queued when its first layer is done
            queue, end = lc.out_offsets(action_recompute_s(self.mem, self.actions[i]), self.duration[i])
            end_at = self.start[i] + end
            if self.start[i] + queue > self.env.now:
                yield self.env.timeout(self.start[i] + queue - self.env.now)
        with self.d2h[rank].request() as req:
            yield req
            if end_at - seconds > self.env.now:  # the engine waits for the last piece to be made
                yield self.env.timeout(end_at - seconds - self.env.now)
            entry = self._log(rank, "d2h", label, i, self.actions[i].stage)
            if nbytes > 0:
                yield self.env.timeout(seconds)
            entry[-1] = self.env.now
        if nbytes > 0:
            to_host(nbytes)
            self._allocate(rank, -nbytes, self.env.now, i)
        done.succeed()

    def _copy_in(self, user: int, owner: int, rank: int, label: str, nbytes: float, seconds: float, after,
                 to_host, done):
        """Before action `user`: wait for `after` (the copy out), then bring `nbytes` back on the h2d engine
        (FIFO), HBM allocated (to `owner`) when the copy starts; `to_host(-nbytes)` once it ends."""
        yield after
        with self.h2d[rank].request() as req:
            yield req
            entry = self._log(rank, "h2d", label, user, self.actions[user].stage)
            self.fetch_span[user] = (self.env.now, self.env.now + (seconds if nbytes > 0 else 0.0))
            if user in self.granted:
                self.granted[user].succeed()
            if nbytes > 0:
                self._allocate(rank, nbytes, self.env.now, owner)
                yield self.env.timeout(seconds)
            entry[-1] = self.env.now
        if nbytes > 0:
            to_host(-nbytes)
        done.succeed()

    def _offload(self, f: int, rank: int, lc: LayerCopy | None):
        """After F: copy the offloadable part of its activations to host (FIFO), then release it from HBM."""
        stage = self.actions[f].stage
        nbytes = float(self.mem.offload_bytes[stage])
        yield from self._copy_out(f, rank, "offload", nbytes, self._copy_s(stage, nbytes),
                                  lambda d: self._move_host(rank, stage, d), self.copied[f], lc)

    def _prefetch(self, b: int, rank: int):
        """Before B/I: wait for the copy out, then bring the activations back (FIFO), HBM allocated first."""
        f = self.forward_of[b]
        stage = self.actions[f].stage
        nbytes = float(self.mem.offload_bytes[stage])
        yield from self._copy_in(b, f, rank, "prefetch", nbytes, self._copy_s(stage, nbytes), self.copied[f],
                                 lambda d: self._move_host(rank, stage, d), self.prefetched[b])

    def _dram(self, rank: int, delta: float) -> None:
        self.dram[rank] += delta

    def _offload_stash(self, i: int, rank: int, lc: LayerCopy | None):
        """After I: copy the offloadable part of its W stash to DRAM (FIFO with the forwards' copies), then
        release it from HBM."""
        nbytes = self.stash_off[self.actions[i].stage]
        yield from self._copy_out(i, rank, "stash-offload", nbytes, nbytes / self.mem.host_link_bps,
                                  lambda d: self._dram(rank, d), self.stash_copied[i], lc)

    def _layer_copies(self) -> tuple[dict[int, LayerCopy], dict[int, LayerCopy]]:
        """Per action, how its copy out (F: activations, I: W stash) and its prefetch (B/I: activations, W: its
        stash) move when they move layer by layer (sim.graph.activation_layer_copies and stash_layer_copies,
        per chunk); absent: the whole-chunk rule."""
        out: dict[int, LayerCopy] = {}
        into: dict[int, LayerCopy] = {}
        if not self.mem.layer_copies:
            return out, into
        acts, stashes = activation_layer_copies(self.mem), stash_layer_copies(self.mem)  # per chunk
        for i, a in enumerate(self.actions):
            act, stash = acts[a.stage], stashes[a.stage]
            for table, lc in ((out, act if a.kind is Kind.F else stash if a.kind is Kind.I else None),
                              (into, act if a.kind in BACKWARD_KINDS else stash if a.kind is Kind.W else None)):
                if lc is not None:
                    table[i] = lc
        return out, into

    def _prefetch_stash(self, w: int, rank: int):
        """Before W: wait for its I's stash copy out, then bring the stash back (FIFO), HBM allocated first."""
        i = step_structure(self.sched).split_of(w)
        nbytes = self.stash_off[self.actions[w].stage]
        yield from self._copy_in(w, w, rank, "stash-prefetch", nbytes, nbytes / self.mem.host_link_bps,
                                 self.stash_copied[i], lambda d: self._dram(rank, d), self.prefetched[w])

    def _fetch_weights(self, use: int, chunk: int, rank: int):
        """Before `use`: bring the chunk's weights back (FIFO on the h2d engine), HBM allocated when it starts."""
        nbytes = self.weight_bytes[chunk]
        with self.h2d[rank].request() as req:
            yield req
            entry = self._log(rank, "h2d", "weights", use, chunk)
            self.away[rank] -= nbytes
            self._allocate(rank, 0.0, self.env.now, use, grew=True)
            yield self.env.timeout(nbytes / self.mem.host_link_bps)
            entry[-1] = self.env.now
        self.weights_back[use].succeed()

    def _log(self, rank: int, stream: str, what: str, i: int, stage: int) -> list:
        """Record a copy as its stream grants it; the caller fills in the end time."""
        entry = [rank, stream, what, i, stage, self.env.now, self.env.now]
        self.copy_log.append(entry)
        return entry

    def _issue_prefetches(self, rank: int, i: int) -> None:
        """As action i starts, queue the prefetches it issues: weights first (sim.graph.weight_windows), then
        activations (sim.graph.prefetch_issuer: of the backward `lookahead` places later on its rank; the first
        action, of every backward up to there)."""
        for use, chunk in self.issue_weights.get(i, ()):
            if use not in self.weights_back:
                self.weights_back[use] = self.env.event()
                self.env.process(self._fetch_weights(use, chunk, rank))
        for b in self.issues.get(i, ()):
            if b not in self.prefetched:
                self.prefetched[b] = self.env.event()
                fetch = self._prefetch_stash if self.actions[b].kind is Kind.W else self._prefetch
                self.env.process(fetch(b, rank))

    def _wait(self, event: simpy.Event, rank: int, ready: float):
        """Wait for `event` from time `ready`; what it adds is stall."""
        if ready > self.env.now:
            yield self.env.timeout(ready - self.env.now)
        if not event.processed:
            yield event
            self.stall[rank] += self.env.now - ready

    # ---- side chains: the optimizer step's copies when model states live off HBM (sim.graph.side_chains) ----
    def _side_chain(self, chain: tuple[SideTask, ...], rank: int):
        """One chain of side tasks (sim.graph.side_chains): each queues on its copy engine (FIFO) or runs on
        the host, after the previous one; the step ends no earlier than the chain."""
        for task in chain:
            if task.stream is None:
                yield self.env.timeout(task.seconds)
                continue
            with (self.d2h if task.stream == "d2h" else self.h2d)[rank].request() as req:
                yield req
                entry = self._log(rank, task.stream, "step", -1, task.chunk)
                yield self.env.timeout(task.seconds)
                entry[-1] = self.env.now
        self.copy_end = max(self.copy_end, self.env.now)

    # ---- the ranks -----------------------------------------------------------------------------------------
    def _finish(self, i: int, rank: int) -> None:
        """Record i's end, start its transfer over the FIFO link, wake whoever waits for it."""
        now = self.env.now
        self.end[i] = now
        dst = self.consumer_rank[i]
        if dst == -1 or dst == rank:
            self.arrive[i] = now
        else:
            link = (rank, dst)
            begin = max(now, self.link_free.get(link, 0.0))
            arrive = begin + self.costs.p2p_s
            self.link_free[link] = arrive
            self.arrive[i] = arrive
            self.transfers.append((rank, dst, str(self.actions[i]), begin, arrive))
        waiter = self.waiters.pop(i, None)
        if waiter is not None:
            waiter.succeed()

    def _rank_process(self, rank: int):
        env, deps, end, arrive, acts = self.env, self.deps, self.end, self.arrive, self.actions
        offloads, copying = self.offloads, self.copying
        for i in self.rank_slices[rank]:
            ready = produced = env.now  # produced: when the rank is free and every input has been computed
            for j, via in deps[i]:
                if end[j] is None:
                    waiter = self.waiters.get(j)
                    if waiter is None:
                        waiter = self.waiters[j] = env.event()
                    yield waiter
                t = arrive[j] if via else end[j]
                if t > ready:
                    ready = t
                if end[j] > produced:
                    produced = end[j]
            if ready > produced:  # exposed communication: the wait that only the transfer explains
                self.p2p_wait[rank] += ready - produced
            kind = acts[i].kind
            backward = kind in BACKWARD_KINDS
            if copying:
                forwards, splits = self.rank_forwards[rank], self.rank_splits[rank]
                gate = self.copied[forwards[-2]] if offloads and kind is Kind.F and len(forwards) >= 2 else None
                if self.stashes and kind is Kind.I and len(splits) >= 2:
                    gate = self.stash_copied[splits[-2]]
                fetched = i in self.issuer  # a B/I with activation offload, a W with stash offload
                if fetched and i not in self.prefetched:
                    self._issue_prefetches(rank, self.issuer[i])
                layered = self.layer_in.get(i) if fetched else None
                whole = self.prefetched.get(i) if fetched and layered is None else None
                for event in (gate, whole, self.weights_back.get(i)):
                    if event is not None:
                        yield from self._wait(event, rank, ready)
                        ready = max(ready, env.now)
                if ready > env.now:
                    yield env.timeout(ready - env.now)
                if layered is not None:  # start as sim.graph.LayerCopy.in_offsets says
                    if i not in self.fetch_span:
                        self.granted[i] = env.event()
                        yield self.granted[i]
                    (p0, p1), dur = self.fetch_span[i], self.duration[i]
                    after_start, after_end = layered.in_offsets(action_recompute_s(self.mem, acts[i]), dur)
                    begin = max(env.now, p0 + after_start, p1 + after_end)
                    self.stall[rank] += begin - ready
                    ready = begin
                    if ready > env.now:
                        yield env.timeout(ready - env.now)
                self._issue_prefetches(rank, i)  # as i starts
            dur = self.duration[i]
            if kind is Kind.F:
                self._allocate(rank, self.kept[i] + self.f_left[acts[i].stage], ready, i)
            elif backward and self.transient[acts[i].stage] > 0:
                self._allocate(rank, float(self.transient[acts[i].stage]), ready, i)
            self.start[i] = ready
            if i in self.layer_out:  # the copy out is queued from the first layer on
                self._copy_after(i, rank, kind, self.layer_out[i])
            wait = ready - env.now + dur
            if wait > 0:
                yield env.timeout(wait)
            if backward:
                # a split backward's I keeps what its W needs (inputs of the weight GEMMs, output gradients)
                stage = acts[i].stage
                stash = self.stash[stage] if kind is Kind.I else 0.0
                self._allocate(rank, stash + self.b_left[stage] - self.kept[self.forward_of[i]]
                               - float(self.transient[stage]), env.now, i)
            elif kind is Kind.W and self.stash[acts[i].stage]:
                self._allocate(rank, -self.stash[acts[i].stage], env.now, i)
            self.busy[rank] += dur
            self.progress[rank] += 1
            self.finished.append(i)
            self._finish(i, rank)
            for chunk in self.release_weights.get(i, ()):
                self.away[rank] += self.weight_bytes[chunk]
                self._record(rank, env.now)
            if i not in self.layer_out:
                self._copy_after(i, rank, kind, None)
            if i in self.side_chains:
                env.process(self._side_chain(self.side_chains[i], rank))
            if self.costs.p2p_blocking and self.arrive[i] > env.now:  # the sender waits for its send
                self.p2p_wait[rank] += self.arrive[i] - env.now
                yield env.timeout(self.arrive[i] - env.now)

    def _copy_after(self, i: int, rank: int, kind: Kind, lc: LayerCopy | None) -> None:
        """Queue action i's copy out: an F's activations, an I's W stash (whole after it ends, or layer by layer
        from its start)."""
        if self.offloads and kind is Kind.F:
            self.rank_forwards[rank].append(i)
            self.env.process(self._offload(i, rank, lc))
        elif self.stashes and kind is Kind.I:
            self.rank_splits[rank].append(i)
            self.env.process(self._offload_stash(i, rank, lc))

    def _optimizer_step(self) -> float:
        """After each rank's last action: its DP reduction and optimizer step (costs.step_tail_s) and the step's
        transient memory, with the offloaded weights a GPU optimizer brings back to update
        (MemoryPlan.step_weight_bytes; a host optimizer updates its own copy and they stay away). Returns
        when the last rank's step ends (SimResult.step_time_s); the pipeline's makespan, which the freeze
        planner reproduces, excludes it."""
        done = 0.0
        self.span = [0.0] * len(self.rank_slices)
        for r, slots in enumerate(self.rank_slices):
            last = max((self.end[i] for i in slots), default=0.0)
            end = last + self.step_tail[r]
            self.span[r] = end - min((self.start[i] for i in slots), default=0.0)
            back = self.step_weights[r]  # weights away at the step's end that a GPU optimizer updates in HBM
            if self.step_transient[r] or back:
                self.live[r] += self.step_transient[r]
                self.away[r] -= back
                self._record(r, last, "optimizer step")
                self.live[r] -= self.step_transient[r]
                self.away[r] += back
                self._record(r, end)
            done = max(done, end)
        return done

    def run(self) -> SimResult:
        for r in range(self.sched.num_ranks):
            self.env.process(self._rank_process(r))
        self.env.run()
        self._check_finished()
        step_end = self._optimizer_step()
        order = self.finished
        acts = [self.actions[i] for i in order]
        return SimResult(
            schedule=self.sched,
            costs=self.costs,
            makespan_s=max(max((self.end[i] for i in order), default=0.0), self.copy_end),
            step_end_s=step_end,
            rank=np.asarray([self.rank_of[i] for i in order], dtype=np.int64),
            stage=np.asarray([a.stage for a in acts], dtype=np.int64),
            microbatch=np.asarray([a.microbatch for a in acts], dtype=np.int64),
            kind=[a.kind.value for a in acts],
            start_s=np.asarray([self.start[i] for i in order]),
            end_s=np.asarray([self.end[i] for i in order]),
            busy_s=np.asarray(self.busy),
            p2p_wait_s=np.asarray(self.p2p_wait),
            rank_span_s=np.asarray(self.span),
            peak_activation_bytes=np.asarray(self.peak_act),
            peak_hbm_bytes=np.asarray(self.peak_hbm),
            static_bytes=np.asarray(self.static),
            memory=self.memory,
            transfers=self.transfers,
            oom_events=self.oom,
            stall_s=np.asarray(self.stall),
            peak_dram_bytes=np.asarray(self.peak_dram),
            peak_nvme_bytes=np.asarray(self.peak_nvme),
            hbm_limit_bytes=self.mem.hbm_limit_bytes,
            copies=[
                CopyRecord(r, stream, what, self.actions[i] if i >= 0 else None, stage, start, end)
                for r, stream, what, i, stage, start, end in self.copy_log
            ],
            peak_at=[
                PeakMoment(r, at, during, static, live if during != "optimizer step" else self._left_behind(live, r),
                           self.step_transient[r] if during == "optimizer step" else 0.0)
                for r, (at, during, live, static) in enumerate(self.peak_moment)
            ],
        )

    def _left_behind(self, live: float, rank: int) -> float:
        """Of `live` during the optimizer step, what the forwards and backwards left (MemoryPlan's
        forward_retained_bytes and backward_retained_bytes), not the step's own working memory; 0 where nothing
        is left (no float residue of the activations' frees)."""
        return max(live - self.step_transient[rank], 0.0) if any(self.f_left) or any(self.b_left) else 0.0

    def _check_finished(self) -> None:
        blocked = []
        for r, slots in enumerate(self.rank_slices):
            if self.progress[r] < len(slots):
                i = slots[self.progress[r]]
                waits = [str(self.actions[j]) for j, _ in self.deps[i] if self.end[j] is None]
                blocked.append(f"rank {r} at {self.actions[i]} waits for {'+'.join(waits)}")
        if blocked:
            raise DeadlockError(f"schedule {self.sched.name!r} deadlocks: {'; '.join(blocked)}")


