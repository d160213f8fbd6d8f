"""Activation memory as the scenario's [memory] table plans it: measured, recomputed, or offloaded to host.

`run_memory` resolves the plan exactly as the simulator does (solver.step.resolve_memory_plan: the fixed
[memory] settings, or the memory MILP's verified choice with `memory.plan = true`, solved once on the launcher
and handed to the ranks in RunConfig.memory_choice), so a chunk the simulator recomputes is the chunk the
runtime recomputes:

    none                  keep everything
    full, chronos:full    checkpoint every decoder layer (torch.utils.checkpoint, non-reentrant): keep the
                          layer's input, recompute the layer right before its backward
    selective             checkpoint each layer's attention block only
    planned (MILP)        checkpoint the chunk's first k decoder layers, offload the planned share of the
                          chunk's saved bytes (its DRAM and NVMe layers; both go to host memory here), and
                          keep the optimizer state on the host on the ranks the plan says
    offload_weights       the chunk's parameters leave the device between uses (runtime/weight_offload.py)

`SavedTensors` is a `saved_tensors_hooks` context around each forward. It counts the bytes autograd saves
for the backward (each storage once; parameters are not activations): the CPU's measure of a chunk's
activation memory, the simulator's `activation_bytes`. With an offload share > 0 it also moves saved
tensors to host memory when the forward saves them (until that share of the bytes is offloaded), on the
copy stream (runtime/streams.py: a CUDA side stream into pinned memory, so the copy overlaps compute; on
the CPU the same calls inline, into a separate host buffer, which exercises the same path and lets the
meter tell device-resident from offloaded bytes). They come back ahead of need: the executor calls
`prefetch()` for a chunk-microbatch a few actions before its backward, which issues the host-to-device
copies on the copy stream and records an event; the backward's unpack only makes the compute stream wait
for that event. A tensor not prefetched is copied back when unpacked (counted as `demand_bytes`). The hooks
do not see what checkpoint keeps, so the checkpoint wrapper reports its input's bytes to the active meter.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from runtime.streams import CopyStream
from sim.config import Scenario
from sim.errors import PipeplanError
from sim.ir import Schedule
from solver.memory_milp import MemoryChoice

_active = threading.local()


@dataclass(frozen=True)
class ChunkMemory:
    """What one chunk does with its activations at run time."""

    recompute: str  # "none" | "full" | "selective": how a checkpointed layer recomputes
    offload_share: float  # share of the saved activation bytes moved to host after the forward
    recompute_layers: int | None = None  # checkpoint only the first k decoder layers (memory MILP); None: all
    label: str = "none"


@dataclass(frozen=True)
class RunMemory:
    chunks: list[ChunkMemory]  # per chunk
    states_on_host: list[bool]  # per rank: optimizer state and fp32 master weights in host memory
    weights_offloaded: list[bool] | None = None  # per chunk: parameters off the device between uses

    @property
    def offloads_weights(self) -> bool:
        return bool(self.weights_offloaded) and any(self.weights_offloaded)

    @property
    def labels(self) -> list[str]:
        return [c.label for c in self.chunks]


def run_memory(sc: Scenario, schedule: Schedule, choice: MemoryChoice | None = None) -> RunMemory:
    """Per chunk and rank, the memory plan the simulator uses for this scenario and schedule (one resolver,
    solver.step.resolve_memory_plan; `choice`: the MILP's decision the launcher already solved)."""
    from sim.costs import build_cost_table
    from solver.step import resolve_memory_plan

    costs = build_cost_table(sc).with_microbatches(schedule.num_microbatches)
    mem = sc.memory
    resolved = resolve_memory_plan(sc, costs, schedule, choice)
    plan = resolved.plan
    if resolved.choice is None:
        chunks = [ChunkMemory(p.removeprefix("chronos:"), mem.offload_activations, None, p) for p in plan.policy]
        return RunMemory(chunks, [mem.optimizer != "hbm"] * schedule.num_ranks, _weights(plan))
    k, layers = resolved.choice.recompute_layers, costs.detail.layers
    share = np.divide(plan.offload_bytes, plan.kept_bytes, out=np.zeros(len(layers)), where=plan.kept_bytes > 0)
    chunks = [
        ChunkMemory("full" if k[c] else "none", abs(float(share[c])), int(k[c]), plan.policy[c])
        for c in range(len(layers))
    ]
    on_host = resolved.choice.states_on_host
    states = [bool(x) for x in on_host] if mem.optimizer == "hbm" else [True] * schedule.num_ranks
    return RunMemory(chunks, states, _weights(plan))


def _weights(plan) -> list[bool]:
    """Per chunk, whether the plan moves its weights off the device in their idle windows."""
    return [bool(x) for x in plan.weight_offload_bytes] if len(plan.weight_offload_bytes) else []


def apply_policy(chunk: nn.Module, policy: ChunkMemory | str) -> nn.Module:
    """Recompute as `policy` says (names and parameters unchanged)."""
    if isinstance(policy, str):
        policy = ChunkMemory(policy.removeprefix("chronos:"), 0.0)
    layers = list(chunk.layers.values())
    if policy.recompute_layers is not None:
        layers = layers[: policy.recompute_layers]
    if policy.recompute == "full":
        for layer in layers:
            layer.forward = functools.partial(_checkpointed, layer.forward)
    elif policy.recompute == "selective":
        for layer in layers:
            layer.attention.forward = functools.partial(_checkpointed, layer.attention.forward)
    elif policy.recompute != "none":
        raise PipeplanError(f"memory.recompute: the runtime has no policy {policy.recompute!r}")
    return chunk


def _checkpointed(forward, x: torch.Tensor, *args):
    meter: SavedTensors | None = getattr(_active, "meter", None)
    if meter is not None and torch.is_grad_enabled() and meter.count(x):
        meter.device_bytes += x.untyped_storage().nbytes()  # checkpoint keeps the block's input
    return checkpoint(forward, x, *args, use_reentrant=False)


class Offloaded:
    """One saved tensor in host memory: how it left the device, and (once prefetched) its way back."""

    __slots__ = ("back", "back_done", "device", "done", "host")

    def __init__(self, host: torch.Tensor, device: torch.device, done: torch.cuda.Event | None):
        self.host, self.device, self.done = host, device, done
        self.back: torch.Tensor | None = None  # the device copy, once prefetch issued it
        self.back_done: torch.cuda.Event | None = None


class SavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Meter (and offload a share of) what autograd saves inside the context; see the module docstring."""

    def __init__(self, param_ptrs: set[int], offload_share: float = 0.0, stream: CopyStream | None = None):
        self.param_ptrs = param_ptrs
        self.share = offload_share
        self.stream = stream
        self.seen: set[int] = set()
        self.device_bytes = 0  # saved activations that stay on the device
        self.host_bytes = 0  # saved activations moved to host memory
        self.offloaded: list[Offloaded] = []
        self.prefetched_bytes = 0  # brought back by prefetch, ahead of the backward
        self.demand_bytes = 0  # brought back only when the backward asked
        super().__init__(self._pack, self._unpack)

    def __enter__(self):
        self._prev = getattr(_active, "meter", None)
        _active.meter = self
        return super().__enter__()

    def __exit__(self, *exc):
        _active.meter = self._prev
        return super().__exit__(*exc)

    def count(self, t: torch.Tensor) -> bool:
        """True the first time t's storage is seen (parameters never count)."""
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.param_ptrs or ptr in self.seen:
            return False
        self.seen.add(ptr)
        return True

    def _pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() in self.param_ptrs:
            return t
        size = t.untyped_storage().nbytes() if self.count(t) else 0
        if self.share <= 0 or self.host_bytes >= self.share * (self.host_bytes + self.device_bytes + size):
            self.device_bytes += size
            return t
        self.host_bytes += size
        if self.stream is None:
            self.stream = CopyStream(t.device)
        stream = self.stream
        host = stream.host_empty(t.shape, t.dtype)
        stream.wait_for_compute()
        with stream.use():
            host.copy_(t.detach(), non_blocking=True)
        stream.keep_alive(t)  # t's memory is not reused before the copy ran
        handle = Offloaded(host, t.device, stream.record())
        self.offloaded.append(handle)
        return handle

    def prefetch(self) -> int:
        """Issue the copies back to the device for every offloaded tensor not yet on its way; the bytes."""
        moved = 0
        for h in self.offloaded:
            if h.back is not None:
                continue
            with self.stream.use():  # after the offload copy: the same stream runs them in order
                h.back = h.host.to(h.device, non_blocking=True)
            h.back_done = self.stream.record()
            moved += h.host.untyped_storage().nbytes()
        self.prefetched_bytes += moved
        return moved

    def _unpack(self, packed):
        if not isinstance(packed, Offloaded):
            return packed
        if packed.back is None:  # not prefetched: copy back now, on the compute stream
            CopyStream.wait(packed.done)
            self.demand_bytes += packed.host.untyped_storage().nbytes()
            return packed.host.to(packed.device, non_blocking=True)
        CopyStream.wait(packed.back_done)
        CopyStream.hand_over(packed.back)
        return packed.back


def param_storages(module: nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}
