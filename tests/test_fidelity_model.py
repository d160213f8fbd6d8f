"""The issue-12 cost model against independent numbers: Korthikanti et al.'s closed forms, Megatron-LM's
parameter and memory formulas, Narayanan et al.'s FLOP count, hand-computed collectives and rooflines."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pipeplan.sim.activations import layer_memory
from pipeplan.sim.comm import Link, all_gather_s, all_reduce_s, build_links, dp_link, p2p_link, tp_link
from pipeplan.sim.config import load_scenario, parse_scenario
from pipeplan.sim.cost_model import bytes_per_param, device_spec, p2p_transfer_s
from pipeplan.sim.costs import build_cost_table
from pipeplan.sim.errors import ScenarioError
from pipeplan.sim.layer_ops import attention_core_s
from pipeplan.sim.layer_split import balanced_split, even_split
from pipeplan.sim.roofline import FLASH_CAUSAL_TFLOPS, flash_shape_factor, gemm_efficiency, wave_efficiency
from pipeplan.sim.step import simulate_scenario

# GPT-3 175B as Korthikanti et al. Table 3 run it: a = 96, h = 12288, L = 96, s = 2048, t = 8, p = 8, b = 1
GPT175 = {"architecture": "gpt", "layers": 96, "hidden": 12288, "heads": 96, "vocab": 51200, "seq_len": 2048}


def _raw_gpt(model=None, training=None, parallel=None, pipeline=None, memory=None, device=None) -> dict:
    return {
        "pipeline": {"stages": 8, "microbatches": 8, **(pipeline or {})},
        "model": {**GPT175, **(model or {})},
        "training": {"attention": "eager", "dropout": 0.1, **(training or {})},
        "parallel": {"tp": 8, "sequence_parallel": False, **(parallel or {})},
        "device": {"preset": "A100-80GB", **(device or {})},
        "memory": memory or {},
    }


def gpt(model=None, training=None, parallel=None, pipeline=None, memory=None, device=None):
    return parse_scenario(_raw_gpt(model, training, parallel, pipeline, memory, device))


SBH = 2048 * 1 * 12288
S2 = 5 * 96 * 2048 / 12288  # 5as/h


@pytest.mark.parametrize(("parallel", "expected"), [
    ({"tp": 1}, 34 + S2),  # Table 2, no parallelism
    ({"tp": 8}, 10 + 24 / 8 + S2 / 8),  # tensor parallel
    ({"tp": 8, "sequence_parallel": True}, 34 / 8 + S2 / 8),  # tensor + sequence parallel
])
def test_activation_bytes_are_korthikanti_table_2(parallel, expected):
    assert layer_memory(gpt(parallel=parallel)).activation == pytest.approx(SBH * expected, rel=1e-12)


def test_selective_recomputation_drops_exactly_the_5as2b_terms():
    # Table 2: TP + selective = sbh(10 + 24/t); TP + SP + selective = sbh(34/t)
    mem = layer_memory(gpt())
    assert mem.activation - mem.attention_core == pytest.approx(SBH * (10 + 24 / 8))
    mem = layer_memory(gpt(parallel={"sequence_parallel": True}))
    assert mem.activation - mem.attention_core == pytest.approx(SBH * 34 / 8)


def test_full_recomputation_keeps_2sbh_per_layer_without_sp_and_2sbh_over_t_with_it():
    assert layer_memory(gpt()).checkpoint == 2 * SBH  # Megatron stores the whole layer input at TP w/o SP
    assert layer_memory(gpt(parallel={"sequence_parallel": True})).checkpoint == 2 * SBH / 8


def test_flash_keeps_no_s_squared_tensor_and_no_dropout_keeps_no_mask():
    flash = layer_memory(gpt(parallel={"tp": 1}, training={"attention": "flash"}))
    assert flash.activation == pytest.approx(34 * SBH + 4 * 96 * 2048)  # + the fp32 log-sum-exp
    clean = layer_memory(gpt(parallel={"tp": 1}, training={"attention": "flash", "dropout": 0.0}))
    assert flash.activation - clean.activation == 2 * SBH  # two hidden dropout masks, one byte per element
    eager = layer_memory(gpt(parallel={"tp": 1}, training={"dropout": 0.0}))
    assert eager.attention_core == 2 * 96 * 2048**2  # the softmax output alone, 2as^2b


def test_megatron_activation_model_honours_sequence_parallel_off():
    off = layer_memory(gpt(memory={"activation_model": "megatron"}, training={"attention": "flash"}))
    on = layer_memory(gpt(memory={"activation_model": "megatron"}, parallel={"sequence_parallel": True}))
    assert off.activation == pytest.approx(SBH * (10 + 24 / 8))  # f = 4h
    assert on.activation == pytest.approx(SBH * 34 / 8)  # theoretical_memory_usage.py: sbh(18 + 4f/h)/t


def test_zero_bubble_weight_stash_is_32sbh():
    # Qi et al. 2024, Table 1: W needs 32sbh (its GEMMs' inputs and output gradients), B 34sbh + 5as^2b
    assert layer_memory(gpt(parallel={"tp": 1})).weight_stash == 32 * SBH


def test_row_parallel_w_keeps_the_gathered_output_gradient():
    # with SP the proj and fc2 output gradients arrive all-gathered (s whole, h whole) and their W keeps them; the
    # QKV and fc1 inputs stay SP shards (re-gathered for W), the rest are h- or f-sharded: in e·sbh units
    # 2/t (QKV, fc1 inputs) + 5/t (proj, fc2 inputs; f = 4h) + 7/t (QKV, fc1 output gradients) + 2 (proj, fc2)
    t = 8
    assert layer_memory(gpt(parallel={"sequence_parallel": True})).weight_stash == pytest.approx(
        2 * SBH * (14 / t + 2))
    assert layer_memory(gpt()).weight_stash == pytest.approx(2 * SBH * (2 + 12 / t + 2))  # no SP: inputs whole


def test_gpt_parameters_are_narayanans_count():
    # Narayanan et al. 2021, eq. (2): P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)); plus the final LayerNorm
    sc = gpt(parallel={"tp": 1}, pipeline={"stages": 1})
    l, h, v, s = 96, 12288, 51200, 2048
    expected = 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h)) + 2 * h
    assert build_cost_table(sc).params.sum() == pytest.approx(expected, rel=1e-12)


def test_first_stage_states_match_megatron_theoretical_memory_usage():
    # megatron/training/theoretical_memory_usage.py (it omits linear biases): most loaded shard =
    # (block params / p + embedding) / t + replicated layernorms / p; 18 bytes per parameter
    sc = gpt(pipeline={"stages": 8, "microbatches": 8})
    h, f, l, v, p, t = 12288, 4 * 12288, 96, 51200, 8, 8
    block = (4 * h * h + 2 * h * f) * l
    shard = (block / p + v * h) / t + 4 * h * l / p
    biases = (l / p) * ((3 * h + f) / t + 2 * h)  # QKV and fc1 biases shard over t, proj and fc2 biases do not
    first = build_cost_table(sc).params[0] - 2048 * h - biases  # Megatron counts no biases, no positions
    assert first == pytest.approx(shard, rel=1e-12)
    assert build_cost_table(sc).static_bytes[0] == pytest.approx(build_cost_table(sc).params[0] * 18)


def test_zero_stages_shard_states_over_dp():
    assert bytes_per_param(gpt(parallel={"dp": 4, "zero": 1})) == 6 + 12 / 4  # Megatron distributed optimizer
    assert bytes_per_param(gpt(parallel={"dp": 4, "zero": 2})) == 2 + 16 / 4
    assert bytes_per_param(gpt(parallel={"dp": 4, "zero": 3}, pipeline={"stages": 1})) == 16 / 4  # FSDP2
    # with a pipeline FSDP keeps the gathered bf16 weights (fp8 with Float8 all-gathers) and accumulates the
    # unsharded gradients in its fp32 reduce dtype (FSDPParam.to_accumulated_grad_if_needed)
    assert bytes_per_param(gpt(parallel={"dp": 4, "zero": 3})) == 16 / 4 + 2 + 4
    h100 = {"preset": "H100-SXM-80GB"}
    assert bytes_per_param(gpt(parallel={"dp": 4, "zero": 3}, training={"float8_linears": True}, device=h100)) == \
        16 / 4 + 1 + 4


def test_uneven_layers_126_over_16_chunks():
    counts = even_split(126, 16)
    assert sum(counts) == 126 and sorted(counts) == [7, 7] + [8] * 14
    assert counts[-1] == 7 and counts[0] == 7  # the LM-head and embedding chunks give up a layer first
    assert even_split(30, 4, embedding_slot=True, loss_slot=True) == [7, 8, 8, 7]  # Megatron's accounting


def test_126_layers_over_8_stages_and_2_virtual_stages_simulate():
    sc = load_scenario(None, {"model.layers": 126, "pipeline.stages": 8, "pipeline.virtual_stages": 2,
                              "pipeline.schedule": "interleaved-1f1b", "pipeline.microbatches": 16})
    table = build_cost_table(sc)
    assert table.detail.layers.sum() == 126
    assert simulate_scenario(sc).makespan_s > 0


def test_balanced_split_is_optimal_by_brute_force():
    extra = [0.5, 0.0, 0.0, 2.2]
    counts = balanced_split(10, 1.0, extra)
    best = min(
        max(n * 1.0 + x for n, x in zip(split, extra, strict=True))
        for split in np.ndindex(11, 11, 11, 11) if sum(split) == 10
    )
    assert sum(counts) == 10
    assert max(n + x for n, x in zip(counts, extra, strict=True)) == best


def test_hf_config_json_fills_the_model(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
           "max_position_embeddings": 8192, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "s.toml").write_text('[pipeline]\nstages = 4\nmicrobatches = 8\n[model]\nconfig = "config.json"\n')
    sc = load_scenario(tmp_path / "s.toml")
    assert build_cost_table(sc).params.sum() == 8_030_261_248  # Meta's published Llama 3 8B count
    sc = load_scenario(tmp_path / "s.toml", {"model.seq_len": 4096})
    assert sc.model.seq_len == 4096  # explicit keys win
    (tmp_path / "bad.toml").write_text('[pipeline]\nstages = 1\nmicrobatches = 1\n[model]\nconfig = "nope.json"\n')
    with pytest.raises(ScenarioError, match=r"model\.config .*nope\.json: file not found"):
        load_scenario(tmp_path / "bad.toml")


def test_hf_config_seq_len_moe_and_which_wins(tmp_path):
    from pipeplan.sim.hf_config import DEFAULT_SEQ_LEN

    cfg = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
           "max_position_embeddings": 131072}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "s.toml").write_text('[pipeline]\nstages = 4\nmicrobatches = 8\n[model]\nconfig = "config.json"\n')
    assert load_scenario(tmp_path / "s.toml").model.seq_len == DEFAULT_SEQ_LEN  # not 131,072
    (tmp_path / "moe.json").write_text(json.dumps({**cfg, "num_local_experts": 8, "num_experts_per_tok": 2}))
    with pytest.raises(ScenarioError, match=r"mixture-of-experts model \(num_local_experts = 8\)"):
        load_scenario(tmp_path / "s.toml", {"model.config": "moe.json"})
    with pytest.raises(ScenarioError, match=r"config\.json would be ignored \(layers = 48 here, 32 there\)"):
        load_scenario("llama2-70b-48l-pp8-tp8-a100", {"model.config": str(tmp_path / "config.json")})


def test_ring_collectives_closed_forms():
    link = Link(100e9, 5e-6)
    assert all_reduce_s(8e9, 8, link) == pytest.approx(14 * 5e-6 + 2 * 7 / 8 * 8e9 / 100e9)
    assert all_gather_s(8e9, 8, link) == pytest.approx(7 * 5e-6 + 7 / 8 * 8e9 / 100e9)
    assert all_reduce_s(8e9, 1, link) == 0.0


def test_links_follow_placement():
    sc = gpt(parallel={"tp": 8, "dp": 4}, device={"preset": "H100-SXM-80GB"})
    links = build_links(sc, sc.device.resolved())
    assert tp_link(sc, links).bytes_per_s == 450e9  # TP 8 fills one 8-GPU node: NVLink
    assert p2p_link(sc, links).bytes_per_s == 50e9  # each stage is its own node: 400 Gb/s NDR
    assert dp_link(sc, links).bytes_per_s == 50e9
    small = gpt(parallel={"tp": 2, "dp": 2}, pipeline={"stages": 2})
    small_links = build_links(small, small.device.resolved())
    assert p2p_link(small, small_links).bytes_per_s == 300e9  # 2 x 2 x 2 = 8 ranks: one A100 node
    assert dp_link(small, small_links).bytes_per_s == 300e9


def test_link_efficiency_scales_collective_times():
    """A collective's bandwidth term divides by datasheet x efficiency (nccl-tests busbw / line rate, already
    ring-corrected), its latency term does not; efficiency 1.0 gives the datasheet time; a scenario's
    interconnect.*_gbps is taken as given, with no efficiency applied."""
    n, nbytes = 8, 1e9
    full = gpt(device={"nvlink_efficiency": 1.0, "nic_efficiency": 1.0})
    half = gpt(device={"nvlink_efficiency": 0.5, "nic_efficiency": 0.25})
    lf, lh = build_links(full, full.device.resolved()), build_links(half, half.device.resolved())
    assert lf.intra.bytes_per_s == 300e9 and lf.inter.bytes_per_s == 25e9
    assert lh.intra.bytes_per_s == 150e9 and lh.inter.bytes_per_s == 6.25e9
    assert lh.intra.latency_s == lf.intra.latency_s == pytest.approx(5e-6)
    for op, steps, share in ((all_reduce_s, 2 * (n - 1), 2 * (n - 1) / n), (all_gather_s, n - 1, (n - 1) / n)):
        assert op(nbytes, n, lf.intra) == pytest.approx(steps * 5e-6 + share * nbytes / 300e9)
        assert op(nbytes, n, lh.intra) == pytest.approx(steps * 5e-6 + share * nbytes / 150e9)
        assert op(nbytes, n, lh.inter) - steps * 10e-6 == pytest.approx(4 * (op(nbytes, n, lf.inter) - steps * 10e-6))
    given = parse_scenario({**_raw_gpt(device={"nvlink_efficiency": 0.5, "nic_efficiency": 0.25}),
                            "interconnect": {"intra_node_gbps": 300.0, "inter_node_gbps": 25.0}})
    lg = build_links(given, given.device.resolved())
    assert lg.intra.bytes_per_s == 300e9 and lg.inter.bytes_per_s == 25e9


def test_link_efficiency_must_be_a_share():
    for bad in (0.0, 1.5):
        with pytest.raises(ScenarioError, match=r"device\.nvlink_efficiency"):
            gpt(device={"nvlink_efficiency": bad})


@pytest.mark.parametrize("sp,style", [(True, "megatron"), (False, "megatron"), (False, "dtensor")])
def test_p2p_hop_by_hand(sp, style):
    """GPT-3 175B at b = 1 on DGX A100s (each stage its own node: 25 GB/s HDR between stages, 10 us; TP 8 on
    NVLink, 300 GB/s, 5 us). With SP each TP rank sends its sequence shard; without, Megatron's scatter-gather
    sends 1/8 and all-gathers the rest over NVLink, torch pipelining sends the whole replicated tensor."""
    sc = gpt(parallel={"sequence_parallel": sp, "tp_style": style})
    full = 2 * SBH  # bf16 [s, b, h]: 50.3 MB
    on_wire = {(True, "megatron"): full / 8, (False, "megatron"): full / 8, (False, "dtensor"): full}[(sp, style)]
    gather = 7 * 5e-6 + 7 / 8 * full / 300e9 if (sp, style) == (False, "megatron") else 0.0
    assert build_cost_table(sc).p2p_s == pytest.approx(10e-6 + on_wire / 25e9 + gather)


def test_p2p_scatter_gather_switch():
    """parallel.p2p_scatter_gather = false is Megatron-Core's whole-tensor hop (3c92fa93b5): the same time as
    torch pipelining's; the default for "megatron" is the scatter-gather, and true on it changes nothing."""
    full = 2 * SBH
    whole = 10e-6 + full / 25e9
    split = 10e-6 + full / 8 / 25e9 + 7 * 5e-6 + 7 / 8 * full / 300e9
    assert build_cost_table(gpt(parallel={"p2p_scatter_gather": False})).p2p_s == pytest.approx(whole)
    assert build_cost_table(gpt()).p2p_s == pytest.approx(split)
    assert build_cost_table(gpt(parallel={"p2p_scatter_gather": True})).p2p_s == build_cost_table(gpt()).p2p_s
    dtensor = gpt(parallel={"tp_style": "dtensor", "p2p_scatter_gather": False})
    assert build_cost_table(dtensor).p2p_s == pytest.approx(whole)


