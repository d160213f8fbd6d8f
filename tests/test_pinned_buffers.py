"""The runtime's bounded pinned buffers (runtime/streams.py PinnedBuffers) follow the simulator's rule,
sim.copy_rules.PINNED_BUFFERS: a forward waits for the activation copies out of the forward that many back."""

from __future__ import annotations

from types import SimpleNamespace

from pipeplan.runtime.memory import apply_policy
from pipeplan.runtime.stages import build_model
from pipeplan.runtime.streams import CopyStream, PinnedBuffers
from pipeplan.sim.copy_rules import PINNED_BUFFERS, buffer_gate
from tests.test_runtime_model import ARGS, batches, one_rank_executor, one_thread  # noqa: F401


def test_a_producer_waits_for_the_copies_out_pinned_buffers_back(monkeypatch):
    waited = []
    monkeypatch.setattr(CopyStream, "wait", staticmethod(waited.append))
    buffers = PinnedBuffers()
    copies = [[SimpleNamespace(out=f"F{j}.{k}") for k in range(2)] for j in range(5)]
    for j, own in enumerate(copies):
        waited.clear()
        buffers.before()
        expected = [h.out for h in copies[j - PINNED_BUFFERS]] if j >= PINNED_BUFFERS else []
        assert waited == expected
        buffers.after(own)
    assert buffer_gate([1]) is None and buffer_gate(list(range(5))) == 5 - PINNED_BUFFERS


def test_the_executor_gates_each_forward_on_the_copies_of_the_forward_pinned_buffers_back(monkeypatch):
    gates = []
    before = PinnedBuffers.before

    def recording(self):
        gates.append([len(c) for c in self.copied])  # copies out of every earlier forward, as the gate sees them
        before(self)

    monkeypatch.setattr(PinnedBuffers, "before", recording)
    m = 4
    chunk = apply_policy(build_model(ARGS), "none")
    trace = one_rank_executor(chunk, m, offload_share=1.0).run_step(batches(m))
    assert trace.offloaded_bytes > 0
    assert len(gates) == m  # once per forward, with every earlier forward's copies out (all non-empty)
    assert [len(g) for g in gates] == list(range(m)) and all(n > 0 for g in gates for n in g)



def test_the_executor_gates_each_split_backward_on_the_stash_copies_pinned_buffers_back(monkeypatch):
    """ZB-V on one rank with the whole W stash to host: every I (8 of them) sees the stash copies out of the
    I's before it, all non-empty; the forwards' buffers hold no stash copies."""
    from tests.test_stash_offload import _zbv_stash_run

    seen: dict[int, list[list[int]]] = {}
    before = PinnedBuffers.before

    def recording(self):
        seen.setdefault(id(self), []).append([len(c) for c in self.copied])
        before(self)

    monkeypatch.setattr(PinnedBuffers, "before", recording)
    trace, _ = _zbv_stash_run(1.0)
    assert trace.stash_offloaded_bytes > 0
    forwards, splits = seen.values()  # forwards come first in the step
    assert [len(g) for g in forwards] == list(range(8)) and all(n == 0 for g in forwards for n in g)
    assert [len(g) for g in splits] == list(range(8)) and all(n > 0 for g in splits for n in g)
