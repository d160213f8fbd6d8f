"""Activation memory as the scenario's [memory] table plans it: measured, recomputed, or offloaded to host.

`run_memory` resolves the plan exactly as the simulator does (solver.step.resolve_memory_plan: the fixed
[memory] settings, or the memory MILP's verified choice with `memory.plan = true`, solved once on the launcher
and handed to the ranks in RunConfig.memory_choice), so a chunk the simulator recomputes is the chunk the
runtime recomputes:

    none                  keep everything
    full, chronos:full    checkpoint every decoder layer (torch.utils.checkpoint, non-reentrant): keep the
                          layer's input, recompute the layer right before its backward
    selective             checkpoint each layer's attention core (the SDPA call, model.AttentionCore) only:
                          keep Q, K, V, drop the softmax statistics (flash's log-sum-exp); the projections run
                          once (Megatron's selective recomputation, Korthikanti et al. 2022, sec. 4.2)
    selective-op          torchtitan's op-level selective checkpointing (selective_ac_option = "op"), through
                          torch's SAC API: keep the layer input, the outputs of every other aten.mm (wq, wv,
                          w1, w2) and of flash SDPA (output and log-sum-exp); recompute the rest
    planned (MILP)        checkpoint the chunk's first k decoder layers whole and the next j op-level
                          (selective-op's wrapper), offload the planned share of the
                          chunk's saved bytes (its DRAM and NVMe layers; both go to host memory here), and
                          keep the optimizer state on the host on the ranks the plan says
    recompute_norms       on every layer not checkpointed whole or op-level, the two norms' outputs are not
                          kept: Megatron-Core's output-discarding "layernorm" recomputation. The norm runs
                          under checkpoint (its input kept, not its internals), and the GEMMs that save its
                          output (directly, or as autocast's or the split backward's cast copy) save a token
                          instead, which redoes the norm when the backward unpacks it (`SavedTensors.regenerate`)
    offload_weights       the chunk's parameters leave the device between uses (runtime/weight_offload.py)
    offload_stash         the planned share of each I's W stash waits for its W in host memory
                          (runtime/stash_offload.py)

`SavedTensors` is a `saved_tensors_hooks` context around each forward. It counts the bytes autograd saves
for the backward (each storage once; parameters are not activations): the CPU's measure of a chunk's
activation memory, the simulator's `activation_bytes`. With an offload share > 0 it also moves saved
tensors to host memory when the forward saves them (until that share of the bytes is offloaded), on the
copy stream (runtime/streams.py: a CUDA side stream into pinned memory, so the copy overlaps compute; on
the CPU the same calls inline, into a separate host buffer, which exercises the same path and lets the
meter tell device-resident from offloaded bytes). They come back ahead of need: the executor calls
`prefetch()` for a chunk-microbatch a few actions before its backward, which issues the host-to-device
copies on the copy stream and records an event; the backward's unpack only makes the compute stream wait
for that event. A tensor not prefetched is copied back when unpacked (counted as `demand_bytes`). Offload
and metering go by storage: autograd saves some tensors twice and several views of one storage, which move
out (and back) once, as one copy of the whole storage; a storage is known by a weak reference to it, so a new
storage at a freed one's address counts anew. The hooks see checkpoint's inputs (it saves them through
autograd) but not the op-level policy's cache, so that policy reports the outputs it tells torch to keep.
Each policy keeps exactly the per-layer bytes the cost model counts for it (sim/activations.py,
sim/layer_ops.py; tests/test_runtime_recompute.py).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from pipeplan.runtime.streams import CopyStream, HostCopy
from pipeplan.sim.config import Scenario
from pipeplan.sim.errors import PipeplanError
from pipeplan.sim.ir import Schedule
from pipeplan.solver.memory_milp import MemoryChoice

if TYPE_CHECKING:
    from pipeplan.runtime.model import Transformer

_active = threading.local()


@dataclass(frozen=True)
class ChunkMemory:
    """What one chunk does with its activations at run time."""

    recompute: str  # a RECOMPUTE_WRAPPERS name: "none" | "full" | "selective" | "selective-op"
    offload_share: float  # share of the saved activation bytes moved to host after the forward
    recompute_layers: int | None = None  # checkpoint only the first k decoder layers (memory MILP); None: all
    label: str = "none"
    op_layers: int = 0  # then the next j decoder layers op-level ("selective-op"; memory MILP)
    norms: bool = False  # the other layers recompute their norms' outputs (memory.recompute_norms)


@dataclass(frozen=True)
class RunMemory:
    chunks: list[ChunkMemory]  # per chunk
    states_on_host: list[bool]  # per rank: optimizer state and fp32 master weights in host memory
    weights_offloaded: list[bool] | None = None  # per chunk: parameters off the device between uses
    stash_shares: list[float] | None = None  # per chunk: share of each W stash in host memory from I to W

    @property
    def offloads_weights(self) -> bool:
        return self.weights_offloaded is not None and any(self.weights_offloaded)

    @property
    def labels(self) -> list[str]:
        return [c.label for c in self.chunks]


def run_memory(sc: Scenario, schedule: Schedule, choice: MemoryChoice | None = None) -> RunMemory:
    """Per chunk and rank, the memory plan the simulator uses for this scenario and schedule (one resolver,
    solver.step.resolve_memory_plan; `choice`: the MILP's decision the launcher already solved)."""
    from pipeplan.sim.costs import build_cost_table
    from pipeplan.solver.step import resolve_memory_plan

    costs = build_cost_table(sc).with_microbatches(schedule.num_microbatches)
    mem = sc.memory
    resolved = resolve_memory_plan(sc, costs, schedule, choice)
    plan = resolved.plan
    stash = _stash_shares(plan)
    norms = mem.recompute_norms
    if resolved.choice is None:
        chunks = [ChunkMemory(p.removeprefix("chronos:"), mem.offload_activations, None, p, norms=norms)
                  for p in plan.policy]
        for c in chunks:
            if c.recompute not in RECOMPUTE_WRAPPERS:
                raise PipeplanError(f"memory.recompute: the runtime has no policy {c.recompute!r}; it runs "
                                    f"{', '.join(RECOMPUTE_WRAPPERS)} (and chronos, which resolves to them)")
        return RunMemory(chunks, [mem.optimizer != "hbm"] * schedule.num_ranks, _weights(plan), stash)
    assert costs.detail is not None  # a [model] scenario's cost table has its detail
    k, j, layers = resolved.choice.recompute_layers, resolved.choice.op_recompute_layers, costs.detail.layers
    share = _shares(plan.offload_bytes, plan.kept_bytes)
    chunks = [
        ChunkMemory("full" if k[c] else "none", abs(float(share[c])), int(k[c]), plan.policy[c], int(j[c]), norms)
        for c in range(len(layers))
    ]
    on_host = resolved.choice.states_on_host
    states = [bool(x) for x in on_host] if mem.optimizer == "hbm" else [True] * schedule.num_ranks
    return RunMemory(chunks, states, _weights(plan), stash)


def _stash_shares(plan) -> list[float] | None:
    """Per chunk, the share of its W stash the plan moves to host memory (None: nothing moves)."""
    if not plan.offloads_stash:
        return None
    return [float(x) for x in _shares(plan.stash_offload_bytes, plan.stash_bytes)]


def _shares(part, whole) -> np.ndarray:
    """Per chunk, part / whole (0 where the chunk holds nothing)."""
    part, whole = np.asarray(part, float), np.asarray(whole, float)
    return np.divide(part, whole, out=np.zeros(len(whole)), where=whole > 0)


def _weights(plan) -> list[bool]:
    """Per chunk, whether the plan moves its weights off the device in their idle windows."""
    return [bool(x) for x in plan.weight_offload_bytes] if len(plan.weight_offload_bytes) else []


def apply_policy(chunk: Transformer, policy: ChunkMemory | str) -> Transformer:
    """Recompute as `policy` says (names and parameters unchanged): its policy on every layer, or on the first
    `recompute_layers` and op-level on the `op_layers` after them (a planned chunk)."""
    if isinstance(policy, str):
        policy = ChunkMemory(policy.removeprefix("chronos:"), 0.0)
    wrap = RECOMPUTE_WRAPPERS.get(policy.recompute)
    if wrap is None:
        raise PipeplanError(f"memory.recompute: the runtime has no policy {policy.recompute!r}; it runs "
                            f"{', '.join(RECOMPUTE_WRAPPERS)}")
    layers = list(chunk.layers.values())
    k = len(layers) if policy.recompute_layers is None else policy.recompute_layers
    for layer in layers[:k]:
        wrap(layer)
    for layer in layers[k: k + policy.op_layers]:
        _checkpoint_layer_ops(layer)
    if policy.norms:  # whole-layer and op-level checkpointing redo the norms already
        redone = k if policy.recompute in ("full", "selective-op") else 0
        for layer in layers[redone + policy.op_layers:]:
            _recompute_norms(layer)
    return chunk


# ---- recomputation policies: name -> what it does to one decoder layer (runtime.model.TransformerBlock) --
def _keep_all(_layer: nn.Module) -> None:
    pass


def _checkpoint_layer(layer: nn.Module) -> None:
    """full: keep the layer's input, recompute the whole layer before its backward."""
    layer.forward = functools.partial(_checkpointed, layer.forward)


def _checkpoint_attention_core(layer: nn.Module) -> None:
    """selective: keep the core's inputs Q, K, V, recompute softmax(QK^T)V before its backward."""
    core = layer.get_submodule("attention.core")
    core.forward = functools.partial(_checkpointed, core.forward)


def _checkpoint_layer_ops(layer: nn.Module) -> None:
    """selective-op: keep the layer's input and what `op_policy` saves, recompute the other ops."""
    layer.forward = functools.partial(_checkpointed, layer.forward, context_fn=_op_contexts)


def _recompute_norms(layer: nn.Module) -> None:
    """recompute_norms: keep each norm's input, not its output; the GEMMs reading the output save a token."""
    for norm in (layer.get_submodule("attention_norm"), layer.get_submodule("ffn_norm")):
        norm.forward = functools.partial(_norm_without_output, norm.forward)


def _norm_without_output(forward, x: torch.Tensor) -> torch.Tensor:
    meter: SavedTensors | None = getattr(_active, "meter", None)
    if meter is None or not torch.is_grad_enabled():
        return forward(x)
    y = _checkpointed(forward, x)  # keeps x (reported to the meter), not the norm's internals
    meter.regenerate(y, functools.partial(forward, x))
    return y


RECOMPUTE_WRAPPERS: dict[str, Callable[[nn.Module], None]] = {
    "none": _keep_all, "full": _checkpoint_layer, "selective": _checkpoint_attention_core,
    "selective-op": _checkpoint_layer_ops,
}
"""The runtime's recompute policies, by the names sim.memory.RECOMPUTE gives them ("chronos" resolves per
chunk to "full" or "none" before it gets here)."""


def _checkpointed(forward, *args, context_fn: Callable | None = None):
    # checkpoint keeps its inputs for the recomputation through autograd (save_for_backward in its
    # _NoopSaveInputs), so the meter's hooks see them and may offload them: not reported separately
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn)


