"""One pipeline rank's step: run its actions in the schedule IR's order — the order the simulator used.

    F(s, mb)   input: tokens (s = 0), a local handoff, or a receive;  output: loss (last stage), a local
               handoff, or an asynchronous send.  The parameters frozen for (s, mb) have requires_grad
               off while the forward runs, so its graph has no weight-gradient edges for them.
    B(s, mb)   full backward from the loss or the received output gradient: weight gradients accumulate
               into .grad, the input gradient goes to stage s-1.
    I(s, mb)   the same, but linear layers queue their weight gradients (runtime/split_backward.py).
    W(s, mb)   runs what I(s, mb) queued.

Each action's start is taken once its inputs have arrived and its end when its compute is done (a monotonic
clock on the CPU, CUDA events on the GPU), relative to the step's start, in the simulator's trace schema;
the step's start is also kept on the host clock (`StepTrace.t0_s`), so that runtime/clock.py can put every
rank's times on rank 0's clock.
Saved-activation bytes are metered per chunk-microbatch (runtime/memory.py) from F until B/I frees them,
plus what I queued for W, giving a per-rank live-activation timeline; a share of what I queued can wait for
W in host memory (runtime/stash_offload.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipeplan.runtime import stash_offload
from pipeplan.runtime.memory import SavedTensors, param_storages
from pipeplan.runtime.model import cross_entropy
from pipeplan.runtime.p2p import P2P, Message, input_message
from pipeplan.runtime.split_backward import WeightGradStore
from pipeplan.runtime.streams import CopyStream, PinnedBuffers
from pipeplan.runtime.weight_offload import WeightOffload
from pipeplan.sim.config import MemoryConfig
from pipeplan.sim.copy_rules import prefetch_window
from pipeplan.sim.ir import Action, Kind, Schedule

LOOKAHEAD = 2  # receives posted for this many upcoming actions
# default: a backward's offloaded activations are fetched when the rank starts the action this many places
# before it (the scenario's memory.prefetch_lookahead default; sim.copy_rules.prefetch_window's rule)
PREFETCH_ACTIONS: int = MemoryConfig.model_fields["prefetch_lookahead"].default


def autocast(device: torch.device, dtype: torch.dtype | None) -> torch.autocast:
    """Autocast to `dtype` on this device type (CPU or CUDA, the same way); a no-op context for None."""
    return torch.autocast(device.type, dtype or torch.float32, enabled=dtype is not None)


def reset_device_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_peak_bytes(device: torch.device) -> int | None:
    """The CUDA allocator's peak since the last reset; None on the CPU (no allocator to ask)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


class Clock:
    """Marks on a monotonic clock (CPU) or CUDA events, read as seconds since `start()`; `host_t0` is the
    start on the host clock `now` (on CUDA the device is idle at the start, so its first event runs then)."""

    def __init__(self, device: torch.device, now: Callable[[], float] = time.perf_counter):
        self.cuda = device.type == "cuda"
        self.now = now
        self.t0: Any = 0.0  # a float (seconds) on the CPU, a torch.cuda.Event on CUDA
        self.host_t0 = 0.0

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self.now()

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.t0 = self.mark()
        self.host_t0 = self.now() if self.cuda else self.t0

    def seconds(self, mark) -> float:
        if self.cuda:
            mark.synchronize()
            return self.t0.elapsed_time(mark) / 1e3
        return mark - self.t0


@dataclass
class StepTrace:
    """What one rank measured in one step; times are seconds since the step's start."""

    actions: list[tuple[Action, float, float]] = field(default_factory=list)  # executed order
    split: list[tuple[Action, float, float]] = field(default_factory=list)  # I and W inside a profiled B
    losses: dict[int, float] = field(default_factory=dict)  # microbatch -> loss (last stage only)
    memory: list[tuple[float, int, int]] = field(default_factory=list)  # (time_s, live device, live host bytes)
    activation_bytes: dict[int, list[int]] = field(default_factory=dict)  # stage -> saved bytes per F
    offloaded_bytes: int = 0
    prefetched_bytes: int = 0  # of those, brought back ahead of their backward (the rest on demand)
    stash_offloaded_bytes: int = 0  # W stash moved to host after I
    stash_prefetched_bytes: int = 0  # of those, brought back ahead of their W (the rest on demand)
    peak_activation_bytes: int = 0
    peak_device_bytes: int | None = None  # CUDA allocator peak over the actions (Trainer.step: and the optimizer's)
    t0_s: float = 0.0  # the step's start on this rank's host clock (runtime/clock.py aligns ranks with it)

    def to_plain(self) -> dict[str, Any]:
        """Primitives only (actions as their strings): what a weights_only checkpoint can hold."""
        return {"actions": [(str(a), s, e) for a, s, e in self.actions],
                "split": [(str(a), s, e) for a, s, e in self.split], "losses": dict(self.losses),
                "memory": list(self.memory), "activation_bytes": dict(self.activation_bytes),
                "offloaded_bytes": self.offloaded_bytes, "prefetched_bytes": self.prefetched_bytes,
                "stash_offloaded_bytes": self.stash_offloaded_bytes,
                "stash_prefetched_bytes": self.stash_prefetched_bytes,
                "peak_activation_bytes": self.peak_activation_bytes,
                "peak_device_bytes": self.peak_device_bytes, "t0_s": self.t0_s}

    @classmethod
    def from_plain(cls, d: dict[str, Any]) -> StepTrace:
        return cls(**{**d, "actions": [(Action.parse(a), s, e) for a, s, e in d["actions"]],
                      "split": [(Action.parse(a), s, e) for a, s, e in d["split"]]})


