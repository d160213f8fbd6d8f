"""TimelyFreeze in the runtime: per (stage, microbatch) frozen parameter sets that match planned ratios.

An action's freeze ratio r (its B, or its W with split backward) is the share of its chunk's weight-gradient
work to skip. The chunk's parameters are the units; a draw picks units in a random order and takes them while
their total size stays nearest r times the chunk's (dW of a linear layer costs in proportion to its size).
On the first stage the order is front-weighted (Efraimidis–Spirakis keys u^(1/w), weight n - depth): freezing
the earliest parameters also ends the backward early, since stage 0 needs no input gradient. Sets are
re-drawn every K steps, and whenever the ratios change, from a generator whose state is checkpointed.

A frozen parameter has requires_grad off while its microbatch's forward runs (runtime/executor.py), so that
microbatch's graph has no gradient edge to it: it gets no gradient from that microbatch and its dW is never
computed. Between forwards every parameter requires grad again.

Phases (step numbers from 0):

    warm-up      [0, w)               nothing frozen
    monitoring   [w, w + M)           alternately unfrozen (w_max) and fully frozen (w_min); durations kept
    LP solve     end of step w + M-1  per-chunk medians -> cost table -> solver.plan.plan_freeze (rank 0)
    ramp         [w + M, w + M + R)   ratios rise linearly to the plan
    steady       after                the plan's ratios

`uniform` follows the same phases with every ratio at the cap (the same budget, spread evenly).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from runtime.executor import StepTrace
from sim.config import FreezeConfig
from sim.costs import CostTable
from sim.ir import GRADIENT_KINDS, Schedule

Key = tuple[int, int]  # (stage, microbatch)


def draw_frozen(units: list[tuple[str, int]], ratio: float, gen: torch.Generator,
                front_weighted: bool = False) -> list[str]:
    """Names of units (name, size) to freeze so their total size is nearest `ratio` of the whole."""
    if ratio <= 0 or not units:
        return []
    if ratio >= 1:
        return [n for n, _ in units]
    n = len(units)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    weights = torch.arange(n, 0, -1, dtype=torch.float64) if front_weighted else torch.ones(n, dtype=torch.float64)
    keys = u ** (1.0 / weights)
    order = torch.argsort(keys, descending=True).tolist()
    target = ratio * sum(size for _, size in units)
    chosen, total = [], 0
    for i in order:
        name, size = units[i]
        if total + size <= target + size / 2:  # take it if that leaves the total nearer the target
            chosen.append(name)
            total += size
    return chosen


@dataclass
class FreezePhases:
    mode: str  # none | uniform | timelyfreeze
    cap: float
    warmup: int
    monitor: int
    ramp: int
    redraw: int
    max_ratio: float = 1.0

    def phase(self, step: int) -> str:
        if self.mode == "none" or step < self.warmup:
            return "warmup" if self.mode != "none" else "off"
        k = step - self.warmup
        if k < self.monitor:
            return "monitor-unfrozen" if k % 2 == 0 else "monitor-frozen"
        k -= self.monitor
        return "ramp" if k < self.ramp else "steady"

    @property
    def solve_after_step(self) -> int:
        return self.warmup + self.monitor - 1

    def ramp_scale(self, step: int) -> float:
        k = step - self.warmup - self.monitor
        return 1.0 if self.ramp == 0 or k >= self.ramp else (k + 1) / (self.ramp + 1)


@dataclass
class Freezer:
    """One rank's freezing state: the plan, the current frozen sets, the monitoring measurements."""

    phases: FreezePhases
    schedule: Schedule
    units: dict[int, list[tuple[str, int]]]  # local stage -> (parameter name, size) in depth order
    seed: int = 0
    plan: dict[Key, float] = field(default_factory=dict)  # (stage, mb) -> planned ratio, every stage
    planned_makespan_s: float | None = None
    durations: dict[str, dict[tuple[int, str], list[float]]] = field(
        default_factory=lambda: {"unfrozen": defaultdict(list), "frozen": defaultdict(list)})
    drawn: dict[Key, list[str]] = field(default_factory=dict)
    drawn_at: int | None = None
    drawn_scale: float | None = None

    def __post_init__(self) -> None:
        self.gen = torch.Generator().manual_seed(self.seed)

    @classmethod
    def build(cls, phases: FreezePhases, schedule: Schedule, chunks: Mapping[int, nn.Module], seed: int,
              rank: int) -> Freezer:
        units = {s: [(n, p.numel()) for n, p in c.named_parameters()] for s, c in chunks.items()}
        return cls(phases, schedule, units, seed=seed * 7919 + rank)

    # ---- per step ------------------------------------------------------------------------------
    def ratios(self, step: int) -> dict[Key, float]:
        """The freeze ratio of every local (stage, mb) at `step`."""
        phase = self.phases.phase(step)
        keys = [(s, mb) for s in self.units for mb in range(self.schedule.num_microbatches)]
        if phase in ("off", "warmup", "monitor-unfrozen"):
            return dict.fromkeys(keys, 0.0)
        if phase == "monitor-frozen":
            return dict.fromkeys(keys, 1.0)
        scale = self.phases.ramp_scale(step)
        return {k: scale * self.plan.get(k, 0.0) for k in keys}

    def frozen(self, step: int) -> dict[Key, list[str]]:
        """Parameter names frozen per local (stage, mb) at `step`: re-drawn every K steps and on changes."""
        ratios = self.ratios(step)
        scale = self.phases.ramp_scale(step) if self.phases.phase(step) in ("ramp", "steady") else None
        fresh = self.drawn_at is None or step - self.drawn_at >= self.phases.redraw or self.drawn_scale != scale
        if self.phases.phase(step).startswith("monitor") or fresh:
            self.drawn = {k: draw_frozen(self.units[k[0]], r, self.gen, front_weighted=k[0] == 0)
                          for k, r in ratios.items()}
            self.drawn_at, self.drawn_scale = step, scale
        return {k: v for k, v in self.drawn.items() if v}

    def realized_ratio(self) -> float:
        """Mean over local (stage, mb) of the frozen share of the chunk's parameters, as last drawn."""
        shares = []
        for (s, _mb), names in self.drawn.items():
            sizes = dict(self.units[s])
            shares.append(sum(sizes[n] for n in names) / max(1, sum(sizes.values())))
        return float(np.mean(shares)) if shares else 0.0

    def observe(self, step: int, trace: StepTrace) -> None:
        phase = self.phases.phase(step)
        if not phase.startswith("monitor"):
            return
        bucket = self.durations["unfrozen" if phase == "monitor-unfrozen" else "frozen"]
        for a, start, end in trace.actions:
            bucket[(a.stage, a.kind.value)].append(end - start)

    # ---- the plan ------------------------------------------------------------------------------
    def measured_costs(self, measurements: list[dict[str, dict[tuple[int, str], list[float]]]]
                       ) -> tuple[CostTable, FreezeConfig]:
        """Per-chunk medians of all ranks' monitoring as the LP's cost table and fully-frozen bounds."""
        merged: dict[str, dict[tuple[int, str], list[float]]] = {"unfrozen": defaultdict(list),
                                                                  "frozen": defaultdict(list)}
        for m in measurements:
            for which, table in m.items():
                for key, values in table.items():
                    merged[which][key] += values
        sched = self.schedule
        n = sched.num_stages

        def med(which: str, s: int, kind: str) -> float:
            values = merged[which].get((s, kind))
            return statistics.median(values) if values else 0.0

        split = sched.uses_split_backward
        f = np.array([med("unfrozen", s, "F") for s in range(n)])
        if split:
            i = np.array([med("unfrozen", s, "I") for s in range(n)])
            w = np.array([med("unfrozen", s, "W") for s in range(n)])
            w_min = np.minimum([med("frozen", s, "W") for s in range(n)], w)
            freeze = FreezeConfig(cap=self.phases.cap, max_ratio=self.phases.max_ratio, weight_min_s=list(w_min))
        else:
            b = np.array([med("unfrozen", s, "B") for s in range(n)])
            b_min = np.minimum([med("frozen", s, "B") for s in range(n)], b)
            i, w = b_min, b - b_min
            freeze = FreezeConfig(cap=self.phases.cap, max_ratio=self.phases.max_ratio, backward_min_s=list(b_min))
        zeros = np.zeros(n)
        costs = CostTable(sched.num_ranks, sched.virtual_stages, sched.num_microbatches, f, i, w, zeros, zeros,
                          p2p_s=0.0)
        return costs, freeze

    def solve(self, measurements: list[dict[str, dict[tuple[int, str], list[float]]]]) -> None:
        """Set the plan: the cap everywhere (uniform) or the freeze LP on the measured costs (timelyfreeze)."""
        sched = self.schedule
        keys = [(s, mb) for s in range(sched.num_stages) for mb in range(sched.num_microbatches)]
        if self.phases.mode == "uniform":
            self.plan = dict.fromkeys(keys, min(self.phases.cap, self.phases.max_ratio))
            return
        from solver.plan import plan_freeze

        costs, freeze = self.measured_costs(measurements)
        plan = plan_freeze(sched, costs, freeze, baselines=False)  # LP, verified in the simulator
        self.plan = dict.fromkeys(keys, 0.0)
        for node, ratio in zip(plan.dag.freezable.tolist(), plan.solution.ratio.tolist(), strict=True):
            a = plan.dag.actions[node]
            if a.kind in GRADIENT_KINDS:
                self.plan[(a.stage, a.microbatch)] = float(ratio)
        self.planned_makespan_s = plan.planned.makespan_s

    # ---- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"plan": dict(self.plan), "planned_makespan_s": self.planned_makespan_s,
                "durations": {k: dict(v) for k, v in self.durations.items()}, "drawn": dict(self.drawn),
                "drawn_at": self.drawn_at, "drawn_scale": self.drawn_scale, "gen": self.gen.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.plan = dict(state["plan"])
        self.planned_makespan_s = state["planned_makespan_s"]
        self.durations = {k: defaultdict(list, v) for k, v in state["durations"].items()}
        self.drawn, self.drawn_at, self.drawn_scale = dict(state["drawn"]), state["drawn_at"], state["drawn_scale"]
        self.gen.set_state(state["gen"])
