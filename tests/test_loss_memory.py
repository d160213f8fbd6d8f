"""The memory of the loss and the LM head: the cross entropy's working set (sim/overheads.py
`loss_transient_bytes`), how it meets recomputation, and what a split backward keeps for the head's W."""

from __future__ import annotations

import pytest
from pipeplan.scenarios import SCENARIO_DIR

from pipeplan.sim.config import load_scenario
from pipeplan.sim.overheads import loss_transient_bytes

TT70B = SCENARIO_DIR / "validation" / "torchtitan-llama3.1-70b-fsdp32-tp8.toml"
LOGITS_PER_RANK = 16 * 8192 * 128256 / 8  # micro batch 16 x 8,192 tokens, vocabulary over TP 8


def _sc(**overrides):
    return load_scenario(TT70B, overrides)


def test_torch_cross_entropy_holds_12_bytes_per_logit_and_16_under_loss_parallel():
    """Beside the 4 bytes kept: fused e + 4; torch's 8 (nll and log_softmax gradients); loss_parallel's 12."""
    assert loss_transient_bytes(_sc(**{"training.loss_impl": "fused"})) == pytest.approx(6 * LOGITS_PER_RANK)
    assert loss_transient_bytes(_sc(**{"training.loss_impl": "torch-fp32"})) == pytest.approx(12 * LOGITS_PER_RANK)
    one = _sc(**{"training.loss_impl": "torch-fp32", "parallel.tp": 1, "parallel.sequence_parallel": False})
    assert loss_transient_bytes(one) == pytest.approx(8 * 16 * 8192 * 128256)


def test_the_last_chunk_holds_the_larger_of_the_loss_and_a_recomputed_layer_not_both():
    """Autograd runs the loss and LM-head backward, frees their buffers, then reaches the last checkpointed
    layer: under full recomputation the last chunk's B holds max(loss, one layer's activations)."""
    from pipeplan.sim.costs import build_cost_table
    from pipeplan.sim.memory import build_memory_plan
    from pipeplan.sim.step import resolve_schedule

    sc = _sc()  # full recomputation, torch's loss under loss_parallel
    costs = build_cost_table(sc)
    plan = build_memory_plan(sc, costs, resolve_schedule(sc))
    frag = 1 / (1 - sc.memory.fragmentation)
    loss = 12 * LOGITS_PER_RANK * frag
    layer = float(costs.detail.layer_activation_bytes[-1])
    assert loss > layer  # here the loss is the larger: 30 GB against one layer's 11 GB
    assert plan.transient_bytes[-1] == pytest.approx(loss)
    small = _sc(**{"training.micro_batch_size": 1, "model.vocab": 1024})
    small_costs = build_cost_table(small)
    small_plan = build_memory_plan(small, small_costs, resolve_schedule(small))
    assert small_plan.transient_bytes[-1] == pytest.approx(float(small_costs.detail.layer_activation_bytes[-1]))


def test_a_split_backward_keeps_the_lm_heads_input_and_logit_gradient_for_w():
    """The last chunk's W stash adds the LM head's input (e·sbh/SP) and the logits' gradient (e·sbV/t) to its
    layers' (pipeplan's own runtime measured them: tests/test_runtime_cli.py)."""
    from pipeplan.sim.costs import build_cost_table

    sc = load_scenario(SCENARIO_DIR / "tiny-cpu.toml", {"pipeline.layers_per_stage": "even"})
    d = build_cost_table(sc).detail
    per_layer = d.weight_stash_bytes[0] / d.layers[0]
    m, tr = sc.model, sc.training
    e = {"fp32": 4, "bf16": 2, "fp16": 2}[tr.dtype]
    head = e * tr.micro_batch_size * m.seq_len * (m.hidden + m.vocab)  # tp = 1
    frag = 1 / (1 - sc.memory.fragmentation)
    assert d.weight_stash_bytes[-1] == pytest.approx(d.layers[-1] * per_layer + head * frag)
