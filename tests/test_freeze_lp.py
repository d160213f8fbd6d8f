"""The freeze LP against numbers worked out by hand, brute force, scipy and the simulator."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from pipeplan.sim.config import FreezeConfig
from pipeplan.sim.engine import simulate
from pipeplan.sim.ir import Action, Kind, Schedule
from pipeplan.sim.schedules import build_schedule
from pipeplan.solver.errors import FreezeInputError, InfeasibleError
from pipeplan.solver.freeze_dag import build_freeze_dag
from pipeplan.solver.freeze_lp import solve_freeze_lp
from pipeplan.solver.highs import LinearProgram
from tests.conftest import make_costs


def plan(name: str, p: int, m: int, v: int = 1, cap: float = 0.9, max_ratio: float = 1.0, **cost_kw):
    sched = build_schedule(name, p, m, v)
    costs = make_costs(p, v, m, **cost_kw)
    dag = build_freeze_dag(sched, costs, FreezeConfig(cap=cap, max_ratio=max_ratio))
    return sched, costs, dag, solve_freeze_lp(dag, cap, max_ratio)


def ratios(dag, sol) -> dict[str, float]:
    return {str(dag.actions[i]): float(r) for i, r in zip(dag.freezable, sol.ratio, strict=True)}


def simulated(sched, costs, dag, sol) -> float:
    return simulate(sched, costs, dag.action_durations(sol.ratio)).makespan_s  # freezable and tied actions


# ---- ground truth by hand ---------------------------------------------------------------------------
def test_single_stage_freezes_exactly_the_cap():
    # one rank runs F B F B ... back to back; the only chunk is the first, which needs no input gradient, so a
    # fully frozen B does nothing: T = m (F + B) - Σ r (I + W), so T* = 4·3 - 0.5·4·2 = 8
    _, _, _, sol = plan("1f1b", 1, 4, cap=0.5)
    assert sol.makespan_s == pytest.approx(8.0, abs=1e-7)
    assert sol.ratio.sum() == pytest.approx(2.0, abs=1e-7)  # stage 2 may use its 1e-9 slack


def test_a_measured_fully_frozen_backward_is_the_bound():
    # freeze.backward_min_s (the runtime's measured fully frozen B) replaces the model's: T* = 12 - 0.5·4·(2 - 1)
    sched = build_schedule("1f1b", 1, 4, 1)
    dag = build_freeze_dag(sched, make_costs(1, 1, 4), FreezeConfig(cap=0.5, backward_min_s=1.0))
    assert solve_freeze_lp(dag, 0.5).makespan_s == pytest.approx(10.0, abs=1e-7)


def test_single_stage_limited_by_max_ratio():
    # every B at most 0.3 frozen: Σ r <= 1.2 < cap·m = 2, T* = 12 - 1.2·(I + W)
    _, _, _, sol = plan("1f1b", 1, 4, cap=0.5, max_ratio=0.3)
    assert sol.makespan_s == pytest.approx(9.6, abs=1e-7)
    np.testing.assert_allclose(sol.ratio, 0.3, atol=1e-9)


def test_two_stages_one_microbatch_with_transfers():
    # F0 -> F1 -> B1 -> B0 is one chain: 1 + .1 + 1 + 2 + .1 + 2 = 6.2, minus 0.5·W on stage 1 and 0.5·(I + W)
    # on stage 0 (no input gradient) at cap 0.5: 6.2 - 0.5 - 1 = 4.7
    sched, costs, dag, sol = plan("1f1b", 2, 1, cap=0.5, p2p=0.1)
    assert sol.makespan_s == pytest.approx(4.7, abs=1e-7)
    assert ratios(dag, sol) == pytest.approx({"0B0": 0.5, "1B0": 0.5}, abs=1e-7)
    assert simulated(sched, costs, dag, sol) == pytest.approx(4.7, rel=1e-8)


def test_zero_bubble_freezes_only_the_w_that_shortens_the_step():
    # zb-h1, p=2, m=2, F = I = W = 1. Unfrozen: rank 1 runs F0 I0 F1 I1 W0 W1 from t=1, ending at 7; rank 0
    # ends ... I1 [5, 6] W1 [6, 7]. Rank 0's W0 [4, 5] ends as rank 1's I1 arrives: freezing it saves
    # nothing. Stage 0 needs no input gradient, so its I1 shrinks with W1's ratio r: rank 0 ends at 5 + 2(1 - r).
    # Rank 1 ends at 5 + 2 - (r1W0 + r1W1) >= 5.2 (its cap, 0.9 x 2), so T* = 5.2 with r0W1 = 0.9 (least freezing).
    sched, costs, dag, sol = plan("zb-h1", 2, 2, cap=0.9)
    r = ratios(dag, sol)
    assert sol.makespan_s == pytest.approx(5.2, abs=1e-7)
    assert r["0W0"] == 0.0
    assert r["0W1"] == pytest.approx(0.9, abs=1e-7)
    assert r["1W0"] + r["1W1"] == pytest.approx(1.8, abs=1e-7)
    i1 = dag.action_durations(sol.ratio)[Action(0, Kind.I, 1)]  # the tied I, as the simulator is given it
    assert i1 == pytest.approx(0.1, abs=1e-7)
    assert simulated(sched, costs, dag, sol) == pytest.approx(5.2, rel=1e-8)


def test_cap_zero_is_the_unfrozen_step():
    sched, costs, dag, sol = plan("1f1b", 4, 8, cap=0.0)
    assert not sol.ratio.any()
    np.testing.assert_array_equal(sol.duration_s, dag.w_max[dag.freezable])
    assert sol.makespan_s == pytest.approx(simulate(sched, costs).makespan_s, rel=1e-12)


# ---- the second objective ---------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("zbv", 2)])
def test_every_frozen_action_shortens_the_step(name, v):
    """Lexicographic stage 2: thawing any frozen action a little makes the step longer."""
    f = np.linspace(1.0, 1.6, 4 * v)  # uneven chunks, so not every action is critical
    _, _, dag, sol = plan(name, 4, 8, v, cap=0.6, f=f, i=f, w=0.8 * f)
    base = dag.node_durations(sol.ratio)
    for k in np.flatnonzero(sol.ratio > 1e-7):
        thawed = sol.ratio.copy()
        thawed[k] -= min(thawed[k], 1e-3)
        dur = dag.node_durations(thawed)
        start, _ = dag.earliest_starts(dur)
        assert (start + dur).max() > sol.makespan_s + 1e-7, (
            f"{dag.actions[dag.freezable[k]]} frozen for nothing"
        )
    start, _ = dag.earliest_starts(base)
    assert (start + base).max() == pytest.approx(sol.makespan_s, rel=1e-8)


# ---- against the simulator, brute force and scipy -----------------------------------------------------
@pytest.mark.parametrize(
    ("name", "p", "m", "v", "p2p"),
    [
        ("gpipe", 4, 8, 1, 0.05),
        ("1f1b", 4, 8, 1, 0.05),
        ("interleaved-1f1b", 4, 8, 2, 0.05),
        ("zbv", 4, 8, 2, 0.05),
        ("zb-h1", 4, 8, 1, 0.05),
        ("1f1b", 4, 8, 1, 3.0),
        ("zbv", 4, 8, 2, 1.5),
    ],  # p2p above F: FIFO links queue
)
def test_lp_makespan_equals_the_simulator(name, p, m, v, p2p):
    sched, costs, dag, sol = plan(name, p, m, v, cap=0.7, p2p=p2p)
    if p2p > 1:
        assert dag.link_nodes > 0
    assert simulated(sched, costs, dag, sol) == pytest.approx(sol.makespan_s, rel=1e-6)


@pytest.mark.parametrize(("name", "v"), [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2)])
def test_lp_makespan_equals_the_simulator_with_blocking_sends(name, v):
    """interconnect.p2p_blocking: the freeze DAG puts the send on the sender's rank-order edge, as the engine
    waits for it; the plan's makespan is what the engine measures with the frozen durations."""
    sched = build_schedule(name, 4, 8, v)
    costs = replace(make_costs(4, v, 8, p2p=0.2), p2p_blocking=True)
    dag = build_freeze_dag(sched, costs, FreezeConfig(cap=0.7, max_ratio=1.0))
    sol = solve_freeze_lp(dag, 0.7, 1.0)
    assert simulated(sched, costs, dag, sol) == pytest.approx(sol.makespan_s, rel=1e-6)
    assert sol.makespan_s > solve_freeze_lp(build_freeze_dag(sched, replace(costs, p2p_blocking=False),
                                                             FreezeConfig(cap=0.7, max_ratio=1.0)), 0.7, 1.0).makespan_s


