"""The runtime's single-process parts: the decoder and its split, split backward, freezing, recompute and
offload, data, P2P ordering — each against ground truth computed the plain way (no process group needed:
a one-rank pipeline runs the executor in this process)."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from pipeplan.scenarios import scenario_path

from pipeplan.runtime.config import RunConfig
from pipeplan.runtime.data import TokenData
from pipeplan.runtime.executor import PREFETCH_ACTIONS, PipelineExecutor
from pipeplan.runtime.freeze import FreezePhases, Freezer, draw_frozen
from pipeplan.runtime.memory import ChunkMemory, apply_policy, run_memory
from pipeplan.runtime.model import ModelArgs, cross_entropy
from pipeplan.runtime.p2p import P2P, Message, pair_sequences
from pipeplan.runtime.split_backward import WeightGradStore, enable_split_backward
from pipeplan.runtime.stages import build_chunk, build_model, layer_ranges
from pipeplan.sim.errors import PipeplanError
from pipeplan.sim.ir import Action, Kind
from pipeplan.sim.schedules import build_schedule, schedule_names

ARGS = ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab=256, seq_len=16)
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def batches(m: int, step: int = 0, b: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return TokenData("synthetic", ARGS.vocab, ARGS.seq_len, b, seed=0).step(step, m)


def one_rank_executor(chunk, m: int, schedule: str = "gpipe", **kwargs) -> PipelineExecutor:
    sched = build_schedule(schedule, 1, m, 1)
    p2p = P2P(sched, 0, (2, ARGS.seq_len, ARGS.dim), torch.float32, CPU)
    return PipelineExecutor(sched, 0, {0: chunk}, p2p, CPU, **kwargs)


def reference_grads(model, data, weight=None) -> dict[str, torch.Tensor]:
    """Gradients of mean_mb loss; `weight(name, mb)` = 0 drops microbatch mb from parameter name's gradient."""
    grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for mb, (x, y) in enumerate(data):
        model.zero_grad()
        (cross_entropy(model(x), y) / len(data)).backward()
        for n, p in model.named_parameters():
            grads[n] += p.grad * (1.0 if weight is None else weight(n, mb))
    return grads


# ---- model and split ---------------------------------------------------------------------------------
def test_chunks_compose_to_the_full_model_bit_for_bit():
    full = build_model(ARGS)
    chunks = [build_chunk(ARGS, s, layer_ranges([1, 1, 1, 1])) for s in range(4)]
    x = batches(1)[0][0]
    h = x
    for c in chunks:
        h = c(h)
    assert torch.equal(h, full(x))  # (B, T, V) logits
    assert [list(c.layers) for c in chunks] == [["0"], ["1"], ["2"], ["3"]]
    full_params = dict(full.named_parameters())
    for c in chunks:  # names survive the split, and so do initial values
        for n, p in c.named_parameters():
            assert torch.equal(p, full_params[n])
    assert chunks[0].tok_embeddings is not None and chunks[0].output is None
    assert chunks[3].tok_embeddings is None and chunks[3].output is not None
    assert layer_ranges([3, 0, 5]) == [range(0, 3), range(3, 3), range(3, 8)]


def test_split_backward_i_then_w_equals_full_backward():
    plain, split = build_model(ARGS), enable_split_backward(build_model(ARGS))
    x, y = batches(1)[0]
    cross_entropy(plain(x), y).backward()
    store = WeightGradStore()
    with store.capture():
        cross_entropy(split(x), y).backward()
    assert split.layers["0"].attention.wq.weight.grad is None  # I deferred every linear's dW ...
    assert split.layers["0"].attention_norm.weight.grad is not None  # ... but not the cheap parameters
    store.run()
    for (n, p), (_, q) in zip(plain.named_parameters(), split.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=n)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_one_rank_executor_matches_plain_training(name):
    m = 4
    data = batches(m)
    chunk = build_model(ARGS)
    trace = one_rank_executor(chunk, m, name).run_step(data)
    expected = reference_grads(build_model(ARGS), data)
    for n, p in chunk.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-7, msg=n)
    assert [a for a, _, _ in trace.actions] == list(build_schedule(name, 1, m, 1).ranks[0])
    assert sorted(trace.losses) == list(range(m))


