"""Megatron-Core's layernorm recomputation (memory.recompute_norms): every layer not recomputed whole keeps its two
norm outputs out of its activations and redoes the norms before its backward, in the cost table, the simulator and
the memory MILP (the runtime's side: tests/test_runtime_recompute.py)."""

from __future__ import annotations

import numpy as np
import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.sim.activations import DTYPE_BYTES
from pipeplan.sim.config import load_scenario
from pipeplan.sim.cost_model import device_spec
from pipeplan.sim.costs import build_cost_table
from pipeplan.sim.engine import simulate
from pipeplan.sim.errors import ScenarioError
from pipeplan.sim.layer_ops import norms_forward_bytes
from pipeplan.sim.memory import build_memory_plan
from pipeplan.sim.step import resolve_schedule
from pipeplan.solver.step import resolve_memory_plan

SEVENTY = scenario_path("llama2-70b-48l-pp8-tp8-a100")
NORMS = {"memory.recompute_norms": True}


def _costs(overrides: dict, path=SEVENTY):
    sc = load_scenario(path, overrides)
    return sc, build_cost_table(sc)


@pytest.mark.parametrize("compile_", [True, False])
def test_the_cost_table_moves_the_norm_outputs_into_backward_time(compile_):
    """Each layer keeps its norm outputs' bytes less (2·e·sbh without SP; eager also each RMSNorm's fp32 copy of
    x) and its B/I redoes both norms, memory-bound; a whole-layer recomputation redoes the same total as before."""
    base = {"training.compile": compile_}
    sc, off = _costs(base)
    _, on = _costs({**base, **NORMS})
    m, tr = sc.model, sc.training
    e = DTYPE_BYTES[tr.dtype]
    sbh = tr.micro_batch_size * m.seq_len * m.hidden  # replicated over TP: no sequence parallelism here
    dropped = (2 * e + (0 if compile_ else 2 * 4)) * sbh / (1 - sc.memory.fragmentation)
    d_off, d_on = off.detail, on.detail
    assert np.allclose(d_off.layer_activation_bytes - d_on.layer_activation_bytes, dropped)
    assert np.allclose(d_on.layer_norm_output_bytes, dropped)
    assert np.allclose(d_on.recompute_working_bytes, d_off.layer_activation_bytes)
    assert np.allclose(off.activation_bytes - on.activation_bytes, d_on.layers * dropped)
    norm_s = norms_forward_bytes(sc) / device_spec(sc).hbm_bps
    assert np.allclose(on.backward_input_s - off.backward_input_s, d_on.layers * norm_s, rtol=1e-9, atol=0)
    assert np.allclose(on.forward_s, off.forward_s) and np.allclose(on.backward_weight_s, off.backward_weight_s)
    # recomputing a whole layer or op-level redoes the norms too: B/I's share comes off what they add
    assert np.allclose(d_on.layer_forward_s + norm_s, d_off.layer_forward_s)
    assert np.allclose(d_on.op_recompute_s + norm_s, d_off.op_recompute_s)


def test_full_recomputation_is_unchanged():
    """Under full recomputation the flag has nothing to drop: the same kept bytes, the same step to rounding."""
    res = {}
    for name, extra in (("off", {}), ("on", NORMS)):
        sc = load_scenario(SEVENTY, {"memory.recompute": "full", "model.layers": 96, **extra})
        costs, schedule = build_cost_table(sc), resolve_schedule(sc)
        res[name] = simulate(schedule, costs, memory=build_memory_plan(sc, costs, schedule))
    assert res["on"].makespan_s == pytest.approx(res["off"].makespan_s, rel=1e-12)
    assert np.allclose(res["on"].peak_hbm_bytes, res["off"].peak_hbm_bytes)


def test_it_buys_depth_for_about_one_percent_of_the_step():
    """On the shipped 70B setting a layer keeps a third fewer activation bytes for < 1.5 % more step time."""
    sc_off, off = _costs({})
    _, on = _costs(NORMS)
    schedule = resolve_schedule(sc_off)
    slower = simulate(schedule, on).makespan_s / simulate(schedule, off).makespan_s - 1
    assert 0 < slower < 0.015
    assert on.detail.layer_activation_bytes[0] / off.detail.layer_activation_bytes[0] == pytest.approx(2 / 3, abs=0.01)


def test_the_planner_plans_with_it():
    """A tight HBM: the MILP's plan with the norms recomputed is verified by simulation and never slower than
    the plan without (it has every plan of the flag off with fewer bytes per kept layer, for a little time)."""
    tight = {"model.layers": 96, "device.hbm_gib": 60.0, "memory.plan": True,
             "pipeline.schedule": "interleaved-1f1b", "pipeline.virtual_stages": 2}
    steps = {}
    for name, extra in (("off", {}), ("on", NORMS)):
        sc = load_scenario(SEVENTY, {**tight, **extra})
        costs, schedule = build_cost_table(sc), resolve_schedule(sc)
        planned = resolve_memory_plan(sc, costs, schedule, explain=False).planned
        assert planned is not None and not planned.simulated.oom_over_limit
        steps[name] = planned.simulated.makespan_s
    assert steps["on"] < steps["off"]


@pytest.mark.parametrize(("overrides", "path", "fragment"), [
    ({}, scenario_path("explicit-unit"), "needs a [model] scenario"),
    ({"parallel.tp_style": "dtensor", "parallel.sequence_parallel": True}, SEVENTY, 'tp_style = "dtensor"'),
])
def test_where_it_cannot_apply_the_scenario_is_refused(overrides, path, fragment):
    with pytest.raises(ScenarioError) as err:
        load_scenario(path, {**overrides, **NORMS})
    assert "memory.recompute_norms" in str(err.value) and fragment in str(err.value)
