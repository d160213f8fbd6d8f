"""Chronos-Offload of weights: a chunk's bf16 working weights leave HBM between uses (sim.graph.weight_windows),
in the engine, the step graph and the memory MILP."""

from __future__ import annotations

import numpy as np
import pytest

from scenarios import scenario_path
from sim.config import load_scenario
from sim.costs import build_cost_table
from sim.engine import simulate
from sim.errors import ScenarioError
from sim.graph import weight_windows
from sim.ir import Kind
from sim.memory import build_memory_plan
from sim.step import resolve_schedule

SEVENTY = scenario_path("llama2-70b-48l-pp8-tp8-a100")
# one microbatch through a V: rank 0 runs F0, F15, I15, W15, I0, W0, so chunk 0 is idle while the V turns
ONE_MB = {"pipeline.schedule": "v-half", "pipeline.virtual_stages": 2, "pipeline.microbatches": 1,
          "model.layers": 32, "memory.prefetch_lookahead": 1}


def _run(overrides):
    sc = load_scenario(SEVENTY, overrides)
    costs = build_cost_table(sc)
    schedule = resolve_schedule(sc)
    plan = build_memory_plan(sc, costs, schedule)
    return schedule, plan, simulate(schedule, costs, memory=plan)


def test_windows_follow_the_lookahead():
    schedule, *_ = _run(ONE_MB)
    windows = weight_windows(schedule, 1)
    rank0 = [(w.chunk, w.release_after, w.next_use, w.issuer) for w in windows if w.chunk in (0, 15)]
    # chunk 0: out after F0 (node 0), back for I0 (node 4), fetched as W15 (node 3) starts; both out after their
    # last use; chunk 15 is used back to back, so only its step-boundary window exists
    assert rank0 == [(0, 0, 4, 3), (0, 5, -1, -1), (15, 3, -1, -1)]
    assert not [w for w in weight_windows(schedule, 3) if w.chunk == 0 and w.next_use >= 0]  # gap 4 <= 3 + 1


def test_peak_falls_by_the_weights_away_at_the_peak():
    _, _, kept = _run({**ONE_MB, "memory.offload_weights": "none"})
    _, plan, away = _run({**ONE_MB, "memory.offload_weights": "all"})
    # rank 0 peaks during 15I0 in both runs, inside chunk 0's window: exactly chunk 0's bf16 weights less
    assert kept.peak_at[0].during == away.peak_at[0].during == "15I0"
    assert kept.peak_hbm_bytes[0] - away.peak_hbm_bytes[0] == pytest.approx(plan.weight_offload_bytes[0], rel=1e-12)
    assert (away.peak_hbm_bytes <= kept.peak_hbm_bytes + 1e-6).all()
    # the host keeps the copy: DRAM grows by the offloaded weights
    assert away.peak_dram_bytes.sum() - kept.peak_dram_bytes.sum() == pytest.approx(plan.weight_offload_bytes.sum())


def test_copy_time_appears_when_the_link_cannot_hide_it():
    fast = _run({**ONE_MB, "memory.offload_weights": "all"})
    slow_link = {**ONE_MB, "memory.offload_weights": "all", "device.host_link_gbps": 0.5}
    _, plan, slow = _run(slow_link)
    _, _, slow_kept = _run({**slow_link, "memory.offload_weights": "none"})
    assert fast[2].stall_s.sum() == 0
    assert slow.stall_s.sum() > 0
    assert slow.step_time_s > slow_kept.step_time_s
    fetches = [c for c in slow.copies if c.what == "weights"]
    assert fetches and all(c.action.kind in (Kind.F, Kind.I, Kind.B, Kind.W) for c in fetches)
    for c in fetches:
        assert c.end_s - c.start_s == pytest.approx(plan.weight_offload_bytes[c.stage] / plan.host_link_bps)


def test_host_optimizer_keeps_the_weights_there():
    states = {"memory.optimizer": "dram", "memory.master_weights": "dram"}
    _, kept, _ = _run({**ONE_MB, **states})
    _, away, _ = _run({**ONE_MB, **states, "memory.offload_weights": "all"})
    # the update writes the weights on the host: the step's weights-back copy is gone (fetched at next use)
    np.testing.assert_allclose(away.step_h2d_bytes, kept.step_h2d_bytes - away.weight_offload_bytes)


