"""An independent reference for the engine: one training step walked by hand from docs/simulator.md's rules,
without the step graph's or the engine's code (only the schedule's action lists are shared).

Rules, as the docs state them: a rank runs its actions in order, one at a time. F(s) needs F(s-1); B or I(s)
needs its own F(s) and the backward (B or I) of s+1; W needs its I. Durations: F, I, W from the table, B =
I + W. A result consumed on another rank crosses the directed link between the ranks: one transfer at a time,
`p2p_s` each, in the order the sender produces them; with blocking sends the sender's next action waits until
its send has arrived. Activations: an F holds its chunk's bytes from its start until its B or I ends; an I
then holds the chunk's W stash until its W ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeplan.sim.ir import Action, Kind


@dataclass
class ReferenceStep:
    start: dict[Action, float] = field(default_factory=dict)
    end: dict[Action, float] = field(default_factory=dict)
    p2p_wait: list[float] = field(default_factory=list)  # per rank: idle only because an input was in transit
    peak_activation: list[float] = field(default_factory=list)  # per rank
    transfers: int = 0

    @property
    def makespan(self) -> float:
        return max(self.end.values(), default=0.0)


def _duration(a: Action, f, i, w) -> float:
    s = a.stage
    return f[s] if a.kind is Kind.F else i[s] if a.kind is Kind.I else w[s] if a.kind is Kind.W else i[s] + w[s]


def _needs(a: Action, present: set[Action], last_stage: int) -> list[Action]:
    if a.kind is Kind.F:
        return [Action(a.stage - 1, Kind.F, a.microbatch)] if a.stage > 0 else []
    if a.kind is Kind.W:
        return [Action(a.stage, Kind.I, a.microbatch)]
    own = [Action(a.stage, Kind.F, a.microbatch)]
    if a.stage == last_stage:
        return own
    later = [x for x in (Action(a.stage + 1, k, a.microbatch) for k in (Kind.B, Kind.I)) if x in present]
    return own + later[:1]


def _receiver_stage(a: Action, last_stage: int) -> int | None:
    """The stage that consumes `a`'s result: F feeds the next stage, B/I the previous one, W nobody."""
    if a.kind is Kind.F:
        return a.stage + 1 if a.stage < last_stage else None
    if a.kind in (Kind.B, Kind.I):
        return a.stage - 1 if a.stage > 0 else None
    return None


def reference_step(sched, f, i, w, act, stash, p2p_s: float = 0.0, blocking: bool = False) -> ReferenceStep:
    """Walk the step: a rank takes its next action as soon as every input of it has a known arrival time."""
    ranks = [list(r) for r in sched.ranks]
    s2r, last = list(sched.stage_to_rank), sched.num_stages - 1
    present = {a for r in ranks for a in r}
    out = ReferenceStep(p2p_wait=[0.0] * len(ranks))
    arrive: dict[Action, float] = {}  # when a's result is usable on its consumer's rank
    free, pos, link_free = [0.0] * len(ranks), [0] * len(ranks), {}
    while any(p < len(r) for p, r in zip(pos, ranks, strict=True)):
        moved = False
        for r, actions in enumerate(ranks):
            while pos[r] < len(actions):
                a = actions[pos[r]]
                needs = _needs(a, present, last)
                if any(x not in out.end for x in needs):
                    break
                ready = max([free[r], *(arrive[x] if s2r[x.stage] != r else out.end[x] for x in needs)])
                produced = max([free[r], *(out.end[x] for x in needs)])
                out.p2p_wait[r] += ready - produced
                out.start[a], out.end[a] = ready, ready + _duration(a, f, i, w)
                free[r] = out.end[a]
                to = _receiver_stage(a, last)
                if to is not None and s2r[to] != r:
                    link = (r, s2r[to])
                    arrive[a] = link_free[link] = max(out.end[a], link_free.get(link, 0.0)) + p2p_s
                    out.transfers += 1
                    if blocking:
                        out.p2p_wait[r] += arrive[a] - out.end[a]
                        free[r] = arrive[a]
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("the reference walk is stuck: the schedule deadlocks")
    out.peak_activation = [_peak(actions, act, stash) for actions in ranks]
    return out


def _peak(actions: list[Action], act, stash) -> float:
    """The rank's activations change only as its own actions start (F) and end (B, I, W), in its order."""
    live, peak = 0.0, 0.0
    for a in actions:
        if a.kind is Kind.F:
            live += act[a.stage]
        elif a.kind is Kind.B:
            live -= act[a.stage]
        elif a.kind is Kind.I:
            live += stash[a.stage] - act[a.stage]
        else:
            live -= stash[a.stage]
        peak = max(peak, live)
    return peak

