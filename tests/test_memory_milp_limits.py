"""The memory MILP stops on work, not time: the same model gives the same plan on any machine load, and a plan
cut short by the node limit is flagged as HiGHS' incumbent, with its gap, never passed off as the optimum."""

from __future__ import annotations

import numpy as np
import pytest
from pipeplan.scenarios import scenario_path

import pipeplan.solver.memory_milp as memory_milp
from pipeplan.sim.config import load_scenario
from pipeplan.sim.costs import build_cost_table
from pipeplan.sim.memory import keep_everything, with_states
from pipeplan.sim.step import resolve_schedule
from pipeplan.solver.errors import SolverTimeoutError
from pipeplan.solver.highs import LinearProgram

SEVENTY = scenario_path("llama2-70b-48l-pp8-tp8-a100")
# the MILP's mechanics at the full 80 GB: with the default 5% margin no plan fits this chronos step (77.8 GiB)
CHRONOS = {"pipeline.schedule": "chronos", "pipeline.virtual_stages": 2, "memory.hbm_margin_gib": 0.0}


def multi_knapsack(options: dict) -> LinearProgram:
    """max v·x subject to 8 random knapsack rows, x binary: small, but HiGHS needs ~25 nodes to prove it."""
    rng = np.random.default_rng(1)
    n, m = 60, 8
    weights, values = rng.integers(10, 100, (m, n)), rng.integers(10, 100, n)
    lp = LinearProgram("knapsack", {"random_seed": 0, "mip_rel_gap": 1e-4, **options})
    x = lp.add_variables(n, 0, 1)
    lp.set_integer(x)
    lp.add_rows(-np.inf, weights.sum(axis=1) / 2, np.repeat(np.arange(m), n), np.tile(x, m), weights.ravel())
    lp._values = values  # the objective, kept with the model for the test
    return lp


def test_a_node_limit_returns_the_incumbent_flagged_with_its_gap():
    full = multi_knapsack({}).minimize(np.arange(60), -multi_knapsack({})._values, "knapsack")
    assert full.proven_optimal and full.mip_gap <= 1e-4
    lp = multi_knapsack({"mip_max_nodes": 2})
    cut = lp.minimize(np.arange(60), -lp._values, "knapsack", accept_incumbent=True)
    assert not cut.proven_optimal
    assert cut.mip_gap > 1e-4  # not closed; the bound brackets the true optimum
    assert cut.dual_bound <= full.objective + 1e-9 <= cut.objective + 1e-9
    with pytest.raises(memory_milp.SolverError, match="without an optimum"):  # not accepted unless asked
        multi_knapsack({"mip_max_nodes": 2}).minimize(np.arange(60), -lp._values, "knapsack")


def test_an_lp_then_a_milp_share_highs_thread_pool():
    """HiGHS sizes its global thread pool on the first solve; a later model asking for another count would
    fail with kError. Every model gets the same count from the adapter, so an LP first does no harm."""
    lp = LinearProgram("lp")
    x = lp.add_variables(3, 0, 1)
    lp.add_rows(1, 2, np.zeros(3), x, np.ones(3))
    assert lp.minimize(x, 1.0, "lp").objective == pytest.approx(1.0)
    milp = multi_knapsack({})
    assert milp.minimize(np.arange(60), -milp._values, "knapsack").proven_optimal


def test_the_safety_time_limit_raises_its_own_error():
    lp = multi_knapsack({"time_limit": 1e-9})
    with pytest.raises(SolverTimeoutError, match="safety time limit"):
        lp.minimize(np.arange(60), -lp._values, "knapsack", accept_incumbent=True)


def _solve(sc, options=None):
    costs, sched = build_cost_table(sc), resolve_schedule(sc)
    base = with_states(sc, costs, keep_everything(costs))
    return memory_milp._solve(sc, costs, sched, base, sc.memory.prefetch_lookahead, np.ones(costs.num_chunks),
                              base.hbm_limit_bytes, True)


def test_the_same_memory_milp_solved_twice_gives_the_same_plan():
    sc = load_scenario(SEVENTY, CHRONOS)
    a, b = _solve(sc), _solve(sc)
    assert a.proven_optimal and a.mip_gap <= 1e-2
    assert a.choice.to_dict() == b.choice.to_dict()
    assert (a.makespan_s, a.peak_hbm_bytes) == (b.makespan_s, b.peak_hbm_bytes)


def test_a_tiny_node_limit_yields_an_incumbent_flagged_as_such(monkeypatch):
    sc = load_scenario(SEVENTY, CHRONOS)
    proven = _solve(sc)
    # this model closes its gap at the root node, so stop it at its first incumbent instead (another work limit)
    monkeypatch.setattr(memory_milp, "MILP_OPTIONS", {**memory_milp.MILP_OPTIONS, "mip_rel_gap": 0.0,
                                                      "mip_max_improving_sols": 1})
    cut = _solve(sc)
    assert not cut.proven_optimal and cut.mip_gap > 0
    assert cut.dual_bound <= cut.makespan_s + 1e-9  # the proven bound lies below the incumbent's step
    assert cut.makespan_s >= proven.makespan_s * (1 - 1e-2)  # proven is within 1% of the optimum


def test_an_unproven_smallest_hbm_is_stated_as_at_most():
    low = memory_milp.SmallestHbm(12 * 2**30, False, 11 * 2**30).describe()
    assert "at most 12.00 GiB" in low and "at least 11.00 GiB" in low
    assert memory_milp.SmallestHbm(12 * 2**30, True, 12 * 2**30).describe().endswith("is 12.00 GiB")
