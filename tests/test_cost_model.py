"""The analytical cost model against closed forms and published model sizes."""

from __future__ import annotations

import numpy as np
import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.sim.config import load_scenario
from pipeplan.sim.cost_model import bytes_per_param, layer_costs
from pipeplan.sim.costs import build_cost_table


def test_llama3_8b_parameter_count_matches_the_published_8_03b():
    sc = load_scenario()  # LLaMA-3 8B, tp=1
    table = build_cost_table(sc)
    assert table.params.sum() == 8_030_261_248


def test_layer_flops_and_activation_closed_forms():
    sc = load_scenario()
    m, b = sc.model, sc.training.micro_batch_size
    s, h, f, a = m.seq_len, m.hidden, m.ffn_hidden, m.heads
    h_kv = m.kv_heads * h // a
    lc = layer_costs(sc)
    linear = 2 * b * s * (h * (h + 2 * h_kv) + h * h + 3 * h * f)
    attn = 2 * b * s * s * h
    assert lc.forward_flops == linear + attn
    assert lc.backward_input_flops == linear + 2.5 * attn
    assert lc.backward_weight_flops == linear
    assert lc.activation_bytes == 2 * s * b * (6 * h + 2 * h_kv + 4 * f) + 4 * a * b * s


def test_tensor_parallel_divides_compute_and_memory():
    base = load_scenario()
    tp4 = load_scenario(None, {"parallel.tp": 4})
    one, four = layer_costs(base), layer_costs(tp4)
    assert four.forward_flops == pytest.approx(one.forward_flops / 4)
    assert four.activation_bytes == pytest.approx(one.activation_bytes / 4)  # sequence parallel on
    t1, t4 = build_cost_table(base), build_cost_table(tp4)
    assert t4.static_bytes.sum() < t1.static_bytes.sum() / 3.9
    assert (t4.forward_s > t1.forward_s / 4).all()  # all-reduces are not free


def test_megatron_bytes_per_parameter():
    sc = load_scenario()
    assert bytes_per_param(sc) == 18
    zero1 = load_scenario(None, {"training.distributed_optimizer": True, "parallel.dp": 4})
    assert bytes_per_param(zero1) == 6 + 12 / 4


def test_mfu_and_tokens_per_s_are_consistent():
    from pipeplan.sim.step import simulate_scenario

    # a flat calibration instead of the GEMM curve; no recomputation (its forwards are not model FLOPs)
    sc = load_scenario(None, {"device.efficiency": 0.55, "memory.recompute": "none"})
    res = simulate_scenario(sc)
    tokens = sc.pipeline.microbatches * sc.training.micro_batch_size * sc.model.seq_len
    assert res.tokens_per_s == pytest.approx(tokens / res.step_time_s)
    # at a flat efficiency, MFU = efficiency x (1 - bubble) x the share of busy time spent on model FLOPs (the
    # rest is memory-bound element-wise work, the loss and TP communication), up to P2P on the critical path
    table = res.costs
    flop_time = table.flops_per_microbatch / (table.gpus_per_rank * table.peak_flops_per_gpu * 0.55)
    busy_per_mb = float((table.forward_s + table.backward_input_s + table.backward_weight_s).sum())
    assert 0.85 < flop_time / busy_per_mb < 1.0
    pipeline_share = res.makespan_s / res.step_time_s  # the optimizer step after the pipeline does no model FLOPs
    assert res.mfu == pytest.approx(0.55 * (1 - res.bubble_ratio) * flop_time / busy_per_mb * pipeline_share,
                                    rel=0.01)


def test_explicit_scalars_broadcast_and_lists_stay_per_chunk():
    sc = load_scenario(scenario_path("explicit-unit"), {"costs.forward_s": [1.0, 2.0, 3.0, 4.0]})
    table = build_cost_table(sc)
    np.testing.assert_array_equal(table.forward_s, [1, 2, 3, 4])
    np.testing.assert_array_equal(table.backward_input_s, [1, 1, 1, 1])
    assert table.hbm_bytes == float("inf")
