"""W stash offload at run time: a share of what I queued for W goes to host memory after I and comes back
before W, as the simulator moves it (memory.offload_stash, or the memory MILP's per-chunk share).

A chunk-microbatch's stash is its `WeightGradStore` (runtime/split_backward.py): per linear layer the input X
and the output gradient dY of its weight GEMM. `offload` walks the queue in order and moves whole tensors,
each storage once (wq, wk and wv share one X), until the share of the stash's bytes is on its way out: the
simulator's byte share to within one tensor. Copies run on the copy stream (runtime/streams.py: a CUDA side
stream into pinned memory; inline on the CPU; `HostCopy`, as for offloaded activations), after the compute
that made the tensor; `prefetch` issues the
copies back when the rank starts the action `prefetch_lookahead` places before the W (sim.graph's rule), in
the order W needs them; `HostCopy.get` makes W's compute wait for that copy (each tensor its own), or copies
back on demand if no prefetch was issued.
"""

from __future__ import annotations

import torch

from pipeplan.runtime.split_backward import WeightGradStore
from pipeplan.runtime.streams import CopyStream, HostCopy


def offload(store: WeightGradStore, share: float, stream: CopyStream) -> int:
    """Move `share` of the store's bytes to host memory, whole tensors in queue order; the bytes moved."""
    target, moved = share * store.nbytes, 0
    copies: dict[int, HostCopy] = {}  # storage -> its copy: a tensor queued twice moves once

    def move(t):
        nonlocal moved
        if not isinstance(t, torch.Tensor):
            return t
        ptr = t.untyped_storage().data_ptr()
        if ptr not in copies:
            if moved >= target:
                return t
            copies[ptr] = HostCopy(t, stream)
            moved += copies[ptr].nbytes
        return copies[ptr]

    store.pending = [(move(x), move(grad_y), weight) for x, grad_y, weight in store.pending]
    return moved


def copies_out(store: WeightGradStore) -> list[HostCopy]:
    """The store's tensors in host memory (its copies out), for the pinned-buffer gate (streams.PinnedBuffers)."""
    return [t for x, grad_y, _ in store.pending for t in (x, grad_y) if isinstance(t, HostCopy)]


def prefetch(store: WeightGradStore) -> int:
    """Issue the copies back for every offloaded tensor not on its way yet, in the order W needs them (it runs
    the queue backwards: WeightGradStore.run); the bytes."""
    moved, seen = 0, set()
    for x, grad_y, _ in reversed(store.pending):
        for t in (x, grad_y):
            if isinstance(t, HostCopy) and t.back is None and id(t) not in seen:
                seen.add(id(t))
                t.fetch()
                moved += t.nbytes
    return moved
