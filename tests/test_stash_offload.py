"""W stash offload: a split backward's stash (the weight GEMMs' inputs and output gradients, held from I's end
to W's end) copied to host after I and prefetched before W, in the engine (hand-computed timelines), in the
memory MILP (its plans re-simulate to what it predicted, and it lowers the HBM floor), and refused by the
runtime, which keeps the stash on the device."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.sim.config import load_scenario
from pipeplan.sim.costs import build_cost_table
from pipeplan.sim.engine import simulate
from pipeplan.sim.ir import Action, Schedule
from pipeplan.sim.memory import build_memory_plan
from pipeplan.sim.memory_plan import keep_everything
from pipeplan.sim.step import resolve_schedule

UNIT = scenario_path("explicit-unit")
SEVENTY = scenario_path("llama2-70b-48l-pp8-tp8-a100")


def one_rank(order: str, microbatches: int) -> tuple:
    """Unit costs (F = I = W = 1 s, 1 byte of activations per microbatch) on one rank running `order`."""
    costs = build_cost_table(load_scenario(UNIT, {"pipeline.stages": 1, "pipeline.microbatches": microbatches}))
    return Schedule("hand", 1, microbatches, (tuple(Action.parse(x) for x in order.split()),), (0,)), costs


def stash_plan(costs, offloaded: float, lookahead: int, link_bps: float):
    """A 4-byte stash per microbatch, `offloaded` bytes of it moved over a `link_bps` host link."""
    return dataclasses.replace(keep_everything(costs), stash_bytes=np.array([4.0]),
                               stash_offload_bytes=np.array([offloaded]), host_link_bps=link_bps,
                               prefetch_lookahead=lookahead)


def copies(res) -> list[tuple[str, str, str, float, float]]:
    return [(c.stream, c.what, str(c.action), c.start_s, c.end_s) for c in res.copies]


def hbm(res) -> list[tuple[float, float]]:
    return [(t, h) for _r, t, h, *_ in res.memory]


def test_stash_offload_timeline_when_the_copy_is_slower_than_compute():
    """F0 F1 I0 I1 W0 W1, half of a 4-byte stash over 1 byte/s (2 s a copy), prefetch issued one action ahead.
    I0 ends at 3, its copy runs 3-5; I1's queues behind it (5-7). W0's prefetch, issued when I1 starts (3),
    waits for I0's copy and runs 5-7: W0 waits from 4 to 7. W1's, issued when W0 starts (7), runs 7-9."""
    sched, costs = one_rank("0F0 0F1 0I0 0I1 0W0 0W1", 2)
    res = simulate(sched, costs, memory=stash_plan(costs, 2.0, 1, 1.0))
    assert copies(res) == [("d2h", "stash-offload", "0I0", 3.0, 5.0), ("d2h", "stash-offload", "0I1", 5.0, 7.0),
                           ("h2d", "stash-prefetch", "0W0", 5.0, 7.0), ("h2d", "stash-prefetch", "0W1", 7.0, 9.0)]
    assert list(res.start_s) == [0.0, 1.0, 2.0, 3.0, 7.0, 9.0]
    assert res.makespan_s == 10.0 and res.stall_s[0] == 3.0 + 1.0
    # activations 1 per F; at I's end +4 (stash) -1 (activations); offloaded halves leave at copy end, come back
    # at prefetch start; W frees the whole stash
    assert hbm(res) == [(0.0, 0.0), (0.0, 1.0), (1.0, 2.0), (3.0, 5.0), (4.0, 8.0), (5.0, 6.0), (5.0, 8.0),
                        (7.0, 6.0), (7.0, 8.0), (8.0, 4.0), (10.0, 0.0)]
    assert res.peak_dram_bytes[0] == 4.0  # both halves away between 5 and 7 (I1's out before W0's is back)


def test_stash_offload_lowers_the_peak_and_costs_its_exposed_copies():
    """F0 I0 F1 I1 F2 I2 W0 W1 W2, half of the stash over 4 bytes/s (0.5 s), prefetched at W's own start.
    Kept whole, the three stashes peak at 12 when I2 ends (6). Offloaded: I0's and I1's halves are away by
    then (copies 2-2.5 and 4-4.5), so I2's end reaches 2 + 2 + 4 = 8, and W0's prefetch (+2) 10; each W waits
    0.5 s for its prefetch: 9 s -> 10.5 s."""
    sched, costs = one_rank("0F0 0I0 0F1 0I1 0F2 0I2 0W0 0W1 0W2", 3)
    kept = simulate(sched, costs, memory=stash_plan(costs, 0.0, 0, 4.0))
    assert kept.makespan_s == 9.0 and kept.peak_hbm_bytes[0] == 12.0 and not kept.copies
    res = simulate(sched, costs, memory=stash_plan(costs, 2.0, 0, 4.0))
    assert copies(res) == [("d2h", "stash-offload", "0I0", 2.0, 2.5), ("d2h", "stash-offload", "0I1", 4.0, 4.5),
                           ("d2h", "stash-offload", "0I2", 6.0, 6.5), ("h2d", "stash-prefetch", "0W0", 6.0, 6.5),
                           ("h2d", "stash-prefetch", "0W1", 7.5, 8.0), ("h2d", "stash-prefetch", "0W2", 9.0, 9.5)]
    assert res.makespan_s == 10.5 and res.stall_s[0] == 1.5
    assert res.peak_hbm_bytes[0] == 10.0
    assert res.peak_dram_bytes[0] == 6.0  # at 6.5 I2's half arrives before W0's leaves the host
    assert res.memory[-1][2] == 0.0 and res.memory[-1][5] == 0.0  # nothing left anywhere at the end


def test_a_third_split_waits_for_the_stash_copy_two_back():
    """Two pinned stash buffers: I2 may not start before I0's copy ends (the forwards' rule, for I)."""
    sched, costs = one_rank("0F0 0F1 0F2 0I0 0I1 0I2 0W0 0W1 0W2", 3)
    res = simulate(sched, costs, memory=stash_plan(costs, 4.0, 2, 1.0))  # 4 s a copy: I0's runs 4-8
    assert res.start_s[5] == 8.0  # I2, ready at 5


def test_scenario_share_moves_only_a_split_backwards_stash():
    for name, v in (("zbv", 2), ("1f1b", 1)):
        sc = load_scenario(SEVENTY, {"pipeline.schedule": name, "pipeline.virtual_stages": v, "model.layers": 16,
                                     "memory.offload_stash": 0.5})
        costs, sched = build_cost_table(sc), resolve_schedule(sc)
        plan = build_memory_plan(sc, costs, sched)
        if name == "1f1b":  # no I, no W: nothing to move
            assert not plan.offloads_stash
            continue
        np.testing.assert_allclose(plan.stash_offload_bytes, 0.5 * plan.stash_bytes)
        res = simulate(sched, costs, memory=plan)
        n_split = sum(a.kind.value == "I" for r in sched.ranks for a in r)
        assert sum(c.what == "stash-offload" for c in res.copies) == n_split
        assert sum(c.what == "stash-prefetch" for c in res.copies) == n_split
        whole = simulate(sched, costs, memory=dataclasses.replace(plan, stash_offload_bytes=np.zeros(sched.num_stages)))
        assert res.peak_dram_bytes.max() > whole.peak_dram_bytes.max()  # stash halves sit on the host
        assert res.makespan_s >= whole.makespan_s  # copies never shorten a step


SMALL = {"pipeline.stages": 4, "pipeline.microbatches": 8, "model.layers": 16, "pipeline.schedule": "zbv",
         "pipeline.virtual_stages": 2, "memory.prefetch_lookahead": 1, "memory.plan": True,
         "memory.offload_stash": "auto"}


def test_planner_offloads_the_stash_where_nothing_else_fits_and_predicts_the_step():
    """The HBM floor with the stash movable ("auto") lies below the floor without; between them the planner's plan
    offloads some stash, fits, and its re-simulated step is the MILP's prediction (within the planner's 2%)."""
    from pipeplan.solver.memory_milp import MemoryInfeasibleError, plan_memory, smallest_hbm_bytes

    sc = load_scenario(SEVENTY, SMALL)
    costs, sched = build_cost_table(sc), resolve_schedule(sc)
    with_stash = smallest_hbm_bytes(sc, costs, sched).bytes
    kept = load_scenario(SEVENTY, {**SMALL, "memory.offload_stash": 0.0})  # the stash stays in HBM
    without = smallest_hbm_bytes(kept, costs, sched).bytes
    assert with_stash < without * 0.99
    limit = (with_stash + without) / 2
    over = {**SMALL, "device.hbm_gib": limit / 2**30, "memory.hbm_margin_gib": 0.0}
    sc = load_scenario(SEVENTY, over)
    costs = build_cost_table(sc)
    planned = plan_memory(sc, costs, sched)
    assert planned.choice.stash_offload_layers.any()
    assert planned.plan.offloads_stash
    res = simulate(sched, costs, memory=planned.plan)  # the plan, run again from scratch
    assert res.makespan_s == pytest.approx(planned.predicted_makespan_s, rel=0.02)
    assert res.peak_hbm_bytes.max() <= planned.plan.hbm_limit_bytes * (1 + 1e-9)
    assert any(c.what == "stash-offload" and c.end_s > c.start_s for c in res.copies)
    with pytest.raises(MemoryInfeasibleError):
        plan_memory(load_scenario(SEVENTY, {**over, "memory.offload_stash": 0.0}), costs, sched)


def _zbv_stash_run(share, lookahead=1):
    """One rank holding both chunks of a ZB-V (4 microbatches, split backward), W stash share `share` to host."""
    import torch

    from pipeplan.runtime.executor import PipelineExecutor
    from pipeplan.runtime.model import ModelArgs
    from pipeplan.runtime.p2p import P2P
    from pipeplan.runtime.split_backward import enable_split_backward
    from pipeplan.runtime.stages import build_chunk, layer_ranges
    from pipeplan.sim.schedules import build_schedule
    from tests.test_runtime_model import batches

    args = ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab=256, seq_len=16)
    cpu = torch.device("cpu")
    sched = build_schedule("zbv", 1, 4, 2)
    torch.manual_seed(0)
    chunks = {s: enable_split_backward(build_chunk(args, s, layer_ranges([2, 2]), cpu)) for s in range(2)}
    p2p = P2P(sched, 0, (2, args.seq_len, args.dim), torch.float32, cpu)
    ex = PipelineExecutor(sched, 0, chunks, p2p, cpu, offload_stash=share, prefetch_lookahead=lookahead)
    trace = ex.run_step(batches(4, 0))
    grads = {(s, n): p.grad.clone() for s, c in chunks.items() for n, p in c.named_parameters()}
    return trace, grads


@pytest.mark.parametrize("share,lookahead", [(0.5, 1), (1.0, 1), (1.0, 0)])
def test_the_runtime_moves_the_w_stash_share_and_trains_bit_for_bit(share, lookahead):
    """The planned share of each I's W stash goes to host after I and comes back before its W (with lookahead
    0 as the W starts); the gradients and losses are those of the stash kept on the device, bit for bit; the
    device holds less between I and W; every stash, device and host, is released by its W."""
    import torch

    kept, kept_grads = _zbv_stash_run(0.0)
    trace, grads = _zbv_stash_run(share, lookahead)
    assert trace.losses == kept.losses
    assert all(torch.equal(grads[k], kept_grads[k]) for k in kept_grads)
    assert kept.stash_offloaded_bytes == 0 < trace.stash_offloaded_bytes == trace.stash_prefetched_bytes
    assert max(h for _, _, h in trace.memory) > 0 == max(h for _, _, h in kept.memory)
    assert max(d for _, d, _ in trace.memory) <= max(d for _, d, _ in kept.memory)
    assert trace.memory[-1][1:] == (0, 0)
    if share < 1:
        everything = _zbv_stash_run(1.0)[0].stash_offloaded_bytes
        assert share * everything <= trace.stash_offloaded_bytes < everything


def test_a_stash_share_is_whole_tensors_each_storage_once(monkeypatch):
    """offload(store, share) moves the shortest prefix of the queue's distinct tensors that reaches the share:
    at least share x the stash's bytes, less than that plus one tensor. wq, wk and wv queue one X: it moves
    (and counts) once."""
    import torch

    from pipeplan.runtime.model import ModelArgs
    from pipeplan.runtime.split_backward import WeightGradStore, enable_split_backward
    from pipeplan.runtime.stages import build_chunk, layer_ranges
    from pipeplan.runtime.stash_offload import HostCopy, offload, prefetch
    from pipeplan.runtime.streams import CopyStream

    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab=256, seq_len=16)
    cpu = torch.device("cpu")
    order: list[int] = []  # the copies back, as issued
    real_fetch = HostCopy.fetch
    monkeypatch.setattr(HostCopy, "fetch", lambda self: (order.append(id(self)), real_fetch(self))[1])
    for share in (0.3, 0.5, 1.0):
        order.clear()
        torch.manual_seed(0)
        chunk = enable_split_backward(build_chunk(args, 0, layer_ranges([2]), cpu))
        store = WeightGradStore()
        with store.capture():
            chunk(torch.randint(0, 256, (2, 16))).float().pow(2).mean().backward()
        raw = sum(x.nbytes + g.nbytes for x, g, _ in store.pending)
        total = store.nbytes
        assert total < raw  # shared inputs count once
        largest = max(t.nbytes for x, g, _ in store.pending for t in (x, g))
        moved = offload(store, share, CopyStream(cpu))
        assert share * total <= moved < share * total + largest
        assert store.nbytes == total  # the same bytes, part of them on the host
        copies = {id(t) for x, g, _ in store.pending for t in (x, g) if isinstance(t, HostCopy)}
        assert sum(t.nbytes for t in {id(t): t for x, g, _ in store.pending for t in (x, g)
                                      if isinstance(t, HostCopy)}.values()) == moved and copies
        assert prefetch(store) == moved and prefetch(store) == 0  # each copy comes back once
        # in the order W needs them: it runs the queue backwards
        needed = dict.fromkeys(id(t) for x, g, _ in reversed(store.pending) for t in (x, g) if isinstance(t, HostCopy))
        assert order == list(needed)


def test_run_memory_hands_the_plans_stash_share_to_the_ranks():
    from pipeplan.runtime.memory import run_memory
    from pipeplan.sim.step import resolve_schedule

    text = {"pipeline.schedule": "zbv", "pipeline.virtual_stages": 2, "memory.offload_stash": 0.5}
    sc = load_scenario(scenario_path("tiny-cpu"), text)
    mem = run_memory(sc, resolve_schedule(sc))
    assert mem.stash_shares == pytest.approx([0.5] * sc.num_chunks)
    plain = load_scenario(scenario_path("tiny-cpu"))
    assert run_memory(plain, resolve_schedule(plain)).stash_shares is None
