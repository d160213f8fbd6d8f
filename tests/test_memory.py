"""Memory accounting, recomputation, offload tiers and the MILP memory planner."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.sim.config import load_scenario
from pipeplan.sim.costs import build_cost_table
from pipeplan.sim.engine import simulate
from pipeplan.sim.memory import build_memory_plan
from pipeplan.sim.step import resolve_schedule

SEVENTY = scenario_path("llama2-70b-48l-pp8-tp8-a100")
UNIT = scenario_path("explicit-unit")


def step(path, **overrides):
    sc = load_scenario(path, {k.replace("__", "."): v for k, v in overrides.items()})
    costs = build_cost_table(sc)
    sched = resolve_schedule(sc)
    plan = build_memory_plan(sc, costs, sched)
    return sc, costs, sched, plan, simulate(sched, costs, memory=plan)


def megatron_theoretical_bytes(sc) -> float:
    """Megatron-LM's theoretical_memory_usage.py for the most loaded (first) stage: weights + optimizer
    (18 bytes/param) plus activations (Korthikanti et al. Table 2 with flash attention)."""
    m, p, t = sc.model, sc.pipeline.stages, sc.parallel.tp
    v = sc.pipeline.virtual_stages
    s, b, h, f, L = m.seq_len, sc.training.micro_batch_size, m.hidden, m.ffn_hidden, m.layers
    layers_params = 2 * L * h * h * ((1 + m.kv_heads / m.heads) + (f / h) * 1.5 + 2 / h + 1 / h)
    shard = (layers_params / p + h * m.vocab) / t
    act = s * b * h * (18 + 4 * f / h) * L + 8 * s * b * p + s * b * h * p
    act *= 1 + (p - 1) / (p * v) if v > 1 else min(1, sc.pipeline.microbatches / p)
    return shard * 18 + act / t


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_peak_memory_matches_megatron_formula(schedule, v):
    sc, *_, res = step(SEVENTY, pipeline__schedule=schedule, pipeline__virtual_stages=v,
                       memory__activation_model="megatron", parallel__sequence_parallel=True,
                       memory__fragmentation=0.0, memory__runtime_overheads=False)  # the formula counts neither
    expected = megatron_theoretical_bytes(sc)
    assert res.peak_hbm_bytes[0] == pytest.approx(expected, rel=0.02)
    assert res.peak_hbm_bytes.argmax() == 0


def test_48_layers_oom_under_1f1b_and_interleaved():
    for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
        *_, res = step(SEVENTY, pipeline__schedule=schedule, pipeline__virtual_stages=v)
        assert res.oom, schedule


def test_full_recompute_adds_a_forward_and_keeps_the_checkpoint():
    *_, plan, res = step(UNIT, pipeline__stages=2, pipeline__microbatches=2, memory__recompute="full",
                         costs__checkpoint_bytes=0.25)
    np.testing.assert_allclose(plan.kept_bytes, 0.25)
    np.testing.assert_allclose(plan.recompute_s, 1.0)
    assert res.makespan_s == pytest.approx((2 + 2 - 1) * (1 + 3))  # B = I + W + recomputed F
    # rank 0 holds two checkpoints and, during a backward, the recomputed layer's activations (1.0)
    assert res.peak_activation_bytes[0] == pytest.approx(2 * 0.25 + 1.0)


def test_selective_lies_between_none_and_full():
    peaks, times = {}, {}
    for pol in ("none", "selective", "full"):
        *_, res = step(SEVENTY, memory__recompute=pol, model__layers=16)
        peaks[pol], times[pol] = res.peak_activation_bytes[0], res.makespan_s
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    assert times["none"] < times["selective"] < times["full"]


def test_selective_needs_a_model():
    from pipeplan.sim.errors import ScenarioError

    with pytest.raises(ScenarioError, match=r"memory\.recompute: 'selective' needs a \[model\]"):
        step(UNIT, memory__recompute="selective")


def test_chronos_recomputes_only_the_long_lived_chunks():
    *_, plan, res = step(SEVENTY, memory__recompute="chronos", model__layers=16)
    # in 1F1B activations of rank r wait ~(p - r) steps: the first half of the ranks recompute
    assert plan.policy == ("chronos:full",) * 4 + ("chronos:none",) * 4
    *_, none = step(SEVENTY, model__layers=16)
    assert res.peak_activation_bytes[0] < none.peak_activation_bytes[0]
    assert res.peak_activation_bytes[-1] == none.peak_activation_bytes[-1]


def test_activation_offload_moves_bytes_to_dram_and_back():
    *_, res = step(UNIT, costs__activation_bytes=32e9, memory__offload_activations=0.5)
    *_, keep = step(UNIT, costs__activation_bytes=32e9)
    assert res.peak_hbm_bytes[0] < keep.peak_hbm_bytes[0]
    assert res.peak_dram_bytes[0] > 0
    finals = {}
    for r, _t, hbm, static, act, dram, nvme in res.memory:
        assert hbm == pytest.approx(static + act)
        finals[r] = (act, dram, nvme)
    assert all(v == pytest.approx((0, 0, 0)) for v in finals.values())  # everything came back and was freed


def test_slow_copies_stall_and_are_reported():
    # GPipe keeps activations long. 16 GB at 32 GB/s takes 0.5 s each way, forwards take 1 s: hidden.
    # 160 GB takes 5 s: the copies cannot hide, forwards and backwards wait for them.
    *_, fast = step(UNIT, pipeline__schedule="gpipe", costs__activation_bytes=16e9, memory__offload_activations=1.0)
    *_, slow = step(UNIT, pipeline__schedule="gpipe", costs__activation_bytes=160e9, memory__offload_activations=1.0)
    *_, keep = step(UNIT, pipeline__schedule="gpipe")
    assert fast.stall_s.sum() == pytest.approx(0) and fast.makespan_s == pytest.approx(keep.makespan_s)
    assert slow.stall_s.sum() > 0 and slow.makespan_s > keep.makespan_s


def test_short_lived_activations_stall_when_offloaded():
    """1F1B's last rank runs each backward right after its forward: there is no time to copy out and back."""
    *_, res = step(UNIT, costs__activation_bytes=16e9, memory__offload_activations=1.0)
    assert res.stall_s[-1] == pytest.approx(8 * 1.0)  # every microbatch waits 0.5 s out + 0.5 s back


