"""When a simulated step copies what, with stream semantics (docs/simulator.md, Offload): activations after F
and W stashes after I go to the host and come back before their consumer, and offloaded weights come back
before their next use. The step's rules come from sim.graph (prefetch_issuer, weight_windows, LayerCopy,
side_chains) and sim.copy_rules (PINNED_BUFFERS); the copies run on sim.copy_engines and move bytes in the
sim.ledger.

The engine calls three hooks per action: `before` (wait for the pinned-buffer gate and the prefetches, then
issue the prefetches this action's start issues), `at_start` and `after` (queue the copies out).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

import simpy

from pipeplan.sim.copy_engines import CopyEngines, Process
from pipeplan.sim.copy_rules import CopyKind, Stream, buffer_gate
from pipeplan.sim.graph import (
    STASH_KINDS,
    LayerCopy,
    action_recompute_s,
    activation_layer_copies,
    activation_nvme,
    prefetch_issuer,
    side_chains,
    stash_layer_copies,
    step_structure,
    weight_windows,
)
from pipeplan.sim.ir import BACKWARD_KINDS, Kind, Schedule
from pipeplan.sim.ledger import HbmLedger
from pipeplan.sim.memory_plan import MemoryPlan


@dataclass
class Flavor:
    """One kind of offloaded bytes: activations (F -> B/I) or a W stash (I -> W)."""

    out: CopyKind  # the copy after the producer
    back: CopyKind  # the prefetch before the consumer
    nbytes: list[float]  # per chunk
    nvme: list[bool]  # per chunk: to NVMe (else DRAM)
    layered: list[LayerCopy | None]  # per chunk: layer by layer (memory.copy_granularity = "layer")
    done: dict[int, simpy.Event]  # producer node -> its copy out has ended
    ran: list[list[int]] = field(default_factory=list)  # per rank: its producers in the order they ran


class WeightShuttle:
    """Weight offload (sim.graph.weight_windows): a chunk's weights leave HBM as a window opens (no copy: the
    host keeps theirs) and come back on the h2d engine, issued as the window's issuer starts."""

    def __init__(self, schedule: Schedule, mem: MemoryPlan, n_ranks: int):
        self.nbytes = mem.weight_offload_bytes.tolist() if mem.offloads_weights else []
        self.release: dict[int, list[int]] = {}  # node -> chunks whose weights leave as it ends
        self.issue: dict[int, list[tuple[int, int]]] = {}  # issuer -> (next use, chunk)
        self.back: dict[int, simpy.Event] = {}  # next use -> its weights are in HBM again
        self.away = [0.0] * n_ranks  # per rank: offloaded weights off HBM at the step's start
        if not mem.offloads_weights:
            return
        s2r = schedule.stage_to_rank
        for w in weight_windows(schedule, mem.prefetch_lookahead, mem.weight_offload_bytes > 0):
            if w.release_after < 0:
                self.away[s2r[w.chunk]] += self.nbytes[w.chunk]
            else:
                self.release.setdefault(w.release_after, []).append(w.chunk)
            if w.next_use >= 0:
                self.issue.setdefault(w.issuer, []).append((w.next_use, w.chunk))


class Prefetches:
    """Which node's start issues each consumer's prefetch (sim.graph.prefetch_issuer: B/I for activations, W
    for its stash), and how each prefetch is going."""

    def __init__(self, schedule: Schedule, mem: MemoryPlan):
        issuer = prefetch_issuer(schedule, mem.prefetch_lookahead) if mem.offloads else {}  # B/I -> node
        if mem.offloads_stash:  # W -> the node whose start issues its stash prefetch
            issuer.update(prefetch_issuer(schedule, mem.prefetch_lookahead, STASH_KINDS))
        self.issuer = issuer
        self.issues: dict[int, list[int]] = {}  # node -> the B/I and W prefetches its start issues, in rank order
        for b, at in sorted(issuer.items()):
            self.issues.setdefault(at, []).append(b)
        self.done: dict[int, simpy.Event] = {}  # consumer -> its bytes are back in HBM
        self.granted: dict[int, simpy.Event] = {}  # layer-wise consumer -> its prefetch has started
        self.span: dict[int, tuple[float, float]] = {}  # consumer -> its prefetch's (start, end)