def test_auto_needs_the_planner():
    with pytest.raises(ScenarioError, match=r"memory\.offload_weights"):
        load_scenario(SEVENTY, {"memory.offload_weights": "auto"})


def test_memory_milp_offloads_weights_when_it_pays():
    """HBM set half of chunk 0's weights below the keep-everything peak: offloading those weights (hidden
    behind compute) is the cheapest way to fit, cheaper than recomputing or offloading any activation; with
    room to spare the planner offloads nothing."""
    from solver.memory_milp import plan_memory

    *_, kept = _run(ONE_MB)
    _, chunk0_plan, chunk0 = _run({**ONE_MB, "memory.offload_weights": [c == 0 for c in range(16)]})
    margin = load_scenario(SEVENTY, ONE_MB).memory.hbm_margin_gib
    auto = {**ONE_MB, "memory.plan": True, "memory.offload_weights": "auto"}
    for limit, offloads in ((kept.peak_hbm_bytes.max() * 1.01, False),
                            (kept.peak_hbm_bytes.max() - 0.5 * chunk0_plan.weight_offload_bytes[0], True)):
        sc = load_scenario(SEVENTY, {**auto, "device.hbm_gib": limit / 2**30 + margin})
        planned = plan_memory(sc, build_cost_table(sc), resolve_schedule(sc))
        assert planned.choice.weight_mask.tolist() == [offloads] + [False] * 15
        assert not planned.recompute_layers.any() and not planned.dram_layers.any()
        expected = chunk0 if offloads else kept
        assert planned.simulated.makespan_s == pytest.approx(expected.makespan_s, rel=1e-12)
        assert planned.simulated.peak_hbm_bytes.max() <= limit


# ---- the runtime: parameters leave the device between uses, results bit for bit ----------------------------
def _zbv_one_rank(offload_weights):
    import torch

    from runtime.executor import PipelineExecutor
    from runtime.model import ModelArgs
    from runtime.p2p import P2P
    from runtime.stages import build_chunk, layer_ranges
    from sim.schedules import build_schedule
    from tests.test_runtime_model import batches

    args = ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab=256, seq_len=16)
    cpu = torch.device("cpu")
    sched = build_schedule("zbv", 1, 4, 2)  # one rank holding both chunks of the V
    torch.manual_seed(0)
    chunks = {s: build_chunk(args, s, layer_ranges([2, 2]), cpu) for s in range(2)}
    p2p = P2P(sched, 0, (2, args.seq_len, args.dim), torch.float32, cpu)
    ex = PipelineExecutor(sched, 0, chunks, p2p, cpu, offload_weights=offload_weights, weight_lookahead=1)
    traces = [ex.run_step(batches(4, step)) for step in range(2)]  # two steps: the host copy is refreshed
    grads = {(s, n): p.grad.clone() for s, c in chunks.items() for n, p in c.named_parameters()}
    return sched, ex, traces, grads


def test_runtime_weight_offload_is_bit_identical_and_follows_the_windows():
    import torch

    sched, _, plain_traces, plain_grads = _zbv_one_rank(None)
    _, ex, traces, grads = _zbv_one_rank([True, True])
    assert [t.losses for t in traces] == [t.losses for t in plain_traces]
    assert grads.keys() == plain_grads.keys()
    assert all(torch.equal(grads[k], plain_grads[k]) for k in grads)
    # the executed events are the simulator's windows, step after step
    windows = weight_windows(sched, 1)
    expected = []
    for w in windows:
        expected.append(("release", w.release_after, w.chunk))  # -1: at the step's start
        if w.next_use >= 0:
            expected += [("prefetch", w.issuer, w.chunk), ("ready", w.next_use, w.chunk)]
    restored = [("restore", -1, c) for c in sorted({w.chunk for w in windows})]
    step_log = ex.weights.log[: len(ex.weights.log) // 2]
    assert sorted(e for e in step_log if e[0] != "restore") == sorted(expected)
    assert [e for e in step_log if e[0] == "restore"] == restored
    assert step_log == ex.weights.log[len(ex.weights.log) // 2:]
    # a chunk never runs while its weights are away
    away = set()
    for pos, a in enumerate(sched.ranks[0]):
        for what, at, c in step_log:
            if at == pos and what == "ready":
                away.discard(c)
        assert a.stage not in away
        for what, at, c in step_log:
            if at == pos and what == "release":
                away.add(c)
