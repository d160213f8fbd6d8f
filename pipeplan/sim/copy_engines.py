"""Each rank's copy engines in a simulated step: one SimPy resource per stream (sim.copy_rules.Stream), so
copies on one stream run one at a time in the order they asked (FIFO), and the log of every copy as its
stream granted it (SimResult.copies), which the step graph chains in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

import simpy

from pipeplan.sim.copy_rules import CopyKind, Stream
from pipeplan.sim.graph import SideTask
from pipeplan.sim.ir import Action
from pipeplan.sim.results import CopyRecord

Process = Generator[simpy.Event, None, None]  # a SimPy process body


@dataclass(slots=True)
class _Grant:
    """One copy as its stream granted it; `end` is set when the copy is done (a CopyRecord once the step ends)."""

    rank: int
    stream: Stream
    what: CopyKind
    i: int  # the action's node index, or -1 (the optimizer step's copies)
    stage: int
    start: float
    end: float


class CopyEngines:
    """The streams of every rank, the grant-order log, and when the last side-chain copy ended."""

    def __init__(self, env: simpy.Environment, n_ranks: int):
        self.env = env
        self.streams = {s: [simpy.Resource(env) for _ in range(n_ranks)] for s in Stream}
        self.log: list[_Grant] = []  # at grant
        self.end_s = 0.0  # the last side chain's end: the pipeline's makespan is no earlier

    def hold(self, rank: int, stream: Stream, what: CopyKind, i: int, stage: int, seconds: float | None,
             end_no_earlier: float = 0.0, on_grant: Callable[[], None] | None = None) -> Process:
        """Queue on the rank's `stream`, then copy for `seconds` (None: an empty copy, no time). A copy that
        must end no earlier than `end_no_earlier` (its last piece is made then) waits for it once granted;
        `on_grant` runs as the copy starts (HBM taken for a prefetch)."""
        env = self.env
        with self.streams[stream][rank].request() as req:
            yield req
            if end_no_earlier - (seconds or 0.0) > env.now:
                yield env.timeout(end_no_earlier - (seconds or 0.0) - env.now)
            entry = _Grant(rank, stream, what, i, stage, env.now, env.now)
            self.log.append(entry)
            if on_grant is not None:
                on_grant()
            if seconds is not None:
                yield env.timeout(seconds)
            entry.end = env.now

    def side_chain(self, chain: tuple[SideTask, ...], rank: int) -> Process:
        """One chain of side tasks (sim.graph.side_chains): each queues on its copy engine (FIFO) or runs on
        the host, after the previous one; the step ends no earlier than the chain."""
        for task in chain:
            if task.stream is None:
                yield self.env.timeout(task.seconds)
            else:
                yield from self.hold(rank, task.stream, CopyKind.STEP, -1, task.chunk, task.seconds)
        self.end_s = max(self.end_s, self.env.now)

    def records(self, actions: tuple[Action, ...]) -> list[CopyRecord]:
        return [CopyRecord(g.rank, g.stream, g.what, actions[g.i] if g.i >= 0 else None, g.stage, g.start, g.end)
                for g in self.log]
