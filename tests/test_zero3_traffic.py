"""ZeRO-3 parameter traffic bounds each pass when there is no pipeline (sim.data_parallel.zero3_pass_comm_s)."""

from __future__ import annotations

import numpy as np
import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.sim.comm import all_gather_s, build_links, dp_link, reduce_scatter_s
from pipeplan.sim.config import load_scenario
from pipeplan.sim.cost_model import embedding_params, layer_costs, model_chunk_costs
from pipeplan.sim.costs import build_cost_table
from pipeplan.sim.data_parallel import GRAD_BYTES, zero3_per_microbatch
from pipeplan.sim.memory import build_memory_plan
from pipeplan.sim.schedules import build_schedule

NARAYANAN_175B = scenario_path("validation/narayanan-t2-175b-zero3")
TITAN_8B = scenario_path("validation/torchtitan-llama3.1-8b-fsdp8")
TITAN_405B_PP = scenario_path("validation/torchtitan-llama3.1-405b-pp8")
AT_1536 = {"parallel.dp": 1536, "training.micro_batch_size": 1}  # Narayanan Table 2: 14 s of gather per pass


def _hidden(path, overrides=None):
    return model_chunk_costs(load_scenario(path, {**(overrides or {}), "parallel.zero3_prefetch": "hidden"}))


def test_a_gather_longer_than_compute_sets_f_and_b():
    sc = load_scenario(NARAYANAN_175B, AT_1536)
    assert zero3_per_microbatch(sc)
    c, hidden = model_chunk_costs(sc), _hidden(NARAYANAN_175B, AT_1536)
    link = dp_link(sc, build_links(sc, sc.device.resolved()))
    assert link.bytes_per_s == pytest.approx(25e9)  # 1536 ranks span nodes: the 25 GB/s HCA
    d, layers, p = 1536, sc.model.layers, layer_costs(sc).params
    other = sum(embedding_params(sc))
    gather_f = layers * all_gather_s(2 * p, d, link) + all_gather_s(2 * other, d, link)  # fp16 weights
    # B re-gathers every layer but the last, which stays gathered from its forward (torchtitan at 9dec370)
    traffic_b = ((layers - 1) * all_gather_s(2 * p, d, link) + layers * reduce_scatter_s(GRAD_BYTES * p, d, link)
                 + reduce_scatter_s(GRAD_BYTES * other, d, link))
    # closed form: (d-1)/d of the 349 GB of fp16 weights at 25 GB/s, plus 1535 ring steps per layer
    assert gather_f == pytest.approx((1535 / 1536) * 2 * (layers * p + other) / 25e9 + 97 * 1535 * link.latency_s)
    assert 13.5 < gather_f < 16.0
    assert hidden.forward_s[0] < gather_f  # the compute alone is shorter
    assert c.forward_s[0] == pytest.approx(gather_f, rel=1e-12)
    assert (c.backward_input_s + c.backward_weight_s)[0] == pytest.approx(traffic_b, rel=1e-12)
    assert c.backward_weight_s[0] == hidden.backward_weight_s[0]  # the excess goes on I
    slack = traffic_b - (hidden.backward_input_s + hidden.backward_weight_s)[0]
    assert c.detail.backward_comm_slack_s[0] == pytest.approx(slack)


def test_recomputation_fills_the_time_b_waits_on_its_traffic():
    sc = load_scenario(NARAYANAN_175B, AT_1536)  # memory.recompute = "full"
    costs = build_cost_table(sc)
    plan = build_memory_plan(sc, costs, build_schedule("1f1b", 1, 1))
    recompute = costs.detail.layers * costs.detail.layer_forward_s
    slack = costs.detail.backward_comm_slack_s
    assert recompute[0] > 0 and slack[0] > recompute[0]
    assert plan.recompute_s[0] == 0.0  # max(B + R, traffic) = traffic
    # at micro batch 5 on 384 GPUs, B's compute is shorter than its traffic, B's compute plus the recomputation
    # longer: the recomputation is partly hidden and the pass ends at B + R
    sc5 = load_scenario(NARAYANAN_175B, {"parallel.dp": 384, "training.micro_batch_size": 5})
    c5, h5 = build_cost_table(sc5), _hidden(NARAYANAN_175B, {"parallel.dp": 384, "training.micro_batch_size": 5})
    p5 = build_memory_plan(sc5, c5, build_schedule("1f1b", 1, 1))
    r5, s5 = (c5.detail.layers * c5.detail.layer_forward_s)[0], c5.detail.backward_comm_slack_s[0]
    assert 0 < s5 < r5
    assert p5.recompute_s[0] == pytest.approx(r5 - s5)
    b5 = (c5.backward_input_s + c5.backward_weight_s)[0] + p5.recompute_s[0]
    assert b5 == pytest.approx((h5.backward_input_s + h5.backward_weight_s)[0] + r5)


