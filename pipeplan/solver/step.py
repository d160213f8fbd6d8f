"""Which memory plan a scenario's step runs under, decided in one place, and the step simulated under it.

`resolve_memory_plan` is that place: the fixed [memory] settings (sim.memory.build_memory_plan), or with
`memory.plan = true` the memory MILP's verified choice (solver.memory_milp). A choice the launcher already
solved (`pipeplan run` hands it to the ranks in RunConfig.memory_choice) is rebuilt without solving again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeplan.sim.config import Scenario
from pipeplan.sim.costs import CostTable, build_cost_table
from pipeplan.sim.engine import SimResult, simulate
from pipeplan.sim.ir import Schedule
from pipeplan.sim.memory import MemoryPlan, build_memory_plan, keep_everything, with_states
from pipeplan.sim.step import resolve_schedule
from pipeplan.solver.memory_milp import MemoryChoice, MemoryPlanResult, plan_from_choice, plan_memory


@dataclass(frozen=True)
class ScenarioMemory:
    """The memory plan of a scenario's step and, when the MILP chose it, the planner's result."""

    plan: MemoryPlan
    planned: MemoryPlanResult | None = None  # solved here (memory.plan = true, no choice handed in)
    choice: MemoryChoice | None = None  # the MILP's decision (memory.plan = true), solved here or handed in

    def summary(self) -> dict[str, Any]:
        """What a step's summary says about its memory policy."""
        if self.planned is not None:
            return {"memory_plan": list(self.plan.policy),
                    "memory_plan_predicted_makespan_s": self.planned.predicted_makespan_s,
                    "memory_plan_solve_wall_s": self.planned.solve_wall_s,
                    "memory_plan_proven_optimal": self.planned.proven_optimal,
                    "memory_plan_mip_gap": self.planned.mip_gap}
        if self.choice is not None:
            return {"memory_plan": list(self.plan.policy)}
        return {"memory_policy": list(self.plan.policy)} if any(p != "none" for p in self.plan.policy) else {}


def resolve_memory_plan(
    sc: Scenario, costs: CostTable, schedule: Schedule, choice: MemoryChoice | None = None, explain: bool = True
) -> ScenarioMemory:
    """The memory plan the step runs under: [memory] as written, or (memory.plan = true) the memory MILP's
    verified choice, solved here unless `choice` (one already solved for this scenario) is given. `explain`:
    when no plan fits, work out the smallest HBM that would (plan_memory)."""
    if not sc.memory.plan:
        return ScenarioMemory(build_memory_plan(sc, costs, schedule))
    if choice is not None:
        base = with_states(sc, costs, keep_everything(costs))
        return ScenarioMemory(plan_from_choice(sc, costs, schedule, base, choice, sc.memory.prefetch_lookahead),
                              choice=choice)
    planned = plan_memory(sc, costs, schedule, explain=explain)
    return ScenarioMemory(planned.plan, planned, planned.choice)


def simulate_with_memory_policy(
    sc: Scenario, schedule_csv: str | Path | None = None
) -> tuple[SimResult, dict[str, Any]]:
    """The simulated step and what to add to its summary about the memory policy."""
    costs = build_cost_table(sc)
    schedule = resolve_schedule(sc, schedule_csv)
    memory = resolve_memory_plan(sc, costs, schedule)
    result = memory.planned.simulated if memory.planned is not None else simulate(schedule, costs, memory=memory.plan)
    return result, memory.summary()
