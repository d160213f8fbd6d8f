"""The SimPy engine against closed forms, the DAG longest path and hand-computed timelines."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pipeplan.sim.dag import build_dag, longest_path_s
from pipeplan.sim.engine import DeadlockError, simulate
from pipeplan.sim.ir import Schedule
from pipeplan.sim.schedules import SCHEDULES, build_schedule, schedule_names
from tests.conftest import make_costs

# every registered schedule at its usual virtual stages, read from the registry, plus interleaving at v = 3
ALL = [(name, SCHEDULES[name].virtual_stages) for name in schedule_names()] + [("interleaved-1f1b", 3)]


def timeline(result) -> list[tuple[str, float, float]]:
    order = np.lexsort((result.start_s, result.rank))
    return [
        (f"{result.stage[k]}{result.kind[k]}{result.microbatch[k]}", float(result.start_s[k]), float(result.end_s[k]))
        for k in order
    ]


def test_1f1b_two_ranks_timeline():
    res = simulate(build_schedule("1f1b", 2, 2), make_costs(2, 1, 2, f=1, i=1, w=1))
    assert timeline(res) == [
        ("0F0", 0, 1), ("0F1", 1, 2), ("0B0", 4, 6), ("0B1", 7, 9),
        ("1F0", 1, 2), ("1B0", 2, 4), ("1F1", 4, 5), ("1B1", 5, 7),
    ]  # fmt: skip
    assert res.makespan_s == 9


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 4), (4, 4), (4, 8), (8, 16), (3, 7)])
def test_unit_cost_makespan_is_m_plus_p_minus_1(name, p, m):
    res = simulate(build_schedule(name, p, m), make_costs(p, 1, m, f=1, i=1, w=1))
    assert res.makespan_s == pytest.approx((m + p - 1) * (1 + 2))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3), (8, 16)])
def test_activation_peaks_1f1b_and_gpipe(p, m):
    one = simulate(build_schedule("1f1b", p, m), make_costs(p, 1, m))
    assert list(one.peak_activation_bytes) == [min(p - i, m) for i in range(p)]
    gp = simulate(build_schedule("gpipe", p, m), make_costs(p, 1, m))
    assert list(gp.peak_activation_bytes) == [m] * p


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (8, 16, 2)])
def test_interleaved_bubble_formula(p, m, v):
    """Narayanan et al. 2021: the bubble shrinks to (p-1)/v of one microbatch's per-rank F+B."""
    f, b = 1.0, 2.0
    res = simulate(build_schedule("interleaved-1f1b", p, m, v), make_costs(p, v, m, f=f, i=1, w=1))
    assert res.makespan_s == pytest.approx(m * v * (f + b) + (p - 1) * (f + b))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (8, 16)])
@pytest.mark.parametrize("f,i,w", [(1, 1, 1), (1.0, 1.5, 0.5), (2, 1, 1)])
def test_zb_h1_bubble_formula(p, m, f, i, w):
    """Qi et al. 2023: ZB-H1's bubble is (p-1)(T_F + T_B - T_W), 1F1B's is (p-1)(T_F + T_B + T_W)."""
    res = simulate(build_schedule("zb-h1", p, m), make_costs(p, 1, m, f=f, i=i, w=w))
    assert res.makespan_s == pytest.approx(m * (f + i + w) + (p - 1) * (f + i - w))
    base = simulate(build_schedule("1f1b", p, m), make_costs(p, 1, m, f=f, i=i, w=w))
    assert base.makespan_s == pytest.approx(m * (f + i + w) + (p - 1) * (f + i + w))


@pytest.mark.parametrize("name,v", ALL)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12)])
def test_makespan_equals_dag_longest_path(name, v, p, m):
    """With zero transfer time the engine is the DAG's longest path, whatever the costs."""
    rng = np.random.default_rng(p * 100 + m)
    n = p * v
    costs = make_costs(p, v, m, f=rng.uniform(0.5, 2, n), i=rng.uniform(0.5, 2, n), w=rng.uniform(0, 1, n))
    sched = build_schedule(name, p, m, v)
    res = simulate(sched, costs)
    assert res.makespan_s == pytest.approx(longest_path_s(build_dag(sched, costs)), rel=1e-12)


def test_every_registered_schedule_is_covered():
    assert {n for n, _ in ALL} == set(schedule_names()) >= {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv",
                                                              "v-half", "chronos"}


def test_links_are_fifo_and_transfers_overlap_compute():
    # rank 0 finishes both forwards quickly; the second transfer queues behind the first on the link
    res = simulate(build_schedule("gpipe", 2, 2), make_costs(2, 1, 2, f=0.1, i=0.1, w=0.1, p2p=1.0))
    starts = {name: (s, e) for name, s, e in timeline(res)}
    assert starts["0F1"] == pytest.approx((0.1, 0.2))  # compute goes on while 0F0's output is on the wire
    assert starts["1F0"] == pytest.approx((1.1, 1.2))
    assert starts["1F1"] == pytest.approx((2.1, 2.2))  # waits for the link, not for rank 0
    assert [(s, d, a) for s, d, a, *_ in res.transfers][:2] == [(0, 1, "0F0"), (0, 1, "0F1")]