# torchtitan's op-level save list (torchtitan/parallelisms/parallelize_llama.py `_save_list` at 9dec370, the
# version sim/layer_ops.py models), plus the CPU's flash kernel, which SDPA dispatches to on the CPU where it
# dispatches to _scaled_dot_product_flash_attention on CUDA: the same outputs (output, log-sum-exp), so a CPU
# run keeps what a GPU run keeps.
OP_SAVE_LIST = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.abs.default,
    torch.ops.aten.max.default,
}


def op_policy() -> Callable[..., CheckpointPolicy]:
    """torchtitan's `_custom_policy` (parallelize_llama.py at 9dec370) for one checkpointed layer call: save the
    outputs of the ops in OP_SAVE_LIST except every second aten.mm (counted per forward and per recomputation,
    so the recomputation's decisions match the forward's), recompute everything else. Saved outputs are
    reported to the active meter (torch hands the op's output to the policy as `ctx.op_output`)."""
    mm_count = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            mm_count[mode] += 1
        save = func in OP_SAVE_LIST and not (func == torch.ops.aten.mm.default and mm_count[mode] % 2 == 0)
        meter: SavedTensors | None = getattr(_active, "meter", None)
        if save and mode == "forward" and meter is not None:
            meter.add(getattr(ctx, "op_output", None))
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_contexts():
    return create_selective_checkpoint_contexts(op_policy())


