"""Layer-granular copies (memory.copy_granularity = "layer", sim.graph.LayerCopy): hand-computed timelines in
the engine against whole-chunk copies of the same plan, the planner's plans with them, and the freeze planner
and the runtime refusing them in one line. (The step graph reproducing the engine with them, to 1e-12, is
tests/test_freeze_offload.py's "layers-*" cases over six schedules.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.analysis.cli import main
from pipeplan.sim.config import load_scenario
from pipeplan.sim.costs import build_cost_table
from pipeplan.sim.engine import simulate
from pipeplan.sim.graph import LayerCopy, layer_copy
from pipeplan.sim.ir import Action, Schedule
from pipeplan.sim.memory_plan import keep_everything
from pipeplan.sim.step import resolve_schedule

UNIT = scenario_path("explicit-unit")
SEVENTY = scenario_path("llama2-70b-48l-pp8-tp8-a100")


def one_rank(order: str):
    """Unit costs (F = I = W = 1 s, B = 2 s, 1 byte of activations per microbatch) on one rank running `order`."""
    costs = build_cost_table(load_scenario(UNIT, {"pipeline.stages": 1, "pipeline.microbatches": 1}))
    return Schedule("hand", 1, 1, (tuple(Action.parse(x) for x in order.split()),), (0,)), costs


def two_layers(costs, layers: bool, **arrays):
    """A plan over a 1 byte/s host link, prefetches issued at their consumer's own start (lookahead 0); with
    `layers`, copies move in pieces of half a chunk (a chunk of two layers)."""
    plan = dataclasses.replace(keep_everything(costs), host_link_bps=1.0, prefetch_lookahead=0,
                               **{k: np.array([v]) for k, v in arrays.items()})
    if layers:
        plan = dataclasses.replace(plan, copy_layers=np.array([2.0]), activation_piece_bytes=np.array([0.5]),
                                   stash_piece_bytes=plan.stash_bytes / 2)
    return plan


def timeline(res) -> tuple[list, list]:
    return ([(c.what, c.start_s, c.end_s) for c in res.copies], list(zip(res.start_s, res.end_s, strict=True)))


@pytest.mark.parametrize(("offloaded", "layers", "copies", "actions"), [
    # whole chunk: copy out after F (1-2), prefetch after it (2-3), B after the prefetch (3-5)
    (1.0, False, [("offload", 1.0, 2.0), ("prefetch", 2.0, 3.0)], [(0.0, 1.0), (3.0, 5.0)]),
    # both layers away: queued when layer 0 is done (0.5), ends at 1.5 (layer 1's piece, made at 1, takes 0.5);
    # the prefetch runs 1.5-2.5; B needs layer 1's piece (back at 2) before its first layer: 2-4
    (1.0, True, [("offload", 0.5, 1.5), ("prefetch", 1.5, 2.5)], [(0.0, 1.0), (2.0, 4.0)]),
    # whole chunk, half away: out 1-1.5, back 1.5-2, B 2-4
    (0.5, False, [("offload", 1.0, 1.5), ("prefetch", 1.5, 2.0)], [(0.0, 1.0), (2.0, 4.0)]),
    # layer 0 away: out 0.5-1, back 1-1.5; B reaches layer 0 at 2 > 1.5 and does not wait: 1-3
    (0.5, True, [("offload", 0.5, 1.0), ("prefetch", 1.0, 1.5)], [(0.0, 1.0), (1.0, 3.0)]),
])
def test_activation_copies_layer_by_layer(offloaded, layers, copies, actions):
    sched, costs = one_rank("0F0 0B0")
    res = simulate(sched, costs, memory=two_layers(costs, layers, offload_bytes=offloaded))
    assert timeline(res) == (copies, actions)
    assert res.stall_s[0] == actions[1][0] - 1.0  # B could start at 1, when F ends


@pytest.mark.parametrize(("layers", "copies", "actions"), [
    # whole chunk: I 1-2, stash copy 2-4, W's prefetch after it 4-6, W 6-7
    (False, [("stash-offload", 2.0, 4.0), ("stash-prefetch", 4.0, 6.0)], [(0.0, 1.0), (1.0, 2.0), (6.0, 7.0)]),
    # by layer: the stash of I's first layer (half of 4 bytes, 2 s) is copied from 1.5, when that layer is done,
    # to 3.5; back 3.5-5.5; W runs that layer last (from 5.5), so it starts at 5 and ends at 6
    (True, [("stash-offload", 1.5, 3.5), ("stash-prefetch", 3.5, 5.5)], [(0.0, 1.0), (1.0, 2.0), (5.0, 6.0)]),
])
def test_stash_copies_layer_by_layer(layers, copies, actions):
    sched, costs = one_rank("0F0 0I0 0W0")
    plan = two_layers(costs, layers, stash_bytes=4.0, stash_offload_bytes=2.0)
    assert timeline(simulate(sched, costs, memory=plan)) == (copies, actions)


def test_the_rule_in_numbers():
    """A 2.5-layer copy of a 4-layer chunk: k = 3 pieces, the first-needed half a piece (f = 0.5)."""
    _, costs = one_rank("0F0 0B0")
    plan = dataclasses.replace(two_layers(costs, True, offload_bytes=1.25), copy_layers=np.array([4.0]))
    lc = layer_copy(plan, 0, 1.25)
    assert lc == LayerCopy(4.0, 3, 0.25)
    # out, after an F of 4 s: queued at 1 (first layer), ends no earlier than 3 layers + 0.25 s
    assert lc.out_offsets(0.0, 4.0) == (1.0, 3.25)
    # in, before a B of 1 s recomputation + 4 s: start >= P0 + 0.25 + 3 - 5 (clamped to P0), >= P1 + 1 - 5
    assert lc.in_offsets(1.0, 5.0) == (0.0, -4.0)
    assert layer_copy(plan, 0, 0.0) is None  # an empty copy follows the chunk rule
    assert layer_copy(dataclasses.replace(plan, copy_layers=np.zeros(0)), 0, 1.25) is None


def test_one_layer_per_chunk_is_the_whole_chunk_rule():
    sched, costs = one_rank("0F0 0I0 0W0")
    whole = two_layers(costs, False, offload_bytes=0.5, stash_bytes=4.0, stash_offload_bytes=2.0)
    one = dataclasses.replace(whole, copy_layers=np.array([1.0]), activation_piece_bytes=np.array([1.0]),
                              stash_piece_bytes=np.array([4.0]))
    assert timeline(simulate(sched, costs, memory=one)) == timeline(simulate(sched, costs, memory=whole))


def test_layer_copies_never_slow_the_shipped_step():
    """The 70B scenario at 32 layers with half of every activation and stash offloaded, both granularities:
    layer by layer the step is shorter and nothing else (HBM peak aside) changes."""
    over = {"model.layers": 32, "pipeline.schedule": "zbv", "pipeline.virtual_stages": 2,
            "memory.offload_activations": 0.5, "memory.offload_stash": 0.5}
    runs = {}
    for granularity in ("chunk", "layer"):
        from pipeplan.sim.memory import build_memory_plan

        sc = load_scenario(SEVENTY, {**over, "memory.copy_granularity": granularity})
        costs, sched = build_cost_table(sc), resolve_schedule(sc)
        plan = build_memory_plan(sc, costs, sched)
        assert plan.layer_copies == (granularity == "layer")
        runs[granularity] = simulate(sched, costs, memory=plan)
    chunk, layer = runs["chunk"], runs["layer"]
    assert layer.makespan_s < chunk.makespan_s and layer.stall_s.sum() < chunk.stall_s.sum()
    assert len(layer.copies) == len(chunk.copies)
    assert layer.peak_hbm_bytes.max() <= chunk.peak_hbm_bytes.max() * (1 + 1e-9)


def test_planner_prices_layer_copies():
    """At HBM limits between the keep-everything peak (38.8 GiB) and the floor (16.4 GiB) the planner moves
    W stashes. With layer-wise copies its rows (module docstring of solver.memory_milp) predict the simulated
    step within 2%, and its plan is faster than the whole-chunk plan, whether that one's choice runs with
    whole-chunk copies or layer by layer."""
    from pipeplan.solver.memory_milp import plan_from_choice, plan_memory

    over = {"pipeline.stages": 4, "pipeline.microbatches": 8, "model.layers": 16, "pipeline.schedule": "zbv",
            "pipeline.virtual_stages": 2, "memory.prefetch_lookahead": 1, "memory.plan": True,
            "memory.offload_stash": "auto", "device.hbm_gib": 24,
            # whole-layer recomputation only: with op-level too, the whole-chunk plan's choice run layer by layer
            # comes out 0.2 % faster than the layer-wise plan, inside the MILP's 1 % gap
            "memory.plan_recompute": "full"}
    planned, sc = {}, {}
    for granularity in ("chunk", "layer"):
        sc[granularity] = load_scenario(SEVENTY, {**over, "memory.copy_granularity": granularity})
        costs, sched = build_cost_table(sc[granularity]), resolve_schedule(sc[granularity])
        planned[granularity] = plan_memory(sc[granularity], costs, sched)
    chunk, layer = planned["chunk"], planned["layer"]
    assert layer.plan.layer_copies and layer.plan.offloads_stash and not chunk.plan.layer_copies
    for p in (chunk, layer):
        assert p.simulated.makespan_s == pytest.approx(p.predicted_makespan_s, rel=0.02)
        assert p.simulated.peak_hbm_bytes.max() <= p.plan.hbm_limit_bytes * (1 + 1e-9)
    from pipeplan.sim.memory import keep_everything, with_states

    base = with_states(sc["layer"], costs, keep_everything(costs))
    chunk_choice_by_layer = simulate(sched, costs, memory=plan_from_choice(sc["layer"], costs, sched, base,
                                                                          chunk.choice, 1))
    assert layer.simulated.makespan_s < chunk_choice_by_layer.makespan_s < chunk.simulated.makespan_s


def test_freeze_planner_refuses_layer_copies_in_one_line(capsys, tmp_path):
    args = ["plan", str(SEVENTY), "--set", "memory.copy_granularity=layer", "--set", "memory.offload_activations=0.5",
            "--out", str(tmp_path / "x")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "memory.copy_granularity: the freeze planner prices whole-chunk copies" in err


def test_the_runtime_runs_layer_copies_with_its_one_copy_mechanism():
    """The runtime's copies move tensor by tensor either way (docs/runtime.md, "Copy granularity"): a layer-wise
    plan runs with the same per-chunk shares as the whole-chunk one (the e2e run: tests/test_runtime_cli.py)."""
    from pipeplan.runtime.memory import run_memory
    from pipeplan.sim.step import resolve_schedule

    keys = {"pipeline.schedule": "zbv", "pipeline.virtual_stages": 2, "memory.offload_activations": 0.5,
            "memory.offload_stash": 0.5}
    mems = {}
    for granularity in ("chunk", "layer"):
        sc = load_scenario(scenario_path("tiny-cpu"), {**keys, "memory.copy_granularity": granularity})
        mems[granularity] = run_memory(sc, resolve_schedule(sc))
    assert mems["layer"] == mems["chunk"]
    assert mems["layer"].stash_shares == [0.5] * 8 and all(c.offload_share > 0 for c in mems["layer"].chunks)