def test_blocking_p2p_two_ranks_timeline():
    """Megatron's schedules wait for each send (p2p_communication._communicate waits on its requests): the
    sender loses the transfer time. By hand, f = 1, b = 2, p2p = 0.5: rank 0 waits after 0F0 and 0F1 for their
    sends; rank 1 waits after 1B0 for its gradient's send, so 1F1 starts at 5.0 although its input arrived at
    3.0 (overlapping sends would start it at 4.5)."""
    costs = replace(make_costs(2, 1, 2, f=1, i=1, w=1, p2p=0.5), p2p_blocking=True)
    res = simulate(build_schedule("1f1b", 2, 2), costs)
    assert timeline(res) == [
        ("0F0", 0, 1), ("0F1", 1.5, 2.5), ("0B0", 5, 7), ("0B1", 8.5, 10.5),
        ("1F0", 1.5, 2.5), ("1B0", 2.5, 4.5), ("1F1", 5, 6), ("1B1", 6, 8),
    ]  # fmt: skip
    assert res.makespan_s == 10.5
    overlapped = simulate(build_schedule("1f1b", 2, 2), make_costs(2, 1, 2, f=1, i=1, w=1, p2p=0.5))
    assert overlapped.makespan_s == 10.0


@pytest.mark.parametrize("name,v", ALL)
def test_blocking_p2p_makespan_equals_dag_longest_path(name, v):
    """A blocking sender never queues on its link, so the DAG with the send on the rank-order edge is exact."""
    p, m = 4, 8
    rng = np.random.default_rng(7)
    n = p * v
    costs = replace(make_costs(p, v, m, f=rng.uniform(0.5, 2, n), i=rng.uniform(0.5, 2, n),
                               w=rng.uniform(0, 1, n), p2p=0.3), p2p_blocking=True)
    sched = build_schedule(name, p, m, v)
    res = simulate(sched, costs)
    assert res.makespan_s == pytest.approx(longest_path_s(build_dag(sched, costs)), rel=1e-12)
    assert res.makespan_s >= simulate(sched, replace(costs, p2p_blocking=False)).makespan_s


def test_oom_is_reported_not_raised():
    costs = make_costs(4, 1, 8, act=10.0, static=5.0, hbm=40.0)
    res = simulate(build_schedule("1f1b", 4, 8), costs)
    assert res.oom
    assert {e.rank for e in res.oom_events} == {0}  # 5 + 4*10 > 40 only on rank 0 (3*10 + 5 = 35 on rank 1)
    first = res.oom_events[0]
    assert first.excess_bytes == pytest.approx(5.0)
    assert first.action == "0F3"
    assert list(res.peak_hbm_bytes) == [45.0, 35.0, 25.0, 15.0]


def test_memory_timeline_returns_to_static():
    res = simulate(build_schedule("1f1b", 2, 3), make_costs(2, 1, 3, act=2.0, static=7.0))
    by_rank: dict[int, list[float]] = {}
    for r, _t, hbm, *_tiers in res.memory:
        by_rank.setdefault(r, []).append(hbm)
    for r in (0, 1):
        assert by_rank[r][0] == 7.0 and by_rank[r][-1] == 7.0
        assert max(by_rank[r]) == 7.0 + 2.0 * (2 - r)