def test_p2p_scatter_gather_sends_whole_when_t_does_not_divide_the_tensor():
    """Megatron's `_communicate` (p2p_communication.py lines 148-162 at 0b44909c1a) scatter-gathers only when
    s·b·h divides by t. hidden 12,282 and seq 2,047: s·b·h = 25,141,254 is even but not a multiple of 4, so
    at t = 4 the hop goes whole; at t = 2 it splits. A validated scenario cannot get there (tp divides heads,
    sim/limits.py, and heads divide hidden), so the model is swapped in after validation."""
    elements = 2047 * 12282
    assert elements % 4 and not elements % 2
    for t, split in ((4, False), (2, True)):
        sc = gpt(parallel={"tp": t})
        sc = sc.model_copy(update={"model": sc.model.model_copy(update={"hidden": 12282, "seq_len": 2047})})
        links = build_links(sc, sc.device.resolved())
        full = 2 * elements
        p2p, tp = p2p_link(sc, links), tp_link(sc, links)
        expected = p2p.transfer_s(full / t) + all_gather_s(full, t, tp) if split else p2p.transfer_s(full)
        assert p2p_transfer_s(sc, links) == pytest.approx(expected)
    assert p2p_transfer_s(sc, links) < p2p_link(sc, links).transfer_s(2 * elements)  # t = 2 splits


