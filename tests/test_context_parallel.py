"""Context parallelism (issue #41 item 5, sim/context_parallel.py): a cp rank is the seq_len / cp scenario with the
cp ranks as data parallelism, plus attention over the other ranks' keys and the exposed K/V exchange."""

from __future__ import annotations

import numpy as np
import pytest

from pipeplan.sim.comm import all_gather_s, build_links
from pipeplan.sim.config import parse_scenario
from pipeplan.sim.context_parallel import cp_link, kv_chunk_bytes, kv_exchange_s, local_scenario
from pipeplan.sim.cost_model import device_spec
from pipeplan.sim.costs import build_cost_table
from pipeplan.sim.errors import ScenarioError
from pipeplan.sim.layer_ops import attention_core_s

S = 16384


def llama(seq=S, cp=1, dp=2, tp=2, training=None, parallel=None, interconnect=None):
    return parse_scenario({
        "pipeline": {"stages": 2, "microbatches": 4},
        "model": {"layers": 8, "hidden": 4096, "ffn_hidden": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256,
                  "seq_len": seq},
        "training": {"micro_batch_size": 1, **(training or {})},
        "parallel": {"tp": tp, "dp": dp, "cp": cp, **(parallel or {})},
        "device": {"preset": "H100-SXM-80GB"},
        "interconnect": interconnect or {},
    })


def test_a_cp_rank_holds_the_activations_and_states_of_the_local_scenario():
    sc = llama(seq=2 * S, cp=2, dp=1)
    cp, local = build_cost_table(sc), build_cost_table(llama(seq=S, cp=1, dp=2))
    assert np.allclose(cp.activation_bytes, local.activation_bytes)
    assert np.allclose(cp.static_bytes, local.static_bytes)
    assert cp.tokens_per_microbatch * cp.data_parallel == 2 * S * 1  # every token of the step counted once
    assert np.allclose(cp.backward_weight_s, local.backward_weight_s)  # W has no attention


def test_attention_over_the_other_ranks_keys_with_a_free_link():
    """With an unbounded link the ring hides every transfer: F grows by (cp - 1) local attention cores a layer."""
    fast = {"intra_node_gbps": 1e9, "intra_node_latency_us": 0, "inter_node_gbps": 1e9, "inter_node_latency_us": 0}
    cp = 4
    sc = llama(seq=cp * S, cp=cp, dp=1, interconnect=fast)
    local = local_scenario(sc)
    attn_f, attn_i = attention_core_s(local, device_spec(sc))
    got, base = build_cost_table(sc), build_cost_table(local)
    layers = got.detail.layers
    assert np.allclose(got.forward_s - base.forward_s, layers * (cp - 1) * attn_f)
    assert np.allclose(got.backward_input_s - base.backward_input_s, layers * (cp - 1) * attn_i)


def test_exposed_kv_exchange_closed_forms():
    slow = {"intra_node_gbps": 1.0, "inter_node_gbps": 1.0}  # 1 GB/s: every transfer exposed
    for comm in ("p2p-ring", "all-gather"):
        sc = llama(seq=4 * S, cp=4, dp=1, parallel={"cp_comm": comm}, interconnect=slow)
        local, dev = local_scenario(sc), device_spec(sc)
        links = build_links(sc, sc.device.resolved())
        link, chunk = cp_link(sc, links), kv_chunk_bytes(sc)
        step_f, step_i = attention_core_s(local, dev)
        f, i = kv_exchange_s(sc, local, dev, links)
        if comm == "p2p-ring":
            assert f == pytest.approx(3 * (link.transfer_s(chunk) - step_f))
            assert i == pytest.approx(3 * (2 * link.transfer_s(chunk) - step_i))
        else:
            gather = all_gather_s(4 * chunk, 4, link)
            assert f == pytest.approx(gather - step_f)
            assert i == pytest.approx(gather - step_i + all_gather_s(4 * chunk * 2, 4, link))  # fp32 dK, dV
    # K and V of s / cp tokens: 8 kv heads over TP 2, head dim 128, bf16
    assert kv_chunk_bytes(llama(seq=4 * S, cp=4)) == 2 * 2 * S * 4 * 128


def test_cp_group_within_a_node_while_tp_times_cp_fits():
    links = build_links(llama(), llama().device.resolved())
    assert cp_link(llama(seq=4 * S, cp=4, tp=2), links) is links.intra
    assert cp_link(llama(seq=8 * S, cp=8, tp=2), links) is links.inter


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"seq": S, "cp": 2, "training": {"attention": "eager"}}, "flash"),
    ({"seq": 1000, "cp": 8}, "2 x cp"),
])
def test_bad_context_parallel_settings_name_the_field(kwargs, match):
    with pytest.raises(ScenarioError, match=match):
        build_cost_table(llama(**kwargs))


def test_model_flops_count_the_other_ranks_keys():
    """A CP rank's model FLOPs per microbatch: the local scenario's plus (cp - 1) local attention cores a layer,
    forward and the flash backward's 2.5x, on each of the tp ranks."""
    from pipeplan.sim.layer_ops import FLASH_BACKWARD, layer_flops

    sc = llama(seq=4 * S, cp=4, dp=1)
    local = local_scenario(sc)
    extra = 2 * 8 * 3 * layer_flops(local).attention_forward * (1 + FLASH_BACKWARD)  # tp 2, 8 layers, cp - 1
    assert build_cost_table(sc).flops_per_microbatch == pytest.approx(
        build_cost_table(local).flops_per_microbatch + extra)
