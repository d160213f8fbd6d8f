"""torch.distributed.pipelining's per-microbatch P2P buffers (`pipeline.p2p_buffers`, sim/p2p_buffers.py),
checked against bytes counted by hand: one boundary tensor B = e·b·s·h/SP per buffer, m receive buffers per stage
and direction, the stage input inside one of them, each output (the last stage's logits) and each input
gradient kept until the step ends."""

from __future__ import annotations

import numpy as np
import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.analysis.cli import main
from pipeplan.sim.config import load_scenario
from pipeplan.sim.costs import build_cost_table
from pipeplan.sim.engine import simulate
from pipeplan.sim.errors import ScenarioError
from pipeplan.sim.memory import build_memory_plan
from pipeplan.sim.step import resolve_schedule

EIGHT_B = scenario_path("llama3-8b-pp4-h100")
# 4 stages of 2 layers, m = 6, TP 2 with sequence parallelism: B = 2 bytes x 1 x 8192 x 4096 / 2
SMALL = {"model.layers": 8, "pipeline.microbatches": 6, "parallel.tp": 2, "parallel.sequence_parallel": True}
M = 6
B = 2 * 1 * 8192 * 4096 / 2
LOGITS = 2 * 1 * 8192 * 128256 / 2  # the last stage's bf16 logits, vocabulary-sharded over TP 2


def run(mode: str, **extra):
    sc = load_scenario(EIGHT_B, {**SMALL, "pipeline.p2p_buffers": mode, **extra})
    costs, sched = build_cost_table(sc), resolve_schedule(sc)
    plan = build_memory_plan(sc, costs, sched)
    return sc, costs, plan, simulate(sched, costs, memory=plan)


@pytest.fixture(scope="module")
def both():
    return run("per-exchange"), run("per-microbatch")


def test_default_is_per_exchange():
    assert load_scenario(EIGHT_B).pipeline.p2p_buffers == "per-exchange"


def test_buffers_are_static_bytes_per_stage(both):
    """First stage: m gradient buffers; middle stages: m activation + m gradient buffers; last: m activation."""
    (_, ex, pex, _), (_, mb, pmb, _) = both
    assert mb.static_bytes - ex.static_bytes == pytest.approx([M * B, 2 * M * B, 2 * M * B, M * B])
    assert pmb.static_hbm_bytes - pex.static_hbm_bytes == pytest.approx([M * B, 2 * M * B, 2 * M * B, M * B])


def test_stage_input_lives_in_its_buffer_and_outputs_and_input_gradients_stay(both):
    (sc, ex, _, _), (_, mb, _, _) = both
    frag = 1 / (1 - sc.memory.fragmentation)
    assert ex.activation_bytes - mb.activation_bytes == pytest.approx([0, B * frag, B * frag, B * frag])
    assert mb.detail.forward_retained_bytes == pytest.approx([B * frag, B * frag, B * frag, LOGITS * frag])
    assert mb.detail.backward_retained_bytes == pytest.approx([0, B * frag, B * frag, B * frag])
    assert not ex.detail.forward_retained_bytes.any() and not ex.detail.backward_retained_bytes.any()


def test_engine_holds_outputs_and_input_gradients_to_the_step_end(both):
    """After the step every rank still holds its m outputs (the last rank its m logits) and, but the first, its
    m input gradients; the first stage's peak grows by its m gradient buffers and at most its m outputs."""
    (sc, _, _, rex), (_, _, _, rmb) = both
    frag = 1 / (1 - sc.memory.fragmentation)
    last_live = {rank: live for rank, _t, _hbm, _static, live, _d, _n in rmb.memory}
    expected = [M * B * frag, 2 * M * B * frag, 2 * M * B * frag, M * (LOGITS + B) * frag]
    assert [last_live[r] for r in range(4)] == pytest.approx(expected, abs=1.0)
    grown = rmb.peak_hbm_bytes[0] - rex.peak_hbm_bytes[0]
    assert M * B < grown <= M * B + M * B * frag * (1 + 1e-9)


@pytest.mark.parametrize("command", ["simulate", "show"])
def test_explicit_costs_refuse_per_microbatch_at_load(tmp_path, capsys, command):
    """The scenario validator refuses it (sim/config.py), so even `show`, which builds no simulation, exits 2."""
    scen = str(scenario_path("explicit-unit"))
    with pytest.raises(ScenarioError, match=r"pipeline\.p2p_buffers: 'per-microbatch' needs a \[model\] scenario"):
        load_scenario(scen, {"pipeline.p2p_buffers": "per-microbatch"})
    out = ["--out", str(tmp_path / "o")] if command == "simulate" else []
    code = main([command, scen, "--set", "pipeline.p2p_buffers=\"per-microbatch\"", *out])
    err = capsys.readouterr().err
    assert code == 2 and "pipeline.p2p_buffers" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_bad_value_exits_2_in_one_line(tmp_path, capsys):
    code = main(["simulate", str(EIGHT_B), "--set", "pipeline.p2p_buffers=\"per-step\"", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "pipeline.p2p_buffers" in err and "per-microbatch" in err and err.count("\n") == 1


def test_per_microbatch_keeps_time_unchanged(both):
    (_, _, _, rex), (_, _, _, rmb) = both
    assert rmb.makespan_s == rex.makespan_s
    assert np.array_equal(rmb.start_s, rex.start_s)
