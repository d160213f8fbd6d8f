"""Plan a step's freeze ratios and prove the plan in the simulator: the library call behind `pipeplan plan`.

    plan = plan_scenario(load_scenario(None, {"freeze.cap": 0.5}))
    plan.speedup, plan.solution.ratio, plan.planned  # the planned step, simulated by sim.engine

The LP (solver.freeze_lp) is written over sim.dag's graph with the engine's own transfer model (FIFO links
included when they can queue, solver.freeze_dag), so the engine must reproduce the LP's makespan: a gap
above 1e-6 relative raises VerificationError instead of writing a plan nobody should trust.

The scenario's memory policy is part of the step: recomputation lengthens every B and I, and offload
(activations, or model states with the optimizer step's copies) adds the copy engines' FIFO streams to the
DAG in the order a simulated step granted them. Freezing moves actions in time, which can reorder copies
that were requested close together, so after each solve the order is read again from the planned step's
simulation and the LP re-solved until it is stable (ORDER_ROUNDS at most).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeplan.sim.config import FreezeConfig, Scenario, load_scenario
from pipeplan.sim.costs import CostTable, build_cost_table
from pipeplan.sim.engine import SimResult, simulate
from pipeplan.sim.ir import Action, Schedule
from pipeplan.sim.memory import MemoryPlan
from pipeplan.sim.schedules import sweep_schedules
from pipeplan.sim.step import resolve_schedule
from pipeplan.solver.baselines import BASELINES, uniform_ratios
from pipeplan.solver.errors import FreezeInputError, VerificationError
from pipeplan.solver.freeze_dag import FreezeDag, build_freeze_dag, copy_order
from pipeplan.solver.freeze_lp import FreezeSolution, solve_freeze_lp
from pipeplan.solver.step import resolve_memory_plan

VERIFY_REL_TOL = 1e-6
ORDER_ROUNDS = 6
"""LP solves at most before the copy engines' order must have settled. Measured with the cap lifted, over 540
plans (the three shipped model scenarios x schedules 1f1b, interleaved-1f1b, zb-h1, zbv, chronos x
activation offload 0.3 / 1.0, 0.6 with states in DRAM, states alone x prefetch_lookahead 1, 2, 4 x freeze.cap
0.3, 0.6, 0.9): 515 settled after 1 solve and 25 (all interleaved-1f1b) after 2, none later; 6 is three times
that, and a plan that still has not settled says so (its note). tests/test_freeze_offload.py keeps the hardest
corner of that grid within 2."""
SWEEP_CAPS = tuple(round(0.1 * k, 1) for k in range(10))  # 0, 0.1, ..., 0.9


@dataclass(frozen=True)
class BaselineResult:
    name: str
    mean_ratio: float
    makespan_s: float
    baseline_makespan_s: float

    @property
    def speedup(self) -> float:
        return self.baseline_makespan_s / self.makespan_s

    @property
    def gain_per_freeze(self) -> float | None:
        """Relative step-time reduction per unit of mean freeze ratio (None when nothing is frozen)."""
        return step_gain(self.baseline_makespan_s, self.makespan_s, self.mean_ratio)


@dataclass
class FreezePlan:
    schedule: Schedule
    costs: CostTable
    freeze: FreezeConfig
    dag: FreezeDag
    solution: FreezeSolution
    baseline: SimResult  # the unfrozen step
    planned: SimResult  # the step at the planned durations
    baselines: list[BaselineResult] = field(default_factory=list)
    memory: MemoryPlan | None = None  # the scenario's recomputation policy, timed into the DAG
    uniform_at_cap: BaselineResult | None = None  # every freezable action at min(cap, max_ratio)
    uniform_ratio_to_match: float | None = None  # least uniform ratio reaching the LP's makespan
    order_rounds: int = 1  # LP solves until the copy engines' order was stable (1 without offload)
    memory_summary: dict[str, Any] = field(default_factory=dict)  # the memory MILP's record (memory.plan = true)

    @property
    def cap(self) -> float:
        return self.freeze.cap

    @property
    def speedup(self) -> float:
        return self.baseline.makespan_s / self.planned.makespan_s

    @property
    def mean_ratio(self) -> float:
        r = self.solution.ratio
        return float(r.mean()) if r.size else 0.0

    @property
    def gain_per_freeze(self) -> float | None:
        return step_gain(self.baseline.makespan_s, self.planned.makespan_s, self.mean_ratio)

    def stage_mean_ratio(self) -> list[float]:
        """Per chunk, the mean freeze ratio over its freezable actions (the quantity the cap bounds)."""
        stage, r = self.dag.freezable_stage, self.solution.ratio
        n = self.schedule.num_stages
        total = np.bincount(stage, weights=r, minlength=n)
        count = np.bincount(stage, minlength=n)
        return [float(x) for x in np.divide(total, np.maximum(count, 1))]

    def durations(self) -> dict[Action, float]:
        """The planned duration of every action freezing changes (freezable, and the first chunk's I)."""
        return self.dag.action_durations(self.solution.ratio)

    def actions_table(self) -> list[dict[str, Any]]:
        """One entry per action of the step, freezable or not, in per-rank order."""
        ratio = np.zeros(self.dag.n_actions)
        dur = self.dag.node_durations(self.solution.ratio)[: self.dag.n_actions]
        ratio[self.dag.freezable] = self.solution.ratio
        return [
            {
                "stage": a.stage,
                "microbatch": a.microbatch,
                "kind": a.kind.value,
                "freeze_ratio": float(ratio[i]),
                "duration_s": float(dur[i]),
            }
            for i, a in enumerate(self.dag.actions)
        ]


def step_gain(base_s: float, planned_s: float, mean_ratio: float) -> float | None:
    if mean_ratio <= 0 or base_s <= 0:
        return None
    return (base_s - planned_s) / base_s / mean_ratio


def plan_freeze(
    schedule: Schedule,
    costs: CostTable,
    freeze: FreezeConfig,
    *,
    baselines: bool = True,
    baseline: SimResult | None = None,
    dag: FreezeDag | None = None,
    memory: MemoryPlan | None = None,
) -> FreezePlan:
    """Solve the freeze LP for `schedule` under `costs`, verify it in the engine, compare schedule-blind
    freezing at the same budget. `baseline` and `dag` may be passed in to reuse them across caps."""
    recompute = memory.recompute_s if memory is not None else None
    if memory is not None and memory.layer_copies and (memory.offloads or memory.offloads_stash):
        # a layer-wise copy's rows depend on the durations it overlaps, which the LP varies (sim.graph.LayerCopy)
        raise FreezeInputError('memory.copy_granularity: the freeze planner prices whole-chunk copies only; '
                               'allowed: "chunk" (or a step without activation or W-stash offload)')
    if dag is None:
        copies = None
        if memory is not None and memory.uses_copy_engines:  # the copy order comes from a run
            baseline = baseline if baseline is not None else simulate(schedule, costs, memory=memory)
            copies = copy_order(baseline)
        dag = build_freeze_dag(schedule, costs, freeze, recompute, memory, copies)
    rounds, settled = 0, True
    while True:
        rounds += 1
        solution = solve_freeze_lp(dag, freeze.cap, freeze.max_ratio)
        planned = simulate(schedule, costs, dag.action_durations(solution.ratio), memory=memory)
        if dag.copies is None:
            break
        order = copy_order(planned)
        settled = order == dag.copies
        if settled or rounds == ORDER_ROUNDS:
            break
        dag = build_freeze_dag(schedule, costs, freeze, recompute, memory, order)
    note = "" if settled else f" (the copy engines' order still changed after {ORDER_ROUNDS} solves)"
    verify(solution.makespan_s, planned.makespan_s, note)
    baseline = baseline if baseline is not None else simulate(schedule, costs, memory=memory)
    plan = FreezePlan(
        schedule, costs, freeze, dag, solution, baseline, planned, memory=memory, order_rounds=rounds
    )
    if baselines:
        plan.baselines = compare_baselines(plan)
        plan.uniform_at_cap = _simulate_ratios(
            plan,
            "uniform-at-cap",
            uniform_ratios(plan.dag, plan.freeze.cap, plan.freeze.cap, plan.freeze.max_ratio),
        )
        plan.uniform_ratio_to_match = uniform_ratio_to_match(plan)
    return plan


def plan_scenario(
    sc: Scenario, schedule_csv: str | Path | None = None, *, baselines: bool = True
) -> FreezePlan:
    """The scenario's schedule (or a torch-format CSV's order) planned at its [freeze] settings, under its
    memory policy (the fixed [memory] settings, or the MILP planner's choice with memory.plan = true)."""
    schedule, costs = resolve_schedule(sc, schedule_csv), build_cost_table(sc)
    if not any(getattr(costs, k).any() for k in ("forward_s", "backward_input_s", "backward_weight_s")):
        raise FreezeInputError(
            "costs: every forward and backward duration is 0; a step that takes no time has nothing to plan"
        )
    resolved = resolve_memory_plan(sc, costs, schedule)
    plan = plan_freeze(schedule, costs, sc.freeze, baselines=baselines, memory=resolved.plan)
    plan.memory_summary = resolved.summary() if resolved.planned is not None else {}
    return plan


def verify(lp_makespan_s: float, simulated_makespan_s: float, note: str = "") -> None:
    gap = abs(simulated_makespan_s - lp_makespan_s) / max(abs(lp_makespan_s), 1e-300)
    if not gap <= VERIFY_REL_TOL:
        raise VerificationError(
            f"plan verification: the simulator's makespan {simulated_makespan_s:.9g} s differs from the LP's "
            f"{lp_makespan_s:.9g} s by {gap:.2e} relative (allowed {VERIFY_REL_TOL:g}){note}; a planner bug, "
            f"please report it with the scenario"
        )


def compare_baselines(plan: FreezePlan) -> list[BaselineResult]:
    """Each schedule-blind policy at the LP plan's mean freeze ratio, simulated."""
    fz = plan.freeze
    return [
        _simulate_ratios(plan, name, policy(plan.dag, plan.mean_ratio, fz.cap, fz.max_ratio))
        for name, policy in BASELINES.items()
    ]


def _simulate_ratios(plan: FreezePlan, name: str, ratio: np.ndarray) -> BaselineResult:
    durations = plan.dag.action_durations(ratio)
    result = simulate(plan.schedule, plan.costs, durations, memory=plan.memory)
    mean = float(ratio.mean()) if ratio.size else 0.0
    return BaselineResult(name, mean, result.makespan_s, plan.baseline.makespan_s)


def uniform_ratio_to_match(plan: FreezePlan, tol: float = 1e-4) -> float | None:
    """The least uniform ratio whose step is as short as the LP plan's (bisection on the DAG's longest path,
    the engine's own timing model); None if even uniform freezing at the cap falls short."""
    dag, fz = plan.dag, plan.freeze
    target = plan.solution.makespan_s * (1 + 1e-9)

    def makespan(r: float) -> float:
        if dag.copy_nodes:  # copies may reorder with the durations: ask the engine itself
            ratio = np.full(len(dag.freezable), r)
            durations = dag.action_durations(ratio)
            return simulate(plan.schedule, plan.costs, durations, memory=plan.memory).makespan_s
        dur = dag.node_durations(np.full(len(dag.freezable), r))
        asap = dag.earliest_starts(dur)
        assert asap is not None  # the engine already ran this schedule
        return float((asap[0] + dur).max())

    lo, hi = 0.0, min(fz.cap, fz.max_ratio)
    if makespan(lo) <= target:
        return 0.0
    if makespan(hi) > target:
        return None
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if makespan(mid) <= target else (mid, hi)
    return hi




# ---- cap sweep ------------------------------------------------------------------------------------
def sweep_caps(
    scenario_path: str | None,
    overrides: dict[str, Any] | None = None,
    schedules: dict[str, int] | None = None,
    caps: Iterable[float] = SWEEP_CAPS,
    on_step: Callable[[str, float], None] | None = None,
) -> list[dict[str, Any]]:
    """Speedup of the LP plan per (schedule, cap); each schedule runs at its own virtual_stages."""
    rows = []
    caps = list(caps)
    for name, v in (schedules or sweep_schedules()).items():
        sc = load_scenario(
            scenario_path, {**(overrides or {}), "pipeline.schedule": name, "pipeline.virtual_stages": v}
        )
        schedule, costs = resolve_schedule(sc), build_cost_table(sc)
        memory = resolve_memory_plan(sc, costs, schedule).plan
        base = simulate(schedule, costs, memory=memory)
        dag = build_freeze_dag(schedule, costs, sc.freeze, memory.recompute_s, memory, copy_order(base))
        for cap in caps:
            fz = replace_cap(sc.freeze, cap)
            plan = plan_freeze(schedule, costs, fz, baselines=False, baseline=base, dag=dag, memory=memory)
            rows.append(
                {
                    "schedule": name,
                    "virtual_stages": v,
                    "cap": cap,
                    "baseline_makespan_s": base.makespan_s,
                    "planned_makespan_s": plan.solution.makespan_s,
                    "simulated_makespan_s": plan.planned.makespan_s,
                    "speedup": plan.speedup,
                    "throughput_gain": plan.speedup - 1,
                    "mean_freeze_ratio": plan.mean_ratio,
                    "bubble_ratio_before": base.bubble_ratio,
                    "bubble_ratio_after": plan.planned.bubble_ratio,
                    "solve_wall_s": plan.solution.wall_s,
                }
            )
            if on_step is not None:
                on_step(name, cap)
    return rows


def replace_cap(freeze: FreezeConfig, cap: float) -> FreezeConfig:
    """`freeze` at another cap (model_copy skips validation, so check the range here)."""
    if not 0.0 <= cap <= 1.0:
        raise FreezeInputError(f"freeze.cap: {cap} is outside [0, 1]; give a mean freeze ratio per stage")
    return freeze.model_copy(update={"cap": cap})
