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

Phases (step numbers from 0), as TimelyFreeze runs them:

    warm-up      [0, w)               nothing frozen
    monitoring   [w, w + M)           every step trains: at monitoring step k the microbatches with
                                      (mb + k) odd are fully frozen (w_min), the others unfrozen (w_max), so
                                      every action is timed both ways every two steps, M/2 samples each,
                                      and every parameter gets the other half's gradients each step; each
                                      action's durations kept, per action (stage, kind, microbatch)
    LP solve     end of step w + M-1  per-action medians -> the freeze DAG's w_max, w_min of every B/W (the
                                      LP's variables, and stage 0's I, which shrinks with its W: the
                                      first stage needs no input gradient; F and the other I take their
                                      chunk's median) -> the LP
                                      (solver.plan.plan_freeze) on rank 0 at the first ramp step's cap;
                                      the plan is broadcast to every rank
    ramp         [w + M, w + M + R)   the cap rises linearly, cap·(k+1)/(R+1) at ramp step k; the LP is
                                      re-solved from the measured durations for each step's cap
    steady       after                the plan at the full cap

Frozen sets are re-drawn every K steps and whenever the plan changes. `uniform` follows the same phases
with every ratio at the step's cap (the same budget, spread evenly, ramped the same way). `autofreeze` is
the published baseline (runtime/autofreeze.py): after the warm-up, converged blocks front to back, frozen
for every microbatch, up to the cap's share of the parameters; `apf` likewise (runtime/apf.py): stable
scalars for adaptive periods, whole tensors frozen for every microbatch.
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

from pipeplan.runtime.apf import APF
from pipeplan.runtime.autofreeze import AutoFreeze
from pipeplan.runtime.executor import StepTrace
from pipeplan.sim.config import FreezeConfig
from pipeplan.sim.costs import CostTable
from pipeplan.sim.ir import GRADIENT_KINDS, Schedule

Key = tuple[int, int]  # (stage, microbatch)
ActionKey = tuple[int, str, int]  # (stage, kind, microbatch): one action of the step


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
        if self.mode in ("autofreeze", "apf"):
            return self.mode
        k = step - self.warmup
        if k < self.monitor:
            return "monitor"
        k -= self.monitor
        return "ramp" if k < self.ramp else "steady"

    @property
    def solve_after_step(self) -> int:
        """The first solve: after the last monitoring step."""
        return self.warmup + self.monitor - 1

    @property
    def solve_steps(self) -> range:
        """After these steps the plan is (re-)solved for the next step's cap: the end of monitoring and
        every ramp step (in steady state the cap no longer changes)."""
        if self.mode in ("none", "autofreeze", "apf"):
            return range(0)
        return range(self.solve_after_step, self.solve_after_step + self.ramp + 1)

    def ramp_scale(self, step: int) -> float:
        k = step - self.warmup - self.monitor
        return 1.0 if self.ramp == 0 or k >= self.ramp else (k + 1) / (self.ramp + 1)

    def monitor_frozen(self, step: int, microbatch: int) -> bool:
        """Whether (any stage's) `microbatch` is fully frozen at monitoring step `step` (a checkerboard)."""
        return (microbatch + step - self.warmup) % 2 == 1

    def cap_at(self, step: int) -> float:
        """The cap in force at `step` (ramp and steady phases)."""
        return self.cap * self.ramp_scale(step)


