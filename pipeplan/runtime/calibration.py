"""From measured steps to the simulator's costs: what `pipeplan profile` writes into scenario.toml.

Per chunk, the mean F, I and W durations over the steady steps (a profiled full backward runs as I then W
back to back, so B schedules give I and W too), and the mean saved-activation bytes per forward. Means,
not medians: the makespan is a sum along the critical path, so the tail (a rank descheduled mid-action
when ranks outnumber cores) is part of the cost.

Two more things a real step spends that the durations miss, both read off the same timelines:

    p2p_s      effective transfer time: on every cross-rank edge where the consumer had to wait, the gap
               from the producer's end to the consumer's start (wire time, and the wake-up of a process that
               may have to wait for a core). The simulator's p2p_s is exactly that delay.
    overhead   per action, the mean gap between a rank's consecutive actions when the next one's input was
               already there (Python dispatch, P2P bookkeeping, preemption). Added to each action: to F, I
               and W when the schedule splits its backward, half to each of I and W when it runs B.

A ping-pong between neighbouring ranks (runtime/profile.py) is kept for reference; it is a lower bound,
so p2p_s is never set below it. Every cross-rank gap is read on one clock (runtime/clock.py: each rank's
timeline mapped onto rank 0's), so a rank that left the step's barrier late no longer looks like a fast
(or negative) transfer.
"""

from __future__ import annotations

import statistics

from pipeplan.runtime.clock import aligned_actions
from pipeplan.runtime.train import StepRecord
from pipeplan.sim.errors import PipeplanError
from pipeplan.sim.graph import cross_stage_input
from pipeplan.sim.ir import Action, Kind, Schedule


def steady_steps(history: list[StepRecord], phases: tuple[str, ...] = ("off", "steady")) -> list[int]:
    """Steps of the given phases but the first of the job (allocator and cache warm-up); all if none."""
    steady = [r.step for r in history if r.phase in phases]
    return [s for s in steady if s != history[0].step] or steady or [r.step for r in history]


def input_of(a: Action, num_stages: int) -> tuple[int, int] | None:
    """(stage, microbatch) of the cross-stage producer of `a` (its backward, for B/I), or None: the step
    graph's rule (sim/graph.py)."""
    x = cross_stage_input(a, num_stages)
    return None if x is None else (x.stage, x.microbatch)


def action_gaps(step_traces: list[list[tuple[Action, float, float]]], schedule: Schedule
                ) -> tuple[list[float], list[float]]:
    """(communication waits, local gaps) in one step, from every rank's (action, start, end) list."""
    ends: dict[tuple[int, str, int], float] = {}
    for actions in step_traces:
        for a, _s, e in actions:
            if a.kind is not Kind.W:
                ends[(a.stage, "F" if a.kind is Kind.F else "BI", a.microbatch)] = e
    comm, local = [], []
    for rank, actions in enumerate(step_traces):
        prev_end = None
        for a, start, end in actions:
            src = input_of(a, schedule.num_stages)
            dep_end = ends.get((src[0], "F" if a.kind is Kind.F else "BI", src[1])) if src else None
            cross = src is not None and schedule.stage_to_rank[src[0]] != rank
            if cross and dep_end is not None and (prev_end is None or dep_end > prev_end):
                comm.append(start - dep_end)
            elif prev_end is not None:
                local.append(start - max(prev_end, dep_end if dep_end is not None else prev_end))
            prev_end = end
    return comm, local


def dependency_gaps(step_traces: list[list[tuple[Action, float, float]]], schedule: Schedule) -> list[float]:
    """Consumer start minus producer end for every cross-rank dependency of one step (negative: the
    consumer seems to start before its input existed, which on one clock is at most the clock's error)."""
    ends: dict[tuple[int, str, int], float] = {}
    for actions in step_traces:
        for a, _s, e in actions:
            if a.kind is not Kind.W:
                ends[(a.stage, "F" if a.kind is Kind.F else "BI", a.microbatch)] = e
    gaps = []
    for rank, actions in enumerate(step_traces):
        for a, start, _end in actions:
            src = input_of(a, schedule.num_stages)
            if src is not None and schedule.stage_to_rank[src[0]] != rank:
                gaps.append(start - ends[(src[0], "F" if a.kind is Kind.F else "BI", src[1])])
    return gaps


def chunk_costs(ranks: list[dict], schedule: Schedule, ping_pong_s: float | None) -> dict:
    """Per-chunk costs and the effective p2p_s from every rank's history (runtime/worker.py's records)."""
    n = schedule.num_stages
    times: dict[tuple[int, str], list[float]] = {}
    act: dict[int, list[int]] = {}
    comm: list[float] = []
    local: list[float] = []
    history = ranks[0]["history"]
    profiled = [r.step for r in history if r.phase == "profile"]
    keep = set(profiled[1:] or profiled)  # the first profiled step warms up
    for i, rec in enumerate(history):
        if rec.step not in keep:
            continue
        per_rank = [r["history"][i] for r in ranks]
        c, lo = action_gaps(aligned_actions(ranks, i), schedule)
        comm += c
        local += lo
        for r in per_rank:
            for a, s, e in list(r.trace.actions) + list(r.trace.split):
                times.setdefault((a.stage, a.kind.value), []).append(e - s)
            for stage, values in r.trace.activation_bytes.items():
                act.setdefault(stage, []).extend(values)

    def mean(stage: int, kind: str) -> float:
        values = times.get((stage, kind))
        if not values:
            raise PipeplanError(f"profile: no {kind} measured for chunk {stage}")
        return float(statistics.fmean(values))

    overhead = float(statistics.fmean(local)) if local else 0.0
    split = schedule.uses_split_backward
    per_backward = overhead if split else overhead / 2
    p2p = max(float(statistics.fmean(comm)) if comm else 0.0, ping_pong_s or 0.0)  # ping-pong: a lower bound
    return {
        "forward_s": [mean(s, "F") + overhead for s in range(n)],
        "backward_input_s": [mean(s, "I") + per_backward for s in range(n)],
        "backward_weight_s": [mean(s, "W") + per_backward for s in range(n)],
        "activation_bytes": [float(statistics.fmean(act[s])) for s in range(n)],
        "p2p_s": max(p2p, 0.0),
        "overhead_s": overhead,
        "ping_pong_s": ping_pong_s,
    }