# ---- freezing ------------------------------------------------------------------------------------------
def test_frozen_parameters_get_no_gradient_from_the_microbatches_that_froze_them():
    m = 4
    data = batches(m)
    frozen_names = ["layers.1.feed_forward.w1.weight", "layers.0.attention.wq.weight", "tok_embeddings.weight"]
    frozen = {(0, 1): frozen_names, (0, 3): frozen_names[:1]}
    chunk = build_model(ARGS)
    one_rank_executor(chunk, m).run_step(data, frozen)

    def weight(name: str, mb: int) -> float:
        return 0.0 if name in frozen.get((0, mb), ()) else 1.0

    expected = reference_grads(build_model(ARGS), data, weight)
    for n, p in chunk.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-7, msg=n)
        assert p.requires_grad  # frozen only while its microbatch's forward ran


def test_backward_time_falls_with_the_freeze_ratio():
    """A middle chunk (its input gradient is always needed): interleaved repetitions, the least process CPU
    time of each ratio's B. CPU time and the minimum, because other jobs on a shared machine only ever add to
    a sample (a wall-clock median flipped 0.5 against 0.0 once under load)."""
    args = ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=512, vocab=256, seq_len=64)
    chunk = build_chunk(args, 1, layer_ranges([1, 1]))
    params = dict(chunk.named_parameters())
    units = [(n, p.numel()) for n, p in params.items()]
    times: dict[float, list[float]] = {0.0: [], 0.5: [], 1.0: []}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, args.seq_len, args.dim)
    for _ in range(12):
        for ratio in times:
            frozen = {id(params[n]) for n in draw_frozen(units, ratio, gen)}
            for p in chunk.parameters():
                p.requires_grad_(id(p) not in frozen)
            inp = x.clone().requires_grad_(True)
            out = chunk(inp)  # (4, T, h)
            for p in chunk.parameters():
                p.requires_grad_(True)
            start = time.process_time()
            out.backward(torch.ones_like(out))
            times[ratio].append(time.process_time() - start)
            assert inp.grad is not None
            chunk.zero_grad(set_to_none=True)
    least = {r: min(v) for r, v in times.items()}
    assert least[1.0] < 0.85 * least[0.0], least
    assert least[0.5] < least[0.0], least


def test_draws_match_the_ratio_and_lean_to_the_front_on_stage_0():
    units = [(f"u{i}", 100) for i in range(40)]
    gen = torch.Generator().manual_seed(1)
    for ratio in (0.0, 0.25, 0.5, 1.0):
        chosen = draw_frozen(units, ratio, gen)
        assert abs(len(chosen) / 40 - ratio) <= 1 / 40
    front = [statistics.mean(int(n[1:]) for n in draw_frozen(units, 0.3, gen, front_weighted=True)) for _ in range(30)]
    flat = [statistics.mean(int(n[1:]) for n in draw_frozen(units, 0.3, gen)) for _ in range(30)]
    assert statistics.mean(front) < statistics.mean(flat) - 3


def test_freeze_phases_in_order():
    phases = FreezePhases("timelyfreeze", cap=0.5, warmup=2, monitor=2, ramp=2, redraw=5)
    assert [(s, phases.phase(s)) for s in range(8)] == [
        (0, "warmup"), (1, "warmup"), (2, "monitor"), (3, "monitor"),
        (4, "ramp"), (5, "ramp"), (6, "steady"), (7, "steady")]
    assert phases.solve_after_step == 3
    assert [round(phases.ramp_scale(s), 3) for s in (4, 5, 6)] == [0.333, 0.667, 1.0]
    assert FreezePhases("none", 0.5, 2, 2, 2, 5).phase(3) == "off"
    # the cap ramps up; the plan is re-solved after monitoring and after each ramp step, for the next step's cap
    assert [(s, round(phases.cap_at(s + 1), 3)) for s in phases.solve_steps] == [(3, 0.167), (4, 0.333), (5, 0.5)]
    assert list(FreezePhases("none", 0.5, 2, 2, 2, 5).solve_steps) == []