@pytest.mark.parametrize("micro_batch", [4, 5])
def test_the_memory_milp_plans_the_recomputation_zero3_hides(micro_batch):
    """175B on 384 GPUs, memory.plan = true: B waits on its parameter traffic and the MILP recomputes layers.
    At micro batch 4 the slack (14.8 s) hides the whole recomputation; at 5, 7.9 s of its 17.5 s. The MILP's
    step must be the simulated one (it used to add the recomputation on top of B's slack: +25% at 4)."""
    from pipeplan.sim.step import resolve_schedule
    from pipeplan.solver.memory_milp import TOLERANCE, plan_memory

    sc = load_scenario(NARAYANAN_175B, {"parallel.dp": 384, "training.micro_batch_size": micro_batch,
                                        "memory.plan": True})
    costs = build_cost_table(sc)
    res = plan_memory(sc, costs, resolve_schedule(sc))
    k, j = res.choice.recompute_layers[0], res.choice.op_recompute_layers[0]  # layers recomputed whole, op-level
    recompute = k * costs.detail.layer_forward_s[0] + j * costs.detail.op_recompute_s[0]
    slack = costs.detail.backward_comm_slack_s[0]
    assert k + j > 0 and slack > 0
    assert min(recompute, slack) > TOLERANCE * res.predicted_makespan_s  # the old pricing fails the check
    assert res.rounds == 1
    assert res.predicted_makespan_s == pytest.approx(res.simulated.makespan_s, rel=1e-6)
    assert res.plan.recompute_s[0] == pytest.approx(max(recompute - slack, 0.0))


def test_a_gather_shorter_than_compute_changes_no_pass():
    sc = load_scenario(TITAN_8B)  # 8 GPUs of one host: the gathers run over NVLink
    assert zero3_per_microbatch(sc)
    c, hidden = model_chunk_costs(sc), _hidden(TITAN_8B)
    assert np.array_equal(c.forward_s, hidden.forward_s)
    assert np.array_equal(c.backward_input_s, hidden.backward_input_s)
    assert np.array_equal(c.backward_weight_s, hidden.backward_weight_s)
    assert not c.detail.backward_comm_slack_s.any()


def test_with_a_pipeline_the_passes_and_the_tail_are_unchanged():
    for path, over in ((TITAN_405B_PP, {}), (NARAYANAN_175B, {**AT_1536, "pipeline.stages": 2})):
        sc = load_scenario(path, over)
        assert sc.pipeline.stages > 1 and not zero3_per_microbatch(sc)
        c, hidden = model_chunk_costs(sc), _hidden(path, over)
        for name in ("forward_s", "backward_input_s", "backward_weight_s"):
            assert np.array_equal(getattr(c, name), getattr(hidden, name))
        assert np.array_equal(c.tail.comm_s, hidden.tail.comm_s)


def test_the_tail_keeps_the_trailing_reduce_scatters_past_b_slack():
    """After the backward's last computation the one reduce-scatter stream still runs the first layer's and then
    the root module's (embedding, final norm, LM head: FSDP2's root post-backward); a traffic-bound B has them
    inside its bound already, so the tail is what exceeds B's slack."""
    from pipeplan.sim.cost_model import device_spec
    from pipeplan.sim.data_parallel import step_tail

    titan = load_scenario(scenario_path("validation/torchtitan-llama3.1-8b-fsdp128"))  # compute-bound B
    c = model_chunk_costs(titan)
    assert not c.detail.backward_comm_slack_s.any()
    link = dp_link(titan, build_links(titan, titan.device.resolved()))
    assert link.bytes_per_s == pytest.approx(50e9)  # 128 ranks: the network
    p, root = layer_costs(titan).params, sum(embedding_params(titan))
    assert 1.0e9 < root < 1.1e9 and root > 4 * p  # Llama 3 8B: 2 x 525M embedding-side, 218M a layer
    trailing = reduce_scatter_s(GRAD_BYTES * p, 128, link) + reduce_scatter_s(GRAD_BYTES * root, 128, link)
    assert c.tail.comm_s[0] == pytest.approx(trailing)
    assert 0.1 < trailing < 0.11  # 18.6 ms + 84.7 ms at 50 GB/s
    # a slack shorter than the trailing reduce-scatters leaves the rest exposed
    args = (titan, device_spec(titan), build_links(titan, titan.device.resolved()), c.params,
            c.backward_input_s + c.backward_weight_s, 1, p, c.detail.layers)
    assert step_tail(*args, slack_b=np.array([0.04])).comm_s[0] == pytest.approx(trailing - 0.04)
    assert step_tail(*args, slack_b=np.array([0.2])).comm_s[0] == 0.0
    # 175B on 1536 GPUs: B waits 37 s on its traffic, the 0.4 s of trailing reduce-scatters included
    sc = load_scenario(NARAYANAN_175B, AT_1536)
    c, hidden = model_chunk_costs(sc), _hidden(NARAYANAN_175B, AT_1536)
    assert c.detail.backward_comm_slack_s[0] > 30
    assert c.tail.comm_s[0] == 0.0
    assert hidden.tail.comm_s[0] > 20  # the whole step's fp32 reduce-scatter (28 s), now inside every B


