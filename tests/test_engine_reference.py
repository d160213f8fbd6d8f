"""The engine against tests/reference_step.py, a walk of the step written independently from docs/simulator.md
(no step-graph or engine code): every registered schedule, random sizes and costs, free or queueing links,
blocking or overlapped sends, with and without a W stash; activation, W stash and weight offload on the copy
engines."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipeplan.sim.engine import simulate
from pipeplan.sim.errors import ScheduleError
from pipeplan.sim.memory_plan import keep_everything
from pipeplan.sim.schedules import SCHEDULES, build_schedule, schedule_names
from tests.conftest import make_costs
from tests.reference_step import Offload, reference_step


@st.composite
def steps(draw):
    """A schedule (any registered one), its sizes, per-chunk costs and link settings."""
    name = draw(st.sampled_from(schedule_names()))
    v = SCHEDULES[name].virtual_stages
    p = draw(st.integers(1, 4))
    m = p * draw(st.integers(1, 3)) + draw(st.sampled_from([0, 0, 1]))
    try:
        sched = build_schedule(name, p, m, v)
    except ScheduleError:
        assume(False)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = p * v
    costs = make_costs(p, v, m, f=rng.uniform(0.5, 2, n), i=rng.uniform(0.5, 2, n), w=rng.uniform(0, 1, n),
                       act=rng.uniform(1, 4, n), p2p=draw(st.sampled_from([0.0, 0.05, 0.4, 1.5])))
    stash = rng.uniform(0, 1, n) if draw(st.booleans()) else np.zeros(n)
    return sched, replace(costs, p2p_blocking=draw(st.booleans())), stash


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(steps())
def test_engine_matches_the_independent_reference(step):
    sched, costs, stash = step
    res = simulate(sched, costs, memory=replace(keep_everything(costs), stash_bytes=stash))
    ref = reference_step(sched, costs.forward_s, costs.backward_input_s, costs.backward_weight_s,
                         costs.activation_bytes, stash, costs.p2p_s, costs.p2p_blocking)
    assert res.makespan_s == pytest.approx(ref.makespan, rel=1e-9, abs=1e-12)
    by_name = {str(a): (ref.start[a], ref.end[a]) for a in ref.start}
    engine = {f"{s}{kd}{mb}": (b, e) for s, kd, mb, b, e in
              zip(res.stage, res.kind, res.microbatch, res.start_s, res.end_s, strict=True)}
    assert engine.keys() == by_name.keys()
    for a, (b, e) in engine.items():
        assert (b, e) == pytest.approx(by_name[a], rel=1e-9, abs=1e-12), a
    assert list(res.p2p_wait_s) == pytest.approx(ref.p2p_wait, rel=1e-9, abs=1e-9)
    assert list(res.peak_activation_bytes) == pytest.approx(ref.peak_activation, rel=1e-12, abs=1e-12)
    assert len(res.transfers) == ref.transfers


def test_the_reference_reproduces_a_hand_computed_queue():
    """Two ranks, 1F1B, p2p_s = 1.5 > F: the second activation waits for the first on the link."""
    sched = build_schedule("1f1b", 2, 2)
    costs = make_costs(2, 1, 2, f=1, i=1, w=1, p2p=1.5)
    ref = reference_step(sched, costs.forward_s, costs.backward_input_s, costs.backward_weight_s,
                         costs.activation_bytes, np.zeros(2), 1.5)
    # rank 0: 0F0 [0, 1] arrives 2.5, 0F1 [1, 2] queues behind it and arrives 4; rank 1: 1F0 [2.5, 3.5],
    # 1B0 [3.5, 5.5] arrives 7, 1F1 [5.5, 6.5], 1B1 [6.5, 8.5] arrives 10; rank 0: 0B0 [7, 9], 0B1 [10, 12]
    assert {str(a): (ref.start[a], ref.end[a]) for a in ref.start} == {
        "0F0": (0, 1), "0F1": (1, 2), "0B0": (7, 9), "0B1": (10, 12),
        "1F0": (2.5, 3.5), "1B0": (3.5, 5.5), "1F1": (5.5, 6.5), "1B1": (6.5, 8.5),
    }  # fmt: skip
    assert simulate(sched, costs).makespan_s == ref.makespan == 12


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(steps(), st.integers(0, 2**32 - 1), st.integers(1, 4), st.booleans(), st.booleans())
def test_engine_offload_matches_the_independent_reference(step, seed, lookahead, act_copies, stash_copies):
    """Activation (and W stash) offload on the copy engines: pinned buffers, prefetch issue points, FIFO
    streams shared by both kinds."""
    sched, costs, stash = step
    rng = np.random.default_rng(seed)
    act = costs.activation_bytes
    stash = stash * 5  # stash copies as long as activation copies, so their pinned buffers bind too
    off = act * rng.uniform(0.1, 0.9, len(act)) if act_copies else np.zeros(len(act))
    stash_off = stash * rng.uniform(0.1, 0.9, len(act)) if stash_copies else np.zeros(len(act))
    bandwidth = float(rng.uniform(0.3, 3.0))  # copies from a fraction of a forward to several
    plan = replace(keep_everything(costs), offload_bytes=off, host_link_bps=bandwidth, prefetch_lookahead=lookahead,
                   stash_bytes=stash, stash_offload_bytes=stash_off)
    res = simulate(sched, costs, memory=plan)
    assume(off.any() or stash_off.any())
    copies = Offload(sched, act, off if off.any() else None, bandwidth, lookahead, stash,
                     stash_off if stash_off.any() else None)
    ref = reference_step(sched, costs.forward_s, costs.backward_input_s, costs.backward_weight_s, act, stash,
                         costs.p2p_s, costs.p2p_blocking, copies)
    engine = {f"{s}{kd}{mb}": (b, e) for s, kd, mb, b, e in
              zip(res.stage, res.kind, res.microbatch, res.start_s, res.end_s, strict=True)}
    for a in ref.start:
        assert engine[str(a)] == pytest.approx((ref.start[a], ref.end[a]), rel=1e-9, abs=1e-9), a
    assert res.makespan_s == pytest.approx(ref.makespan, rel=1e-9, abs=1e-12)
    assert list(res.stall_s) == pytest.approx(ref.stall, rel=1e-9, abs=1e-9)
    assert list(res.peak_hbm_bytes) == pytest.approx(ref.peak_hbm, rel=1e-9, abs=1e-9)
    order = {key: [f"{what} {x}" for what, x in items] for key, items in (res.copy_order() or {}).items()}
    assert order == ref.copies


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(steps(), st.integers(0, 2**32 - 1), st.integers(1, 3), st.booleans())
def test_engine_weight_offload_matches_the_independent_reference(step, seed, lookahead, act_copies):
    """Weight offload (with or without activation offload): windows, the boundary, h2d FIFO order, HBM peaks."""
    sched, costs, _ = step
    rng = np.random.default_rng(seed)
    act, n = costs.activation_bytes, len(costs.activation_bytes)
    off = act * rng.uniform(0.1, 0.9, n) if act_copies else np.zeros(n)
    weights = rng.uniform(0.5, 3.0, n)
    static = weights + rng.uniform(0, 2, n)
    bandwidth = float(rng.uniform(0.3, 3.0))
    plan = replace(keep_everything(costs), offload_bytes=off, host_link_bps=bandwidth, prefetch_lookahead=lookahead,
                   weight_offload_bytes=weights, static_hbm_bytes=static)
    res = simulate(sched, costs, memory=plan)
    per_rank = np.zeros(sched.num_ranks)
    np.add.at(per_rank, list(sched.stage_to_rank), static)
    copies = Offload(sched, act, off if off.any() else None, bandwidth, lookahead, weights=weights, static=per_rank)
    ref = reference_step(sched, costs.forward_s, costs.backward_input_s, costs.backward_weight_s, act,
                         np.zeros(n), costs.p2p_s, costs.p2p_blocking, copies)
    engine = {f"{s}{kd}{mb}": (b, e) for s, kd, mb, b, e in
              zip(res.stage, res.kind, res.microbatch, res.start_s, res.end_s, strict=True)}
    for a in ref.start:
        assert engine[str(a)] == pytest.approx((ref.start[a], ref.end[a]), rel=1e-9, abs=1e-9), a
    assert list(res.stall_s) == pytest.approx(ref.stall, rel=1e-9, abs=1e-9)
    assert list(res.peak_hbm_bytes) == pytest.approx(ref.peak_hbm, rel=1e-9, abs=1e-9)
    order = {key: [f"{what} {x}" for what, x in items] for key, items in (res.copy_order() or {}).items()}
    assert order == ref.copies