@pytest.mark.parametrize("parallel,field", [
    ({"p2p_scatter_gather": True, "tp_style": "dtensor"}, "tp_style"),
    ({"p2p_scatter_gather": True, "sequence_parallel": True}, "sequence_parallel"),
])
def test_p2p_scatter_gather_true_needs_megatron_without_sp(parallel, field):
    with pytest.raises(ScenarioError, match=rf"parallel\.p2p_scatter_gather: .*{field}") as info:
        gpt(parallel=parallel)
    assert "\n" not in str(info.value)



def test_p2p_scatter_gather_at_tp_1_ignores_sequence_parallel_but_never_dtensor():
    """At t = 1 there is nothing to split (Megatron turns SP off there): true with SP on is accepted."""
    assert gpt(parallel={"tp": 1, "p2p_scatter_gather": True, "sequence_parallel": True}).parallel.scatter_gather_p2p
    with pytest.raises(ScenarioError, match="tp_style"):
        gpt(parallel={"tp": 1, "p2p_scatter_gather": True, "tp_style": "dtensor"})
    assert not gpt(parallel={"tp_style": "dtensor"}).parallel.scatter_gather_p2p
    assert gpt().parallel.scatter_gather_p2p and gpt().parallel.p2p_scatter_gather is None


def test_p2p_limit_error_names_the_fields_that_set_the_hop():
    with pytest.raises(ScenarioError, match="p2p_s comes to") as info:
        build_cost_table(gpt(parallel={"tp": 8}, device={"preset": "A100-80GB"}).model_copy(
            update={"interconnect": gpt().interconnect.model_copy(update={"p2p_gbps": 1e-9})}))
    for field in ("interconnect.p2p_gbps", "p2p_latency_us", "inter_node", "parallel.p2p_scatter_gather",
                  "tp_gbps"):
        assert field in str(info.value)


