"""ZB-2p against ground truth: torch's validator and dry run, the zero-bubble closed form, its memory bound."""

from __future__ import annotations

import pytest

from pipeplan.sim.ir import Kind
from pipeplan.sim.schedules import build_schedule
from tests.test_schedules import MICROBATCHES, RANKS, assert_torch_accepts, in_flight_peak, makespan

COSTS = [(1, 1, 1), (2, 2, 1), (1, 2, 1), (3, 2, 1), (1, 1, 0.5)]


def test_torch_validator_accepts_and_dry_run_progresses():
    for p in RANKS:
        for m in MICROBATCHES:
            assert_torch_accepts("zb-2p", p, m, 1)


@pytest.mark.parametrize(("t_f", "t_i", "t_w"), COSTS)
def test_with_2p_microbatches_only_the_first_forward_reaching_the_last_rank_idles(t_f, t_i, t_w):
    # the paper's "zero bubble": a parallelogram, rank i busy from i*T_F for m(T_F + T_I + T_W)
    cost = {Kind.F: t_f, Kind.I: t_i, Kind.W: t_w, Kind.B: t_i + t_w}
    for p, m in [(2, 4), (4, 8), (4, 16), (8, 16), (8, 24)]:
        assert makespan(build_schedule("zb-2p", p, m), cost) == m * (t_f + t_i + t_w) + (p - 1) * t_f


@pytest.mark.parametrize(("t_f", "t_i", "t_w"), COSTS)
def test_never_slower_than_zb_h1(t_f, t_i, t_w):
    cost = {Kind.F: t_f, Kind.I: t_i, Kind.W: t_w, Kind.B: t_i + t_w}
    for p in RANKS:
        for m in MICROBATCHES:
            assert makespan(build_schedule("zb-2p", p, m), cost) <= makespan(build_schedule("zb-h1", p, m), cost)


def test_rank_i_warms_up_with_2_p_minus_i_minus_1_forwards_and_keeps_at_most_2p_in_flight():
    for p in RANKS:
        for m in MICROBATCHES:
            sched = build_schedule("zb-2p", p, m)
            assert [in_flight_peak(r, Kind.I) for r in sched.ranks] == [min(2 * (p - i) - 1, m) for i in range(p)]
            assert max(in_flight_peak(r, Kind.W) for r in sched.ranks) <= 2 * p