def test_the_lp_sees_each_actions_own_median():
    """Monitoring keeps durations per action; the LP's plan at cap 0 is then the simulator's step on
    exactly those per-action medians (one slow W on stage 1 included), not on per-chunk averages."""
    import numpy as np

    from pipeplan.sim.costs import CostTable
    from pipeplan.sim.engine import simulate

    sched = build_schedule("zb-h1", 2, 4, 1)
    fz = Freezer.build(FreezePhases("timelyfreeze", 0.5, 0, 2, 0, 5), sched, {0: build_model(ARGS)}, 0, 0)
    base = {"F": 1.0, "I": 1.0, "W": 1.0}
    slow = (1, "W", 3)  # one action measured 4x slower than its chunk's others
    unfrozen = {(s, k, mb): [base[k] * (4.0 if (s, k, mb) == slow else 1.0)] * 3
                for s in range(2) for k in "FIW" for mb in range(4)}
    frozen = {(s, "W", mb): [0.1] for s in range(2) for mb in range(4)}
    fz.solve([{"unfrozen": unfrozen, "frozen": {}}, {"unfrozen": {}, "frozen": frozen}], cap=0.0)
    assert set(fz.plan.values()) == {0.0}
    ones = np.ones(2)
    expected = simulate(sched, CostTable(2, 1, 4, ones, ones, ones, np.zeros(2), np.zeros(2), p2p_s=0.0),
                        durations={Action(1, Kind.W, 3): 4.0}).makespan_s
    assert fz.planned_makespan_s == pytest.approx(expected)
    fz.solve([{"unfrozen": unfrozen, "frozen": frozen}], cap=0.5)  # with freezing allowed the LP cuts it
    assert fz.planned_makespan_s < expected and fz.unfrozen_makespan_s == pytest.approx(expected)
    for s in range(2):
        assert np.mean([fz.plan[(s, mb)] for mb in range(4)]) <= 0.5 + 1e-9


def test_monitoring_trains_every_step_and_times_every_action_both_ways():
    """A checkerboard over microbatches: at each monitoring step half the microbatches are fully frozen and
    half train, so no step discards training, and every action is timed frozen and unfrozen alternately."""
    from pipeplan.runtime.executor import StepTrace

    sched = build_schedule("1f1b", 1, 4, 1)
    chunk = build_model(ARGS)
    names = {n for n, _ in chunk.named_parameters()}
    fz = Freezer.build(FreezePhases("timelyfreeze", 0.5, 1, 4, 0, 5), sched, {0: chunk}, seed=0, rank=0)
    for step in range(1, 5):
        frozen = fz.frozen(step)
        assert sorted(frozen) == [(0, mb) for mb in range(4) if (mb + step - 1) % 2 == 1]
        assert all(set(v) == names for v in frozen.values())  # those fully frozen, the others not at all
        assert fz.realized_ratio() == 0.5
        trace = StepTrace(actions=[(a, 0.0, 1.0 if a.kind is Kind.F or (0, a.microbatch) not in frozen else 0.25)
                                   for a in sched.ranks[0]])
        fz.observe(step, trace)
    for mb in range(4):  # M/2 = 2 samples of each action, each way
        assert fz.durations["unfrozen"][(0, "B", mb)] == [1.0, 1.0]
        assert fz.durations["frozen"][(0, "B", mb)] == [0.25, 0.25]


