"""Schedule generators against ground truth: torch's validator, torch's dry run, torch's own orders, and the
published closed forms for memory and bubble."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as ts

from pipeplan.sim.errors import ScheduleError
from pipeplan.sim.ir import Action, Kind, Schedule
from pipeplan.sim.schedules import SCHEDULES, build_schedule, schedule_names
from pipeplan.sim.schedules.interleaved import microbatches_per_round

# (schedule, virtual_stages) pairs the generators accept, and the sizes swept for each.
ALLOWED_V = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
             ("interleaved-1f1b", 4), ("zb-h1", 1), ("zbv", 2)]  # fmt: skip
RANKS = range(1, 9)
MICROBATCHES = (1, 2, 3, 4, 5, 7, 8, 9, 12, 16)


def sizes(name: str, v: int) -> Iterator[tuple[int, int]]:
    """Every (p, m) of the sweep that `name`'s check allows at v."""
    schedule_names()  # registers the built-ins
    for p in RANKS:
        for m in MICROBATCHES:
            if SCHEDULES[name].check(p, m, v) is None:
                yield p, m


def in_flight_peak(actions: tuple[Action, ...], freed_by: Kind) -> int:
    """Most forwards run along a rank's order whose `freed_by` pass has not run yet."""
    live = peak = 0
    for a in actions:
        if a.kind is Kind.F:
            live += 1
            peak = max(peak, live)
        elif a.kind is freed_by:
            live -= 1
    return peak


def makespan(sched: Schedule, cost: dict[Kind, float]) -> float:
    """Step time with free communication: each rank runs its order, every pass as soon as its inputs exist."""
    last = sched.num_stages - 1
    grad = Kind.I if sched.uses_split_backward else Kind.B  # the pass that sends the input gradient
    end: dict[Action, float] = {}
    free = [0.0] * sched.num_ranks
    pos = [0] * sched.num_ranks
    while sum(pos) < sched.num_actions:
        progressed = False
        for r, actions in enumerate(sched.ranks):
            while pos[r] < len(actions):
                a = actions[pos[r]]
                s, mb = a.stage, a.microbatch
                if a.kind is Kind.F:
                    deps = [Action(s - 1, Kind.F, mb)] if s > 0 else []
                elif a.kind is Kind.W:
                    deps = [Action(s, Kind.I, mb)]
                else:  # B or I: needs its forward and the gradient from the next stage
                    deps = [Action(s, Kind.F, mb)]
                    if s < last:
                        deps.append(Action(s + 1, grad, mb))
                if any(d not in end for d in deps):
                    break
                end[a] = free[r] = max([free[r]] + [end[d] for d in deps]) + cost[a.kind]
                pos[r] += 1
                progressed = True
        assert progressed, f"{sched.name}: ranks wait on each other at positions {pos}"
    return max(free)


def torch_stand_in_stages(p: int, num_stages: int, local: int) -> list[SimpleNamespace]:
    # torch's schedule classes only read these attributes of a stage when building their order, so no
    # process group or model is needed.
    return [
        SimpleNamespace(num_stages=num_stages, group_size=p, group_rank=0, stage_index=i, submod=None)
        for i in range(local)
    ]


def torch_order(name: str, p: int, m: int, v: int) -> dict[int, list[str]]:
    """torch's own per-rank compute order for the same schedule (raises ValueError where torch refuses)."""
    if name == "gpipe":
        order = ts.ScheduleGPipe(torch_stand_in_stages(p, p, 1)[0], m).pipeline_order
    elif name == "1f1b":
        order = ts.Schedule1F1B(torch_stand_in_stages(p, p, 1)[0], m).pipeline_order
    elif name == "interleaved-1f1b":
        order = ts.ScheduleInterleaved1F1B(torch_stand_in_stages(p, p * v, v), m).pipeline_order
    elif name == "zb-h1":  # torch's ZB1P with one stage per rank is ZB-H1
        order = ts.ScheduleInterleavedZeroBubble(torch_stand_in_stages(p, p, 1), m).pipeline_order
    elif name == "zbv":
        order = ts.ScheduleZBVZeroBubble(torch_stand_in_stages(p, 2 * p, 2), m).pipeline_order
    else:
        raise KeyError(name)
    compute = {ts.F, ts.B, ts.I, ts.W}  # drop idle steps and REDUCE_GRAD
    return {r: [str(a) for a in acts if a and a.computation_type in compute] for r, acts in order.items()}


