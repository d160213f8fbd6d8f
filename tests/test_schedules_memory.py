"""Memory-capped V schedules (v-half, chronos) against ground truth: torch's validator and dry run, the
engine's measured peaks and activation lifetimes, the DAG longest path, and the table in docs/schedules.md."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from pipeplan.sim.dag import build_dag, longest_path_s
from pipeplan.sim.engine import SimResult, simulate
from pipeplan.sim.errors import ScheduleError
from pipeplan.sim.ir import Action, Kind, Schedule
from pipeplan.sim.memory import hbm_waits
from pipeplan.sim.schedules import SCHEDULES, build_schedule, schedule_names
from pipeplan.sim.schedules.v_shape import (
    CHRONOS_SLOWDOWN,
    ActionTimes,
    Admission,
    PastDeadline,
    chronos_plan,
    deferred_w_limit,
    list_schedule,
    v_half_limit,
    zigzag_placement,
)
from pipeplan.sim.step import list_clock
from tests.conftest import make_costs
from tests.test_schedules import assert_torch_accepts, in_flight_peak

RANKS = range(1, 9)
MICROBATCHES = (1, 2, 3, 4, 5, 7, 8, 9, 12, 16)
MEMORY_CAPPED = [("v-half", 2), ("chronos", 2), ("chronos", 4)]


def sizes(name: str, v: int) -> Iterator[tuple[int, int]]:
    schedule_names()  # registers the built-ins
    for p in RANKS:
        for m in MICROBATCHES:
            if SCHEDULES[name].check(p, m, v) is None:
                yield p, m


def run_unit(sched: Schedule) -> SimResult:
    """Simulate with T_F = T_I = T_W = 1/v and activation 1/v per chunk: every schedule then runs the same
    model (a rank's whole-microbatch forward takes 1 and holds 1), whatever its v."""
    v = sched.virtual_stages
    u = 1.0 / v
    return simulate(sched, make_costs(sched.num_ranks, v, sched.num_microbatches, f=u, i=u, w=u, act=u))


def activation_lifetimes(res: SimResult) -> np.ndarray:
    """For every (stage, microbatch): how long the activation waits in HBM before its backward starts."""
    return hbm_waits(res).ravel()


# ---- validity --------------------------------------------------------------------------------------------
def test_registered_with_checks_that_name_the_field():
    assert {"v-half", "chronos"} <= set(schedule_names())
    assert SCHEDULES["v-half"].check(4, 8, 3) == "needs pipeline.virtual_stages = 2 (got 3)"
    for v in (1, 3, 5):
        assert "pipeline.virtual_stages to be even and >= 2" in SCHEDULES["chronos"].check(4, 8, v)
    assert all(SCHEDULES["chronos"].check(p, m, v) is None for p in RANKS for m in (1, 7, 16) for v in (2, 4, 6))
    with pytest.raises(ScheduleError, match=r"'chronos' needs pipeline.virtual_stages to be even .* \(got 3\)"):
        build_schedule("chronos", 4, 8, 3)


def test_v_placement_is_the_registry_s_and_zigzag_returns_every_other_chunk():
    from pipeplan.sim.schedules import v_placement

    assert all(zigzag_placement(p, 2) == v_placement(p) for p in RANKS)
    assert zigzag_placement(3, 4) == (0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0)


@pytest.mark.parametrize(("name", "v"), MEMORY_CAPPED)
def test_torch_validator_accepts_and_dry_run_progresses(name: str, v: int):
    for p, m in sizes(name, v):
        assert_torch_accepts(name, p, m, v)


@pytest.mark.parametrize(("name", "v"), MEMORY_CAPPED)
def test_csv_round_trip(name: str, v: int):
    for p, m in [(1, 1), (2, 4), (3, 7), (4, 8), (8, 16)]:
        sched = build_schedule(name, p, m, v)
        back = Schedule.from_csv_text(sched.to_csv_text(), num_microbatches=m)
        assert back == sched
        assert back.stage_to_rank == sched.stage_to_rank


@pytest.mark.parametrize("v", [2, 4])
def test_list_scheduler_never_stalls_even_at_the_tightest_cap(v: int):
    # The reservation argument says any forward_limit >= v works; sweep the caps that bind.
    for p in RANKS:
        for m in (1, 3, 8):
            for limit in range(v, v * (p + 2), max(1, p // 2)):
                plan = list_schedule(p, m, v, Admission(limit, deferred_w_limit(p, v)))
                sched = Schedule("cap", p * v, m, plan.ranks, zigzag_placement(p, v)).validate()
                res = simulate(sched, make_costs(p, v, m))  # raises DeadlockError on a bad order
                assert res.makespan_s <= plan.makespan
                assert max(in_flight_peak(r, Kind.I) for r in sched.ranks) <= limit


def test_list_scheduler_refuses_a_cap_below_one_microbatch_and_gives_up_past_its_deadline():
    with pytest.raises(ScheduleError, match="forward_limit 1 < v = 2"):
        list_schedule(4, 8, 2, Admission(1, 10))
    with pytest.raises(PastDeadline):
        list_schedule(4, 8, 2, Admission(2, 10), deadline=40)


# ---- the list scheduler's clock (pipeline.order_timing) -------------------------------------------------------
def test_the_unit_clock_is_the_default():
    for p, m, v in [(1, 3, 2), (4, 8, 2), (3, 7, 4), (8, 32, 2)]:
        for adm in (Admission(v, 0, split_backward=False), Admission(2 * v, 2 * v), Admission(v * m, v * (p + 1))):
            assert list_schedule(p, m, v, adm, times=ActionTimes.unit(p * v)) == list_schedule(p, m, v, adm)


@pytest.mark.parametrize("v", [2, 4])
@pytest.mark.parametrize(("p", "m"), [(2, 5), (4, 8), (5, 12)])
def test_an_order_timed_on_the_costs_is_valid_within_its_cap_and_the_engine_replays_its_run(v: int, p: int, m: int):
    """Timed on any clock the scheduler still never stalls and keeps its cap (the reservation argument does
    not depend on time), and under the costs it was timed with the engine's step is exactly the scheduler's
    run: each action starts when its rank is free and its inputs have arrived, in both."""
    rng = np.random.default_rng(10 * p + m + v)
    n = p * v
    costs = make_costs(p, v, m, f=rng.uniform(0.5, 2, n), i=rng.uniform(0.5, 2.5, n), w=rng.uniform(0.1, 1, n),
                       p2p=float(rng.uniform(0.01, 0.5)))
    times = list_clock(costs)
    assert times.hop == costs.p2p_s and times.of(Kind.B, 1) == costs.duration(Action(1, Kind.B, 0))
    for cap in (v, v * (p // 2 + 1), v * m):
        for stash in (0, cap, deferred_w_limit(p, v)):
            plan = list_schedule(p, m, v, Admission(cap, stash, split_backward=stash > 0), times=times)
            sched = Schedule("timed", n, m, plan.ranks, zigzag_placement(p, v)).validate()
            assert simulate(sched, costs).makespan_s == pytest.approx(plan.makespan, rel=1e-12)
            backward = Kind.I if stash else Kind.B
            assert max(in_flight_peak(r, backward) for r in sched.ranks) <= cap


def test_the_clock_is_chronos_only():
    with pytest.raises(ScheduleError, match=r"pipeline.order_timing: schedule '1f1b' has no cost-timed order"):
        build_schedule("1f1b", 4, 8, 1, times=ActionTimes.unit(4))
    with pytest.raises(ScheduleError, match=r"the clock has times for 4 stages, not p·v = 8"):
        build_schedule("chronos", 4, 8, 2, times=ActionTimes.unit(4))


def test_timed_on_the_70b_step_s_costs_the_same_cap_runs_faster():
    """The shipped ChronosPipe setting at 80 layers, cap 12 with the stash under it: the order built on the
    step's costs (per chunk F 107 ms, I 120 ms, W 83 ms, a 2.2 ms hop) runs 8 % faster than the unit-cost
    order, within the same cap (docs/schedules.md)."""
    from pipeplan.sim.config import load_scenario
    from pipeplan.sim.costs import build_cost_table
    from pipeplan.sim.step import resolve_schedule

    path = "scenarios/llama2-70b-48l-pp8-tp8-a100.toml"
    over = {"model.layers": 80, "pipeline.schedule": "chronos", "pipeline.admission_cap": 12,
            "pipeline.stash_limit": 12}
    runs = {}
    for timing in ("unit", "costs"):
        sc = load_scenario(path, {**over, "pipeline.order_timing": timing})
        sched = resolve_schedule(sc)
        runs[timing] = simulate(sched, build_cost_table(sc)).makespan_s
        assert max(in_flight_peak(r, Kind.I) for r in sched.ranks) <= 12
    assert runs["costs"] < runs["unit"] / 1.07


@pytest.mark.parametrize(("name", "v"), MEMORY_CAPPED)
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12)])
def test_makespan_equals_dag_longest_path(name: str, v: int, p: int, m: int):
    rng = np.random.default_rng(p * 100 + m)
    n = p * v
    costs = make_costs(p, v, m, f=rng.uniform(0.5, 2, n), i=rng.uniform(0.5, 2, n), w=rng.uniform(0, 1, n))
    sched = build_schedule(name, p, m, v)
    assert simulate(sched, costs).makespan_s == pytest.approx(longest_path_s(build_dag(sched, costs)), rel=1e-12)


# ---- v-half: memory ---------------------------------------------------------------------------------------
def test_v_half_holds_at_most_p_plus_2_over_2_microbatches_per_rank():
    for p, m in sizes("v-half", 2):
        sched = build_schedule("v-half", p, m, 2)
        cap = 2 * min((p + 2) // 2, m)  # chunk-activations; (p+2)//2 whole-rank microbatches
        assert v_half_limit(p) == 2 * ((p + 2) // 2)
        res = simulate(sched, make_costs(p, 2, m))  # 1 per chunk-activation
        assert res.peak_activation_bytes.max() <= cap, (p, m)
        one_f_one_b = simulate(build_schedule("1f1b", p, m), make_costs(p, 1, m))  # 1 per whole-rank microbatch
        assert res.peak_activation_bytes.max() / 2 <= one_f_one_b.peak_activation_bytes[0]
        if p >= 3 and m >= p:  # strictly less than 1F1B's p microbatches on rank 0
            assert res.peak_activation_bytes.max() / 2 < one_f_one_b.peak_activation_bytes[0]
        # The paper's unit (zbv_greedy.py's mem_of_stage): a chunk-activation from its F until its W, so live
        # activations and W stashes together, stay within the same cap.
        assert max(in_flight_peak(r, Kind.W) for r in sched.ranks) <= cap, (p, m)


def test_v_half_costs_some_zbv_step_time_at_half_its_memory_counted_until_w():
    # Measured, m >= 2p: up to +13.6% for even p (8, 16), +17.2% for odd p (5, 10), whose cap (p+1)//2 is
    # relatively tighter; the cost shrinks with m (docs/schedules.md).
    for p in range(2, 9):
        for m in (2 * p, 3 * p, 4 * p):
            unit = make_costs(p, 2, m)
            sched = build_schedule("v-half", p, m, 2)
            v_half = simulate(sched, unit)
            zbv_sched = build_schedule("zbv", p, m, 2)
            zbv = simulate(zbv_sched, unit)
            assert v_half.peak_activation_bytes.max() <= (p + 2) // 2 * 2 <= zbv.peak_activation_bytes.max()
            until_w = max(in_flight_peak(r, Kind.W) for r in sched.ranks)
            assert until_w <= (p + 2) // 2 * 2 <= max(in_flight_peak(r, Kind.W) for r in zbv_sched.ranks), (p, m)
            assert zbv.makespan_s <= v_half.makespan_s <= (1.14 if p % 2 == 0 else 1.18) * zbv.makespan_s, (p, m)


# ---- chronos: memory, lifetime, step time ------------------------------------------------------------------
def test_chronos_holds_less_than_1f1b_from_4_ranks_on():
    for p in range(4, 9):
        for m in (2 * p, 3 * p, 4 * p):
            chronos = run_unit(build_schedule("chronos", p, m, 2))
            one_f_one_b = run_unit(build_schedule("1f1b", p, m))
            assert chronos.peak_activation_bytes.max() < one_f_one_b.peak_activation_bytes[0] == p, (p, m)


def test_chronos_activations_wait_less_than_under_1f1b_interleaved_and_zbv():
    # Measured ratios of mean waits over this sweep: <= 0.89 of 1F1B's, 0.55 of interleaved's, 0.71 of ZB-V's.
    for p in range(3, 9):
        for m in (p, 2 * p, 4 * p):
            chronos = activation_lifetimes(run_unit(build_schedule("chronos", p, m, 2)))
            for other, ratio in [("1f1b", 0.9), ("interleaved-1f1b", 0.6), ("zbv", 0.75)]:
                waits = activation_lifetimes(run_unit(build_schedule(other, p, m, 1 if other == "1f1b" else 2)))
                assert chronos.mean() < ratio * waits.mean(), (other, p, m)
                assert chronos.max() < waits.max(), (other, p, m)


def test_chronos_step_time_is_within_5_percent_of_the_uncapped_and_of_zbv_and_beats_interleaved():
    for p in RANKS:
        for m in (1, 3, 8, 9, 12, 16):
            limit, plan = chronos_plan(p, m, 2)
            uncapped = list_schedule(p, m, 2, Admission(2 * m, deferred_w_limit(p, 2)))
            assert plan.makespan <= (1 + CHRONOS_SLOWDOWN) * uncapped.makespan
            if limit > 2:  # the cap is the smallest that keeps that pace
                with pytest.raises(PastDeadline):
                    list_schedule(p, m, 2, Admission(limit - 1, deferred_w_limit(p, 2)),
                                  deadline=(1 + CHRONOS_SLOWDOWN) * uncapped.makespan)  # fmt: skip
            chronos = run_unit(build_schedule("chronos", p, m, 2))
            assert chronos.makespan_s <= (1 + CHRONOS_SLOWDOWN) * run_unit(build_schedule("zbv", p, m, 2)).makespan_s
            if SCHEDULES["interleaved-1f1b"].check(p, m, 2) is None:
                assert chronos.makespan_s <= run_unit(build_schedule("interleaved-1f1b", p, m, 2)).makespan_s


@pytest.mark.parametrize(("p", "m"), [(4, 8), (8, 32)])
def test_chronos_uses_split_backward_because_full_b_is_slower_at_every_cap(p: int, m: int):
    """Full B runs forwards first (module docstring of sim.schedules.v_shape): at 1F1B's memory (cap 2p) it keeps
    1F1B's pace to within 1 %, uncapped it is interleaved 1F1B's makespan; split backward beats both."""
    split = list_schedule(p, m, 2, Admission(2 * m, deferred_w_limit(p, 2))).makespan
    interleaved = run_unit(build_schedule("interleaved-1f1b", p, m, 2)).makespan_s * 2  # in unit chunk passes
    one_f_one_b = run_unit(build_schedule("1f1b", p, m, 1)).makespan_s * 2
    at_1f1b_memory, uncapped = (list_schedule(p, m, 2, Admission(cap, 0, split_backward=False)).makespan
                                for cap in (2 * p, 2 * m))
    assert split < interleaved == uncapped <= at_1f1b_memory
    assert at_1f1b_memory <= 1.01 * one_f_one_b


# ---- the table in docs/schedules.md ----------------------------------------------------------------------------
# Unit costs per chunk (T_F = T_I = T_W = 1, activation 1): makespan, bubble ratio, peak chunk-activations on the
# fullest rank, and the mean and max wait from a chunk's F end to its B/I start.
DOCS_TABLE = {
    (4, 8): {
        ("1f1b", 1): (33.0, 0.273, 4, 5.12, 15.0),
        ("interleaved-1f1b", 2): (57.0, 0.158, 11, 17.47, 42.0),
        ("zbv", 2): (51.0, 0.059, 8, 14.62, 37.0),
        ("v-half", 2): (55.0, 0.127, 6, 7.84, 19.0),
        ("chronos", 2): (53.0, 0.094, 6, 7.52, 19.0),
        ("interleaved-1f1b", 4): (105.0, 0.086, 19, 35.73, 82.0),
        ("chronos", 4): (103.0, 0.068, 12, 15.1, 32.0),
    },
    (8, 32): {
        ("1f1b", 1): (117.0, 0.179, 8, 11.16, 35.0),
        ("interleaved-1f1b", 2): (213.0, 0.099, 23, 41.42, 102.0),
        ("zbv", 2): (199.0, 0.035, 16, 38.06, 109.0),
        ("v-half", 2): (213.0, 0.099, 10, 16.73, 36.0),
        ("chronos", 2): (205.0, 0.063, 10, 16.18, 36.0),
        ("interleaved-1f1b", 4): (405.0, 0.052, 39, 83.71, 198.0),
        ("chronos", 4): (403.0, 0.047, 20, 31.77, 72.0),
    },
}


def table_row(name: str, v: int, p: int, m: int) -> tuple[float, float, int, float, float]:
    res = simulate(build_schedule(name, p, m, v), make_costs(p, v, m))
    waits = activation_lifetimes(res)
    return (res.makespan_s, round(res.bubble_ratio, 3), int(res.peak_activation_bytes.max()),
            round(float(waits.mean()), 2), float(waits.max()))  # fmt: skip


@pytest.mark.parametrize("p_m", list(DOCS_TABLE))
def test_docs_table_is_what_the_engine_measures(p_m: tuple[int, int]):
    for (name, v), row in DOCS_TABLE[p_m].items():
        assert table_row(name, v, *p_m) == row, (name, v)


@pytest.mark.parametrize("v", [2, 4])
def test_admission_cap_and_stash_limit_bound_what_chronos_holds(v: int):
    """pipeline.admission_cap sets chronos' cap (V-Half's as cap and stash limit reproduces v-half's order at
    v = 2, V-Half's cap alone does not: W deferred as usual); with the stash
    limit at the cap too, activations in flight plus stashes waiting for W stay within the cap, where the
    default stash limit lets deferred W passes grow past it; a stash limit of 0 runs full B (no stash)."""
    for p, m in [(3, 6), (4, 8), (8, 32)]:
        half = v_half_limit(p)
        assert build_schedule("chronos", p, m, 2, half, half).ranks == build_schedule("v-half", p, m, 2).ranks
        assert build_schedule("chronos", p, m, 2, half).ranks != build_schedule("v-half", p, m, 2).ranks
    looser = False
    for p in (2, 4, 8):
        m = 2 * p
        for cap in sorted({v, 2 * v, p * v // 2, p * v}):
            held = max(in_flight_peak(r, Kind.W) for r in build_schedule("chronos", p, m, v, cap, cap).ranks)
            loose = max(in_flight_peak(r, Kind.W) for r in build_schedule("chronos", p, m, v, cap).ranks)
            assert held <= cap <= loose, (p, cap)
            looser |= loose > cap
            full_b = build_schedule("chronos", p, m, v, cap, 0)
            assert {a.kind for r in full_b.ranks for a in r} == {Kind.F, Kind.B}
            assert max(in_flight_peak(r, Kind.B) for r in full_b.ranks) <= cap
    assert looser
    with pytest.raises(ScheduleError, match=r"pipeline\.stash_limit"):
        build_schedule("zbv", 4, 8, 2, None, 4)