def test_without_a_pipeline_hbm_holds_the_root_module_gathered_and_its_head_gradient():
    """FSDP2 does not reshard the root module (embedding, final norm, LM head) after forward: its bf16 weights
    stay gathered through B, and the LM head's unsharded bf16 gradient from B's first op to the root's
    reduce-scatter; neither with a pipeline, whose weights stay gathered anyway (counted as states)."""
    from pipeplan.sim.overheads import runtime_bytes

    sc = load_scenario(scenario_path("validation/torchtitan-llama3.1-8b-fsdp128"))
    dev, p = sc.device.resolved(), layer_costs(sc).params
    root, head = sum(embedding_params(sc)), sc.model.vocab * sc.model.hidden
    base = runtime_bytes(sc, dev, p)
    assert runtime_bytes(sc, dev, p, root, head) - base == pytest.approx(2 * (root + head))
    assert 2.9 * 2**30 < 2 * (root + head) < 3.0 * 2**30  # Llama 3 8B: 1.05B root parameters, 525M of head
    assert model_chunk_costs(sc).detail.state_bytes["runtime"][0] == pytest.approx(base + 2 * (root + head))
    # Float8 linears: the embedding and LM head are not Float8, their gathered weights stay bf16
    f8 = load_scenario(scenario_path("validation/torchtitan-llama3.1-8b-fsdp128"), {"training.float8_linears": True})
    assert runtime_bytes(f8, dev, p, root, head) - runtime_bytes(f8, dev, p) == pytest.approx(2 * (root + head))
    piped = load_scenario(TITAN_405B_PP)
    assert runtime_bytes(piped, dev, 1e9, 5e9, 2e9) == runtime_bytes(piped, dev, 1e9)


def test_float8_gathers_the_decoder_layers_in_fp8_and_the_root_in_bf16():
    from pipeplan.sim.data_parallel import zero3_pass_comm_s

    sc = load_scenario(scenario_path("validation/torchtitan-llama3.1-8b-fsdp128"), {"training.float8_linears": True})
    links = build_links(sc, sc.device.resolved())
    link, p, root = dp_link(sc, links), layer_costs(sc).params, sum(embedding_params(sc))
    layers = np.array([float(sc.model.layers)])
    f, b = zero3_pass_comm_s(sc, links, layers, p, layers * p + root)
    assert f[0] == pytest.approx(32 * all_gather_s(1 * p, 128, link) + all_gather_s(2 * root, 128, link))
    assert b[0] == pytest.approx(31 * all_gather_s(1 * p, 128, link) + 32 * reduce_scatter_s(GRAD_BYTES * p, 128, link)
                                 + reduce_scatter_s(GRAD_BYTES * root, 128, link))


def test_a_bad_prefetch_value_names_the_field():
    from pipeplan.sim.errors import ScenarioError

    with pytest.raises(ScenarioError, match="zero3_prefetch"):
        load_scenario(NARAYANAN_175B, {"parallel.zero3_prefetch": "two"})



def test_with_a_pipeline_and_float8_the_kept_root_weights_stay_in_the_training_dtype():
    """FSDP with a pipeline keeps the gathered weights for the step, Float8 linears at 1 byte each, but the
    embedding and LM head (not Float8) in bf16: 2 bytes per root parameter on the first and last chunks."""
    sc = load_scenario(TITAN_405B_PP)
    assert sc.training.float8_linears and sc.pipeline.stages > 1 and sc.training.dtype == "bf16"
    c = model_chunk_costs(sc)
    layers = c.detail.layers * layer_costs(sc).params
    first, last = embedding_params(sc)
    weights = c.detail.state_bytes["weights"]
    assert weights[1:-1] == pytest.approx(layers[1:-1])  # decoder layers only: 1 byte each
    assert weights[0] == pytest.approx(layers[0] + 2 * first)
    assert weights[-1] == pytest.approx(layers[-1] + 2 * last)
