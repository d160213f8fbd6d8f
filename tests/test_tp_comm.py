"""TP collectives per pass and their overlap modes (sim/tp_comm.py), and DTensor TP's saved inputs.

Hand-computable numbers: a device with a flat GEMM efficiency of 1 and near-infinite HBM bandwidth, so a GEMM
takes 2MNK / peak; a link with no latency, so a collective takes (t - 1)/t · bytes / bandwidth."""

from __future__ import annotations

import pytest
from pipeplan.scenarios import SCENARIO_DIR

from pipeplan.sim.comm import Link
from pipeplan.sim.config import load_scenario
from pipeplan.sim.errors import ScenarioError
from pipeplan.sim.layer_ops import _gemms, layer_times
from pipeplan.sim.roofline import DeviceSpec
from pipeplan.sim.tp_comm import Collective, layer_collectives, pass_with_comm_s

TT70B = SCENARIO_DIR / "validation" / "torchtitan-llama3.1-70b-fsdp32-tp8.toml"
PEAK = 1e15
DEV = DeviceSpec(peak_flops=PEAK, hbm_bps=1e18, sm_count=1, gemm_efficiency=1.0, attention_efficiency=1.0,
                 flat_efficiency=1.0)
LINK = Link(bytes_per_s=1e11, latency_s=0.0)
T = 8
GEMM = (8192.0, 8192.0, 8192.0)
G = 2 * 8192**3 / PEAK  # 1.0995 ms, on the whole and in 8 row chunks alike


def _sc(**overrides):
    return load_scenario(TT70B, {"parallel.tp_style": "dtensor", **overrides})


def _megatron(**overrides):
    return load_scenario(TT70B, {"parallel.tp_style": "megatron", "training.loss_impl": "fused", **overrides})


def _bytes_for(comm_s: float) -> float:
    return comm_s * LINK.bytes_per_s * T / (T - 1)


@pytest.mark.parametrize("comm_s, none, full, async_tp", [
    # copies shorter than the 7 chunks they hide behind: async-tp hides them all
    (0.5e-3, G + 0.5e-3, G, G),
    # copies longer than the GEMM: full overlap leaves C - G; async-tp also pays the one chunk it cannot hide
    (2e-3, G + 2e-3, 2e-3, 2e-3 + G / T),
])
def test_a_fused_all_gather_hides_all_but_one_chunk(comm_s, none, full, async_tp):
    ag = [Collective("all-gather", _bytes_for(comm_s), (GEMM,), True)]
    for mode, expected in (("none", none), ("full", full), ("async-tp", async_tp)):
        sc = _sc(**{"parallel.tp_comm_overlap": mode})
        assert pass_with_comm_s(sc, G, ag, LINK, 2, DEV) == pytest.approx(expected, rel=1e-9), mode


def test_a_fused_reduce_scatter_also_pays_the_sum_of_the_partials():
    """fused_matmul_reduce_scatter sums the t stacked partials in one kernel: reads e·M·N, writes e·M·N/t."""
    dev = DeviceSpec(peak_flops=PEAK, hbm_bps=1e12, sm_count=1, gemm_efficiency=1.0, attention_efficiency=1.0,
                     flat_efficiency=1.0)
    tall = (32768.0, 8192.0, 8192.0)  # M / 8 = 4096 rows: each chunk stays compute-bound at 1 TB/s
    g = 2 * 32768 * 8192 * 8192 / PEAK
    rs = [Collective("reduce-scatter", _bytes_for(2 * g), (tall,), True)]
    reduction = 2 * 32768 * 8192 * (1 + 1 / T) / 1e12
    sc = _sc(**{"parallel.tp_comm_overlap": "async-tp"})
    assert pass_with_comm_s(sc, g, rs, LINK, 2, dev) == pytest.approx(2 * g + g / T + reduction, rel=1e-9)


def test_unfused_collectives_stay_exposed_under_async_tp():
    c = [Collective("reduce-scatter", _bytes_for(0.5e-3), (GEMM,), False)]
    sc = _sc(**{"parallel.tp_comm_overlap": "async-tp"})
    assert pass_with_comm_s(sc, G, c, LINK, 2, DEV) == pytest.approx(G + 0.5e-3, rel=1e-9)