class Offloads:
    """The copies a memory plan makes during the step, and the waits they impose on the ranks."""

    def __init__(self, env: simpy.Environment, schedule: Schedule, mem: MemoryPlan, hbm: HbmLedger,
                 weights: WeightShuttle, duration: list[float], start: list[float]):
        st = step_structure(schedule)
        self.env, self.st, self.mem, self.hbm, self.weights = env, st, mem, hbm, weights
        self.duration, self.start = duration, start  # the engine's per-node lists, read as actions start
        n_ranks = len(st.rank_offsets) - 1
        self.engines = CopyEngines(env, n_ranks)
        self.copying = mem.offloads or mem.offloads_weights or mem.offloads_stash  # may an action wait on a copy
        self.stall = [0.0] * n_ranks  # per rank: time waited on copies
        self.flavors = self._flavors(n_ranks)  # producer kind -> Flavor
        self.fetches = Prefetches(schedule, mem)
        self.side_chains = side_chains(schedule, mem)  # work that follows an action off the compute stream
        self.layered = any(lc is not None for fl in self.flavors.values() for lc in fl.layered)  # copies out at start
        self.follows = bool(self.flavors or self.side_chains or weights.release)  # something may follow an action

    def _flavors(self, n_ranks: int) -> dict[Kind, Flavor]:
        mem, actions = self.mem, self.st.actions
        flavors = {}
        if mem.offloads:
            flavors[Kind.F] = Flavor(CopyKind.OFFLOAD, CopyKind.PREFETCH, mem.offload_bytes.astype(float).tolist(),
                                     activation_nvme(mem).tolist(), activation_layer_copies(mem),
                                     {i: self.env.event() for i, a in enumerate(actions) if a.kind is Kind.F},
                                     [[] for _ in range(n_ranks)])
        if mem.offloads_stash:
            n = len(mem.stash_offload_bytes)
            flavors[Kind.I] = Flavor(CopyKind.STASH_OFFLOAD, CopyKind.STASH_PREFETCH,
                                     mem.stash_offload_bytes.tolist(), [False] * n, stash_layer_copies(mem),
                                     {i: self.env.event() for i, a in enumerate(actions) if a.kind is Kind.I},
                                     [[] for _ in range(n_ranks)])
        return flavors

    def _consumed(self, kind: Kind) -> Flavor:
        """The flavor whose prefetch a consumer of `kind` waits for (B/I: activations, W: its stash)."""
        return self.flavors[Kind.F if kind in BACKWARD_KINDS else Kind.I]

    def _copy_s(self, fl: Flavor, stage: int, nbytes: float) -> float:
        return nbytes / (self.mem.nvme_bps if fl.nvme[stage] else self.mem.host_link_bps)

    # ---- the engine's hooks ------------------------------------------------------------------------------
    def before(self, i: int, rank: int, ready: float) -> Generator[simpy.Event, None, float]:
        """Before node i may start (its inputs there at `ready`): the pinned-buffer gate, its prefetches (whole,
        or layer by layer as sim.graph.LayerCopy.in_offsets says), its weights; then issue what its start
        issues. Returns when it starts; time waited on copies is stall."""
        env, kind = self.env, self.st.actions[i].kind
        own, gate = self.flavors.get(kind), None
        if own is not None and (g := buffer_gate(own.ran[rank])) is not None:
            gate = own.done[g]
        fetched = i in self.fetches.issuer  # a B/I with activation offload, a W with stash offload
        if fetched and i not in self.fetches.done:
            self._issue(rank, self.fetches.issuer[i])
        layered = self._consumed(kind).layered[self.st.actions[i].stage] if fetched else None
        whole = self.fetches.done.get(i) if fetched and layered is None else None
        for event in (gate, whole, self.weights.back.get(i)):
            if event is not None:
                yield from self._wait(event, rank, ready)
                ready = max(ready, env.now)
        if ready > env.now:
            yield env.timeout(ready - env.now)
        if layered is not None:
            ready = yield from self._layered_start(i, rank, ready, layered)
        self._issue(rank, i)  # as i starts
        return ready

    def at_start(self, i: int, rank: int) -> None:
        """As node i starts: a layer-by-layer copy out is queued from its first layer on."""
        fl = self.flavors.get(self.st.actions[i].kind)
        if fl is not None and fl.layered[self.st.actions[i].stage] is not None:
            self._copy_after(i, rank, fl)

    def after(self, i: int, rank: int) -> None:
        """As node i ends: weights whose window it opens leave, its whole copy out is queued, and the side
        chain that follows it starts."""
        for chunk in self.weights.release.get(i, ()):
            self.hbm.weights_leave(rank, self.weights.nbytes[chunk], self.env.now)
        fl = self.flavors.get(self.st.actions[i].kind)
        if fl is not None and fl.layered[self.st.actions[i].stage] is None:
            self._copy_after(i, rank, fl)
        if i in self.side_chains:
            self.env.process(self.engines.side_chain(self.side_chains[i], rank))

    # ---- waits ---------------------------------------------------------------------------------------------
    def _wait(self, event: simpy.Event, rank: int, ready: float) -> Process:
        """Wait for `event` from time `ready`; what it adds is stall."""
        if ready > self.env.now:
            yield self.env.timeout(ready - self.env.now)
        if not event.processed:
            yield event
            self.stall[rank] += self.env.now - ready

    def _layered_start(self, i: int, rank: int, ready: float, lc: LayerCopy) -> Generator[simpy.Event, None, float]:
        """A layer-wise consumer starts once its prefetch has, as early as its first and last pieces allow."""
        env = self.env
        if i not in self.fetches.span:
            self.fetches.granted[i] = env.event()
            yield self.fetches.granted[i]
        (p0, p1), dur = self.fetches.span[i], self.duration[i]
        after_start, after_end = lc.in_offsets(action_recompute_s(self.mem, self.st.actions[i]), dur)
        begin = max(env.now, p0 + after_start, p1 + after_end)
        self.stall[rank] += begin - ready
        if begin > env.now:
            yield env.timeout(begin - env.now)
        return begin

    # ---- copies ----------------------------------------------------------------------------------------------
    def _issue(self, rank: int, i: int) -> None:
        """As node i starts, queue the prefetches it issues: weights first (sim.graph.weight_windows), then
        activations and stashes (sim.graph.prefetch_issuer: of the consumer `lookahead` places later on its rank;
        the first action, of every consumer up to there)."""
        for use, chunk in self.weights.issue.get(i, ()):
            if use not in self.weights.back:
                self.weights.back[use] = self.env.event()
                self.env.process(self._fetch_weights(use, chunk, rank))
        for b in self.fetches.issues.get(i, ()):
            if b not in self.fetches.done:
                self.fetches.done[b] = self.env.event()
                self.env.process(self._prefetch(b, rank))

    def _copy_after(self, i: int, rank: int, fl: Flavor) -> None:
        fl.ran[rank].append(i)
        self.env.process(self._copy_out(i, rank, fl))

    def _copy_out(self, i: int, rank: int, fl: Flavor) -> Process:
        """After producer i (layer by layer: from its first layer on, sim.graph.LayerCopy): copy its offloaded
        bytes to the host on the d2h engine (FIFO), then release them from HBM; its `done` fires either way."""
        env, a = self.env, self.st.actions[i]
        nbytes = fl.nbytes[a.stage]
        seconds = self._copy_s(fl, a.stage, nbytes)
        lc, end_at = fl.layered[a.stage], 0.0
        if lc is not None:  # spawned as i starts: queued when its first layer is done
            queue, end = lc.out_offsets(action_recompute_s(self.mem, a), self.duration[i])
            end_at = self.start[i] + end
            if self.start[i] + queue > env.now:
                yield env.timeout(self.start[i] + queue - env.now)
        yield from self.engines.hold(rank, Stream.D2H, fl.out, i, a.stage, seconds if nbytes > 0 else None, end_at)
        if nbytes > 0:
            self.hbm.host.move(rank, fl.nvme[a.stage], nbytes)
            self.hbm.allocate(rank, -nbytes, env.now, a)
        fl.done[i].succeed()

    def _prefetch(self, user: int, rank: int) -> Process:
        """Before a consumer: wait for its producer's copy out, then bring the bytes back on the h2d engine
        (FIFO), HBM allocated when the copy starts (to the F for activations, to the W for its stash)."""
        env, a = self.env, self.st.actions[user]
        fl = self._consumed(a.kind)
        producer = self.st.forward_of[user] if a.kind in BACKWARD_KINDS else self.st.split_of(user)
        owner = producer if a.kind in BACKWARD_KINDS else user
        nbytes = fl.nbytes[a.stage]
        seconds = self._copy_s(fl, a.stage, nbytes)
        yield fl.done[producer]

        def granted() -> None:
            self.fetches.span[user] = (env.now, env.now + (seconds if nbytes > 0 else 0.0))
            if user in self.fetches.granted:
                self.fetches.granted[user].succeed()
            if nbytes > 0:
                self.hbm.allocate(rank, nbytes, env.now, self.st.actions[owner])

        yield from self.engines.hold(rank, Stream.H2D, fl.back, user, a.stage, seconds if nbytes > 0 else None,
                                     on_grant=granted)
        if nbytes > 0:
            self.hbm.host.move(rank, fl.nvme[a.stage], -nbytes)
        self.fetches.done[user].succeed()

    def _fetch_weights(self, use: int, chunk: int, rank: int) -> Process:
        """Before `use`: bring the chunk's weights back (FIFO on the h2d engine), HBM allocated when it starts."""
        nbytes = self.weights.nbytes[chunk]

        def granted() -> None:
            self.hbm.away[rank] -= nbytes
            self.hbm.allocate(rank, 0.0, self.env.now, self.st.actions[use], grew=True)

        yield from self.engines.hold(rank, Stream.H2D, CopyKind.WEIGHTS, use, chunk,
                                     nbytes / self.mem.host_link_bps, on_grant=granted)
        self.weights.back[use].succeed()