@dataclass
class Freezer:
    """One rank's freezing state: the plan, the current frozen sets, the monitoring measurements."""

    phases: FreezePhases
    schedule: Schedule
    units: dict[int, list[tuple[str, int]]]  # local stage -> (parameter name, size) in depth order
    seed: int = 0
    plan: dict[Key, float] = field(default_factory=dict)  # (stage, mb) -> planned ratio, every stage
    planned_makespan_s: float | None = None
    unfrozen_makespan_s: float | None = None  # the same simulation with nothing frozen: the plan's baseline
    plan_cap: float = 0.0  # the cap the plan was solved for
    plan_version: int = 0  # bumped by every solve: a new plan means new draws
    durations: dict[str, dict[ActionKey, list[float]]] = field(
        default_factory=lambda: {"unfrozen": defaultdict(list), "frozen": defaultdict(list)})
    drawn: dict[Key, list[str]] = field(default_factory=dict)
    drawn_at: int | None = None
    drawn_version: int | None = None

    def __post_init__(self) -> None:
        self.gen = torch.Generator().manual_seed(self.seed)
        self.auto = AutoFreeze(self.phases.cap) if self.phases.mode == "autofreeze" else None
        self.apf = APF(self.phases.cap) if self.phases.mode == "apf" else None

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
        if phase in ("off", "warmup"):
            return dict.fromkeys(keys, 0.0)
        if phase == "monitor":
            return {k: float(self.phases.monitor_frozen(step, k[1])) for k in keys}
        return {k: self.plan.get(k, 0.0) for k in keys}  # the plan solved for this step's cap

    def frozen(self, step: int) -> dict[Key, list[str]]:
        """Parameter names frozen per local (stage, mb) at `step`: re-drawn every K steps and on a new plan
        (autofreeze: its frozen blocks, for every microbatch)."""
        pick = (self.auto.frozen_names if self.auto is not None
                else self.apf.whole_tensors if self.apf is not None else None)
        if pick is not None:  # autofreeze or APF: the method picks the names
            on = self.phases.phase(step) == self.phases.mode
            self.drawn = {(s, mb): pick([n for n, _ in units]) if on else []
                          for s, units in self.units.items() for mb in range(self.schedule.num_microbatches)}
            return {k: v for k, v in self.drawn.items() if v}
        ratios = self.ratios(step)
        planned = self.phases.phase(step) in ("ramp", "steady")
        version = self.plan_version if planned else None
        fresh = self.drawn_at is None or step - self.drawn_at >= self.phases.redraw or self.drawn_version != version
        if self.phases.phase(step) == "monitor" or fresh:
            self.drawn = {k: draw_frozen(self.units[k[0]], r, self.gen, front_weighted=k[0] == 0)
                          for k, r in ratios.items()}
            self.drawn_at, self.drawn_version = step, version
        return {k: v for k, v in self.drawn.items() if v}

    def realized_ratio(self) -> float:
        """Mean over local (stage, mb) of the frozen share of the chunk's parameters, as last drawn (apf: the
        share of this rank's scalars frozen)."""
        if self.apf is not None:
            return self.apf.frozen_share()
        shares = []
        for (s, _mb), names in self.drawn.items():
            sizes = dict(self.units[s])
            shares.append(sum(sizes[n] for n in names) / max(1, sum(sizes.values())))
        return float(np.mean(shares)) if shares else 0.0

    def observe(self, step: int, trace: StepTrace) -> None:
        if self.phases.phase(step) != "monitor":
            return
        for a, start, end in trace.actions:
            which = "frozen" if self.phases.monitor_frozen(step, a.microbatch) else "unfrozen"
            self.durations[which][(a.stage, a.kind.value, a.microbatch)].append(end - start)

    # ---- the plan ------------------------------------------------------------------------------
    @staticmethod
    def merge(measurements: list[dict[str, dict[ActionKey, list[float]]]]) -> dict[str, dict[ActionKey, list[float]]]:
        """Every rank's monitoring in one table per kind of step."""
        merged: dict[str, dict[ActionKey, list[float]]] = {"unfrozen": defaultdict(list), "frozen": defaultdict(list)}
        for m in measurements:
            for which, table in m.items():
                for key, values in table.items():
                    merged[which][key] += values
        return merged

    def measured_costs(self, measurements: list[dict[str, dict[ActionKey, list[float]]]], cap: float | None = None
                       ) -> tuple[CostTable, FreezeConfig]:
        """Per-chunk medians of all ranks' monitoring (over every microbatch's action) as a cost table and
        fully-frozen bounds: the frame the per-action medians (`action_durations`) refine."""
        merged = self.merge(measurements)
        sched = self.schedule
        n = sched.num_stages
        cap = self.phases.cap if cap is None else cap

        def med(which: str, s: int, kind: str) -> float:
            values = [v for (st, k, _mb), vs in merged[which].items() if st == s and k == kind for v in vs]
            return statistics.median(values) if values else 0.0

        split = sched.uses_split_backward
        f = np.array([med("unfrozen", s, "F") for s in range(n)])
        if split:
            i = np.array([med("unfrozen", s, "I") for s in range(n)])
            w = np.array([med("unfrozen", s, "W") for s in range(n)])
            w_min = np.minimum([med("frozen", s, "W") for s in range(n)], w)
            freeze = FreezeConfig(cap=cap, max_ratio=self.phases.max_ratio, weight_min_s=list(w_min))
        else:
            b = np.array([med("unfrozen", s, "B") for s in range(n)])
            b_min = np.minimum([med("frozen", s, "B") for s in range(n)], b)
            i, w = b_min, b - b_min
            freeze = FreezeConfig(cap=cap, max_ratio=self.phases.max_ratio, backward_min_s=list(b_min))
        zeros = np.zeros(n)
        costs = CostTable(sched.num_ranks, sched.virtual_stages, sched.num_microbatches, f, i, w, zeros, zeros,
                          p2p_s=0.0)
        return costs, freeze

    def action_durations(self, measurements: list[dict[str, dict[ActionKey, list[float]]]]
                         ) -> dict[str, dict[ActionKey, float]]:
        """The median of each action's unfrozen and fully frozen durations over the monitoring steps."""
        merged = self.merge(measurements)
        return {which: {k: statistics.median(v) for k, v in table.items() if v} for which, table in merged.items()}

    def solve(self, measurements: list[dict[str, dict[ActionKey, list[float]]]], cap: float | None = None) -> None:
        """Set the plan for `cap` (default: the full cap): the cap everywhere (uniform) or the freeze LP on
        the measured per-action durations (timelyfreeze)."""
        sched = self.schedule
        cap = self.phases.cap if cap is None else cap
        keys = [(s, mb) for s in range(sched.num_stages) for mb in range(sched.num_microbatches)]
        self.plan_cap, self.plan_version = cap, self.plan_version + 1
        if self.phases.mode == "uniform":
            self.plan = dict.fromkeys(keys, min(cap, self.phases.max_ratio))
            return
        from dataclasses import replace

        from pipeplan.solver.freeze_dag import build_freeze_dag
        from pipeplan.solver.plan import plan_freeze

        costs, freeze = self.measured_costs(measurements, cap)
        medians = self.action_durations(measurements)
        frozen_i = [v for (s, k, _mb), v in medians["frozen"].items() if s == 0 and k == "I"]
        dag = build_freeze_dag(sched, costs, freeze, input_min_s=statistics.median(frozen_i) if frozen_i else 0.0)
        w_max, w_min = dag.w_max.copy(), dag.w_min.copy()
        tied = dag.tied.tolist() if dag.tied is not None else []
        for i in dag.freezable.tolist() + tied:  # each freezable (and tied) action's own medians: the LP's
            a = dag.actions[i]                   # variables; the others keep their chunk's, as the simulator
            key = (a.stage, a.kind.value, a.microbatch)
            if key in medians["unfrozen"]:
                w_max[i] = medians["unfrozen"][key]
                w_min[i] = min(medians["frozen"].get(key, w_min[i]), w_max[i])
        dag = replace(dag, w_max=w_max, w_min=w_min)
        plan = plan_freeze(sched, costs, freeze, baselines=False, dag=dag)  # LP, verified in the simulator
        from pipeplan.sim.engine import simulate

        unfrozen = {dag.actions[i]: float(w_max[i]) for i in dag.freezable.tolist() + tied}
        self.unfrozen_makespan_s = simulate(sched, costs, unfrozen).makespan_s
        self.plan = dict.fromkeys(keys, 0.0)
        for node, ratio in zip(plan.dag.freezable.tolist(), plan.solution.ratio.tolist(), strict=True):
            a = plan.dag.actions[node]
            if a.kind in GRADIENT_KINDS:
                self.plan[(a.stage, a.microbatch)] = float(ratio)
        self.planned_makespan_s = plan.planned.makespan_s

    # ---- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain containers and one CPU tensor (the generator): a weights_only checkpoint can hold it."""
        return {"plan": dict(self.plan), "planned_makespan_s": self.planned_makespan_s,
                "unfrozen_makespan_s": self.unfrozen_makespan_s, "plan_cap": self.plan_cap,
                "plan_version": self.plan_version, "durations": {k: dict(v) for k, v in self.durations.items()},
                "drawn": dict(self.drawn), "drawn_at": self.drawn_at, "drawn_version": self.drawn_version,
                "gen": self.gen.get_state(), "auto": self.auto.state_dict() if self.auto is not None else None,
                "apf": self.apf.state_dict() if self.apf is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.plan = dict(state["plan"])
        self.planned_makespan_s, self.plan_cap = state["planned_makespan_s"], state["plan_cap"]
        self.unfrozen_makespan_s = state["unfrozen_makespan_s"]
        self.plan_version = state["plan_version"]
        self.durations = {k: defaultdict(list, v) for k, v in state["durations"].items()}
        self.drawn, self.drawn_at = dict(state["drawn"]), state["drawn_at"]
        self.drawn_version = state["drawn_version"]
        self.gen.set_state(state["gen"].cpu())
        if self.auto is not None and state.get("auto") is not None:
            self.auto.load_state_dict(state["auto"])
        if self.apf is not None and state.get("apf") is not None:
            self.apf.load_state_dict(state["apf"])  # a CPU ByteTensor, whatever device the checkpoint went through
