"""Chronos-Offload of weights at run time: a chunk's parameters leave the device between their uses.

The windows are the simulator's (sim.graph.weight_windows): a chunk's weights leave after the action that
opens a window and come back before its next use, fetched on the copy stream (runtime/streams.py) when the
action `lookahead` places earlier starts, so the copy overlaps that compute. Leaving costs no copy: the host
holds a current copy of the chunk's parameters (pinned on CUDA). A released parameter keeps its Parameter
object (optimizer, autograd graph and names are untouched) with an empty tensor in place of its data, so a
use the plan did not prefetch fails loudly instead of computing on stale values; autograd's saved
references see the data swapped back before the backward that reads them.

The step boundary follows sim.memory.with_weight_offload's rule for an optimizer on the device (torch.optim
updates the parameters in place): only the chunks that start the step away (sim.graph.starts_away) are off
the device at the step's end; `end_step` brings them back for the update on the copy stream (the step's h2d
copy), and `begin_step`, after the update, refreshes every offloading chunk's host copy on the copy stream
(the step's d2h copy) and releases the chunks that start away. The copy stream is FIFO, so a prefetch
issued later reads the refreshed copy without the host waiting for it; `end_step` makes the compute stream
wait for the refresh before the next update writes the parameters. `log` holds the current step's events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from pipeplan.runtime.streams import CopyStream
from pipeplan.sim.graph import step_structure, weight_windows
from pipeplan.sim.ir import Schedule


@dataclass
class _Fetch:
    """Parameters on their way back for one use: device tensors and the copy stream's event."""

    tensors: list[torch.Tensor]
    event: torch.cuda.Event | None


@dataclass
class WeightOffload:
    """One rank's weight windows, executed around its actions (positions in the rank's order)."""

    chunks: Mapping[int, nn.Module]
    device: torch.device
    release_after: dict[int, list[int]]  # position -> chunks whose weights leave when it ends
    issue_at: dict[int, list[tuple[int, int]]]  # position -> (use position, chunk) prefetches it issues
    start_away: list[int]  # chunks whose weights are on the host at the step's start
    stream: CopyStream
    log: list[tuple[str, int, int]] = field(default_factory=list)  # (event, position, chunk), in order
    _host: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    _fetches: dict[tuple[int, int], _Fetch] = field(default_factory=dict)  # (use position, chunk) -> copy
    _away: set[int] = field(default_factory=set)

    @classmethod
    def build(cls, schedule: Schedule, rank: int, chunks: Mapping[int, nn.Module], offload: Sequence[bool],
              lookahead: int, device: torch.device) -> WeightOffload | None:
        """The windows of this rank's offloading chunks, or None when it offloads none."""
        mine = [bool(offload[s]) and s in chunks for s in range(schedule.num_stages)]
        if not any(mine):
            return None
        st = step_structure(schedule)
        base = st.rank_offsets[rank]
        release: dict[int, list[int]] = {}
        issue: dict[int, list[tuple[int, int]]] = {}
        start: list[int] = []
        for w in weight_windows(schedule, lookahead, mine):
            if w.release_after < 0:
                start.append(w.chunk)
            else:  # every other window opens with a release, the step's last one too
                release.setdefault(w.release_after - base, []).append(w.chunk)
            if w.next_use >= 0:
                issue.setdefault(w.issuer - base, []).append((w.next_use - base, w.chunk))
        return cls(chunks, device, release, issue, start, CopyStream(device))

    # ---- the step ------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """After the optimizer step: refresh the host copies on the copy stream, then release the chunks that
        start the step away (the copy stream keeps their device memory until it has read it)."""
        self.log = []
        self.stream.wait_for_compute()  # the update's writes come first
        with self.stream.use():
            for c in sorted({c for cs in self.release_after.values() for c in cs} | set(self.start_away)
                            | {c for cs in self.issue_at.values() for _, c in cs}):
                params = list(self.chunks[c].parameters())
                if c not in self._host:
                    self._host[c] = [self.stream.host_empty(p.shape, p.dtype) for p in params]
                for h, p in zip(self._host[c], params, strict=True):
                    h.copy_(p.data, non_blocking=True)
                    self.stream.keep_alive(p.data)
                self.log.append(("refresh", -1, c))
        for c in self.start_away:
            self._release(c, -1)

    def before(self, pos: int) -> None:
        """As the action at `pos` starts: issue the prefetches it issues, then install its own weights."""
        for use, c in self.issue_at.get(pos, ()):
            self._prefetch(use, c, pos)
        for (use, c), fetch in list(self._fetches.items()):
            if use == pos:
                del self._fetches[(use, c)]
                CopyStream.wait(fetch.event)
                for p, t in zip(self.chunks[c].parameters(), fetch.tensors, strict=True):
                    CopyStream.hand_over(t)
                    p.data = t
                self._away.discard(c)
                self.log.append(("ready", pos, c))

    def after(self, pos: int) -> None:
        """As the action at `pos` ends: release the chunks whose window it opens."""
        for c in self.release_after.get(pos, ()):
            self._release(c, pos)

    def end_step(self) -> None:
        """Bring the chunks that are away (those that start the step away) back for the optimizer's update, on
        the copy stream; the compute stream waits for it (and for the step's refresh of the host copies)."""
        for c in sorted(self._away):
            self._prefetch(-1, c, -1)
        CopyStream.wait(self.stream.record())
        for (_use, c), fetch in sorted(self._fetches.items()):
            for p, t in zip(self.chunks[c].parameters(), fetch.tensors, strict=True):
                CopyStream.hand_over(t)
                p.data = t
            self.log.append(("restore", -1, c))
        self._fetches.clear()
        self._away.clear()

    def _release(self, c: int, pos: int) -> None:
        for p in self.chunks[c].parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self._away.add(c)
        self.log.append(("release", pos, c))

    def _prefetch(self, use: int, c: int, pos: int) -> None:
        self.stream.wait_for_compute()
        with self.stream.use():
            tensors = [h.to(self.device, non_blocking=True, copy=True) for h in self._host[c]]
        self._fetches[(use, c)] = _Fetch(tensors, self.stream.record())
        self.log.append(("prefetch", pos, c))
