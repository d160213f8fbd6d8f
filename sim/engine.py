"""SimPy engine: one process per pipeline rank runs its actions in the schedule's order.

An action starts when its rank is free and its inputs have arrived: F needs the previous stage's F of that
microbatch; B or I needs the next stage's B/I and its own F; W needs its I. A result that crosses ranks is
sent over the directed link between them: each link is a FIFO single server (one transfer at a time, p2p_s
each), computed in closed form so a transfer costs one timeout event; transfers overlap compute. HBM per
rank is the static bytes plus activations, allocated when F starts and freed when B or I ends; exceeding the
capacity is recorded (rank, time, by how much), not raised. A schedule whose ranks wait on each other forever
raises DeadlockError naming the blocked actions.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import simpy

from sim.costs import CostTable
from sim.errors import ScheduleError
from sim.ir import Action, Kind, Schedule


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
    memory: list[tuple[int, float, float]]  # (rank, time_s, hbm_bytes) at every change
    transfers: list[tuple[int, int, str, float, float]]  # (src_rank, dst_rank, action, start_s, end_s)
    oom_events: list[OOMEvent] = field(default_factory=list)
    sim_wall_s: float = 0.0

    @property
    def bubble_ratio(self) -> float:
        """Idle share of all rank-time over the step."""
        total = self.makespan_s * self.schedule.num_ranks
        return float(1.0 - self.busy_s.sum() / total) if total > 0 else 0.0

    @property
    def oom(self) -> bool:
        return bool(self.oom_events)

    @property
    def tokens_per_s(self) -> float | None:
        c = self.costs
        if c.tokens_per_microbatch is None or self.makespan_s <= 0:
            return None
        return c.tokens_per_microbatch * self.schedule.num_microbatches * c.data_parallel / self.makespan_s

    @property
    def mfu(self) -> float | None:
        c = self.costs
        if c.flops_per_microbatch is None or c.peak_flops_per_gpu is None or self.makespan_s <= 0:
            return None
        gpus = self.schedule.num_ranks * c.gpus_per_rank
        return c.flops_per_microbatch * self.schedule.num_microbatches / (
            self.makespan_s * gpus * c.peak_flops_per_gpu
        )


def simulate(
    schedule: Schedule,
    costs: CostTable,
    durations: Mapping[Action, float] | None = None,
) -> SimResult:
    """Run one training step of `schedule` under `costs`; `durations` overrides single actions' times."""
    t0 = time.perf_counter()
    result = _StepSimulation(schedule, costs, durations or {}).run()
    result.sim_wall_s = time.perf_counter() - t0
    return result