def test_matches_brute_force_on_a_tiny_step():
    # 1f1b p=2 m=2: four B actions; vertices of this LP sit on a 0.25 grid
    _, _, dag, sol = plan("1f1b", 2, 2, cap=0.5)
    stage = dag.freezable_stage
    best = np.inf
    for r in itertools.product(np.linspace(0, 1, 5), repeat=len(dag.freezable)):
        r = np.asarray(r)
        if any(r[stage == s].mean() > 0.5 + 1e-12 for s in np.unique(stage)):
            continue
        dur = dag.node_durations(r)
        start, _ = dag.earliest_starts(dur)
        best = min(best, (start + dur).max())
    assert sol.makespan_s == pytest.approx(best, abs=1e-7)


def test_matches_timelyfreeze_scipy_formulation():
    pytest.importorskip("scipy")
    from pipeplan.analysis.bench.plan import scipy_timelyfreeze

    for name, v in (("1f1b", 1), ("zbv", 2)):
        _, _, dag, sol = plan(name, 4, 8, v, cap=0.5, f=np.linspace(1, 2, 4 * v), p2p=0.1)
        makespan, _, _, _ = scipy_timelyfreeze(dag, 0.5)
        assert makespan == pytest.approx(sol.makespan_s, rel=1e-7)


def test_speedup_never_falls_as_the_cap_grows():
    sched, costs = build_schedule("1f1b", 4, 8, 1), make_costs(4, 1, 8, f=[1.0, 1.0, 1.0, 1.5])
    dag = build_freeze_dag(sched, costs, FreezeConfig())
    makespans = [solve_freeze_lp(dag, cap / 10).makespan_s for cap in range(11)]
    assert all(b <= a + 1e-9 for a, b in itertools.pairwise(makespans))
    assert makespans[-1] < makespans[0]


