"""A scenario's step under its own memory policy: the fixed [memory] settings, or the MILP planner's choice
when `memory.plan = true` (the plan is re-simulated before it is returned)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim.config import Scenario
from sim.costs import build_cost_table
from sim.engine import SimResult, simulate
from sim.memory import build_memory_plan
from sim.step import resolve_schedule


def simulate_with_memory_policy(
    sc: Scenario, schedule_csv: str | Path | None = None
) -> tuple[SimResult, dict[str, Any]]:
    """The simulated step and what to add to its summary about the memory policy."""
    costs = build_cost_table(sc)
    schedule = resolve_schedule(sc, schedule_csv)
    if sc.memory.plan:
        from solver.memory_milp import plan_memory

        planned = plan_memory(sc, costs, schedule)
        extra = {
            "memory_plan": list(planned.plan.policy),
            "memory_plan_predicted_makespan_s": planned.predicted_makespan_s,
            "memory_plan_solve_wall_s": planned.solve_wall_s,
        }
        return planned.simulated, extra
    plan = build_memory_plan(sc, costs, schedule)
    extra = {"memory_policy": list(plan.policy)} if any(p != "none" for p in plan.policy) else {}
    return simulate(schedule, costs, memory=plan), extra