def test_wave_quantisation_and_efficiency_rising_with_gemm_size():
    assert wave_efficiency(256, 128 * 133, 132) == pytest.approx(133 / 264)  # one tile into a second wave
    dev = device_spec(load_scenario())
    effs = [gemm_efficiency(n, n, dev) for n in (256, 1024, 4096, 16384)]
    assert effs == sorted(effs) and effs[0] < 0.1 and effs[-1] > 0.65
    flat = device_spec(load_scenario(None, {"device.efficiency": 0.5}))
    assert gemm_efficiency(256, 256, flat) == 0.5


def test_eager_attention_is_slower_and_keeps_more_than_flash():
    flash = build_cost_table(gpt(training={"attention": "flash"}))
    eager = build_cost_table(gpt())
    assert (eager.forward_s > flash.forward_s).all()
    assert (eager.activation_bytes > flash.activation_bytes).all()


def test_flash_shape_factor_reproduces_the_published_curve():
    # FlashAttention-3 paper Figure 5, FA2 causal forward on H100: each bar over the d = 128, 16k bar.
    for d, series in FLASH_CAUSAL_TFLOPS.items():
        for s, tflops in zip((512, 1024, 2048, 4096, 8192, 16384), series, strict=True):
            assert flash_shape_factor(d, s) == pytest.approx(tflops / 335)
    assert flash_shape_factor(96, 2048) == pytest.approx((262 + 298) / 2 / 335)  # linear in d between 64, 128
    assert flash_shape_factor(256, 16384) == pytest.approx(298 / 370)  # d = 256's fall-off, non-causal series
    assert flash_shape_factor(32, 256) == flash_shape_factor(64, 512)  # held flat outside the data