def test_nvme_tier_holds_offloaded_activations():
    *_, res = step(UNIT, costs__activation_bytes=1e9, memory__offload_activations=1.0,
                   memory__activations_tier="nvme")
    assert res.peak_nvme_bytes.max() > 0 and res.peak_dram_bytes.max() == 0


def test_optimizer_offload_frees_twelve_bytes_per_parameter():
    _sc, costs, _s, plan, res = step(SEVENTY, memory__optimizer="dram", memory__master_weights="dram")
    *_, keep_plan, keep = step(SEVENTY)
    np.testing.assert_allclose(keep_plan.static_hbm_bytes - plan.static_hbm_bytes, 12 * costs.params)
    np.testing.assert_allclose(plan.static_host_bytes["dram"], 12 * costs.params)
    assert res.makespan_s > keep.makespan_s  # the optimizer step's copies are not free


def test_master_weights_must_follow_a_host_optimizer():
    from pipeplan.sim.errors import ScenarioError

    with pytest.raises(ScenarioError, match=r"memory\.master_weights"):
        step(SEVENTY, memory__optimizer="dram", memory__master_weights="hbm")


def test_master_weights_left_unset_follow_the_optimizer():
    for tier in ("hbm", "dram", "nvme"):
        assert load_scenario(SEVENTY, {"memory.optimizer": tier}).memory.master_weights == tier


def test_memory_planner_fits_where_plain_1f1b_does_not_and_beats_full_recomputation():
    # (that the plan fits and its simulation agrees with the MILP, plan_memory checks itself; here the numbers
    # it is compared with come from the engine under other policies)
    from pipeplan.solver.memory_milp import plan_memory

    sc = load_scenario(SEVENTY, {"model.layers": 64})
    costs, sched = build_cost_table(sc), resolve_schedule(sc)
    assert simulate(sched, costs).oom  # plain 1F1B does not fit 64 layers
    res = plan_memory(sc, costs, sched).simulated
    full = step(SEVENTY, model__layers=64, memory__recompute="full")[-1]
    assert not full.oom_over_limit  # full recomputation fits too: the planner's job is to be faster than it
    assert res.makespan_s < full.makespan_s


def every_plan(sc):
    """Brute force over the MILP's choices: every (recomputed whole, op-level, DRAM, NVMe) layer count per chunk
    and states on host or not per rank, each run in the engine: (makespan, peak HBM, any op-level layer) per
    plan."""
    from pipeplan.sim.memory import keep_everything, with_states
    from pipeplan.solver.memory_milp import MemoryChoice, plan_from_choice

    costs, sched = build_cost_table(sc), resolve_schedule(sc)
    base = with_states(sc, costs, keep_everything(costs))
    per_chunk = [[(k, j, d, n) for k in range(int(L) + 1) for j in range(int(L) + 1 - k)
                  for d in range(int(L) + 1 - k - j) for n in range(int(L) + 1 - k - j - d) if not (d and n)]
                 for L in costs.detail.layers]
    results = []
    for combo in itertools.product(*per_chunk):
        for on_host in itertools.product([False, True], repeat=sched.num_ranks):
            k, j, d, n = (np.array(x, float) for x in zip(*combo, strict=True))
            plan = plan_from_choice(sc, costs, sched, base, MemoryChoice(k, d, n, np.array(on_host), op_layers=j),
                                    sc.memory.prefetch_lookahead)
            res = simulate(sched, costs, memory=plan)
            results.append((res.makespan_s, float(res.peak_hbm_bytes.max()), bool(j.any())))
    return results, base.hbm_limit_bytes