def test_deadlock_names_blocked_actions():
    sched = Schedule.from_csv_text("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    with pytest.raises(DeadlockError, match=r"rank 0 at 0B0 waits for 1B0.*rank 1 at 1F1 waits for 0F1"):
        simulate(sched, make_costs(2, 1, 2))
    with pytest.raises(DeadlockError, match="cycle"):
        longest_path_s(build_dag(sched, make_costs(2, 1, 2)))


def test_bubble_ratio_and_duration_overrides():
    sched = build_schedule("1f1b", 2, 2)
    res = simulate(sched, make_costs(2, 1, 2))
    assert res.bubble_ratio == pytest.approx(1 - (2 * 6) / (2 * 9))
    from pipeplan.sim.ir import Action, Kind

    faster = simulate(sched, make_costs(2, 1, 2), durations={Action(0, Kind.B, 1): 1.0})
    assert faster.makespan_s == pytest.approx(8.0)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zbv_only_bubble_is_the_first_forward_reaching_the_last_rank(p, m):
    """ZB-V (Qi et al. 2024) with T_F = T_I = T_W and m >= 2p: the idle time is the (p-1) T_F fill."""
    res = simulate(build_schedule("zbv", p, m, 2), make_costs(p, 2, m))
    assert res.makespan_s == pytest.approx(m * 2 * 3 + (p - 1) * 1)


def test_p2p_wait_is_the_idle_time_only_transfers_explain():
    # gpipe p=2, m=1, F=1, B=2, link 0.5: rank 1 waits 0.5 for F's output, rank 0 waits 0.5 for B's gradient
    res = simulate(build_schedule("gpipe", 2, 1), make_costs(2, 1, 1, f=1, i=1, w=1, p2p=0.5))
    assert timeline(res) == [("0F0", 0, 1), ("0B0", 5, 7), ("1F0", 1.5, 2.5), ("1B0", 2.5, 4.5)]
    assert res.p2p_wait_s.tolist() == [0.5, 0.5]
    assert res.p2p_wait_share == pytest.approx(1.0 / (2 * 7))


@pytest.mark.parametrize("name", schedule_names())
def test_p2p_wait_is_part_of_the_bubble_and_zero_on_free_links(name):
    v = SCHEDULES[name].virtual_stages
    sched = build_schedule(name, 4, 8, v)
    free = simulate(sched, make_costs(4, v, 8, f=1, i=1, w=1))
    assert free.p2p_wait_s.tolist() == [0.0] * 4 and free.p2p_wait_share == 0.0
    slow = simulate(sched, make_costs(4, v, 8, f=1, i=1, w=1, p2p=0.3))
    idle = slow.makespan_s - slow.busy_s
    assert (slow.p2p_wait_s > 0).any() and (slow.p2p_wait_s <= idle + 1e-9).all()
    assert 0 < slow.p2p_wait_share <= slow.bubble_ratio + 1e-12


def test_post_validation_step_is_the_longest_rank_span():
    """Optimizer post-validation (the Zero Bubble fork's --enable-optimizer-post-validation) drops the barrier
    before the optimizer step, so each rank starts its next step after its own optimizer step. By hand, 1F1B on
    two ranks, f = 1, b = 2 (timeline above), tails 0.5 and 3: rank 0 runs 0 .. 9 + 0.5, rank 1 runs 1 .. 7 + 3.
    With the barrier the step ends at max(9.5, 10) = 10; without it the step repeats every max(9.5, 9) = 9.5."""
    costs = replace(make_costs(2, 1, 2, f=1, i=1, w=1), step_tail_s=np.array([0.5, 3.0]))
    sched = build_schedule("1f1b", 2, 2)
    barrier = simulate(sched, costs)
    assert barrier.step_time_s == 10.0
    assert barrier.rank_span_s.tolist() == [9.5, 9.0]
    assert simulate(sched, replace(costs, post_validation=True)).step_time_s == 9.5


@pytest.mark.parametrize("name,v", ALL)
def test_post_validation_step_between_busiest_rank_and_barrier_step(name, v):
    """No rank runs two steps at once (step >= its busy time plus its tail) and dropping a barrier never slows
    the step; 1F1B-shaped schedules, whose rank 0 starts first and ends last, gain nothing without tails."""
    p, m = 4, 8
    rng = np.random.default_rng(11)
    n = p * v
    costs = make_costs(p, v, m, f=rng.uniform(0.5, 2, n), i=rng.uniform(0.5, 2, n), w=rng.uniform(0, 1, n), p2p=0.1)
    sched = build_schedule(name, p, m, v)
    barrier = simulate(sched, costs)
    free = simulate(sched, replace(costs, post_validation=True))
    assert (barrier.busy_s <= free.step_time_s + 1e-12).all()
    assert free.step_time_s <= barrier.step_time_s + 1e-12
    if name == "1f1b":
        assert free.step_time_s == pytest.approx(barrier.step_time_s, rel=1e-12)


def test_post_validation_removes_zb_2p_start_delay():
    """ZB-2p keeps every rank busy from its first action to its last, so without the barrier the last rank's
    start delay leaves the step: on unit costs (f = i = w = 1), p = 4, m = 8, the barrier step is 3m + p - 1 =
    27 (rank 3 starts at 3 and works 24), the post-validation step 3m = 24, each rank's own work: zero bubble."""
    costs = make_costs(4, 1, 8, f=1, i=1, w=1)
    sched = build_schedule("zb-2p", 4, 8)
    assert simulate(sched, costs).step_time_s == 27.0
    free = simulate(sched, replace(costs, post_validation=True))
    assert free.step_time_s == 24.0 and free.busy_s.tolist() == [24.0] * 4


def test_summary_reports_rank_spans_under_post_validation():
    from pipeplan.sim.trace import simulation_summary

    costs = replace(make_costs(2, 1, 2, f=1, i=1, w=1), step_tail_s=np.array([0.5, 3.0]), post_validation=True)
    summary = simulation_summary(simulate(build_schedule("1f1b", 2, 2), costs))
    assert summary["rank_span_s"] == [9.5, 9.0] and summary["step_time_s"] == 9.5 and summary["makespan_s"] == 9
