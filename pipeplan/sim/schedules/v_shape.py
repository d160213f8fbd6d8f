"""Memory-capped V-shaped schedules, built by one list scheduler: `v-half` and `chronos`.

v-half — V-Half (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", arXiv 2405.15362): ZB-V's
    V placement and split backward, with at most (p+2)//2 whole-rank microbatches per rank, about half of
    1F1B's p, counted as the paper does: a chunk-activation from its F until its W (the authors' zbv_greedy.py
    frees at W), so live activations and W stashes together. The paper builds it from a repeating building
    block; here the order comes from the list scheduler below with that cap as both forward_limit and w_limit.
    Unit-cost step time against ZB-V, m >= 2p: up to +13.6 % for even p, +17.2 % for odd p (p = 5, m = 10),
    shrinking with m (docs/schedules.md).
chronos — Chronos-Pipe (Lin et al. 2025, ChronosPipe, arXiv 2503.03182): HBM treated as a small cache, so
    each activation should be consumed soon after it is made. Zig-zag placement over v >= 2 (even) chunks
    per rank, split backward, backward first, and the smallest admission cap whose unit-cost step time
    stays within CHRONOS_SLOWDOWN of the uncapped schedule's. The paper's body was not available; the
    reasoning behind each choice, and measurements, are in docs/schedules.md.

List scheduler. Time runs on a clock (`ActionTimes`): unit steps by default (T_F = T_I = T_W = 1 and T_B = 2 per
chunk, no time on the wire), or the step's own costs (pipeline.order_timing = "costs": each chunk's F, I and W
times and the P2P hop from the cost table, so the greedy choices are made at the moments the step will really
reach them). Whenever a rank is idle it takes the first ready action from:
  1. a backward (I, or B without split): the one whose activation has waited longest;
  2. a W, if the rank holds `w_limit` chunk-activations whose W has not run (in flight + deferred W);
  3. a forward: later chunks first (they carry older microbatches towards the loss), then the lowest
     microbatch. A forward of the rank's first chunk admits a new microbatch and needs
     reserved_r + v <= `forward_limit`;
  4. any other W, oldest first (W only fills what would otherwise be a bubble).
With a full B (no split, w_limit = 0) forwards come before backwards: with no W to fill a bubble, the cap
alone bounds memory, and filling it before running backwards is 1F1B's own warm-up. Backward first with a full
B runs in waves (a rank busy with its last chunk's F-B pairs while its first chunk waits for gradients): on
unit costs at p = 8, m = 32, v = 2 it made 288 steps at cap 16 (1F1B's memory; 1F1B itself 234) and 230
uncapped; forward first makes 236 and 213 (interleaved 1F1B's (m·v + p − 1)·3), docs/schedules.md.

Reservation: admitting a microbatch on rank r reserves all v of its chunk-activations there and each of its
backwards there releases one, so live_r <= reserved_r <= forward_limit throughout. The count of live
activations along a rank's order does not depend on timing, so this bounds the peak under any costs, and
likewise live_r + deferred W_r <= max(forward_limit, w_limit).

Deadlock freedom, for any forward_limit >= v: let j be the oldest unfinished microbatch. Microbatches are
admitted in order, so a rank that has not admitted j holds no reservation and may admit it; later chunks'
forwards and all backwards are never gated; so an action of j is always ready and the scheduler never stalls.
The static order it emits runs under any costs, since the run that produced it is one valid execution of it;
under the costs it was timed with, the engine replays that run (docs/schedules.md).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

from pipeplan.sim.errors import ScheduleError
from pipeplan.sim.ir import Action, Kind, Schedule
from pipeplan.sim.schedules import exact_virtual_stages, register, register_capped

CHRONOS_SLOWDOWN = 0.05  # chronos may run this much slower than the uncapped schedule (on the list clock)


@dataclass(frozen=True)
class ActionTimes:
    """The list scheduler's clock: per stage (model chunk) the F, I and W times, B = I + W, and the time an
    activation or gradient takes between two ranks (`hop`). Hashable, so plans built on it can be cached."""

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    hop: float = 0.0

    @classmethod
    def unit(cls, stages: int) -> ActionTimes:
        """T_F = T_I = T_W = 1, T_B = 2, nothing on the wire: the order does not depend on any cost."""
        ones = (1.0,) * stages
        return cls(ones, ones, ones)

    def of(self, kind: Kind, stage: int) -> float:
        if kind is Kind.F:
            return self.forward[stage]
        if kind is Kind.I:
            return self.backward_input[stage]
        if kind is Kind.W:
            return self.backward_weight[stage]
        return self.backward_input[stage] + self.backward_weight[stage]


def zigzag_placement(p: int, v: int) -> tuple[int, ...]:
    """Chunk c of rank r is stage c·p + r for even c and c·p + p-1-r for odd c; v = 2 is the V placement."""
    return tuple(s % p if (s // p) % 2 == 0 else p - 1 - s % p for s in range(p * v))


@dataclass(frozen=True)
class Admission:
    """What the list scheduler lets one rank hold, in chunk-activations (one chunk, one microbatch)."""

    forward_limit: int  # activations live or reserved; gates forwards of the rank's first chunk
    w_limit: int  # activations whose W has not run; at this count W goes before forwards
    split_backward: bool = True


@dataclass(frozen=True)
class ListSchedule:
    ranks: tuple[tuple[Action, ...], ...]
    makespan: float  # of the run on the list clock that produced the order


class PastDeadline(Exception):
    """A list-scheduler run could not finish by its deadline."""


def list_schedule(p: int, m: int, v: int, admission: Admission, deadline: float = float("inf"),
                  times: ActionTimes | None = None) -> ListSchedule:
    """Run the list scheduler (module docstring) over the zig-zag-placed p·v chunks on the clock `times`
    (default: unit costs); raise PastDeadline as soon as some action would end after `deadline`."""
    if admission.forward_limit < v:
        raise ScheduleError(f"forward_limit {admission.forward_limit} < v = {v}: no microbatch could be admitted")
    n = p * v
    clock = ActionTimes.unit(n) if times is None else times
    if len(clock.forward) != n:
        raise ScheduleError(f"list scheduler: the clock has times for {len(clock.forward)} stages, not p·v = {n}")
    placement = zigzag_placement(p, v)
    chunks = [[s for s in range(n) if placement[s] == r] for r in range(p)]  # ascending stage = chunk order
    backward = Kind.I if admission.split_backward else Kind.B
    forward_first = not admission.split_backward  # module docstring: with a full B the cap alone bounds memory
    never = float("inf")
    f_end = [[never] * m for _ in range(n)]
    f_arrive = [[never] * m for _ in range(n)]  # F's output at stage s + 1's rank
    b_arrive = [[never] * m for _ in range(n)]  # the backward's input gradient at stage s - 1's rank
    next_f, next_b = [0] * n, [0] * n
    deferred_w: list[deque[Action]] = [deque() for _ in range(p)]
    reserved, held = [0] * p, [0] * p  # held: activations whose W (or B) has not run
    free_at = [0.0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    remaining = n * m * (3 if admission.split_backward else 2)
    events = [0.0]  # times at which a rank frees up or a message arrives

    def pick(r: int, t: float) -> Action | None:
        ready_b = [
            (f_end[s][k], -s, s, k)
            for s in chunks[r]
            if (k := next_b[s]) < m and f_end[s][k] <= t and (s == n - 1 or b_arrive[s + 1][k] <= t)
        ]
        oldest = min(ready_b, default=None)  # the backward whose activation has waited longest
        oldest_b = None if oldest is None else Action(oldest[2], backward, oldest[3])
        if oldest_b and not forward_first:
            return oldest_b
        if deferred_w[r] and held[r] >= admission.w_limit:
            return deferred_w[r].popleft()
        for c in reversed(range(v)):
            s = chunks[r][c]
            k = next_f[s]
            if k < m and (s == 0 or f_arrive[s - 1][k] <= t) and (c > 0 or reserved[r] + v <= admission.forward_limit):
                return Action(s, Kind.F, k)
        if oldest_b:
            return oldest_b
        return deferred_w[r].popleft() if deferred_w[r] else None

    def hop(s: int, to: int) -> float:  # the time from stage s to stage `to` (0 on one rank or outside the model)
        return clock.hop if 0 <= to < n and placement[to] != placement[s] else 0.0

    while remaining:
        if not events:  # unreachable by the argument in the module docstring
            raise ScheduleError(f"list scheduler stalled with p={p}, m={m}, v={v}, {admission}")
        t = heapq.heappop(events)
        while events and events[0] <= t:
            heapq.heappop(events)
        for r in range(p):
            if free_at[r] > t or (a := pick(r, t)) is None:
                continue
            s, k = a.stage, a.microbatch
            end = t + clock.of(a.kind, s)
            if end > deadline:
                raise PastDeadline(f"list schedule p={p}, m={m}, v={v}, {admission} runs past {deadline}")
            free_at[r] = end
            heapq.heappush(events, end)
            orders[r].append(a)
            remaining -= 1
            if a.kind is Kind.F:
                f_end[s][k] = end
                f_arrive[s][k] = end + hop(s, s + 1)
                heapq.heappush(events, f_arrive[s][k])
                next_f[s] += 1
                held[r] += 1
                if s == chunks[r][0]:
                    reserved[r] += v
            elif a.kind is backward:
                b_arrive[s][k] = end + hop(s, s - 1)
                heapq.heappush(events, b_arrive[s][k])
                next_b[s] += 1
                reserved[r] -= 1  # the rank decides again only after this backward has ended
                if a.kind is Kind.I:
                    deferred_w[r].append(Action(s, Kind.W, k))
                else:
                    held[r] -= 1
            else:
                held[r] -= 1
    return ListSchedule(tuple(tuple(o) for o in orders), max(free_at))


def deferred_w_limit(p: int, v: int) -> int:
    """Deferred W passes may keep one whole-rank microbatch more than 1F1B's p (ZB-V's 2p chunks at v = 2)."""
    return v * (p + 1)


# ---- v-half ------------------------------------------------------------------------------------------------
def v_half_limit(p: int) -> int:
    """V-Half's cap in chunk-activations held from F until W: (p+2)//2 whole-rank microbatches of 2 chunks
    each, the peak of the authors' V-Half orders in their own unit (zbv_greedy.py's mem_of_stage: +1 at F,
    -1 at W) for p = 2..8."""
    return 2 * ((p + 2) // 2)


def _check_v_half(p: int, m: int, v: int) -> str | None:
    return exact_virtual_stages(v, 2)


@register("v-half", _check_v_half,
          "V placement, split backward, (p+2)//2 microbatches from F to W (half of 1F1B's)", virtual_stages=2)
def build_v_half(p: int, m: int, v: int) -> Schedule:
    """The list scheduler at V-Half's cap, with the W stash counted against it (w_limit = the cap): live
    activations plus stashes waiting for W stay within v_half_limit(p) on every rank, as in the paper. This is
    chronos' order with admission_cap = stash_limit = v_half_limit(p) (one of solver.capacity's variants)."""
    limit = v_half_limit(p)
    plan = _capped_plan(p, m, 2, limit, limit)
    return Schedule("v-half", 2 * p, m, plan.ranks, zigzag_placement(p, 2))


# ---- chronos -----------------------------------------------------------------------------------------------
def _check_chronos(p: int, m: int, v: int) -> str | None:
    if v < 2 or v % 2:
        return (
            f"needs pipeline.virtual_stages to be even and >= 2 (got {v}): its zig-zag placement goes down "
            f"and back up the ranks, so each rank holds pairs of chunks; e.g. {max(2, v + v % 2)}"
        )
    return None


@lru_cache(maxsize=64)  # a linear scan of list-scheduler runs: 0.1 s at p = 8, m = 32; 6 s at p = 32, m = 64
def chronos_plan(p: int, m: int, v: int, slowdown: float = CHRONOS_SLOWDOWN, times: ActionTimes | None = None,
                 full_b: bool = False) -> tuple[int, ListSchedule]:
    """The smallest forward_limit whose makespan on the clock `times` (default: unit costs) is within `slowdown`
    of the uncapped schedule's; with `full_b`, of the order with a full B (no W stash) instead of I and W."""
    w_limit = 0 if full_b else deferred_w_limit(p, v)
    uncapped = list_schedule(p, m, v, Admission(v * m, w_limit, not full_b), times=times)  # v·m never binds
    target = (1 + slowdown) * uncapped.makespan
    for limit in range(v, v * m):
        try:
            return limit, list_schedule(p, m, v, Admission(limit, w_limit, not full_b), deadline=target, times=times)
        except PastDeadline:  # too slow at this cap; cut short
            continue
    return v * m, uncapped