def test_flash_attention_at_equal_flops_is_slower_with_more_smaller_heads():
    # Same hidden size (same attention FLOPs), head dim 128 -> 64: the core runs 0.88-0.89x as fast.
    h100 = {"preset": "H100-SXM-80GB"}
    wide = gpt(model={"heads": 96}, training={"attention": "flash"}, device=h100)
    narrow = gpt(model={"heads": 192}, training={"attention": "flash"}, device=h100)
    (fw, bw), (fn, bn) = (attention_core_s(sc, device_spec(sc)) for sc in (wide, narrow))
    ratio = flash_shape_factor(128, 2048) / flash_shape_factor(64, 2048)
    assert fn / fw == pytest.approx(ratio) and bn / bw == pytest.approx(ratio)
    assert 1.1 < ratio < 1.2


def test_fp8_needs_a_device_with_fp8():
    with pytest.raises(ScenarioError, match="fp8"):
        build_cost_table(gpt(training={"dtype": "fp8"}))
    h100 = {"preset": "H100-SXM-80GB"}
    assert build_cost_table(gpt(training={"dtype": "fp8"}, device=h100)).forward_s.sum() < \
        build_cost_table(gpt(device=h100)).forward_s.sum()


def test_data_parallel_tail_is_the_exposed_reduction_plus_the_memory_bound_step():
    sc = gpt(parallel={"tp": 8, "dp": 4, "overlap_grad_reduce": False}, pipeline={"stages": 8})
    table = build_cost_table(sc)
    links = build_links(sc, sc.device.resolved())
    p_rank = table.params  # one chunk per rank
    hbm = sc.device.resolved()["hbm_gbps"] * 1e9
    expected = [all_reduce_s(4 * pr, 4, dp_link(sc, links)) + (34 + 4) * pr / hbm for pr in p_rank]
    np.testing.assert_allclose(table.step_tail_s, expected)
    overlapped = build_cost_table(gpt(parallel={"tp": 8, "dp": 4}, pipeline={"stages": 8}))
    assert (overlapped.step_tail_s < table.step_tail_s).all()