def test_convex_curve_saves_more_early():
    # share still spent c(r): (0, 1) (0.5, 0.2) (1, 0): half-frozen already saves 80% of W
    sched = build_schedule("1f1b", 1, 4, 1)
    costs = make_costs(1, 1, 4)
    fz = FreezeConfig(cap=0.5, curve=[[0.0, 1.0], [0.5, 0.2], [1.0, 0.0]])
    dag = build_freeze_dag(sched, costs, fz)
    sol = solve_freeze_lp(dag, 0.5)
    # four B of the first chunk (Δ = I + W = 2) at r = 0.5 each save 0.8·2: T* = 12 - 6.4 (the concave-free
    # curve rewards spreading)
    assert sol.makespan_s == pytest.approx(5.6, abs=1e-7)
    np.testing.assert_allclose(sol.ratio, 0.5, atol=1e-9)
    assert simulated(sched, costs, dag, sol) == pytest.approx(5.6, rel=1e-8)


# ---- bad input ------------------------------------------------------------------------------------------
def test_fully_frozen_slower_than_unfrozen_is_rejected():
    sched, costs = build_schedule("1f1b", 2, 2, 1), make_costs(2, 1, 2)
    with pytest.raises(FreezeInputError, match=r"^freeze\.backward_min_s: chunk 0"):
        build_freeze_dag(sched, costs, FreezeConfig(backward_min_s=2.5))
    with pytest.raises(FreezeInputError, match=r"^freeze\.weight_min_s"):
        build_freeze_dag(build_schedule("zb-h1", 2, 2, 1), costs, FreezeConfig(weight_min_s=[0.0, 1.5]))


def test_infeasible_lp_is_an_error_not_a_solution():
    lp = LinearProgram("toy")
    x = lp.add_variables(1, lb=0.0, ub=1.0)
    lp.add_rows(2.0, np.inf, [0], x, [1.0])  # x >= 2 with x <= 1
    with pytest.raises(InfeasibleError, match="infeasible"):
        lp.minimize(x, 1.0, "toy solve")


def test_a_deadlocking_order_makes_the_lp_infeasible():
    a = lambda s, k, mb: Action(s, Kind(k), mb)  # noqa: E731
    # rank 1 wants 1F1 before 1F0, but 0F1 comes after 0B0, which needs 1B0: a cycle
    sched = Schedule(
        "cyclic",
        2,
        2,
        (
            (a(0, "F", 0), a(0, "B", 0), a(0, "F", 1), a(0, "B", 1)),
            (a(1, "F", 1), a(1, "F", 0), a(1, "B", 0), a(1, "B", 1)),
        ),
        (0, 1),
    ).validate()
    dag = build_freeze_dag(sched, make_costs(2, 1, 2), FreezeConfig())
    with pytest.raises(InfeasibleError, match="cycle"):
        solve_freeze_lp(dag, 0.9)