def test_the_first_stages_i_shrinks_with_its_w_in_the_plan():
    """zb-h1, p=2, m=2, every action 1 s unfrozen, W and stage 0's I 0 s fully frozen (the first stage needs no
    input gradient): the LP's plan is tests/test_freeze_lp.py's 5.2 s, and its I is part of the prediction."""
    sched = build_schedule("zb-h1", 2, 2, 1)
    fz = Freezer.build(FreezePhases("timelyfreeze", 0.9, 0, 2, 0, 5), sched, {0: build_model(ARGS)}, 0, 0)
    unfrozen = {(s, k, mb): [1.0] for s in range(2) for k in "FIW" for mb in range(2)}
    frozen = {**{(s, "W", mb): [0.0] for s in range(2) for mb in range(2)},
              **{(s, k, mb): [1.0] for s in range(2) for k in "FI" for mb in range(2) if (s, k) != (0, "I")},
              **{(0, "I", mb): [0.0] for mb in range(2)}}
    fz.solve([{"unfrozen": unfrozen, "frozen": frozen}], cap=0.9)
    assert fz.planned_makespan_s == pytest.approx(5.2)
    assert fz.plan[(0, 1)] == pytest.approx(0.9) and fz.plan[(0, 0)] == 0.0
    frozen[(0, "I", 0)] = frozen[(0, "I", 1)] = [1.0]  # an I that does not shrink: the old model, 6 s
    fz.solve([{"unfrozen": unfrozen, "frozen": frozen}], cap=0.9)
    assert fz.planned_makespan_s == pytest.approx(6.0)


def test_uniform_plan_and_redraw_every_k_steps():
    sched = build_schedule("1f1b", 1, 4, 1)
    chunk = build_model(ARGS)
    fz = Freezer.build(FreezePhases("uniform", 0.5, 0, 2, 0, 3), sched, {0: chunk}, seed=0, rank=0)
    fz.solve([])
    assert set(fz.plan.values()) == {0.5}
    first = fz.frozen(2)
    assert fz.frozen(3) == first and fz.frozen(4) == first  # same sets until K = 3 steps passed
    assert fz.frozen(5) != first
    assert 0.4 < fz.realized_ratio() < 0.6


def test_freezer_checkpoint_round_trip_reproduces_the_draws():
    sched = build_schedule("1f1b", 1, 4, 1)
    chunk = build_model(ARGS)
    a = Freezer.build(FreezePhases("uniform", 0.5, 0, 2, 0, 1), sched, {0: chunk}, seed=3, rank=0)
    a.solve([])
    a.frozen(2)
    b = Freezer.build(FreezePhases("uniform", 0.5, 0, 2, 0, 1), sched, {0: chunk}, seed=99, rank=0)
    b.load_state_dict(a.state_dict())
    assert [a.frozen(s) for s in (3, 4)] == [b.frozen(s) for s in (3, 4)]


# ---- recompute and offload -------------------------------------------------------------------------------
@pytest.mark.parametrize("policy,offload", [("full", 0.0), ("selective", 0.0), ("selective-op", 0.0), ("none", 1.0),
                                           ("none", 0.5)])
def test_recompute_and_offload_keep_gradients_and_cut_device_bytes(policy, offload):
    m = 4
    data = batches(m)
    base = build_model(ARGS)
    base_trace = one_rank_executor(base, m).run_step(data)
    chunk = apply_policy(build_model(ARGS), policy)
    trace = one_rank_executor(chunk, m, offload_share=offload).run_step(data)
    for (n, p), (_, q) in zip(base.named_parameters(), chunk.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=n)
    assert trace.losses == base_trace.losses
    assert trace.peak_activation_bytes < base_trace.peak_activation_bytes
    if offload == 1.0:  # everything left; it came back only for the backwards within PREFETCH_ACTIONS actions
        per_microbatch = trace.activation_bytes[0]
        assert trace.offloaded_bytes == sum(per_microbatch)
        assert max(per_microbatch) < trace.peak_activation_bytes <= (PREFETCH_ACTIONS + 1) * max(per_microbatch)
    if offload > 0:  # every offloaded byte was prefetched ahead of its backward: none copied on demand
        assert trace.prefetched_bytes == trace.offloaded_bytes > 0
    if offload == 0.5:
        assert 0.3 < trace.offloaded_bytes / sum(map(sum, base_trace.activation_bytes.values())) < 0.7