def test_which_collectives_torchs_pass_fuses():
    """Forward: all four; backward: the two all-gathers of dY, and the reduce-scatters of dX only where one
    GEMM produces them (GPT's fused QKV and fc1, not LLaMA's wq/wk/wv and w1/w3, whose gradients are summed)."""
    llama = layer_collectives(_sc(), _gemms(_sc()))
    assert [(c.kind, c.fusable) for c in llama["F"]] == [
        ("all-gather", True), ("reduce-scatter", True), ("all-gather", True), ("reduce-scatter", True)]
    assert [(c.kind, c.fusable) for c in llama["I"]] == [
        ("all-gather", True), ("all-gather", True), ("reduce-scatter", False), ("reduce-scatter", False)]
    assert llama["W"] == []  # DTensor saves the gathered input: nothing to gather again
    gpt = _sc(**{"model.architecture": "gpt"})
    assert all(c.fusable for c in layer_collectives(gpt, _gemms(gpt))["I"])
    megatron = _megatron()
    assert [c.kind for c in layer_collectives(megatron, _gemms(megatron))["W"]] == ["all-gather"] * 2
    no_sp = _sc(**{"parallel.sequence_parallel": False})
    assert {(c.kind, c.fusable) for p in ("F", "I") for c in layer_collectives(no_sp, _gemms(no_sp))[p]} == {
        ("all-reduce", False)}


def test_float8_dtensor_gathers_move_one_byte_per_element():
    """torchao's PrepareFloat8ModuleInput / Float8ColwiseParallel cast before the all-gather, and
    Float8RowwiseParallel casts dY before its backward all-gather; the reduce-scatters stay bf16."""
    sc = _sc()  # the 70B file: Float8 linears, bf16, micro batch 16 x 8192 tokens, h = 8192
    elements = 16 * 8192 * 8192
    colls = layer_collectives(sc, _gemms(sc))
    assert {(c.kind, c.nbytes) for p in ("F", "I") for c in colls[p]} == {
        ("all-gather", elements), ("reduce-scatter", 2 * elements)}
    megatron = _megatron()
    assert {c.nbytes for c in layer_collectives(megatron, _gemms(megatron))["F"]} == {2 * elements}


def test_async_tp_lies_between_no_overlap_and_full_overlap():
    from pipeplan.sim.comm import build_links, tp_link
    from pipeplan.sim.cost_model import device_spec

    times = {}
    for mode in ("none", "async-tp", "full"):
        sc = _sc(**{"parallel.tp_comm_overlap": mode})
        lt = layer_times(sc, device_spec(sc), tp_link(sc, build_links(sc, sc.device.resolved())))
        times[mode] = lt.forward_s + lt.backward_input_s
    assert times["none"] > times["async-tp"] > times["full"]


def test_overlap_keeps_accepting_booleans_and_async_tp_needs_dtensor():
    assert _megatron(**{"parallel.tp_comm_overlap": True}).parallel.tp_comm_overlap == "full"
    assert _megatron(**{"parallel.tp_comm_overlap": False}).parallel.tp_comm_overlap == "none"
    with pytest.raises(ScenarioError, match="tp_style"):
        _megatron(**{"parallel.tp_comm_overlap": "async-tp"})


def test_async_tp_needs_sequence_parallelism():
    """Without SP there is no all-gather or reduce-scatter for the pass to fuse: refused, not silently "none"."""
    with pytest.raises(ScenarioError, match="sequence_parallel"):
        _sc(**{"parallel.tp_comm_overlap": "async-tp", "parallel.sequence_parallel": False})
    assert _sc(**{"parallel.tp_comm_overlap": "async-tp", "parallel.tp": 1,
                  "parallel.sequence_parallel": False}).parallel.tp_comm_overlap == "async-tp"


SBH = 16 * 8192 * 8192  # the 70B file's micro batch 16 x 8,192 tokens x hidden 8,192


