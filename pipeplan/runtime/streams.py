"""A copy stream: host <-> device copies off the compute stream on CUDA; the same calls inline on the CPU.

Offload (runtime/memory.py) and the host optimizer (runtime/optim.py) move tensors between the device and
host memory. On CUDA those copies belong on a side stream, so they overlap the compute stream's kernels,
into pinned host memory, so they are asynchronous DMA; ordering is then by events: the copy stream waits
for the compute that produced a tensor, and the compute stream waits for the copy before it uses the
result. `CopyStream` is that protocol with one implementation per device type: on the CPU there is no
stream, every call runs inline and events are None, so the CPU runs (and tests) the very same code path.
`HostCopy` is one tensor moved out and back under that protocol.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from pipeplan.sim.copy_rules import buffer_gate


class CopyStream:
    """A side stream for copies (CUDA) or its inline stand-in (CPU): see the module docstring."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def pin(self) -> bool:
        """Whether host buffers should be pinned (page-locked): only for a real device to copy from."""
        return self.stream is not None

    def host_empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=self.pin)

    def wait_for_compute(self) -> None:
        """Copies issued after this see everything the compute stream has issued so far."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    @contextmanager
    def use(self) -> Iterator[None]:
        """Issue the enclosed copies on the side stream."""
        if self.stream is None:
            yield
        else:
            with torch.cuda.stream(self.stream):
                yield

    def record(self) -> torch.cuda.Event | None:
        """An event marking the copies issued so far on the side stream (None on the CPU: already done)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def keep_alive(self, t: torch.Tensor) -> None:
        """t's memory must not be reused by the compute stream before the side stream's copy of it ran."""
        if self.stream is not None and t.is_cuda:
            t.record_stream(self.stream)

    def synchronize(self) -> None:
        """Block the host until the side stream's copies are done (before the host reads their results)."""
        if self.stream is not None:
            self.stream.synchronize()

    @staticmethod
    def hand_over(t: torch.Tensor) -> None:
        """A tensor the side stream allocated is now used by the compute stream: its memory must not be
        reused before the compute stream is done with it."""
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        """Make the compute stream wait for a copy (no-op for the CPU's None)."""
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


class HostCopy:
    """One tensor in host memory (an offloaded activation, runtime/memory.py; a W stash tensor,
    runtime/stash_offload.py): its copy out on `stream`, and its copy back once `fetch` issued it."""

    def __init__(self, t: torch.Tensor, stream: CopyStream):
        self.device, self.stream = t.device, stream
        self.host = stream.host_empty(t.shape, t.dtype)
        stream.wait_for_compute()
        with stream.use():
            self.host.copy_(t.detach(), non_blocking=True)
        stream.keep_alive(t)  # t's memory is not reused before the copy ran
        self.out = stream.record()
        self.back: torch.Tensor | None = None
        self.back_done: torch.cuda.Event | None = None

    @property
    def nbytes(self) -> int:
        return self.host.untyped_storage().nbytes()

    def fetch(self) -> None:
        with self.stream.use():  # after the copy out: the same stream runs them in order
            self.back = self.host.to(self.device, non_blocking=True)
        self.back_done = self.stream.record()

    def get(self) -> torch.Tensor:
        """The tensor on its device, for its user: prefetched (wait for that copy), or copied back now, on the
        compute stream."""
        if self.back is None:
            CopyStream.wait(self.out)
            return self.host.to(self.device, non_blocking=True)
        CopyStream.wait(self.back_done)
        CopyStream.hand_over(self.back)
        return self.back


class PinnedBuffers:
    """The simulator's bounded pinned buffers (sim.copy_rules.PINNED_BUFFERS): a producer's copies out (an F's
    offloaded activations) go through a fixed set of host buffers, so the next producer's compute waits for
    the copies out of the one that many back. On the CPU the copies ran inline and the waits are no-ops."""

    def __init__(self) -> None:
        self.copied: list[list[HostCopy]] = []  # per producer this step, in order: its copies out

    def before(self) -> None:
        """Before the next producer runs: make the compute stream wait for the copies that free its buffer."""
        for h in buffer_gate(self.copied) or ():
            CopyStream.wait(h.out)

    def after(self, copies: list[HostCopy]) -> None:
        self.copied.append(copies)