def test_registry_lists_the_builtin_schedules():
    assert set(schedule_names()) >= {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv"}
    assert all(spec.summary for spec in SCHEDULES.values())


def assert_torch_accepts(name: str, p: int, m: int, v: int) -> None:
    """torch's validator accepts the schedule with our stage->rank map, and its dry run makes progress."""
    sched = build_schedule(name, p, m, v)
    assert (sched.num_ranks, sched.num_stages, sched.num_microbatches) == (p, p * v, m)
    mapping = ts._validate_schedule(sched.to_torch(), p, p * v, m)
    assert tuple(mapping[s] for s in range(p * v)) == sched.stage_to_rank
    stage_to_rank = sched.stage_to_rank.__getitem__
    with_comms = ts._add_send_recv(sched.to_torch(), stage_to_rank=stage_to_rank, num_stages=p * v)
    # torch's dry run raises if the ranks' sends and receives cannot all make progress.
    ts._simulate_comms_compute(with_comms, stage_to_rank=stage_to_rank, num_stages=p * v)


@pytest.mark.parametrize(("name", "v"), ALLOWED_V)
def test_torch_validator_accepts_and_dry_run_progresses(name: str, v: int):
    for p, m in sizes(name, v):
        assert_torch_accepts(name, p, m, v)


@pytest.mark.parametrize(("name", "v"), ALLOWED_V)
def test_same_order_as_torch(name: str, v: int):
    compared = 0
    for p, m in sizes(name, v):
        if name == "1f1b" and m < p:
            continue  # torch's Schedule1F1B refuses m < p; ours warms up with min(p-1-i, m)
        try:
            expected = torch_order(name, p, m, v)
        except ValueError:
            # torch's ZB1P keeps its v >= 2 rule (m a multiple of max(1, m // p)) at v = 1, where it is moot.
            assert name == "zb-h1"
            continue
        if name == "1f1b":
            # torch's Schedule1F1B._get_pipeline_order numbers the last rank's forwards 1..m (its runtime,
            # `_step_microbatches`, runs 0..m-1): compare that rank with the numbering fixed.
            last = [Action.parse(text) for text in expected[p - 1]]
            expected[p - 1] = [str(a if a.kind is not Kind.F else Action(a.stage, a.kind, a.microbatch - 1))
                               for a in last]  # fmt: skip
        ours = build_schedule(name, p, m, v)
        assert {r: [str(a) for a in acts] for r, acts in enumerate(ours.ranks)} == expected, (p, m)
        compared += 1
    assert compared >= 20


def test_checks_allow_exactly_the_documented_sizes():
    allowed_v = {"gpipe": {1}, "1f1b": {1}, "zb-h1": {1}, "zbv": {2}, "interleaved-1f1b": {2, 3, 4, 5}}
    for name, vs in allowed_v.items():
        for v in range(1, 6):
            for p in RANKS:
                for m in range(1, 20):
                    ok = v in vs and (name != "interleaved-1f1b" or m % max(1, m // p) == 0)
                    assert (SCHEDULES[name].check(p, m, v) is None) == ok, (name, p, m, v)


def test_interleaved_refuses_exactly_where_torch_does():
    for p in RANKS:
        for m in range(1, 3 * p + 2):
            try:
                torch_order("interleaved-1f1b", p, m, 2)
                torch_refuses = False
            except ValueError:
                torch_refuses = True
            assert (SCHEDULES["interleaved-1f1b"].check(p, m, 2) is not None) == torch_refuses, (p, m)


@pytest.mark.parametrize(
    ("name", "p", "m", "v", "message"),
    [
        ("gpipe", 4, 8, 2, r"'gpipe' needs pipeline.virtual_stages = 1 \(got 2\)"),
        ("1f1b", 4, 8, 3, r"'1f1b' needs pipeline.virtual_stages = 1 \(got 3\)"),
        ("interleaved-1f1b", 4, 8, 1, r"needs pipeline.virtual_stages >= 2 \(got 1\)"),
        ("interleaved-1f1b", 4, 9, 2, r"needs pipeline.microbatches to be a multiple of .* = 2 \(got 9\)"),
        ("zb-h1", 4, 8, 2, r"'zb-h1' needs pipeline.virtual_stages = 1 \(got 2\)"),
        ("zbv", 4, 8, 1, r"'zbv' needs pipeline.virtual_stages = 2 \(got 1\)"),
        ("zbv", 4, 8, 3, r"'zbv' needs pipeline.virtual_stages = 2 \(got 3\)"),
        ("1f1b", 4, 0, 1, r"microbatches .* must all be >= 1"),
        ("nope", 4, 8, 1, r"pipeline.schedule: unknown schedule 'nope'; allowed: .*1f1b"),
    ],
)
def test_build_schedule_refuses_with_the_field_named(name: str, p: int, m: int, v: int, message: str):
    with pytest.raises(ScheduleError, match=message):
        build_schedule(name, p, m, v)


@pytest.mark.parametrize("m", [1, 3, 4, 8, 16])
def test_1f1b_rank_i_holds_at_most_min_p_minus_i_m_and_gpipe_holds_m(m: int):
    p = 4
    one_f_one_b = build_schedule("1f1b", p, m)
    assert [in_flight_peak(r, Kind.B) for r in one_f_one_b.ranks] == [min(p - i, m) for i in range(p)]
    assert [in_flight_peak(r, Kind.B) for r in build_schedule("gpipe", p, m).ranks] == [m] * p


def test_interleaved_rank_i_holds_its_warmup_plus_one_chunks():
    for p, m, v in [(4, 8, 2), (4, 6, 3), (2, 3, 4), (8, 16, 2), (3, 2, 2)]:
        r = microbatches_per_round(p, m)
        sched = build_schedule("interleaved-1f1b", p, m, v)
        expected = [min((v - 1) * r + 2 * (p - 1 - i) + 1, m * v) for i in range(p)]
        assert [in_flight_peak(acts, Kind.B) for acts in sched.ranks] == expected


def test_zero_bubble_keeps_1f1b_memory():
    for p in RANKS:
        for m in MICROBATCHES:
            zb_h1 = build_schedule("zb-h1", p, m)
            # I frees what 1F1B's B frees; the deferred W passes keep at most one extra microbatch's worth.
            assert [in_flight_peak(r, Kind.I) for r in zb_h1.ranks] == [min(p - i, m) for i in range(p)]
            assert max(in_flight_peak(r, Kind.W) for r in zb_h1.ranks) == min(p, m)
            # ZB-V: at most 2p half-size chunks, i.e. 1F1B's p microbatches on rank 0.
            assert max(in_flight_peak(r, Kind.W) for r in build_schedule("zbv", p, m, 2).ranks) <= 2 * p


# ---- published bubbles, with per-chunk costs and free communication -----------------------------------
FULL = {Kind.F: 1.0, Kind.B: 2.0}


@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 2), (4, 4), (4, 8), (8, 16), (4, 2)])
def test_1f1b_and_gpipe_bubble_is_p_minus_1_forward_backwards(p: int, m: int):
    for name in ("gpipe", "1f1b"):
        assert makespan(build_schedule(name, p, m), FULL) == (m + p - 1) * 3.0


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 3), (3, 9, 2)])
def test_interleaved_bubble_is_p_minus_1_over_v(p: int, m: int, v: int):
    # (m + (p-1)/v) * v * (T_F + T_B), per-chunk costs; holds when m is a multiple of p.
    assert makespan(build_schedule("interleaved-1f1b", p, m, v), FULL) == (m + (p - 1) / v) * v * 3.0