def test_dtensor_keeps_the_gathered_qkv_and_mlp_inputs_at_the_gathers_element_size():
    """Megatron keeps the two e-byte shards (e·sbh/t each); DTensor the gathered tensors the matmuls were fed:
    bf16 (e·sbh), or with Float8 linears the float8 tensors torchao gathered (1·sbh), in the activations and
    in a split backward's W stash alike. With Float8 the row-parallel inputs are float8 too (torchao's
    Float8RowwiseParallel casts them): the down-projection's f/t-wide input at 1 byte, not e, and beside flash
    attention's e-byte output the out-proj's float8 copy (h/t); a W stash keeps both inputs at 1 byte."""
    from pipeplan.sim.activations import layer_memory

    f_over_h = 28672 / 8192
    row_act = (-f_over_h + 1) / 8  # (1 - e)·sbf/t + 1·sbh/t, in units of sbh
    row_stash = -(1 + f_over_h) / 8  # (1 - e)·sb(h + f)/t
    for overrides, per_input, act, stash in (({}, 1 - 2 / 8, row_act, row_stash),
                                             ({"training.float8_linears": False}, 2 * (1 - 1 / 8), 0.0, 0.0)):
        dtensor, megatron = layer_memory(_sc(**overrides)), layer_memory(_megatron(**overrides))
        assert dtensor.activation - megatron.activation == pytest.approx((2 * per_input + act) * SBH)
        assert dtensor.weight_stash - megatron.weight_stash == pytest.approx((2 * per_input + stash) * SBH)


def test_dtensor_lm_head_keeps_its_gathered_bf16_input():
    """torchtitan's "output" plan is ColwiseParallel(input_layouts=Shard(1)), not Float8: the head saves the
    gathered bf16 input, e·sbh, where Megatron keeps e·sbh/t; the last chunk's activations and W stash both
    hold it."""
    from pipeplan.sim.costs import build_cost_table

    dtensor, megatron = build_cost_table(_sc()), build_cost_table(_megatron())
    lm_dt, lm_mg = (float(c.detail.layer_activation_bytes[-1]) for c in (dtensor, megatron))  # fragmentation in
    frag = 1 / (1 - _sc().memory.fragmentation)
    layers = dtensor.detail.layers[-1]
    head = 2 * SBH * (1 - 1 / 8) * frag
    assert (dtensor.activation_bytes[-1] - megatron.activation_bytes[-1]
            == pytest.approx(layers * (lm_dt - lm_mg) + head))
    stash_dt = dtensor.detail.weight_stash_bytes[-1] - megatron.detail.weight_stash_bytes[-1]
    row = -(1 + 28672 / 8192) / 8 * SBH  # the row-parallel inputs at 1 byte (Float8RowwiseParallel), as above
    assert stash_dt == pytest.approx(layers * (2 * (1 - 2 / 8) * SBH + row) * frag + head)


@pytest.mark.parametrize("style,sp", [("megatron", True), ("dtensor", True), ("megatron", False)])
def test_lm_head_and_embedding_pay_their_tp_collectives(style, sp):
    """Each pass of the head and the embedding is slower than with a free link by exactly its collectives' ring
    times (no overlap): with SP the embedding reduce-scatters its output and all-gathers dY, the head all-gathers
    its input and reduce-scatters dX (Megatron gathers the input again for dW); without SP the embedding
    all-reduces its output and the head its dX. Every one moves the e-byte stream, 2·sbh."""
    from pipeplan.sim.comm import all_gather_s, all_reduce_s
    from pipeplan.sim.cost_model import device_spec
    from pipeplan.sim.layer_ops import head_times

    over = {"parallel.tp_comm_overlap": "none", "parallel.sequence_parallel": sp}
    sc = _sc(**over) if style == "dtensor" else _megatron(**over)
    dev = device_spec(sc)
    slow, free = head_times(sc, dev, LINK), head_times(sc, dev, Link(bytes_per_s=1e30, latency_s=0.0))
    ag, ar = all_gather_s(2 * SBH, T, LINK), all_reduce_s(2 * SBH, T, LINK)
    regather = ag if style == "megatron" and sp else 0.0
    expected = ((ag, ag, regather, ag, ag) if sp else (0.0, ar, 0.0, ar, 0.0))
    got = (slow.forward_s - free.forward_s, slow.backward_input_s - free.backward_input_s,
           slow.backward_weight_s - free.backward_weight_s, slow.embedding_forward_s - free.embedding_forward_s,
           slow.embedding_backward_s - free.embedding_backward_s)
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)