@pytest.mark.parametrize("lookahead", [1, 2, 3])
def test_offloaded_activations_come_back_lookahead_actions_ahead_as_the_simulator_says(lookahead):
    """GPipe on one rank (F0..F3 B0..B3), everything offloaded: at B0 the backwards within `lookahead` actions
    are back (sim.graph.prefetch_issuer's rule), so lookahead + 1 microbatches' activations are on the device."""
    m = 4
    chunk = apply_policy(build_model(ARGS), "none")
    trace = one_rank_executor(chunk, m, offload_share=1.0, prefetch_lookahead=lookahead).run_step(batches(m))
    per_microbatch = max(trace.activation_bytes[0])
    assert lookahead * per_microbatch < trace.peak_activation_bytes <= (lookahead + 1) * per_microbatch
    assert trace.prefetched_bytes == trace.offloaded_bytes


# ---- data, config, P2P order -----------------------------------------------------------------------------
def test_data_is_a_pure_function_of_seed_step_and_microbatch():
    a, b = TokenData("synthetic", 256, 16, 2, seed=1), TokenData("synthetic", 256, 16, 2, seed=1)
    assert torch.equal(a.microbatch(3, 2)[0], b.microbatch(3, 2)[0])
    assert not torch.equal(a.microbatch(3, 2)[0], a.microbatch(3, 1)[0])
    x, y = a.microbatch(0, 0)
    assert torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(PipeplanError, match="vocab >= 256"):
        TokenData(None, 128, 16, 2)


def test_text_file_tokens(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"hello pipeline world " * 20)
    x, _ = TokenData(str(path), 256, 8, 2).microbatch(0, 0)
    assert bytes(x[0].tolist()) in path.read_bytes()


@pytest.mark.parametrize("kwargs,match", [
    ({"steps": 0}, "--steps"), ({"freeze": "all"}, "--freeze"), ({"freeze_cap": 2.0}, "--cap"),
    ({"resume": True}, "--checkpoint-dir"), ({"freeze": "uniform", "freeze_monitor": 1}, "--freeze-monitor"),
    ({"validate": True}, "--validate"), ({"profile": True, "validate": True, "steps": 3}, "--steps >= 4"),
])
def test_run_config_names_the_flag_to_fix(kwargs, match):
    with pytest.raises(PipeplanError, match=match):
        RunConfig(**kwargs)


def test_run_config_json_round_trip():
    cfg = RunConfig(overrides={"pipeline.schedule": "zbv"}, steps=3, freeze="uniform")
    assert RunConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("name", schedule_names())
def test_p2p_pair_order_agrees_with_every_rank_order(name):
    """Both ranks of a pair issue its messages in one sequence; each rank's sends in it follow the rank's
    own action order, and a receive never waits behind a send its rank has not produced yet."""
    for p, m, v in ((2, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 2)):
        try:
            sched = build_schedule(name, p, m, v)
        except PipeplanError:
            continue
        position = {a: (r, i) for r, acts in enumerate(sched.ranks) for i, a in enumerate(acts)}
        for pair, msgs in pair_sequences(sched).items():
            for rank in pair:
                issued_at = []  # position in the rank's order at which each op can be issued at the latest
                for msg in msgs:
                    producer = Action(msg.stage, Kind.F if not msg.grad else _backward_kind(sched, msg), msg.microbatch)
                    if position[producer][0] == rank:
                        issued_at.append(("send", position[producer][1]))
                    else:
                        consumer = _consumer(sched, msg)
                        issued_at.append(("recv", position[consumer][1]))
                sends = [i for kind, i in issued_at if kind == "send"]
                assert sends == sorted(sends)
                for k, (kind, i) in enumerate(issued_at):
                    if kind == "recv":  # every send before it on the pair is produced before it is needed
                        assert all(j < i for kk, j in issued_at[:k] if kk == "send"), (name, p, v, pair)