@pytest.mark.parametrize(("t_f", "t_i", "t_w"), [(1, 1, 1), (2, 2, 1), (1, 2, 1), (3, 2, 1), (1, 1, 0.5)])
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_i_minus_w(t_f: float, t_i: float, t_w: float):
    cost = {Kind.F: t_f, Kind.I: t_i, Kind.W: t_w, Kind.B: t_i + t_w}
    for p, m in [(2, 2), (4, 4), (4, 8), (8, 8), (8, 20)]:
        work = m * (t_f + t_i + t_w)
        assert makespan(build_schedule("1f1b", p, m), cost) == work + (p - 1) * (t_f + t_i + t_w)
        assert makespan(build_schedule("zb-h1", p, m), cost) == work + (p - 1) * (t_f + t_i - t_w)


@pytest.mark.parametrize(("p", "m"), [(1, 2), (2, 4), (4, 8), (4, 12), (8, 16), (8, 24)])
def test_zbv_with_equal_passes_idles_only_while_the_first_forward_reaches_the_last_rank(p: int, m: int):
    # T_F = T_I = T_W = 1 per chunk, m >= 2p: rank p-1 cannot start before time p-1, and nothing else idles.
    unit = {Kind.F: 1.0, Kind.I: 1.0, Kind.W: 1.0}
    assert makespan(build_schedule("zbv", p, m, 2), unit) == 2 * m * 3 + (p - 1)