class _StepSimulation:
    """Event-efficient core: actions are integer indices; a rank yields one timeout per action (waiting for
    inputs whose arrival time is already known is folded into it) and an event only for a producer that
    has not finished yet."""

    def __init__(self, schedule: Schedule, costs: CostTable, overrides: Mapping[Action, float]):
        if costs.num_chunks != schedule.num_stages:
            raise ScheduleError(
                f"schedule has {schedule.num_stages} stages but the costs describe {costs.num_chunks} chunks"
            )
        self.sched, self.costs = schedule, costs
        self.env = simpy.Environment()
        s2r = schedule.stage_to_rank
        n_ranks = schedule.num_ranks
        self.actions: list[Action] = [a for r in schedule.ranks for a in r]
        index = {(a.stage, a.kind, a.microbatch): i for i, a in enumerate(self.actions)}
        backward = {
            (a.stage, a.microbatch): i for i, a in enumerate(self.actions) if a.kind in (Kind.B, Kind.I)
        }
        n = len(self.actions)
        self.duration = [overrides.get(a, costs.duration(a)) for a in self.actions]
        # deps[i]: (producer j, True if j's output crosses stages and so arrives at arrive[j])
        self.deps: list[tuple[tuple[int, bool], ...]] = []
        self.consumer_rank: list[int] = [-1] * n  # rank of the cross-stage consumer, -1 if none
        for a in self.actions:
            if a.kind is Kind.F:
                j = index.get((a.stage - 1, Kind.F, a.microbatch)) if a.stage > 0 else None
                deps = ((j, True),) if j is not None else ()
            elif a.kind is Kind.W:
                deps = ((index[(a.stage, Kind.I, a.microbatch)], False),)
            else:
                up = backward.get((a.stage + 1, a.microbatch))
                own = (index[(a.stage, Kind.F, a.microbatch)], False)
                deps = (own, (up, True)) if up is not None else (own,)
            for j, via in deps:
                if via:
                    self.consumer_rank[j] = s2r[a.stage]
            self.deps.append(deps)
        self.rank_of = [s2r[a.stage] for a in self.actions]
        offsets = np.cumsum([0] + [len(r) for r in schedule.ranks])
        self.rank_slices = [range(offsets[r], offsets[r + 1]) for r in range(n_ranks)]
        self.end: list[float | None] = [None] * n
        self.arrive: list[float | None] = [None] * n
        self.start: list[float] = [0.0] * n
        self.waiters: dict[int, simpy.Event] = {}
        self.link_free: dict[tuple[int, int], float] = {}
        self.static = costs.static_bytes_per_rank(s2r)
        self.act_bytes = [float(costs.activation_bytes[a.stage]) for a in self.actions]
        self.live = np.zeros(n_ranks)
        self.peak_act = np.zeros(n_ranks)
        self.busy = np.zeros(n_ranks)
        self.progress = [0] * n_ranks
        self.memory = [(r, 0.0, float(self.static[r])) for r in range(n_ranks)]  # (rank, time_s, hbm_bytes)
        self.transfers: list[tuple[int, int, str, float, float]] = []
        self.oom: list[OOMEvent] = []
        self.finished: list[int] = []

    def _allocate(self, rank: int, delta: float, at: float, i: int) -> None:
        self.live[rank] += delta
        hbm = self.static[rank] + self.live[rank]
        self.memory.append((rank, at, float(hbm)))
        if delta > 0:
            self.peak_act[rank] = max(self.peak_act[rank], self.live[rank])
            if hbm > self.costs.hbm_bytes:
                self.oom.append(OOMEvent(rank, at, str(self.actions[i]), float(hbm), self.costs.hbm_bytes))

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
        env, deps, end, arrive, kinds = self.env, self.deps, self.end, self.arrive, self.actions
        for i in self.rank_slices[rank]:
            ready = env.now
            for j, via in deps[i]:
                if end[j] is None:
                    waiter = self.waiters.get(j)
                    if waiter is None:
                        waiter = self.waiters[j] = env.event()
                    yield waiter
                t = arrive[j] if via else end[j]
                if t > ready:
                    ready = t
            dur = self.duration[i]
            kind = kinds[i].kind
            if kind is Kind.F:
                self._allocate(rank, self.act_bytes[i], ready, i)
            self.start[i] = ready
            wait = ready - env.now + dur
            if wait > 0:
                yield env.timeout(wait)
            if kind is Kind.B or kind is Kind.I:
                self._allocate(rank, -self.act_bytes[i], env.now, i)
            self.busy[rank] += dur
            self.progress[rank] += 1
            self.finished.append(i)
            self._finish(i, rank)

    def run(self) -> SimResult:
        for r in range(self.sched.num_ranks):
            self.env.process(self._rank_process(r))
        self.env.run()
        self._check_finished()
        order = self.finished
        acts = [self.actions[i] for i in order]
        peak_hbm = self.static.copy()
        for r, _t, hbm in self.memory:
            if hbm > peak_hbm[r]:
                peak_hbm[r] = hbm
        return SimResult(
            schedule=self.sched,
            costs=self.costs,
            makespan_s=max((self.end[i] for i in order), default=0.0),
            rank=np.asarray([self.rank_of[i] for i in order], dtype=np.int64),
            stage=np.asarray([a.stage for a in acts], dtype=np.int64),
            microbatch=np.asarray([a.microbatch for a in acts], dtype=np.int64),
            kind=[a.kind.value for a in acts],
            start_s=np.asarray([self.start[i] for i in order]),
            end_s=np.asarray([self.end[i] for i in order]),
            busy_s=self.busy,
            peak_activation_bytes=self.peak_act,
            peak_hbm_bytes=peak_hbm,
            static_bytes=self.static,
            memory=self.memory,
            transfers=self.transfers,
            oom_events=self.oom,
        )

    def _check_finished(self) -> None:
        blocked = []
        for r, slots in enumerate(self.rank_slices):
            if self.progress[r] < len(slots):
                i = slots[self.progress[r]]
                waits = [str(self.actions[j]) for j, _ in self.deps[i] if self.end[j] is None]
                blocked.append(f"rank {r} at {self.actions[i]} waits for {'+'.join(waits)}")
        if blocked:
            raise DeadlockError(f"schedule {self.sched.name!r} deadlocks: {'; '.join(blocked)}")
