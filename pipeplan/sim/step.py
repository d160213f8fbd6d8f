"""Scenario -> (schedule, cost table) -> simulated step: the library call behind `pipeplan simulate`."""

from __future__ import annotations

from pathlib import Path

from pipeplan.sim.config import Scenario
from pipeplan.sim.costs import CostTable, build_cost_table
from pipeplan.sim.engine import SimResult, simulate
from pipeplan.sim.errors import ScenarioError, ScheduleError
from pipeplan.sim.ir import Schedule
from pipeplan.sim.memory import build_memory_plan
from pipeplan.sim.schedules import build_schedule
from pipeplan.sim.schedules.v_shape import ActionTimes


def list_clock(costs: CostTable) -> ActionTimes:
    """The cost table as the list scheduler's clock (pipeline.order_timing = "costs"): each chunk's F, I and W
    times, and the P2P time of one hop."""
    return ActionTimes(tuple(map(float, costs.forward_s)), tuple(map(float, costs.backward_input_s)),
                       tuple(map(float, costs.backward_weight_s)), float(costs.p2p_s))


def resolve_schedule(sc: Scenario, schedule_csv: str | Path | None = None) -> Schedule:
    """The scenario's generated schedule, or the action order read from a torch-format CSV."""
    p = sc.pipeline
    if schedule_csv is None:
        times = list_clock(build_cost_table(sc)) if p.order_timing == "costs" else None
        return build_schedule(p.schedule, p.stages, p.microbatches, p.virtual_stages, p.admission_cap,
                              p.stash_limit, times)
    for key in ("admission_cap", "stash_limit"):  # they shape a generated order; a CSV's order is given
        if getattr(p, key) is not None:
            raise ScheduleError(f"pipeline.{key}: applies to a generated schedule, not to --schedule-csv's given "
                                f"order; leave it out")
    if p.order_timing != "unit":
        raise ScheduleError('pipeline.order_timing: times a generated schedule, not --schedule-csv\'s given order; '
                            'leave it "unit"')
    sched = Schedule.read_csv(schedule_csv, num_microbatches=p.microbatches)
    if sched.num_ranks != p.stages:
        raise ScheduleError(f"--schedule-csv: has {sched.num_ranks} rank rows, pipeline.stages is {p.stages}")
    if sched.num_stages != sc.num_chunks:
        raise ScheduleError(
            f"--schedule-csv: has {sched.num_stages} stages, the scenario has stages * virtual_stages = "
            f"{sc.num_chunks} chunks"
        )
    return sched


def simulate_scenario(sc: Scenario, schedule_csv: str | Path | None = None) -> SimResult:
    """One step of the scenario's schedule under its costs and its fixed [memory] policy. A scenario that asks
    the memory MILP for its plan (memory.plan = true) needs the solver: solver.step.simulate_with_memory_policy
    (sim/ sits below solver/ and cannot call it)."""
    if sc.memory.plan:
        raise ScenarioError("memory.plan = true: the plan comes from the memory MILP (solver.step."
                            "simulate_with_memory_policy, `pipeplan simulate`), not from sim.step")
    costs: CostTable = build_cost_table(sc)
    schedule = resolve_schedule(sc, schedule_csv)
    return simulate(schedule, costs, memory=build_memory_plan(sc, costs, schedule))