def _backward_kind(sched, msg: Message) -> Kind:
    return Kind.I if Action(msg.stage, Kind.I, msg.microbatch) in {a for r in sched.ranks for a in r} else Kind.B


def _consumer(sched, msg: Message) -> Action:
    s = msg.consumer_stage
    if not msg.grad:
        return Action(s, Kind.F, msg.microbatch)
    return Action(s, _backward_kind(sched, Message(True, s, msg.microbatch)), msg.microbatch)


def test_partial_recompute_checkpoints_only_the_first_layers():
    m = 2
    data = batches(m)
    base = build_model(ARGS)
    base_trace = one_rank_executor(base, m).run_step(data)
    full_trace = one_rank_executor(apply_policy(build_model(ARGS), "full"), m).run_step(data)
    chunk = apply_policy(build_model(ARGS), ChunkMemory("full", 0.0, recompute_layers=1))
    trace = one_rank_executor(chunk, m).run_step(data)
    # a planned mix: the first layer whole, the next op-level (memory MILP's k and j)
    mixed = apply_policy(build_model(ARGS), ChunkMemory("full", 0.0, recompute_layers=1, op_layers=1))
    mixed_trace = one_rank_executor(mixed, m).run_step(data)
    for (n, p), (_, q), (_, r) in zip(base.named_parameters(), chunk.named_parameters(), mixed.named_parameters(),
                                      strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=n)
        torch.testing.assert_close(r.grad, p.grad, rtol=1e-5, atol=1e-7, msg=n)
    assert full_trace.peak_activation_bytes < trace.peak_activation_bytes < base_trace.peak_activation_bytes
    assert full_trace.peak_activation_bytes < mixed_trace.peak_activation_bytes < trace.peak_activation_bytes


def test_run_memory_is_the_memory_planners_choice():
    from pipeplan.sim.config import load_scenario
    from pipeplan.sim.costs import build_cost_table
    from pipeplan.sim.step import resolve_schedule
    from pipeplan.solver.memory_milp import plan_memory

    # 10 MiB of "HBM" for the tiny model: keeping everything needs ~15 MiB on rank 0
    sc = load_scenario(str(scenario_path("tiny-cpu")), {"device.hbm_gib": 0.01, "memory.plan": True})
    schedule = resolve_schedule(sc)
    planned = plan_memory(sc, build_cost_table(sc), schedule)
    mem = run_memory(sc, schedule)
    assert [c.recompute_layers for c in mem.chunks] == [int(k) for k in planned.recompute_layers]
    assert [c.op_layers for c in mem.chunks] == [int(j) for j in planned.choice.op_recompute_layers]
    assert mem.states_on_host == [bool(y) for y in planned.states_on_host]
    assert any(c.recompute_layers or c.op_layers for c in mem.chunks) or any(mem.states_on_host)  # it does something
    assert mem.labels == list(planned.plan.policy)
    offloaded = planned.plan.offload_bytes / planned.plan.kept_bytes
    assert [c.offload_share for c in mem.chunks] == pytest.approx(offloaded)

    fixed = run_memory(load_scenario(str(scenario_path("tiny-cpu")),
                                     {"memory.recompute": "selective", "memory.offload_activations": 0.25}), schedule)
    assert {(c.recompute, c.offload_share, c.recompute_layers) for c in fixed.chunks} == {("selective", 0.25, None)}


def test_backend_is_nccl_only_with_a_gpu_per_rank(monkeypatch):
    from pipeplan.runtime.worker import choose_backend

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert choose_backend(torch.device("cpu"), 4) == "gloo"
    assert choose_backend(torch.device("cuda", 0), 1) == "nccl"
    assert choose_backend(torch.device("cuda", 0), 4) == "gloo"  # four ranks share the GPU: P2P via host
