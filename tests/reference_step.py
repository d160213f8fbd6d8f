"""An independent reference for the engine: one training step walked by hand from docs/simulator.md's rules,
without the step graph's or the engine's code (only the schedule's action lists are shared).

Rules, as the docs state them: a rank runs its actions in order, one at a time. F(s) needs F(s-1); B or I(s)
needs its own F(s) and the backward (B or I) of s+1; W needs its I. Durations: F, I, W from the table, B =
I + W. A result consumed on another rank crosses the directed link between the ranks: one transfer at a time,
`p2p_s` each, in the order the sender produces them; with blocking sends the sender's next action waits until
its send has arrived. Activations: an F holds its chunk's bytes from its start until its B or I ends; an I
then holds the chunk's W stash until its W ends.

With activation offload (`Offload`, whole chunks, DRAM): each rank has one device-to-host and one host-to-device
copy engine, each FIFO. Every F's offloaded part is copied out after the F (and leaves HBM when the copy ends); a
forward may not start while more than one earlier copy out is unfinished (two pinned buffers). Every backward's
part comes back on the h2d engine, asked for when the rank starts the action `lookahead` places before the
backward (its first action for the first few) or, if later, when the copy out ends; HBM is taken when the copy
starts and the backward waits for its end. Waiting on copies is stall. With W stash offload too, every I's
offloaded stash part is copied out after the I on the same d2h engine (in the rank's order with the
forwards' copies), an I waits for the stash copy out two I's back, and every W's part comes back on the h2d
engine under the same issue rule, in one list with the backwards' prefetches. With weight offload
(docs/memory.md), a chunk's weights leave HBM after a use whose next use lies more than lookahead + 1
actions later, and come back on the h2d engine, asked for when the action lookahead places before that use
starts (before that action's other prefetches); read cyclically over the step's end, a chunk whose first use
lies more than lookahead actions in starts the step away.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pipeplan.sim.ir import Action, Kind


@dataclass
class ReferenceStep:
    start: dict[Action, float] = field(default_factory=dict)
    end: dict[Action, float] = field(default_factory=dict)
    p2p_wait: list[float] = field(default_factory=list)  # per rank: idle only because an input was in transit
    peak_activation: list[float] = field(default_factory=list)  # per rank
    transfers: int = 0
    stall: list[float] = field(default_factory=list)  # per rank: waited on copies (offload only)
    peak_hbm: list[float] = field(default_factory=list)  # per rank: activations in HBM (offload only)
    copies: dict[tuple[int, str], list[str]] = field(default_factory=dict)  # (rank, stream) -> grant order

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


def reference_step(sched, f, i, w, act, stash, p2p_s: float = 0.0, blocking: bool = False,
                   offload: Offload | None = None) -> ReferenceStep:
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
                if offload is not None:
                    ready = offload.before(r, pos[r], a, ready)
                out.start[a], out.end[a] = ready, ready + _duration(a, f, i, w)
                if offload is not None:
                    offload.after(r, a, out.start[a], out.end[a])
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
    if offload is not None:
        out.stall, out.peak_hbm, out.copies = offload.stall, offload.peaks(), offload.copies
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



_PRODUCER = {Kind.B: Kind.F, Kind.I: Kind.F, Kind.W: Kind.I}  # a consumer's bytes come from this action


def _use(key) -> Action:
    """The action a copy back is for: a consumer, or (\"weights\", its next use)."""
    return key[1] if type(key) is tuple else key


class Offload:
    """Activation (and W stash) offload on each rank's two FIFO copy engines (module docstring), walked with
    the ranks. `offloaded` and `stash_offloaded` are per chunk and microbatch (None: that kind is not copied);
    `stash` what an I keeps."""

    def __init__(self, sched, act, offloaded, bandwidth: float, lookahead: int, stash=None, stash_offloaded=None,
                 weights=None, static=None):
        self.bw, self.act_copies, self.stash_copies = bandwidth, offloaded is not None, stash_offloaded is not None
        self.keep = {Kind.F: act, Kind.I: stash if stash is not None else 0 * act}
        self.off = {Kind.F: offloaded, Kind.I: stash_offloaded}
        self.ranks = [list(r) for r in sched.ranks]
        n = len(self.ranks)
        self.pos = {a: k for r in self.ranks for k, a in enumerate(r)}
        self.on_rank = [set(r) for r in self.ranks]
        copied = ((Kind.B, Kind.I) if self.act_copies else ()) + ((Kind.W,) if self.stash_copies else ())
        self.issues: dict[tuple[int, int], list[Action]] = {}  # (rank, position) -> consumers its start asks for
        for r, actions in enumerate(self.ranks):
            for k, a in enumerate(actions):
                if a.kind in copied:
                    self.issues.setdefault((r, max(k - lookahead, 0)), []).append(a)
        self.ran: dict[Kind, list[list[Action]]] = {Kind.F: [[] for _ in range(n)], Kind.I: [[] for _ in range(n)]}
        self.out_end: dict[Action, float] = {}  # producer -> its copy out's end
        self.asked: dict[Action, float] = {}  # consumer -> when its issuer started
        self.back: dict[Action, tuple[float, float]] = {}  # consumer -> its copy back's (start, end)
        self.d2h_free, self.h2d_free, self.stall = [0.0] * n, [0.0] * n, [0.0] * n
        self.events: list[list[tuple[float, float]]] = [[] for _ in range(n)]  # per rank: (time, HBM change)
        self.copies: dict[tuple[int, str], list[str]] = {}
        self.static = list(static) if static is not None else [0.0] * n
        self._weight_windows(lookahead, weights)

    def _copies(self, kind: Kind) -> bool:
        return (kind is Kind.F and self.act_copies) or (kind is Kind.I and self.stash_copies)

    def before(self, r: int, k: int, a: Action, ready: float) -> float:
        """When the rank's k-th action `a` may start, inputs there at `ready`; issues what its start asks for."""
        t = ready
        if self._copies(a.kind) and len(self.ran[a.kind][r]) >= 2:
            t = max(t, self.out_end[self.ran[a.kind][r][-2]])
        for key in (a, ("weights", a)):
            if key in self.asked:
                t = max(t, self._granted_until(r, key)[1])
        self.stall[r] += t - ready
        for use, c in self.w_issue.get((r, k), ()):
            key = ("weights", use)
            self.asked[key], self.w_order[key], self.w_bytes[key] = t, len(self.w_order), self.weights[c]
        for b in self.issues.get((r, k), ()):
            self.asked[b] = t
        return t

    def _weight_windows(self, lookahead: int, weights) -> None:
        """Offloaded weights leave after a use when the next use lies more than lookahead + 1 actions later, and
        come back asked for by the action lookahead places before it; read cyclically over the step's end, a
        chunk whose first use lies more than lookahead actions in starts the step away (docs/memory.md)."""
        self.weights, self.w_order, self.w_bytes = weights, {}, {}
        self.w_release: dict[tuple[int, int], list[int]] = {}  # (rank, position) -> chunks leaving as it ends
        self.w_issue: dict[tuple[int, int], list[tuple[Action, int]]] = {}  # (rank, position) -> (use, chunk)
        self.away = [0.0] * len(self.ranks)
        for r, actions in enumerate(self.ranks if weights is not None else ()):
            uses: dict[int, list[int]] = {}
            for k, a in enumerate(actions):
                uses.setdefault(a.stage, []).append(k)
            for c, ks in sorted(uses.items()):
                gaps = [(k1, k2) for k1, k2 in itertools.pairwise(ks) if k2 - k1 > lookahead + 1]
                if ks[0] > lookahead:  # away across the step's boundary
                    self.away[r] += weights[c]
                    gaps = [(None, ks[0]), *gaps, (ks[-1], None)]
                for k1, k2 in gaps:
                    if k1 is not None:
                        self.w_release.setdefault((r, k1), []).append(c)
                    if k2 is not None:
                        self.w_issue.setdefault((r, k2 - lookahead), []).append((actions[k2], c))

    def after(self, r: int, a: Action, start: float, end: float) -> None:
        s = a.stage
        for c in self.w_release.get((r, self.pos[a]), ()):
            self.events[r].append((end, -self.weights[c]))
        if a.kind is Kind.F:
            self.events[r].append((start, self.keep[Kind.F][s]))
        elif a.kind is Kind.B:
            self.events[r].append((end, -self.keep[Kind.F][s]))
        elif a.kind is Kind.I:
            self.events[r].append((end, self.keep[Kind.I][s] - self.keep[Kind.F][s]))
        else:
            self.events[r].append((end, -self.keep[Kind.I][s]))
        if self._copies(a.kind):
            self.ran[a.kind][r].append(a)
            begin = max(end, self.d2h_free[r])
            self.out_end[a] = self.d2h_free[r] = begin + self.off[a.kind][s] / self.bw
            self.events[r].append((self.out_end[a], -self.off[a.kind][s]))
            self.copies.setdefault((r, "d2h"), []).append(f"{'offload' if a.kind is Kind.F else 'stash-offload'} {a}")

    def _granted_until(self, r: int, b: Action) -> tuple[float, float]:
        """Grant the rank's asked-for copies back in the order they were asked (their copy out done), up to b's."""
        while b not in self.back:
            waiting = [w for w in map(self._request, self.asked) if w is not None and _use(w[-1]) in self.on_rank[r]]
            asked_at, _, _, x = min(waiting)
            weights = type(x) is tuple
            nbytes = self.w_bytes[x] if weights else self.off[_PRODUCER[x.kind]][x.stage]
            begin = max(asked_at, self.h2d_free[r])
            self.back[x] = (begin, begin + nbytes / self.bw)
            self.h2d_free[r] = self.back[x][1]
            self.events[r].append((begin, nbytes))
            label = "weights" if weights else "stash-prefetch" if x.kind is Kind.W else "prefetch"
            self.copies.setdefault((r, "h2d"), []).append(f"{label} {_use(x)}")
        return self.back[b]

    def _request(self, key):
        """(when the copy back asks for its engine, weights before copies asked at once, their order, key), or
        None when not asked yet, granted, or its copy out has not run."""
        if key in self.back:
            return None
        if type(key) is tuple:  # ("weights", use): asked as its issuer starts
            return self.asked[key], 0, self.w_order[key], key
        producer = Action(key.stage, _PRODUCER[key.kind], key.microbatch)
        if producer not in self.out_end:
            return None
        return max(self.asked[key], self.out_end[producer]), 1, self.pos[key], key

    def peaks(self) -> list[float]:
        """Per rank: the most HBM its activations and stashes held; at equal times, frees come first (a
        producer held back by a pinned buffer starts as that copy ends and frees it)."""
        out = []
        for r, events in enumerate(self.events):
            live = peak = self.static[r] - self.away[r]
            for _, delta in sorted(events, key=lambda e: (e[0], e[1] > 0)):
                live += delta
                peak = max(peak, live)
            out.append(peak)
        return out