@pytest.mark.parametrize("tightness,buffers", [(0.25, "per-exchange"), (0.75, "per-exchange"),
                                               (0.25, "per-microbatch")])
def test_memory_milp_finds_the_brute_force_optimum(tightness, buffers):
    """2 ranks x 2 layers per chunk: 784 plans. With HBM set between the smallest and the largest simulated
    peak, the MILP's plan is as fast as the fastest plan that fits (within its 1% MIP gap). With torch
    pipelining's receive buffers (static) and input gradients (held from each backward to the step's end) the
    MILP's HBM rows must count them as the engine does, or its plan would not be the engine's optimum."""
    from pipeplan.solver.memory_milp import plan_memory

    small = {"pipeline.stages": 2, "pipeline.microbatches": 4, "model.layers": 4, "pipeline.p2p_buffers": buffers}
    sc = load_scenario(SEVENTY, small)
    peaks = np.array([peak for _t, peak, _op in every_plan(sc)[0]])
    limit = peaks.min() + tightness * (peaks.max() - peaks.min())
    sc = load_scenario(SEVENTY, {**small, "device.hbm_gib": limit / 2**30, "memory.hbm_margin_gib": 0.0})
    plans, hbm_limit = every_plan(sc)
    best = min(t for t, peak, _op in plans if peak <= hbm_limit * (1 + 1e-9))
    assert best > min(t for t, _peak, _op in plans)  # the limit binds: the fastest plan overall does not fit
    # op-level recomputation (keep every other matmul's output) is a choice that matters here: without it the
    # fastest fitting plan is slower
    assert best < min(t for t, peak, op in plans if peak <= hbm_limit * (1 + 1e-9) and not op)
    planned = plan_memory(sc, build_cost_table(sc), resolve_schedule(sc)).simulated
    assert planned.makespan_s >= best * (1 - 1e-12)  # its plan is one of the enumerated ones
    assert planned.makespan_s <= best * (1 + 1e-2)


def test_memory_planner_reports_the_smallest_hbm_when_nothing_fits():
    from pipeplan.solver.memory_milp import MemoryInfeasibleError, plan_memory

    sc = load_scenario(SEVENTY, {"model.layers": 64, "device.hbm_gib": 8.0})
    costs, sched = build_cost_table(sc), resolve_schedule(sc)
    with pytest.raises(MemoryInfeasibleError, match=r"smallest HBM that would do is (\d+\.\d+) GiB") as info:
        plan_memory(sc, costs, sched)
    smallest = float(info.value.args[0].split("would do is ")[1].split(" GiB")[0])
    assert smallest > 8.0
    roomier = load_scenario(SEVENTY, {"model.layers": 64, "device.hbm_gib": math.ceil(smallest * 1.05)})
    roomy_costs, roomy_sched = build_cost_table(roomier), resolve_schedule(roomier)
    roomy_step = plan_memory(roomier, roomy_costs, roomy_sched).simulated
    assert roomy_step.oom is False
    # the LP relaxation's bound: None where no plan fits, never above the simulated step of a plan that does
    from pipeplan.solver.memory_milp import makespan_lower_bound
    assert makespan_lower_bound(sc, costs, sched) is None
    assert 0 < makespan_lower_bound(roomier, roomy_costs, roomy_sched) <= roomy_step.makespan_s
    # a search that only asks whether a plan fits skips the second MILP: the same error, without the size
    with pytest.raises(MemoryInfeasibleError, match=r"^memory: no keep/recompute/offload plan fits [^;]*$"):
        plan_memory(sc, costs, sched, explain=False)


@pytest.mark.parametrize("states", [
    {"memory.optimizer": "dram", "memory.master_weights": "dram"},
    {"memory.optimizer": "nvme", "memory.master_weights": "nvme"},
    {"memory.gradients": "dram"},
    {"memory.optimizer": "dram", "memory.master_weights": "dram", "memory.gradients": "dram"},
])
def test_memory_planner_counts_the_optimizer_step_the_scenario_already_places(states):
    """States the scenario itself keeps off HBM make every plan pay the optimizer step's copies (and a host
    Adam): the MILP's makespan includes them, so its plan agrees with the engine (plan_memory raises if not),
    and it never 'moves' states that are already on the host."""
    from pipeplan.sim.memory import keep_everything, with_states
    from pipeplan.solver.memory_milp import plan_memory

    sc = load_scenario(scenario_path("llama3-8b-pp4-h100"), {**states, "pipeline.microbatches": 8})
    costs, sched = build_cost_table(sc), resolve_schedule(sc)
    planned = plan_memory(sc, costs, sched)
    assert abs(planned.simulated.makespan_s - planned.predicted_makespan_s) <= 0.01 * planned.predicted_makespan_s
    if sc.memory.optimizer != "hbm":
        assert not planned.choice.states_on_host.any()
        keep = simulate(sched, costs, memory=with_states(sc, costs, keep_everything(costs)))
        assert planned.simulated.makespan_s >= keep.makespan_s * (1 - 1e-9)  # the host step is paid by both
