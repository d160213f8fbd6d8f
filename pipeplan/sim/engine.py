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
buffers, sim.copy_rules.PINNED_BUFFERS). Every backward queues a host-to-device prefetch when the rank starts
the action `prefetch_lookahead` places before it; the prefetch waits for its copy out, allocates HBM when it starts,
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

This module is the event loop; the rules it runs come from sim/graph.py (what waits for what) and
sim/copy_rules.py (streams, copy kinds, PINNED_BUFFERS, the prefetch window), and its collaborators each hold
one part of the state: Links (below), sim/ledger.py (HbmLedger, HostLedger, Residency: memory),
sim/copy_engines.py (the FIFO streams and their log) and sim/offloads.py (which copies happen when, and the
waits they impose); sim/results.py holds what a step returns.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Generator, Mapping

import numpy as np
import simpy

from pipeplan.sim.costs import CostTable, per_rank_sum
from pipeplan.sim.errors import ScheduleError
from pipeplan.sim.graph import step_structure
from pipeplan.sim.ir import BACKWARD_KINDS, Action, Schedule
from pipeplan.sim.ledger import HbmLedger, HostLedger, Residency
from pipeplan.sim.memory_plan import MemoryPlan, keep_everything
from pipeplan.sim.offloads import Offloads, WeightShuttle
from pipeplan.sim.results import CopyRecord, OOMEvent, PeakMoment, SimResult

__all__ = ["CopyRecord", "DeadlockError", "OOMEvent", "PeakMoment", "SimResult", "simulate"]


class DeadlockError(ScheduleError):
    """The schedule cannot finish: some rank waits for an action that can never run."""


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


class Links:
    """The directed links between ranks: each a FIFO single server, `p2p_s` a transfer, in closed form (a
    transfer costs no event: it begins when the link is free and the producer has finished)."""

    def __init__(self, p2p_s: float):
        self.p2p_s = p2p_s
        self.free: dict[tuple[int, int], float] = {}
        self.transfers: list[tuple[int, int, str, float, float]] = []  # (src, dst, action, start_s, end_s)

    def send(self, src: int, dst: int, action: Action, now: float) -> float:
        """Queue `action`'s result from `src` to `dst` at `now`; returns when it arrives."""
        link = (src, dst)
        begin = max(now, self.free.get(link, 0.0))
        arrive = begin + self.p2p_s
        self.free[link] = arrive
        self.transfers.append((src, dst, str(action), begin, arrive))
        return arrive


