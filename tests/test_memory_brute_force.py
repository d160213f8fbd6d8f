"""The memory MILP against brute force: every keep / recompute / offload plan of a small instance (2 ranks,
4 microbatches, 1-2 layers per chunk) simulated by the engine, which is the truth.

Per instance the HBM limit is set between the smallest and the largest simulated peak, so it binds; the MILP,
solved to a 0% gap, must then find a plan as fast as the fastest plan that fits, and its plan must
re-simulate within 0.1% of its predicted step. The plans enumerated: per chunk, layers recomputed whole (k)
and offloaded to DRAM (d), the chunk's non-layer activations (LM head and loss, embedding output) kept or
offloaded (h), and the W stash's share offloaded (u) on a grid where the scenario lets the MILP choose it
("auto") or at the scenario's share. The MILP may choose a continuous u (and h) off the grid, so it may only
be faster than the enumerated best, never slower.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.sim.config import load_scenario
from pipeplan.sim.costs import build_cost_table
from pipeplan.sim.engine import simulate
from pipeplan.sim.memory import keep_everything, with_states
from pipeplan.sim.step import resolve_schedule
from pipeplan.solver import memory_milp
from pipeplan.solver.memory_milp import MemoryChoice, head_activation_bytes, plan_from_choice, plan_memory

SEVENTY = scenario_path("llama2-70b-48l-pp8-tp8-a100")
# states already on the host (no per-rank choice), whole-layer recomputation only, weights kept: the
# activations' and the stash's choices are what is enumerated
SMALL = {"pipeline.stages": 2, "pipeline.microbatches": 4, "memory.optimizer": "dram",
         "memory.master_weights": "dram", "memory.plan": True, "memory.plan_recompute": "full",
         "memory.offload_weights": "none"}
ONE_CHUNK = {"model.layers": 4, "pipeline.virtual_stages": 1}  # 2 layers per chunk
TWO_CHUNKS = {"model.layers": 4, "pipeline.virtual_stages": 2}  # 1 layer per chunk

# (schedule, sizes, memory overrides, stash shares enumerated (of the chunk's layers))
EXACT = {
    "gpipe": ("gpipe", ONE_CHUNK, {}, (0.0,)),
    "1f1b": ("1f1b", ONE_CHUNK, {}, (0.0,)),
    "interleaved-1f1b": ("interleaved-1f1b", TWO_CHUNKS, {}, (0.0,)),
    "chronos": ("chronos", TWO_CHUNKS, {}, (0.0,)),
    "zb-h1 stash auto": ("zb-h1", ONE_CHUNK, {"memory.offload_stash": "auto"}, (0.0, 0.5, 1.0)),
    "zbv stash 1.0": ("zbv", TWO_CHUNKS, {"memory.offload_stash": 1.0}, (1.0,)),
    "v-half": ("v-half", TWO_CHUNKS, {}, (0.0,)),
    "zb-2p stash kept": ("zb-2p", ONE_CHUNK, {}, (0.0,)),
}
# the MILP's residency rule counts a copy in flight as whole for the positions it may span; the engine's
# timing can free it sooner (a stash copied out before the next action starts, a prefetch queued behind a
# slower one on the h2d engine): there the MILP is an upper bound (docs/memory.md, "Memory per position")
OVER_COUNTED = {
    "zb-2p stash 1.0": ("zb-2p", ONE_CHUNK, {"memory.offload_stash": 1.0}, (1.0,)),
    "zb-2p stash 1.0, layer copies": ("zb-2p", ONE_CHUNK, {"memory.offload_stash": 1.0,
                                                           "memory.copy_granularity": "layer"}, (1.0,)),
}


def every_plan(sc, stash_shares):
    """(makespan, peak HBM, choice) of every enumerated plan, each simulated by the engine."""
    costs, sched = build_cost_table(sc), resolve_schedule(sc)
    base = with_states(sc, costs, keep_everything(costs))
    layers = costs.detail.layers
    n = costs.num_chunks
    heads = [(0.0, 1.0) if e > 0 and sc.memory.copy_granularity == "chunk" else (0.0,)
             for e in head_activation_bytes(costs)]
    per_chunk = [[(k, d, h, u * L) for k in range(int(L) + 1) for d in range(int(L) + 1 - k) for h in hs
                  for u in stash_shares] for L, hs in zip(layers, heads, strict=True)]
    plans = []
    for combo in itertools.product(*per_chunk):
        k, d, h, u = (np.array(x, float) for x in zip(*combo, strict=True))
        choice = MemoryChoice(k, d, np.zeros(n), np.zeros(sched.num_ranks, bool), np.zeros(n, bool), u,
                              head_share=h)
        res = simulate(sched, costs, memory=plan_from_choice(sc, costs, sched, base, choice,
                                                             sc.memory.prefetch_lookahead))
        plans.append((res.makespan_s, float(res.peak_hbm_bytes.max()), choice))
    return plans, base.hbm_limit_bytes


def limited(overrides, limit_bytes):
    """The scenario with capacity - margin = `limit_bytes`."""
    # the margin pinned at 0 (the default is a share of capacity), so the capacity is the limit itself
    return load_scenario(SEVENTY, {**overrides, "memory.hbm_margin_gib": 0.0, "device.hbm_gib": limit_bytes / 2**30})


def instance(schedule, sizes, memory, stash_shares, tightness):
    """The scenario with its HBM limit `tightness` of the way from the least to the greatest simulated peak,
    and the fastest enumerated plan that fits it (a plan's peak does not depend on the limit)."""
    overrides = {**SMALL, **sizes, **memory, "pipeline.schedule": schedule}
    plans, _ = every_plan(load_scenario(SEVENTY, overrides), stash_shares)
    peaks = np.array([peak for _t, peak, _c in plans])
    limit = peaks.min() + tightness * (peaks.max() - peaks.min())
    fitting = [t for t, peak, _c in plans if peak <= limit]
    assert min(t for t, _p, _c in plans) < min(fitting)  # the limit binds: the fastest plan does not fit
    return limited(overrides, limit), min(fitting)


def head_instance(schedule, sizes):
    """The first limit, going up through the plans' peaks, where offloading a chunk's non-layer activations
    makes the fastest fitting plan faster, and that plan's step."""
    overrides = {**SMALL, **sizes, "pipeline.schedule": schedule}
    plans, _ = every_plan(load_scenario(SEVENTY, overrides), (0.0,))
    for limit in sorted({peak for _t, peak, _c in plans}):
        fitting = [(t, c) for t, peak, c in plans if peak <= limit]
        best = min(t for t, _c in fitting)
        if best < min((t for t, c in fitting if not c.head_offload_share.any()), default=math.inf):
            return limited(overrides, limit * (1 + 1e-6)), best  # a hair above: the MILP keeps 2e-6 GiB clear
    raise AssertionError("the head's offload never matters here")


@pytest.fixture
def exact_milp(monkeypatch):
    """The MILP solved to a 0% gap (the planner's default stops at 1%)."""
    monkeypatch.setitem(memory_milp.MILP_OPTIONS, "mip_rel_gap", 0.0)


@pytest.mark.parametrize("tightness", [0.3, 0.7])
@pytest.mark.parametrize("name", list(EXACT))
def test_milp_finds_the_brute_force_best(name, tightness, exact_milp):
    sc, best = instance(*EXACT[name], tightness)
    planned = plan_memory(sc, build_cost_table(sc), resolve_schedule(sc))
    assert planned.simulated.makespan_s == pytest.approx(best, rel=1e-9) or planned.simulated.makespan_s < best
    assert planned.simulated.makespan_s == pytest.approx(planned.predicted_makespan_s, rel=1e-3)


@pytest.mark.parametrize("name", list(OVER_COUNTED))
def test_milp_over_counts_copies_in_flight(name, exact_milp):
    """Where the engine's timing frees a stash sooner than the MILP's positions can tell, the MILP finds no
    plan although some fit. Recorded so that an exact residency model turns this test red on purpose."""
    sc, _best = instance(*OVER_COUNTED[name], 0.5)
    with pytest.raises(memory_milp.MemoryInfeasibleError):
        plan_memory(sc, build_cost_table(sc), resolve_schedule(sc), explain=False)


def test_the_head_offload_is_a_choice_that_matters(exact_milp):
    """Interleaved 1F1B, one layer per chunk, at a limit where only offloading the first chunk's embedding
    output or the last chunk's LM head and loss reaches the best step: the MILP's h_c finds it (per-layer
    choices could not; offload_activations = 1 could, with every layer)."""
    sc, best = head_instance("interleaved-1f1b", {"model.layers": 4, "pipeline.virtual_stages": 2})
    planned = plan_memory(sc, build_cost_table(sc), resolve_schedule(sc))
    assert planned.choice.head_offload_share.any()
    assert planned.simulated.makespan_s == pytest.approx(best, rel=1e-9) or planned.simulated.makespan_s < best


@pytest.mark.xfail(strict=True, reason="activation copies in flight over-counted (docs/memory.md, 'Memory per "
                   "position'): the MILP keeps the head in HBM where the engine's offload of it fits and is faster")
def test_milp_finds_the_head_offload_where_copies_overlap(exact_milp):
    sc, best = head_instance("zbv", {"model.layers": 4, "pipeline.virtual_stages": 2})
    planned = plan_memory(sc, build_cost_table(sc), resolve_schedule(sc))
    assert planned.simulated.makespan_s <= best * (1 + 1e-9)
