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
    def __init__(self, schedule: Schedule, costs: CostTable, overrides: Mapping[Action, float]):
        if costs.num_chunks != schedule.num_stages:
            raise ScheduleError(
                f"schedule has {schedule.num_stages} stages but the costs describe {costs.num_chunks} chunks"
            )
        self.sched, self.costs = schedule, costs
        self.env = simpy.Environment()
        self.s2r = schedule.stage_to_rank
        n_ranks = schedule.num_ranks
        self.done = {a: self.env.event() for r in schedule.ranks for a in r}
        self.backward_of = {(a.stage, a.microbatch): a for a in self.done if a.kind in (Kind.B, Kind.I)}
        # the one event each cross-stage consumer waits on: the producer's done event on the same rank,
        # else an arrival event fired when the transfer over the link completes
        self.arrival: dict[Action, simpy.Event] = {}
        for a in self.done:
            consumer = self._consumer(a)
            if consumer is not None:
                same_rank = self.s2r[consumer.stage] == self.s2r[a.stage]
                self.arrival[a] = self.done[a] if same_rank else self.env.event()
        self.link_free: dict[tuple[int, int], float] = {}
        self.plan = [
            [(a, overrides.get(a, costs.duration(a)), self._inputs(a)) for a in actions]
            for actions in schedule.ranks
        ]
        self.static = costs.static_bytes_per_rank(self.s2r)
        self.act_bytes = costs.activation_bytes
        self.live = np.zeros(n_ranks)
        self.peak_act = np.zeros(n_ranks)
        self.busy = np.zeros(n_ranks)
        self.progress = [0] * n_ranks
        self.memory: list[tuple[int, float, float]] = [(r, 0.0, float(self.static[r])) for r in range(n_ranks)]
        self.transfers: list[tuple[int, int, str, float, float]] = []
        self.oom: list[OOMEvent] = []
        self.rec_rank: list[int] = []
        self.rec_action: list[Action] = []
        self.rec_start: list[float] = []
        self.rec_end: list[float] = []

    def _consumer(self, a: Action) -> Action | None:
        """The action on the next stage (F) or previous stage (B/I) that needs `a`'s output."""
        if a.kind is Kind.F and a.stage + 1 < self.sched.num_stages:
            return Action(a.stage + 1, Kind.F, a.microbatch)
        if a.kind in (Kind.B, Kind.I) and a.stage > 0:
            return self.backward_of.get((a.stage - 1, a.microbatch))
        return None

    def _inputs(self, a: Action) -> list[simpy.Event]:
        if a.kind is Kind.F:
            return [self.arrival[Action(a.stage - 1, Kind.F, a.microbatch)]] if a.stage > 0 else []
        if a.kind is Kind.W:
            return [self.done[Action(a.stage, Kind.I, a.microbatch)]]
        deps = [self.done[Action(a.stage, Kind.F, a.microbatch)]]
        upstream = self.backward_of.get((a.stage + 1, a.microbatch))
        if upstream is not None:
            deps.append(self.arrival[upstream])
        return deps

    def _send(self, a: Action, src: int) -> None:
        """Start the transfer of `a`'s output to its consumer's rank, FIFO behind earlier transfers."""
        consumer = self._consumer(a)
        if consumer is None:
            return
        dst = self.s2r[consumer.stage]
        if dst == src:
            return
        now = self.env.now
        link = (src, dst)
        start = max(now, self.link_free.get(link, 0.0))
        end = start + self.costs.p2p_s
        self.link_free[link] = end
        self.transfers.append((src, dst, str(a), start, end))
        arrival = self.arrival[a]
        if end == now:
            arrival.succeed()
        else:
            self.env.timeout(end - now).callbacks.append(lambda _ev, ev=arrival: ev.succeed())

    def _allocate(self, rank: int, delta: float, a: Action) -> None:
        self.live[rank] += delta
        hbm = self.static[rank] + self.live[rank]
        now = self.env.now
        self.memory.append((rank, now, float(hbm)))
        if delta > 0:
            self.peak_act[rank] = max(self.peak_act[rank], self.live[rank])
            if hbm > self.costs.hbm_bytes:
                self.oom.append(OOMEvent(rank, now, str(a), float(hbm), self.costs.hbm_bytes))

    def _rank_process(self, rank: int):
        env = self.env
        for a, dur, inputs in self.plan[rank]:
            pending = [e for e in inputs if not e.processed]
            if len(pending) == 1:
                yield pending[0]
            elif pending:
                yield env.all_of(pending)
            start = env.now
            if a.kind is Kind.F:
                self._allocate(rank, self.act_bytes[a.stage], a)
            if dur > 0:
                yield env.timeout(dur)
            if a.kind in (Kind.B, Kind.I):
                self._allocate(rank, -self.act_bytes[a.stage], a)
            self.busy[rank] += dur
            self.rec_rank.append(rank)
            self.rec_action.append(a)
            self.rec_start.append(start)
            self.rec_end.append(env.now)
            self.progress[rank] += 1
            self.done[a].succeed()
            self._send(a, rank)

    def run(self) -> SimResult:
        for r in range(self.sched.num_ranks):
            self.env.process(self._rank_process(r))
        self.env.run()
        self._check_finished()
        acts = self.rec_action
        static = self.static
        peak_hbm = static.copy()
        for r, _t, hbm in self.memory:
            peak_hbm[r] = max(peak_hbm[r], hbm)
        return SimResult(
            schedule=self.sched,
            costs=self.costs,
            makespan_s=max(self.rec_end, default=0.0),
            rank=np.asarray(self.rec_rank, dtype=np.int64),
            stage=np.asarray([a.stage for a in acts], dtype=np.int64),
            microbatch=np.asarray([a.microbatch for a in acts], dtype=np.int64),
            kind=[a.kind.value for a in acts],
            start_s=np.asarray(self.rec_start),
            end_s=np.asarray(self.rec_end),
            busy_s=self.busy,
            peak_activation_bytes=self.peak_act,
            peak_hbm_bytes=peak_hbm,
            static_bytes=static,
            memory=self.memory,
            transfers=self.transfers,
            oom_events=self.oom,
        )

    def _check_finished(self) -> None:
        blocked = []
        for r, actions in enumerate(self.sched.ranks):
            i = self.progress[r]
            if i < len(actions):
                a = actions[i]
                waits = [str(w) for w in self._waiting_on(a) if not self.done[w].processed]
                blocked.append(f"rank {r} at {a} waits for {'+'.join(waits) or 'a transfer'}")
        if blocked:
            raise DeadlockError(f"schedule {self.sched.name!r} deadlocks: {'; '.join(blocked)}")

    def _waiting_on(self, a: Action) -> list[Action]:
        if a.kind is Kind.F:
            return [Action(a.stage - 1, Kind.F, a.microbatch)] if a.stage > 0 else []
        if a.kind is Kind.W:
            return [Action(a.stage, Kind.I, a.microbatch)]
        up = self.backward_of.get((a.stage + 1, a.microbatch))
        return [Action(a.stage, Kind.F, a.microbatch)] + ([up] if up else [])