class _Regenerable:
    """A tensor the backward recomputes rather than keeps: `fn` redoes it, once, when first unpacked."""

    def __init__(self, fn: Callable[[], torch.Tensor]):
        self.fn = fn
        self.value: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self.value is None:
            with torch.no_grad():
                self.value = self.fn()
        return self.value


@dataclass(frozen=True)
class _Regenerated:
    """What a saved tensor packs to when it is a regenerable tensor, a view of it or a cast copy of it (cast copies
    keep the original's layout, so its strides and offset address the regenerated one's)."""

    source: _Regenerable
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int | torch.SymInt

    def get(self) -> torch.Tensor:
        return self.source.get().to(self.dtype).as_strided(self.size, self.stride, self.offset)


# autograd nodes a saved tensor may sit behind and still be read off the regenerated tensor: views, and one cast
_VIEW_NODES = {"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0"}
_CAST_NODE = "ToCopyBackward0"


@dataclass(frozen=True)
class _Offloaded:
    """What a saved tensor packs to when its storage is in host memory: the storage's copy (one per storage,
    shared by every tensor saved on it) and where in it the tensor lies."""

    copy: HostCopy
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int | torch.SymInt  # what Tensor.storage_offset() returns

    def get(self) -> torch.Tensor:
        storage = self.copy.get().untyped_storage()
        return torch.empty(0, dtype=self.dtype, device=self.copy.device).set_(
            storage, self.offset, self.size, self.stride)


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """t's whole storage as bytes (a view: what offload copies, so every tensor on it comes back)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class SavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Meter (and offload a share of) what autograd saves inside the context; see the module docstring."""

    def __init__(self, param_ptrs: set[int], offload_share: float = 0.0, stream: CopyStream | None = None):
        self.param_ptrs = param_ptrs
        self.share = offload_share
        self.stream = stream
        # storages seen, by address: a weak reference to the storage itself (a dead one means the address was
        # freed and may hold a new storage now) and its host copy when it was offloaded
        self._storages: dict[int, tuple[weakref.ref, HostCopy | None]] = {}
        self.device_bytes = 0  # saved activations that stay on the device
        self.host_bytes = 0  # saved activations moved to host memory
        self.offloaded: list[HostCopy] = []
        self.prefetched_bytes = 0  # brought back by prefetch, ahead of the backward
        self.demand_bytes = 0  # brought back only when the backward asked
        # regenerable tensors (recompute_norms), by storage (a live weak reference guards against reuse) and by
        # the autograd node that made them
        self._by_storage: dict[int, tuple[weakref.ref, _Regenerable]] = {}
        self._by_node: dict[object, _Regenerable] = {}
        super().__init__(self._pack, self._unpack)

    def __enter__(self):
        self._prev = getattr(_active, "meter", None)
        _active.meter = self
        return super().__enter__()

    def __exit__(self, *exc):
        _active.meter = self._prev
        return super().__exit__(*exc)

    def add(self, *tensors) -> None:
        """Count tensors kept outside autograd's saved tensors (checkpoint inputs, selective-op's cache), each
        storage once; anything that is not a tensor (tuples are searched) is ignored."""
        for t in tensors:
            if isinstance(t, (tuple, list)):
                self.add(*t)
            elif isinstance(t, torch.Tensor) and self.count(t):
                self.device_bytes += t.untyped_storage().nbytes()

    def count(self, t: torch.Tensor) -> bool:
        """True the first time t's storage is seen (parameters never count); a new storage at a freed one's
        address is a new storage."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.param_ptrs or self._seen(storage) is not None:
            return False
        self._storages[ptr] = (weakref.ref(storage), None)
        return True

    def _seen(self, storage: torch.UntypedStorage) -> tuple[weakref.ref, HostCopy | None] | None:
        """The record of this very storage (alive: storages keep their Python object while they live)."""
        hit = self._storages.get(storage.data_ptr())
        return hit if hit is not None and hit[0]() is storage else None

    def regenerate(self, t: torch.Tensor, fn: Callable[[], torch.Tensor]) -> None:
        """Save `t` (and its views and cast copies) as a token that calls fn() when the backward unpacks it,
        instead of keeping its bytes."""
        source = _Regenerable(fn)
        self._by_storage[t.untyped_storage().data_ptr()] = (weakref.ref(t), source)
        if t.grad_fn is not None:
            self._by_node[t.grad_fn] = source

    def regenerate_copy(self, t: torch.Tensor, copy: torch.Tensor) -> None:
        """`copy` is t cast outside autograd (the split backward's linear under autocast): if t is regenerable
        and contiguous, so is the copy."""
        source = self._regenerable(t) if (self._by_node or self._by_storage) and t.is_contiguous() else None
        if source is not None:
            self._by_storage[copy.untyped_storage().data_ptr()] = (weakref.ref(copy), source)

    def _regenerable(self, t: torch.Tensor) -> _Regenerable | None:
        """The regenerable tensor `t` is, is a view of, or is a cast copy of (a view of) — or None."""
        hit = self._by_storage.get(t.untyped_storage().data_ptr())
        if hit is not None and hit[0]() is not None:
            return hit[1]
        node, cast = t.grad_fn, False
        while node is not None and node not in self._by_node:
            name = node.name()
            if name == _CAST_NODE and not cast:
                cast = True
            elif name not in _VIEW_NODES or cast:  # views of a cast copy only: a cast of a view is laid out anew
                return None
            node = node.next_functions[0][0]
        return self._by_node.get(node) if node is not None else None

    def _pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() in self.param_ptrs:
            return t
        if self._by_node or self._by_storage:
            source = self._regenerable(t)
            if source is not None:
                return _Regenerated(source, t.dtype, t.size(), t.stride(), t.storage_offset())
        storage = t.untyped_storage()
        seen = self._seen(storage)
        if seen is not None:  # saved before (autograd saves some tensors twice, and views of one storage)
            copy = seen[1]
            return t if copy is None else _Offloaded(copy, t.dtype, t.size(), t.stride(), t.storage_offset())
        size = storage.nbytes()
        ref = weakref.ref(storage)
        if self.share <= 0 or self.host_bytes >= self.share * (self.host_bytes + self.device_bytes + size):
            self.device_bytes += size
            self._storages[storage.data_ptr()] = (ref, None)
            return t
        self.host_bytes += size
        if self.stream is None:
            self.stream = CopyStream(t.device)
        copy = HostCopy(_whole_storage(t), self.stream)
        self._storages[storage.data_ptr()] = (ref, copy)
        self.offloaded.append(copy)
        return _Offloaded(copy, t.dtype, t.size(), t.stride(), t.storage_offset())

    def prefetch(self) -> int:
        """Issue the copies back to the device for every offloaded tensor not yet on its way, the last saved
        first (the backward needs it first: sim.graph.LayerCopy's order); the bytes."""
        moved = 0
        for h in reversed(self.offloaded):
            if h.back is None:
                h.fetch()
                moved += h.nbytes
        self.prefetched_bytes += moved
        return moved

    def _unpack(self, packed):
        if isinstance(packed, _Regenerated):
            return packed.get()
        if not isinstance(packed, _Offloaded):
            return packed
        if packed.copy.back is None:  # not prefetched: copied back now (once per storage)
            self.demand_bytes += packed.copy.nbytes
            packed.copy.fetch()
        return packed.get()


def note_cast_copy(t: torch.Tensor, copy: torch.Tensor) -> None:
    """Tell the active meter that `copy` is `t` cast outside autograd (SavedTensors.regenerate_copy)."""
    meter: SavedTensors | None = getattr(_active, "meter", None)
    if meter is not None and copy is not t:
        meter.regenerate_copy(t, copy)


def param_storages(module: nn.Module) -> set[int]:
    """Storages that are not activations: parameters and buffers (the rotary tables, shared by every layer)."""
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