def test_zb_h1_pays_for_deferred_w_and_zb_2p_for_twice_the_warm_up():
    def peak(schedule):
        sc = gpt(pipeline={"schedule": schedule, "microbatches": 16}, training={"attention": "flash"})
        return simulate_scenario(sc).peak_activation_bytes

    one, h1, two = peak("1f1b"), peak("zb-h1"), peak("zb-2p")
    assert h1[-1] > one[-1] and h1[0] == pytest.approx(one[0])  # rank 0 defers no W; the last rank p-1
    assert 1.7 < two.max() / one.max() < 2.1  # the paper: ZB-2p needs about 2x 1F1B's activation memory


def test_summary_says_when_the_peak_happens_and_what_is_live():
    from pipeplan.sim.trace import simulation_summary

    summary = simulation_summary(simulate_scenario(load_scenario(None, {"training.optimizer_impl": "foreach"})))
    assert summary["fits"] is (not summary["oom"])
    for rank, moment in enumerate(summary["peak_at"]):
        assert moment["rank"] == rank
        parts = moment["static_bytes"] + moment["activation_bytes"] + moment["step_bytes"]
        assert parts == pytest.approx(summary["peak_hbm_bytes"][rank])


def test_step_tail_follows_the_schedules_placement():
    # ZB-V puts the first and the last chunk (embedding, LM head) both on rank 0, so rank 0 reduces the most
    sc = load_scenario(None, {"pipeline.schedule": "zbv", "pipeline.virtual_stages": 2, "parallel.dp": 4,
                              "parallel.overlap_grad_reduce": False})
    table = build_cost_table(sc)
    rank_params = [table.params[r] + table.params[2 * 4 - 1 - r] for r in range(4)]
    assert np.argmax(table.step_tail_s) == np.argmax(rank_params) == 0
    assert table.step_tail_s[0] > table.step_tail_s[1]
