"""The step graph (sim/graph.py): its rule against hand-listed inputs, the engine against a longest path whose
rules are written out here independently, the one memory-plan resolver, and registries that refuse duplicates."""

from __future__ import annotations

import numpy as np
import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.runtime.config import RunConfig
from pipeplan.sim.config import load_scenario
from pipeplan.sim.costs import build_cost_table
from pipeplan.sim.engine import simulate
from pipeplan.sim.errors import ScenarioError
from pipeplan.sim.graph import NodeKind, build_step_graph, cross_stage_input, step_structure
from pipeplan.sim.ir import Action, Kind
from pipeplan.sim.memory import build_memory_plan
from pipeplan.sim.schedules import SCHEDULES, build_schedule, register, schedule_names
from pipeplan.sim.step import resolve_schedule, simulate_scenario
from tests.conftest import independent_longest_path_s, make_costs

SEVENTY = scenario_path("llama2-70b-48l-pp8-tp8-a100")


def test_what_each_action_waits_for():
    sched = build_schedule("zb-h1", 2, 2)
    st = step_structure(sched)
    inputs = {str(a): [str(x) for x in st.inputs(a)] for a in st.actions}
    assert inputs["0F0"] == [] and inputs["1F0"] == ["0F0"]
    assert inputs["0I0"] == ["0F0", "1I0"]  # its own forward first, then the next stage's input gradient
    assert inputs["1I0"] == ["1F0"]  # the last stage has no next stage
    assert inputs["0W1"] == ["0I1"]
    assert cross_stage_input(Action(1, Kind.I, 0), 2) is None
    assert cross_stage_input(Action(0, Kind.I, 0), 2)[:3] == (1, (Kind.B, Kind.I), 0)


@pytest.mark.parametrize("name", schedule_names())
def test_engine_is_the_longest_path_for_every_registered_schedule(name):
    spec = SCHEDULES[name]
    p, m, v = 4, 8, spec.virtual_stages
    rng = np.random.default_rng(7)
    n = p * v
    costs = make_costs(p, v, m, f=rng.uniform(0.5, 2, n), i=rng.uniform(0.5, 2, n), w=rng.uniform(0, 1, n))
    sched = build_schedule(name, p, m, v)
    expected = independent_longest_path_s(sched, costs.duration)
    assert simulate(sched, costs).makespan_s == pytest.approx(expected, rel=1e-12)


def test_the_graph_counts_its_nodes_by_kind():
    sc = load_scenario(SEVENTY, {"memory.offload_activations": 0.5, "memory.optimizer": "dram",
                                 "memory.master_weights": "dram"})
    costs, sched = build_cost_table(sc), resolve_schedule(sc)
    plan = build_memory_plan(sc, costs, sched)
    g = build_step_graph(sched, costs, plan, simulate(sched, costs, memory=plan).copy_order(), links=True)
    p, m = sched.num_ranks, sched.num_microbatches
    assert g.count(NodeKind.COMPUTE) == sched.num_actions
    assert g.count(NodeKind.TRANSFER) == 2 * (p - 1) * m  # one per cross-rank activation and gradient
    assert g.count(NodeKind.OFFLOAD) == g.count(NodeKind.PREFETCH) == sched.num_stages * m
    assert g.count(NodeKind.STEP_D2H) == g.count(NodeKind.STEP_HOST) == g.count(NodeKind.STEP_H2D) == p


# ---- one resolver for the memory plan ------------------------------------------------------------------------
def small_planned_scenario(**more):
    return load_scenario(SEVENTY, {"pipeline.stages": 2, "pipeline.microbatches": 4, "model.layers": 4,
                                   "device.hbm_gib": 7.0, "memory.plan": True, **more})


def test_a_handed_over_choice_is_not_solved_again(monkeypatch):
    import pipeplan.solver.step
    from pipeplan.solver.memory_milp import MemoryChoice
    from pipeplan.solver.step import resolve_memory_plan

    sc = small_planned_scenario()
    costs, sched = build_cost_table(sc), resolve_schedule(sc)
    solved = resolve_memory_plan(sc, costs, sched)
    assert solved.planned is not None and solved.choice is not None
    cfg = RunConfig.from_json(RunConfig(memory_choice=solved.choice.to_dict()).to_json())  # launcher -> ranks

    def no_solving(*_args, **_kwargs):
        raise AssertionError("the memory MILP was solved again")

    monkeypatch.setattr(pipeplan.solver.step, "plan_memory", no_solving)
    again = resolve_memory_plan(sc, costs, sched, cfg.choice())
    assert isinstance(cfg.choice(), MemoryChoice)
    for field in ("kept_bytes", "offload_bytes", "recompute_s", "static_hbm_bytes", "step_h2d_bytes"):
        assert np.array_equal(getattr(again.plan, field), getattr(solved.plan, field)), field
    assert simulate(sched, costs, memory=again.plan).makespan_s == solved.planned.simulated.makespan_s


def test_sim_step_refuses_a_planned_memory_policy():
    with pytest.raises(ScenarioError, match=r"memory\.plan"):
        simulate_scenario(small_planned_scenario())


# ---- registries ----------------------------------------------------------------------------------------------
def test_a_schedule_name_cannot_be_registered_twice():
    schedule_names()
    with pytest.raises(ValueError, match="registered twice"):
        register("1f1b", lambda p, m, v: None, "a second 1f1b")(lambda p, m, v: None)
    assert SCHEDULES["1f1b"].build.__module__ == "pipeplan.sim.schedules.one_f_one_b"