@register_capped(
    "chronos",
    _check_chronos,
    "zig-zag over v >= 2 (even) chunks, backward first, smallest memory cap within 5% of uncapped step time",
    virtual_stages=2,
)
def build_chronos(p: int, m: int, v: int, admission_cap: int | None = None, stash_limit: int | None = None,
                  times: ActionTimes | None = None) -> Schedule:
    """The chronos order; `admission_cap` (pipeline.admission_cap) replaces the chosen cap; `stash_limit`
    (pipeline.stash_limit) replaces the list scheduler's w_limit (default deferred_w_limit; 0: no W stash, a
    full B instead of I and W); `times` (pipeline.order_timing = "costs") is the list scheduler's clock, unit
    costs when None. V-Half's cap as both (v_half_limit(p) at v = 2), on unit costs, gives exactly v-half's
    order."""
    if admission_cap is None and stash_limit is None:
        _, plan = chronos_plan(p, m, v, times=times)
    else:
        cap = chronos_plan(p, m, v, times=times)[0] if admission_cap is None else admission_cap
        if cap < v:
            raise ScheduleError(f"pipeline.admission_cap: {cap} < virtual_stages = {v}: no microbatch could be "
                                f"admitted; give at least {v}")
        w_limit = deferred_w_limit(p, v) if stash_limit is None else stash_limit
        plan = _capped_plan(p, m, v, cap, w_limit, times)
    return Schedule("chronos", p * v, m, plan.ranks, zigzag_placement(p, v))


@lru_cache(maxsize=256)
def _capped_plan(p: int, m: int, v: int, cap: int, w_limit: int, times: ActionTimes | None = None) -> ListSchedule:
    return list_schedule(p, m, v, Admission(min(cap, v * m), w_limit, split_backward=w_limit > 0), times=times)
