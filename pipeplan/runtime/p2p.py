"""Asynchronous point-to-point transfers between pipeline ranks, in one agreed order per pair of ranks.

Two kinds of message cross ranks: the activation a forward F(s, mb) sends to F(s+1, mb), and the input
gradient a backward B/I(s, mb) sends to B/I(s-1, mb). A hop between two chunks on the same rank (the V
schedules' turn, or interleaved chunks of one rank) never comes here: it is a local handoff.

Order. NCCL matches the sends and receives between two ranks in the order each side issues them, on one
stream per pair, so both sides must issue their operations on a pair in the same sequence or they can
deadlock. Each pair's sequence is fixed once, from a simulated step (sim.engine, unit costs): messages in
the order their producers finish. That order is consistent with every rank's own action order, so a rank
can always follow it: it issues a send as soon as the data exists (after posting any receives that come
first on the pair) and posts a receive as early as it likes — `prefetch` posts the receives the next few
actions need, `recv` waits for one. Gloo matches by tag anyway; following the same sequence costs nothing.

Shared GPUs. NCCL refuses two ranks on one device, so when a job has more ranks than GPUs (a pipeline
tried out on one GPU) the ranks join a gloo group and `via_host` stages every message through host memory:
copied to the CPU before the send, received there and copied to the device on `recv`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from pipeplan.sim.costs import CostTable
from pipeplan.sim.engine import simulate
from pipeplan.sim.graph import cross_stage_input
from pipeplan.sim.ir import Action, Kind, Schedule


def shares_gpus(device: torch.device) -> bool:
    """True when this CUDA rank is in a gloo group: ranks share GPUs and messages go through host memory."""
    return device.type == "cuda" and dist.is_initialized() and dist.get_backend() == "gloo"


@dataclass(frozen=True, slots=True)
class Message:
    grad: bool  # False: activation of F(stage, mb); True: input gradient of B/I(stage, mb)
    stage: int  # the producing stage
    microbatch: int

    @property
    def consumer_stage(self) -> int:
        return self.stage - 1 if self.grad else self.stage + 1


def input_message(action: Action, num_stages: int) -> Message | None:
    """The message action consumes, if its producer is another stage (the step graph's rule, sim/graph.py:
    F takes s-1's activation, B/I take s+1's input gradient)."""
    x = cross_stage_input(action, num_stages)
    return None if x is None else Message(action.kind is not Kind.F, x.stage, x.microbatch)


def pair_sequences(schedule: Schedule) -> dict[frozenset[int], list[Message]]:
    """Per unordered pair of ranks, every cross-rank message between them, in the order both issue them."""
    p, v, m = schedule.num_ranks, schedule.virtual_stages, schedule.num_microbatches
    ones = np.ones(p * v)
    result = simulate(schedule, CostTable(p, v, m, ones, ones, ones, ones, np.zeros(p * v), p2p_s=0.0))
    seqs: dict[frozenset[int], list[Message]] = {}
    for src, dst, action_text, _begin, _end in result.transfers:
        a = Action.parse(action_text)
        msg = Message(a.kind is not Kind.F, a.stage, a.microbatch)
        seqs.setdefault(frozenset((src, dst)), []).append(msg)
    return seqs


class P2P:
    """One rank's sends and receives for one step (see module docstring); reusable step after step."""

    def __init__(self, schedule: Schedule, rank: int, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, group: dist.ProcessGroup | None = None, via_host: bool = False):
        self.rank, self.shape, self.dtype, self.device, self.group = rank, shape, dtype, device, group
        self.wire = torch.device("cpu") if via_host else device  # where messages travel
        self.stage_to_rank = schedule.stage_to_rank
        self.num_microbatches = schedule.num_microbatches
        self.seq: dict[int, list[Message]] = {}
        self.index: dict[Message, tuple[int, int]] = {}  # message -> (peer, position in the pair sequence)
        for pair, msgs in pair_sequences(schedule).items():
            if rank in pair:
                (peer,) = pair - {rank}
                self.seq[peer] = msgs
                self.index.update({msg: (peer, i) for i, msg in enumerate(msgs)})
        self.reset()

    def reset(self) -> None:
        self.issued = dict.fromkeys(self.seq, 0)
        self.ready: dict[Message, torch.Tensor] = {}
        self.posted: dict[Message, tuple[torch.Tensor, dist.Work]] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []

    def is_remote(self, msg: Message) -> bool:
        return msg in self.index

    def _tag(self, msg: Message) -> int:
        return (2 * msg.stage + int(msg.grad)) * self.num_microbatches + msg.microbatch

    def _peer_global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    def _issue(self, peer: int, upto: int, strict: bool) -> None:
        """Issue the pair's operations up to position `upto`; a send whose data is not ready yet stops
        the walk (strict: that is a bug, since the pair order agrees with this rank's action order)."""
        seq = self.seq[peer]
        while self.issued[peer] <= upto:
            msg = seq[self.issued[peer]]
            if self.stage_to_rank[msg.consumer_stage] == self.rank:
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.wire)
                work = dist.irecv(buf, self._peer_global(peer), group=self.group, tag=self._tag(msg))
                assert work is not None  # None only on a rank outside the group
                self.posted[msg] = (buf, work)
            else:
                tensor = self.ready.pop(msg, None)
                if tensor is None:
                    if strict:
                        raise RuntimeError(f"P2P order with rank {peer}: {msg} is due before it was produced")
                    return
                work = dist.isend(tensor, self._peer_global(peer), group=self.group, tag=self._tag(msg))
                assert work is not None  # None only on a rank outside the group
                self.sends.append((work, tensor))
            self.issued[peer] += 1

    def send(self, msg: Message, tensor: torch.Tensor) -> None:
        peer, i = self.index[msg]
        self.ready[msg] = tensor.detach().to(self.wire).contiguous()
        self._issue(peer, i, strict=True)

    def prefetch(self, msg: Message) -> None:
        peer, i = self.index[msg]
        self._issue(peer, i, strict=False)

    def recv(self, msg: Message) -> torch.Tensor:
        peer, i = self.index[msg]
        self._issue(peer, i, strict=True)
        buf, work = self.posted.pop(msg)
        work.wait()
        return buf.to(self.device, non_blocking=True)

    def finish(self) -> None:
        """Wait for this step's sends; every message of the step must have been issued and consumed."""
        for work, _tensor in self.sends:
            work.wait()
        left = [str(m) for m in self.posted] + [str(m) for m in self.ready]
        if left or any(self.issued[p] != len(s) for p, s in self.seq.items()):
            raise RuntimeError(f"P2P: step ended with messages not consumed or not sent: {left}")
        self.reset()