class _StepSimulation:
    """The event loop: one SimPy process per rank runs its actions (integer nodes of sim.graph.StepStructure)
    in order. A rank yields one timeout per action (waiting for inputs whose arrival time is already known is
    folded into it) and an event only for a producer that has not finished yet; the collaborators do the rest:
    Links (transfers), HbmLedger and Residency (memory), Offloads (copy engines and what waits on them)."""

    def __init__(self, schedule: Schedule, costs: CostTable, overrides: Mapping[Action, float], mem: MemoryPlan):
        if costs.num_chunks != schedule.num_stages:
            raise ScheduleError(
                f"schedule has {schedule.num_stages} stages but the costs describe {costs.num_chunks} chunks"
            )
        self.sched, self.costs, self.mem = schedule, costs, mem
        self.env = simpy.Environment()
        self.st = st = step_structure(schedule)  # what each action waits for: the step's rules, sim/graph.py
        n, n_ranks = st.n_actions, schedule.num_ranks
        self.duration = self._durations(overrides)
        # end and arrive hold a time only once `done` says the node has finished (until then 0.0, never read)
        self.done: list[bool] = [False] * n
        self.end: list[float] = [0.0] * n
        self.arrive: list[float] = [0.0] * n  # when a result is at its consumer's rank
        self.start: list[float] = [0.0] * n
        self.waiters: dict[int, simpy.Event] = {}  # unfinished producer -> the event its consumers wait on
        self.busy, self.p2p_wait, self.progress = [0.0] * n_ranks, [0.0] * n_ranks, [0] * n_ranks
        self.finished: list[int] = []
        self.links = Links(costs.p2p_s)
        self.hbm, self.residency, self.offloads = self._memory(n_ranks)

    def _durations(self, overrides: Mapping[Action, float]) -> list[float]:
        """Per node: the override (an action's whole duration: a freeze plan's includes any recomputation), or
        the cost table's, plus the plan's recomputation before B and I."""
        recompute = self.mem.recompute_s.tolist()
        return [
            overrides[a] if a in overrides
            else self.costs.duration(a) + (recompute[a.stage] if a.kind in BACKWARD_KINDS else 0.0)
            for a in self.st.actions
        ]

    def _memory(self, n_ranks: int) -> tuple[HbmLedger, Residency, Offloads]:
        mem, s2r = self.mem, self.sched.stage_to_rank
        host = HostLedger(per_rank_sum(mem.static_host_bytes.get("dram", np.zeros(0)), s2r, n_ranks).tolist(),
                          per_rank_sum(mem.static_host_bytes.get("nvme", np.zeros(0)), s2r, n_ranks).tolist())
        weights = WeightShuttle(self.sched, mem, n_ranks)
        hbm = HbmLedger(per_rank_sum(mem.static_hbm_bytes, s2r, n_ranks).tolist(), weights.away, host,
                        self.costs.hbm_bytes)
        residency = Residency(mem, self.st.actions, self.st.forward_of, self.sched.num_stages,
                              per_rank_sum(mem.step_transient_bytes, s2r, n_ranks).tolist(),  # empty: zeros
                              per_rank_sum(mem.step_weight_bytes, s2r, n_ranks).tolist())
        offloads = Offloads(self.env, self.sched, mem, hbm, weights, self.duration, self.start)
        return hbm, residency, offloads

    # ---- the ranks -----------------------------------------------------------------------------------------
    def _rank_process(self, rank: int) -> Generator[simpy.Event, None, None]:
        env, done, offloads = self.env, self.done, self.offloads
        for i in self.st.rank_nodes(rank):
            free = env.now
            for j, _ in self.st.deps[i]:
                if not done[j]:  # an event only for a producer that has not finished yet
                    yield self._waiter(j)
            ready = self._inputs_ready(i, rank, free)
            if offloads.copying:
                ready = yield from offloads.before(i, rank, ready)
            self._begin(i, rank, ready)
            wait = ready - env.now + self.duration[i]
            if wait > 0:
                yield env.timeout(wait)
            self._end(i, rank)
            if self.costs.p2p_blocking and self.arrive[i] > env.now:  # the sender waits for its send
                self.p2p_wait[rank] += self.arrive[i] - env.now
                yield env.timeout(self.arrive[i] - env.now)

    def _waiter(self, j: int) -> simpy.Event:
        waiter = self.waiters.get(j)
        if waiter is None:
            waiter = self.waiters[j] = self.env.event()
        return waiter

    def _inputs_ready(self, i: int, rank: int, free: float) -> float:
        """When node i's inputs are all on its rank, the rank free since `free`. Waiting that only the transfer
        explains is exposed communication (p2p_wait). Every input has finished (_rank_process waited)."""
        end, arrive = self.end, self.arrive
        ready = produced = free  # produced: when the rank is free and every input has been computed
        for j, via in self.st.deps[i]:
            t = arrive[j] if via else end[j]
            if t > ready:
                ready = t
            if end[j] > produced:
                produced = end[j]
        if ready > produced:
            self.p2p_wait[rank] += ready - produced
        return ready

    def _begin(self, i: int, rank: int, ready: float) -> None:
        """Node i starts at `ready`: what it allocates (Residency), a layer-wise copy out."""
        delta = self.residency.at_start[i]
        if delta is not None:
            self.hbm.allocate(rank, delta, ready, self.st.actions[i])
        self.start[i] = ready
        if self.offloads.layered:
            self.offloads.at_start(i, rank)

    def _end(self, i: int, rank: int) -> None:
        """Node i ends now: what it frees, its result onto its link, its copies out and side chains."""
        delta = self.residency.at_end[i]
        if delta is not None:
            self.hbm.allocate(rank, delta, self.env.now, self.st.actions[i])
        self.busy[rank] += self.duration[i]
        self.progress[rank] += 1
        self.finished.append(i)
        self._finish(i, rank)
        if self.offloads.follows:
            self.offloads.after(i, rank)

    def _finish(self, i: int, rank: int) -> None:
        """Record i's end, start its transfer over the FIFO link, wake whoever waits for it."""
        now = self.env.now
        self.end[i] = now
        self.done[i] = True
        dst = self.st.consumer_rank[i]
        self.arrive[i] = now if dst == -1 or dst == rank else self.links.send(rank, dst, self.st.actions[i], now)
        waiter = self.waiters.pop(i, None)
        if waiter is not None:
            waiter.succeed()

    # ---- the step ------------------------------------------------------------------------------------------
    def _optimizer_step(self) -> tuple[float, list[float]]:
        """After each rank's last action: its DP reduction and optimizer step (costs.step_tail_s) and their
        memory (Residency.optimizer_step). Returns when the last rank's step ends (SimResult.step_time_s; the
        pipeline's makespan, which the freeze planner reproduces, excludes it) and each rank's span."""
        n_ranks = self.sched.num_ranks
        tail = self.costs.step_tail_s.tolist() if self.costs.step_tail_s is not None else [0.0] * n_ranks
        done, span = 0.0, []
        for r in range(n_ranks):
            slots = self.st.rank_nodes(r)
            last = max((self.end[i] for i in slots), default=0.0)
            end = last + tail[r]
            span.append(end - min((self.start[i] for i in slots), default=0.0))
            self.residency.optimizer_step(self.hbm, r, last, end)
            done = max(done, end)
        return done, span

    def run(self) -> SimResult:
        for r in range(self.sched.num_ranks):
            self.env.process(self._rank_process(r))
        self.env.run()
        self._check_finished()
        step_end, span = self._optimizer_step()
        order, hbm, host = self.finished, self.hbm, self.hbm.host
        acts = [self.st.actions[i] for i in order]
        return SimResult(
            schedule=self.sched,
            costs=self.costs,
            makespan_s=max(max((self.end[i] for i in order), default=0.0), self.offloads.engines.end_s),
            step_end_s=step_end,
            rank=np.asarray([self.st.rank_of[i] for i in order], dtype=np.int64),
            stage=np.asarray([a.stage for a in acts], dtype=np.int64),
            microbatch=np.asarray([a.microbatch for a in acts], dtype=np.int64),
            kind=[a.kind.value for a in acts],
            start_s=np.asarray([self.start[i] for i in order]),
            end_s=np.asarray([self.end[i] for i in order]),
            busy_s=np.asarray(self.busy),
            p2p_wait_s=np.asarray(self.p2p_wait),
            rank_span_s=np.asarray(span),
            peak_activation_bytes=np.asarray(hbm.peak_act),
            peak_hbm_bytes=np.asarray(hbm.peak_hbm),
            static_bytes=np.asarray(hbm.static),
            memory=hbm.log,
            transfers=self.links.transfers,
            oom_events=hbm.oom,
            stall_s=np.asarray(self.offloads.stall),
            peak_dram_bytes=np.asarray(host.peak_dram),
            peak_nvme_bytes=np.asarray(host.peak_nvme),
            hbm_limit_bytes=self.mem.hbm_limit_bytes,
            copies=self.offloads.engines.records(self.st.actions),
            peak_at=self.residency.peaks(hbm),
        )

    def _check_finished(self) -> None:
        blocked = []
        for r in range(self.sched.num_ranks):
            slots = self.st.rank_nodes(r)
            if self.progress[r] < len(slots):
                i = slots[self.progress[r]]
                waits = [str(self.st.actions[j]) for j, _ in self.st.deps[i] if not self.done[j]]
                blocked.append(f"rank {r} at {self.st.actions[i]} waits for {'+'.join(waits)}")
        if blocked:
            raise DeadlockError(f"schedule {self.sched.name!r} deadlocks: {'; '.join(blocked)}")