class PipelineExecutor:
    def __init__(self, schedule: Schedule, rank: int, chunks: Mapping[int, nn.Module], p2p: P2P,
                 device: torch.device, offload_share: float | Mapping[int, float] = 0.0,
                 profile_backward: bool = False,
                 autocast_dtype: torch.dtype | None = None, now: Callable[[], float] = time.perf_counter,
                 offload_weights: Sequence[bool] | None = None, prefetch_lookahead: int = PREFETCH_ACTIONS,
                 offload_stash: float | Mapping[int, float] = 0.0):
        """`chunks` maps each stage this rank holds to its module; `profile_backward` runs every B as I then
        W back to back and reports both (pipeplan profile); `offload_share` of saved activations goes to host
        (one share, or one per stage);
        `autocast_dtype` runs the forwards in bf16/fp16 autocast, on the CPU and CUDA alike (the backward
        replays the forward's casts) — the fp32 weights are the master copy, gradients accumulate in fp32,
        and the activations that cross stages are fp32 (residual adds promote). `offload_weights` (per chunk)
        moves the chunks' parameters to host memory in their idle windows (runtime/weight_offload.py);
        `prefetch_lookahead` is how many actions ahead offloaded activations, W stashes and weights come back;
        `offload_stash` (one share, or one per stage) of each I's W stash goes to host until its W."""
        self.schedule, self.rank, self.chunks, self.p2p, self.device = schedule, rank, dict(chunks), p2p, device
        self.actions = schedule.ranks[rank]
        self.num_stages, self.m = schedule.num_stages, schedule.num_microbatches
        self.offload_share = {s: float(offload_share if isinstance(offload_share, int | float) else offload_share[s])
                              for s in self.chunks}
        self.profile_backward = profile_backward
        self.clock = Clock(device, now)
        self.param_ptrs = {s: param_storages(c) for s, c in self.chunks.items()}
        self.params = {s: dict(c.named_parameters()) for s, c in self.chunks.items()}
        self.stash_share = {s: float(offload_stash if isinstance(offload_stash, int | float) else offload_stash[s])
                            for s in self.chunks}
        offloads = any(x > 0 for x in (*self.offload_share.values(), *self.stash_share.values()))
        self.offload_stream = CopyStream(device) if offloads else None
        self.autocast_dtype = autocast_dtype
        self.lookahead = prefetch_lookahead
        self.weights = WeightOffload.build(schedule, rank, self.chunks, offload_weights, prefetch_lookahead, device) \
            if offload_weights is not None else None

    # ---- one step ------------------------------------------------------------------------------
    def run_step(self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
                 frozen: Mapping[tuple[int, int], Iterable[str]] | None = None) -> StepTrace:
        """Run this rank's actions once. `batches[mb]` = (inputs, labels), needed on the ranks holding the
        first and the last stage; `frozen[(stage, mb)]` names the chunk parameters frozen for that pair."""
        self.batches, self.frozen = batches, frozen or {}
        self.x: dict[tuple[int, int], torch.Tensor] = {}
        self.y: dict[tuple[int, int], torch.Tensor] = {}
        self.stores: dict[tuple[int, int], WeightGradStore] = {}
        self.saved: dict[tuple[int, int], tuple[int, int]] = {}  # (device, host) bytes
        self.local: dict[Message, torch.Tensor] = {}
        self.loss_tensors: dict[int, torch.Tensor] = {}
        self.live = [0, 0]
        self.marks: list[tuple[Action, object, object]] = []
        self.split_marks: list[tuple[Action, object, object]] = []
        self.memory_marks: list[tuple[object, int, int]] = []
        self._activation_log: dict[int, list[int]] = {}
        self._offloaded = self._prefetched = 0
        self.meters: dict[tuple[int, int], SavedTensors] = {}  # chunk-microbatches with offloaded tensors
        self.buffers = PinnedBuffers()  # the forwards' activation copies out, as the simulator bounds them
        self.stash_buffers = PinnedBuffers()  # the I's W stash copies out, the same way
        self.stash_bytes: dict[tuple[int, int], tuple[int, int]] = {}  # W stash (device, host) bytes
        self.stash_away: set[tuple[int, int]] = set()  # stashes with host copies not fetched yet
        self._stash_offloaded = self._stash_prefetched = 0
        trace = StepTrace()
        reset_device_peak(self.device)
        self.clock.start()
        self.memory_marks.append((self.clock.t0, 0, 0))
        if self.weights is not None:
            self.weights.begin_step()
        for i, action in enumerate(self.actions):
            if self.weights is not None:
                self.weights.before(i)
                self.param_ptrs[action.stage] = param_storages(self.chunks[action.stage])  # they may have moved
            for ahead in self.actions[i + 1 : i + 1 + LOOKAHEAD]:
                msg = input_message(ahead, self.num_stages)
                if msg is not None and self.p2p.is_remote(msg):
                    self.p2p.prefetch(msg)
            if self.meters:
                self._prefetch_activations(i)
            if self.stash_away:
                self._prefetch_stash(i)
            if action.kind is Kind.F:
                self._forward(action)
            elif action.kind is Kind.W:
                self._weight(action)
            else:
                self._backward(action)
            if self.weights is not None:
                self.weights.after(i)
        if self.weights is not None:
            self.weights.end_step()
        self.p2p.finish()
        trace.actions = [(a, self.clock.seconds(s), self.clock.seconds(e)) for a, s, e in self.marks]
        trace.split = [(a, self.clock.seconds(s), self.clock.seconds(e)) for a, s, e in self.split_marks]
        trace.memory = [(self.clock.seconds(t), d, h) for t, d, h in self.memory_marks]
        trace.peak_activation_bytes = max((d for _, d, _ in trace.memory), default=0)
        trace.losses = {mb: float(v) for mb, v in self.loss_tensors.items()}
        trace.t0_s = self.clock.host_t0
        trace.activation_bytes = self._activation_log
        trace.offloaded_bytes = self._offloaded
        trace.prefetched_bytes = self._prefetched
        trace.stash_offloaded_bytes = self._stash_offloaded
        trace.stash_prefetched_bytes = self._stash_prefetched
        trace.peak_device_bytes = device_peak_bytes(self.device)
        return trace

    def _prefetch_stash(self, i: int) -> None:
        """Bring back the offloaded W stash of the W's due as action i starts (sim.copy_rules.prefetch_window,
        as for activations), on the copy stream."""
        for a in self.actions[prefetch_window(i, self.lookahead)]:
            key = (a.stage, a.microbatch)
            if a.kind is Kind.W and key in self.stash_away:
                self.stash_away.discard(key)
                moved = stash_offload.prefetch(self.stores[key])
                self._stash_prefetched += moved
                device_bytes, host_bytes = self.stash_bytes[key]
                self.stash_bytes[key] = (device_bytes + host_bytes, 0)
                self._track(self.clock.mark(), host_bytes, -host_bytes)

    def _prefetch_activations(self, i: int) -> None:
        """Bring back the offloaded activations of the backwards due as action i starts (the simulator's rule,
        sim.copy_rules.prefetch_window), on the copy stream, so they are on the device before those backwards
        unpack them."""
        upcoming = [a for a in self.actions[prefetch_window(i, self.lookahead)] if a.kind in (Kind.B, Kind.I)]
        for a in upcoming:
            meter = self.meters.pop((a.stage, a.microbatch), None)
            if meter is None:
                continue
            moved = meter.prefetch()
            self._prefetched += moved
            device_bytes, host_bytes = self.saved[(a.stage, a.microbatch)]
            self.saved[(a.stage, a.microbatch)] = (device_bytes + host_bytes, 0)
            self._track(self.clock.mark(), host_bytes, -host_bytes)  # back on the device from here

    def _input(self, action: Action) -> torch.Tensor | None:
        msg = input_message(action, self.num_stages)
        if msg is None:
            return None
        if self.p2p.is_remote(msg):
            return self.p2p.recv(msg)
        return self.local.pop(msg)

    def _output(self, msg: Message, tensor: torch.Tensor) -> None:
        if self.p2p.is_remote(msg):
            self.p2p.send(msg, tensor)
        else:
            self.local[msg] = tensor.detach()

    def _track(self, mark, device_delta: int, host_delta: int = 0) -> None:
        self.live[0] += device_delta
        self.live[1] += host_delta
        self.memory_marks.append((mark, *self.live))

    def _forward(self, a: Action) -> None:
        key = (a.stage, a.microbatch)
        chunk = self.chunks[a.stage]
        received = self._input(a)
        if received is None:
            assert self.batches is not None  # the first stage's rank is given its microbatches
            x = self.batches[a.microbatch][0].to(self.device, non_blocking=True)  # tokens (b, T)
        else:
            x = received.requires_grad_(True)  # (b, T, h), a leaf: its .grad is the stage's input grad
        params = self.params[a.stage]
        frozen = [params[n] for n in self.frozen.get(key, ())]
        for p in frozen:
            p.requires_grad_(False)
        meter = SavedTensors(self.param_ptrs[a.stage], self.offload_share[a.stage], self.offload_stream)
        self.buffers.before()
        start = self.clock.mark()
        try:
            with meter, autocast(self.device, self.autocast_dtype):
                out = chunk(x)
                if a.stage == self.num_stages - 1:
                    assert self.batches is not None  # so is the last stage's
                    labels = self.batches[a.microbatch][1].to(self.device, non_blocking=True)
                    loss = cross_entropy(out, labels)
                    self.loss_tensors[a.microbatch] = loss.detach()
                    out = loss / self.m  # the step's loss is the mean over microbatches
        finally:
            for p in frozen:
                p.requires_grad_(True)  # between forwards every parameter requires grad (see freeze.py)
        end = self.clock.mark()
        self.marks.append((a, start, end))
        self.x[key], self.y[key] = x, out
        self.saved[key] = (meter.device_bytes, meter.host_bytes)
        self._activation_log.setdefault(a.stage, []).append(meter.device_bytes + meter.host_bytes)
        self._offloaded += meter.host_bytes
        self.buffers.after(meter.offloaded)
        if meter.offloaded:
            self.meters[key] = meter
        self._track(end, meter.device_bytes, meter.host_bytes)
        if a.stage < self.num_stages - 1:
            self._output(Message(False, a.stage, a.microbatch), out)

    def _backward(self, a: Action) -> None:
        key = (a.stage, a.microbatch)
        grad = self._input(a)  # None on the last stage: backward from the loss
        x, y = self.x.pop(key), self.y.pop(key)
        split = a.kind is Kind.I or self.profile_backward
        store = WeightGradStore()
        if a.kind is Kind.I:
            self.stash_buffers.before()
        start = self.clock.mark()
        if y.requires_grad:  # not when stage 0's whole chunk is frozen for this microbatch
            if split:
                with store.capture():
                    torch.autograd.backward(y, grad)
            else:
                torch.autograd.backward(y, grad)
        dx = x.grad if a.stage > 0 else None
        mid = self.clock.mark()
        if a.kind is Kind.B and split:
            store.run()
            end = self.clock.mark()
            self.split_marks += [(Action(a.stage, Kind.I, a.microbatch), start, mid),
                                 (Action(a.stage, Kind.W, a.microbatch), mid, end)]
        else:
            end = mid
        self.marks.append((a, start, end))
        del x, y
        device_bytes, host_bytes = self.saved.pop(key)
        self._track(end, -device_bytes, -host_bytes)
        if a.kind is Kind.I:
            self.stores[key] = store
            total = store.nbytes
            moved = 0
            if self.stash_share[a.stage] > 0 and total:
                assert self.offload_stream is not None  # made when any share is above 0
                moved = stash_offload.offload(store, self.stash_share[a.stage], self.offload_stream)
                self._stash_offloaded += moved
                self.stash_away.add(key)
            self.stash_buffers.after(stash_offload.copies_out(store))
            self.stash_bytes[key] = (total - moved, moved)
            self._track(end, total - moved, moved)
        if a.stage > 0:
            if dx is None:
                dx = torch.zeros(self.p2p.shape, dtype=self.p2p.dtype, device=self.device)
            self._output(Message(True, a.stage, a.microbatch), dx)

    def _weight(self, a: Action) -> None:
        key = (a.stage, a.microbatch)
        store = self.stores.pop(key)
        self.stash_away.discard(key)  # not prefetched: run() copies it back on demand
        device_bytes, host_bytes = self.stash_bytes.pop(key)
        start = self.clock.mark()
        store.run()
        end = self.clock.mark()
        self.marks.append((a, start, end))
        self._track(end, -device_bytes, -host_bytes)
