"""The step graph: the rules of one training step, written once, that the engine, the LPs and the runtime read.

What an action waits for is one rule (`input_pattern`, `data_inputs`): F(s, mb) consumes F(s-1, mb)'s
activation; B or I (s, mb) consumes its own F(s, mb) and the input gradient of the backward (B or I) of
(s+1, mb); W(s, mb) consumes I(s, mb). A rank runs its actions in the schedule's order. Built on that:

    StepStructure   the schedule alone, as index lists (cached on the schedule): per action its rank, its
                    inputs (and whether each crosses stages, so travels a link when the stages' ranks differ),
                    its own forward (for B/I), and the action after which each chunk's optimizer step runs.
                    The SimPy engine (sim/engine.py) runs this; the runtime asks it what an action receives.
    side_chains     work that follows an action off the compute stream, task after task on a copy engine or
                    the host (today the optimizer step's copies); the engine runs them, the graph adds them.
    prefetch_issuer which action's start issues each backward's prefetch (the offload lookahead).
    LayerCopy       how an activation or W-stash copy moves layer by layer (memory.copy_granularity =
                    "layer"): when it may start and end after its producer, when its consumer may start.
    weight_windows  when a chunk's working weights may leave HBM (between uses further apart than the
                    lookahead, and across the step boundary when an in-step prefetch brings them back) and
                    which action's start fetches them back.
    StepGraph       the structure timed: nodes with durations, edges u -> v meaning start(v) >= finish(u) +
                    delay, as arrays. Node kinds are compute actions, link transfers and copy-engine copies
                    (activation offload / prefetch, the optimizer step's copies). The freeze LP
                    (solver/freeze_dag.py) is this graph plus freezable durations; the memory MILP writes its
                    precedence rows over these edges; sim/dag.py turns it into networkx for a longest path.

The copy engines' own rules (stream and copy-kind names, the pinned-buffer depth, the prefetch issue point)
are named in sim/copy_rules.py; the builders here read them as the engine does.

Adding a kind of node is one builder: a `NodeKind` and a function that takes a `GraphBuilder` and adds its
nodes with their durations (`add_node(kind, key, seconds)`) and its edges, as `add_links` and
`add_activation_copies` do; work that just follows an action (a data-parallel gradient bucket, an optimizer
step) is one more entry in `side_chains`, which the engine and the freeze DAG both read.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import numpy as np

from pipeplan.sim.copy_rules import PINNED_BUFFERS, CopyKind, Stream, prefetch_issue_position
from pipeplan.sim.costs import CostTable
from pipeplan.sim.ir import BACKWARD_KINDS, GRADIENT_KINDS, Action, Kind, Schedule
from pipeplan.sim.memory_plan import MemoryPlan

# (CopyKind, the F | B/I | I | W | next use | chunk it is for); sim.copy_rules names the kinds and streams
CopyItem = tuple[CopyKind, "Action | int"]
CopyOrder = dict[tuple[int, Stream], list[CopyItem]]  # (rank, stream) -> items in grant order


class NodeKind(IntEnum):
    COMPUTE = 0  # an action of the schedule (F, B, I, W)
    TRANSFER = 1  # a cross-rank result on its FIFO link (p2p_s)
    OFFLOAD = 2  # a forward's offloaded activations, device -> host
    PREFETCH = 3  # the same bytes back, host -> device, before the backward
    STEP_D2H = 4  # the optimizer step with states on the host: gradients out
    STEP_HOST = 5  # the host's optimizer work
    STEP_H2D = 6  # updated weights back
    WEIGHT_PREFETCH = 7  # a chunk's bf16 weights back, host -> device, before their next use (weight offload)
    STASH_OFFLOAD = 8  # an I's W stash (weight GEMMs' inputs and output gradients), device -> host
    STASH_PREFETCH = 9  # the same bytes back, host -> device, before the W


# ---- the rule ----------------------------------------------------------------------------------------------
class Input(NamedTuple):
    """What an action consumes: the result of the action of `kinds` at (stage, microbatch)."""

    stage: int
    kinds: tuple[Kind, ...]
    microbatch: int
    crosses_stage: bool  # another stage's result (a P2P message when the stages sit on different ranks)


_F, _I = (Kind.F,), (Kind.I,)


InputPattern = tuple[tuple[int, tuple[Kind, ...], bool], ...]  # (stage offset, producer kinds, crosses stage)


@functools.cache
def input_pattern(kind: Kind, first_stage: bool, last_stage: bool) -> InputPattern:
    """The rule (module docstring), relative to the consumer's stage; B/I list their own F first."""
    if kind is Kind.F:
        return () if first_stage else ((-1, _F, True),)
    if kind is Kind.W:
        return ((0, _I, False),)
    own = (0, _F, False)
    return (own,) if last_stage else (own, (1, BACKWARD_KINDS, True))


def data_inputs(a: Action, num_stages: int) -> tuple[Input, ...]:
    """What `a` waits for besides its rank's order."""
    return tuple(Input(a.stage + d, kinds, a.microbatch, cross)
                 for d, kinds, cross in input_pattern(a.kind, a.stage == 0, a.stage == num_stages - 1))


def cross_stage_input(a: Action, num_stages: int) -> Input | None:
    """The one input of `a` produced by another stage (F: s-1's activation, B/I: s+1's gradient), or None."""
    for x in data_inputs(a, num_stages):
        if x.crosses_stage:
            return x
    return None


# ---- the schedule as index arrays --------------------------------------------------------------------------
@dataclass(frozen=True)
class StepStructure:
    """Schedule-only facts, node i = `actions[i]` (rank by rank, in each rank's order)."""

    actions: tuple[Action, ...]
    rank_of: list[int]
    rank_offsets: list[int]  # rank r runs nodes rank_offsets[r] .. rank_offsets[r+1]-1
    deps: list[tuple[tuple[int, bool], ...]]  # per node: (producer, crosses stage), as data_inputs orders them
    consumer_rank: list[int]  # rank of the node's cross-stage consumer, -1 if none
    forward_of: list[int]  # for B/I: its own F; -1 otherwise
    last_backward: dict[int, int]  # chunk -> its last B/W node: the chunk's optimizer step follows it

    @property
    def n_actions(self) -> int:
        return len(self.actions)

    @functools.cached_property
    def index(self) -> dict[Action, int]:
        return {a: i for i, a in enumerate(self.actions)}

    def rank_nodes(self, rank: int) -> range:
        return range(self.rank_offsets[rank], self.rank_offsets[rank + 1])

    def inputs(self, a: Action) -> list[Action]:
        """The actions whose results `a` waits for (the runtime's and the calibration's question)."""
        return [self.actions[j] for j, _ in self.deps[self.index[a]]]

    def forwards(self, rank: int) -> list[int]:
        """The rank's F nodes in its order (the order its activation copies leave in)."""
        return [i for i in self.rank_nodes(rank) if self.actions[i].kind is Kind.F]

    def splits(self, rank: int) -> list[int]:
        """The rank's I nodes in its order (the order its W stash copies leave in)."""
        return [i for i in self.rank_nodes(rank) if self.actions[i].kind is Kind.I]

    def split_of(self, w: int) -> int:
        """For a W node: its own I (W's one input)."""
        return self.deps[w][0][0]


def step_structure(schedule: Schedule) -> StepStructure:
    """The schedule's structure, built once per Schedule object and kept on it (schedules are immutable)."""
    cached = schedule.__dict__.get("_step_structure")
    if cached is None:
        cached = schedule.__dict__["_step_structure"] = _build_structure(schedule)
    return cached


def _build_structure(schedule: Schedule) -> StepStructure:
    s2r = schedule.stage_to_rank
    actions = tuple(a for r in schedule.ranks for a in r)
    by_key = {(a.stage, a.kind, a.microbatch): i for i, a in enumerate(actions)}  # cheaper keys than Actions
    n, last_stage = len(actions), schedule.num_stages - 1
    deps: list[tuple[tuple[int, bool], ...]] = []
    consumer_rank = [-1] * n
    forward_of = [-1] * n
    for i, a in enumerate(actions):
        found = []
        stage, mb = a.stage, a.microbatch
        for d, kinds, cross in input_pattern(a.kind, stage == 0, stage == last_stage):
            for k in kinds:
                j = by_key.get((stage + d, k, mb))
                if j is not None:
                    found.append((j, cross))
                    if cross:
                        consumer_rank[j] = s2r[stage]
                    elif d == 0 and k is Kind.F:
                        forward_of[i] = j
                    break
        deps.append(tuple(found))
    last: dict[int, int] = {}
    for i, a in enumerate(actions):
        if a.kind in GRADIENT_KINDS:
            last[a.stage] = i  # ranks' lists are in order, so the final assignment is the last one
    offsets = list(itertools.accumulate((len(r) for r in schedule.ranks), initial=0))
    return StepStructure(actions, [s2r[a.stage] for a in actions], offsets, deps, consumer_rank,
                         forward_of, last)


# ---- the timed graph ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepGraph:
    """Nodes 0..n_actions-1 are the actions (StepStructure order), then any transfer and copy nodes."""

    schedule: Schedule
    structure: StepStructure
    kind: np.ndarray  # (n_nodes,) NodeKind
    duration: np.ndarray  # (n_nodes,) s
    edge_u: np.ndarray  # (n_edges,) precedence u -> v: start(v) >= finish(u) + delay
    edge_v: np.ndarray
    edge_delay: np.ndarray
    sinks: np.ndarray  # nodes whose finishes bound the step: each rank's last action, each optimizer step
    keys: dict[tuple[str, object], int]  # extra nodes by key: ("offload", F), ("step-d2h", chunk), ...

    @property
    def actions(self) -> tuple[Action, ...]:
        return self.structure.actions

    @property
    def n_actions(self) -> int:
        return self.structure.n_actions

    @property
    def n_nodes(self) -> int:
        return len(self.duration)

    def count(self, *kinds: NodeKind) -> int:
        return int(np.isin(self.kind, kinds).sum())


class GraphBuilder:
    """Nodes and edges being added; `build()` freezes them into a StepGraph."""

    def __init__(self, schedule: Schedule, durations: np.ndarray):
        self.schedule = schedule
        self.structure = step_structure(schedule)
        self.kind: list[int] = [NodeKind.COMPUTE] * len(durations)
        self.duration: list[float] = durations.tolist()
        self.u: list[int] = []
        self.v: list[int] = []
        self.delay: list[float] = []
        self.in_edges: dict[int, list[int]] = defaultdict(list)
        self.keys: dict[tuple[str, object], int] = {}
        self.sinks = [end - 1 for start, end in itertools.pairwise(self.structure.rank_offsets) if end > start]

    def add_node(self, kind: NodeKind, key: tuple[str, object] | None, seconds: float) -> int:
        node = len(self.duration)
        self.kind.append(kind)
        self.duration.append(float(seconds))
        if key is not None:
            self.keys[key] = node
        return node

    def add_edge(self, u: int, v: int, delay: float = 0.0) -> None:
        self.in_edges[v].append(len(self.u))
        self.u.append(u)
        self.v.append(v)
        self.delay.append(delay)

    def set_edges(self, u: np.ndarray, v: np.ndarray, delay: np.ndarray) -> None:
        """Replace every edge (a builder that rewrites edges, e.g. add_links)."""
        self.u, self.v, self.delay = u.tolist(), v.tolist(), delay.tolist()
        self.in_edges = defaultdict(list)
        for k, x in enumerate(self.v):
            self.in_edges[x].append(k)

    def build(self) -> StepGraph:
        return StepGraph(
            self.schedule, self.structure, np.asarray(self.kind, np.int8), np.asarray(self.duration, np.float64),
            np.asarray(self.u, np.int64), np.asarray(self.v, np.int64), np.asarray(self.delay, np.float64),
            np.asarray(self.sinks, np.int64), self.keys,
        )


def action_durations(schedule: Schedule, costs: CostTable, memory: MemoryPlan | None = None) -> np.ndarray:
    """(n_actions,) each action's time: the cost table's, plus the plan's recomputation before B and I."""
    st = step_structure(schedule)
    dur = np.fromiter((costs.duration(a) for a in st.actions), np.float64, st.n_actions)
    if memory is not None and memory.recompute_s.any():
        dur += np.fromiter((memory.recompute_s[a.stage] if a.kind in BACKWARD_KINDS else 0.0 for a in st.actions),
                           np.float64, st.n_actions)
    return dur


def add_precedence(g: GraphBuilder, p2p_s: float, implied: bool = True, blocking: bool = False) -> None:
    """Each rank's order and every data input; a cross-rank input carries `p2p_s`. With `blocking`
    (CostTable.p2p_blocking) an action whose result crosses ranks also holds its rank's next action back by
    `p2p_s`: the sender waits for its send. With `implied` False, same-rank edges already implied by the rank's
    order (F -> B of one stage, I -> W, F(s) -> F(s+1) on one rank) are left out: they would only be redundant
    LP rows. Edges come out grouped by producer, the rank successor first, then consumers in node order
    (networkx's order for the same graph)."""
    st = g.structure
    rank_of = st.rank_of
    n = st.n_actions
    succ: list[list[int]] = [[] for _ in range(n)]
    for start, end in itertools.pairwise(st.rank_offsets):
        for i in range(start, end - 1):
            succ[i].append(i + 1)
    for v, deps in enumerate(st.deps):
        for u, _cross in deps:
            if v != u + 1 or rank_of[u] != rank_of[v]:
                succ[u].append(v)
    for u in range(n):
        for v in succ[u]:
            same = rank_of[u] == rank_of[v]
            if not implied and same and v != u + 1:
                continue
            sends = blocking and v == u + 1 and st.consumer_rank[u] not in (-1, rank_of[u])
            g.add_edge(u, v, p2p_s if not same or sends else 0.0)


def add_links(g: GraphBuilder, p2p_s: float) -> None:
    """Every cross-rank edge u -> v becomes u -> x -> v with a transfer node x (p2p_s), and each link's
    transfers a FIFO chain. A link's sends all come from one rank, so their order is that rank's order."""
    u, v, delay = np.asarray(g.u, np.int64), np.asarray(g.v, np.int64), np.asarray(g.delay, np.float64)
    rank_of = np.asarray(g.structure.rank_of)  # every node is still an action here
    cross = rank_of[u] != rank_of[v]
    cu, cv = u[cross], v[cross]
    order = np.argsort(cu, kind="stable")
    cu, cv = cu[order], cv[order]
    x = np.asarray([g.add_node(NodeKind.TRANSFER, None, p2p_s) for _ in range(len(cu))], np.int64)
    last_on_link: dict[tuple[int, int], int] = {}
    chain_u, chain_v = [], []
    for xi, a, b in zip(x.tolist(), cu.tolist(), cv.tolist(), strict=True):
        link = (int(rank_of[a]), int(rank_of[b]))
        if link in last_on_link:
            chain_u.append(last_on_link[link])
            chain_v.append(xi)
        last_on_link[link] = xi
    new_u = np.concatenate([u[~cross], cu, x, np.asarray(chain_u, np.int64)])
    new_v = np.concatenate([v[~cross], x, cv, np.asarray(chain_v, np.int64)])
    new_delay = np.concatenate([delay[~cross], np.zeros(len(new_u) - int((~cross).sum()))])
    g.set_edges(new_u, new_v, new_delay)


def links_can_queue(g: GraphBuilder, shortest: np.ndarray, p2p_s: float) -> bool:
    """Can a transfer ever wait for the previous one on its link, when actions take at least `shortest`?
    Sends a < b on one link finish at least shortest[a+1..b] apart; no wait is possible when every such gap
    is >= p2p_s, and then the plain edges with their p2p_s delay are exact."""
    if p2p_s <= 0:
        return False
    rank_of = g.structure.rank_of
    prefix = np.concatenate([[0.0], np.cumsum(shortest)])  # prefix[i] = sum of shortest[:i]
    links: dict[tuple[int, int], list[int]] = defaultdict(list)
    for u, v in zip(g.u, g.v, strict=True):
        if rank_of[u] != rank_of[v]:
            links[(rank_of[u], rank_of[v])].append(u)
    for senders in links.values():
        a = np.sort(np.asarray(senders))
        if a.size > 1 and (prefix[a[1:] + 1] - prefix[a[:-1] + 1]).min() < p2p_s:
            return True
    return False


# ---- copy-engine nodes: each rank has one d2h and one h2d stream, FIFO in the order `copies` gives ----------
def add_copies(g: GraphBuilder, mem: MemoryPlan, copies: CopyOrder) -> None:
    """The plan's copy nodes, chained per rank and stream in grant order, then the offload gates and the
    prefetch issue points (sim/engine.py's stream semantics)."""
    if mem.offloads:
        add_activation_copies(g, mem)
    if mem.offloads_weights:
        add_weight_prefetches(g, mem)
    if mem.offloads_stash:
        add_stash_copies(g, mem)
    if mem.has_step_copies:
        add_step_copies(g, mem)
    for (_rank, stream), items in copies.items():
        chain = [g.keys[(f"step-{stream}", x) if what == CopyKind.STEP else (what, x)] for what, x in items]
        for u, v in itertools.pairwise(chain):
            g.add_edge(u, v)
    if mem.offloads:
        add_offload_gates(g)
    if mem.offloads_stash:
        add_stash_gates(g)
    add_issue_edges(g, mem)


def add_activation_copies(g: GraphBuilder, mem: MemoryPlan) -> None:
    """An offload after every F, a prefetch before every B/I (after that F's offload); layer by layer with
    memory.copy_granularity = "layer" (layer_copy)."""
    st = g.structure
    copy_s = mem.offload_bytes / np.where(activation_nvme(mem), mem.nvme_bps, mem.host_link_bps)  # per chunk
    lc = activation_layer_copies(mem)
    for i, a in enumerate(st.actions):
        if a.kind is Kind.F:
            _add_copy_out(g, mem, i, g.add_node(NodeKind.OFFLOAD, (CopyKind.OFFLOAD, a), copy_s[a.stage]),
                          lc[a.stage])
    for i, a in enumerate(st.actions):
        if a.kind in BACKWARD_KINDS:
            q = g.add_node(NodeKind.PREFETCH, (CopyKind.PREFETCH, a), copy_s[a.stage])
            g.add_edge(g.keys[(CopyKind.OFFLOAD, st.actions[st.forward_of[i]])], q)
            _add_copy_in(g, mem, q, i, lc[a.stage])


def add_stash_copies(g: GraphBuilder, mem: MemoryPlan) -> None:
    """A stash offload after every I, a stash prefetch before every W (after that I's stash offload); layer by
    layer with memory.copy_granularity = "layer" (layer_copy)."""
    st = g.structure
    copy_s = mem.stash_offload_bytes / mem.host_link_bps  # per chunk
    lc = stash_layer_copies(mem)
    for i, a in enumerate(st.actions):
        if a.kind is Kind.I:
            _add_copy_out(g, mem, i, g.add_node(NodeKind.STASH_OFFLOAD, (CopyKind.STASH_OFFLOAD, a),
                                                copy_s[a.stage]), lc[a.stage])
    for i, a in enumerate(st.actions):
        if a.kind is Kind.W:
            q = g.add_node(NodeKind.STASH_PREFETCH, (CopyKind.STASH_PREFETCH, a), copy_s[a.stage])
            g.add_edge(g.keys[(CopyKind.STASH_OFFLOAD, st.actions[st.split_of(i)])], q)
            _add_copy_in(g, mem, q, i, lc[a.stage])


def _add_copy_out(g: GraphBuilder, mem: MemoryPlan, x: int, q: int, lc: LayerCopy | None) -> None:
    """Copy node q after its producer x: when x ends, or (layer by layer) as LayerCopy.out_offsets says."""
    if lc is None:
        g.add_edge(x, q)
        return
    dur = g.duration[x]
    request, end = lc.out_offsets(action_recompute_s(mem, g.structure.actions[x]), dur)
    g.add_edge(x, q, request - dur)  # start(q) >= start(x) + request
    g.add_edge(x, q, end - dur - g.duration[q])  # finish(q) >= start(x) + end


def _add_copy_in(g: GraphBuilder, mem: MemoryPlan, q: int, y: int, lc: LayerCopy | None) -> None:
    """Consumer y after its prefetch q: when q ends, or (layer by layer) as LayerCopy.in_offsets says."""
    if lc is None:
        g.add_edge(q, y)
        return
    after_start, after_end = lc.in_offsets(action_recompute_s(mem, g.structure.actions[y]), g.duration[y])
    g.add_edge(q, y, after_start - g.duration[q])
    g.add_edge(q, y, after_end)


def activation_nvme(mem: MemoryPlan) -> np.ndarray:
    """Per chunk: its offloaded activations go to NVMe (else DRAM)."""
    return mem.offload_nvme if mem.offload_nvme is not None else np.zeros(len(mem.offload_bytes), bool)


def action_recompute_s(mem: MemoryPlan, a: Action) -> float:
    """The recomputation an action runs before its layers' own work (B and I only)."""
    return float(mem.recompute_s[a.stage]) if a.kind in BACKWARD_KINDS and len(mem.recompute_s) else 0.0


# ---- layer-granular copies (memory.copy_granularity = "layer") ------------------------------------------------
class LayerCopy(NamedTuple):
    """A non-empty activation or W-stash copy that moves layer by layer, in pieces of one layer's bytes.

    An action of a chunk of n layers runs its recomputation first (B and I), then its n layers, each taking
    1/n of the rest of its time (`work_s`; the embedding's and the LM head's work are spread over the layers).
    The copied layers are the first the producer makes (F: layers 0, 1, ...; I: its stash of layers n-1,
    n-2, ...) and the last the consumer needs (B/I run their layers backwards; W runs its layers in the
    reverse of I's order). A copy of N bytes in pieces of b bytes moves k = ceil(N/b) pieces (at most n),
    the consumer's first-needed one (the partial one) f·b bytes, f = N/b - (k - 1), taking `first_s`.

        out   the copy is queued when the producer's first layer is done, FIFO on the d2h engine as before,
              and ends no earlier than the producer's k-th layer + `first_s` (its last piece is made then)
        in    the prefetch is queued, issued and gated as before; the consumer starts no earlier than the
              prefetch starts, and so that it reaches the first-needed piece's layer once that piece is back
              (P0 + first_s) and its last layer once the whole prefetch is (P1)

    With one layer per chunk (or one piece) this is the whole-chunk rule. HBM is still freed when a copy out
    ends and taken when a prefetch starts (a bound on the piecewise truth from above)."""

    layers: float  # n
    pieces: int  # k
    first_s: float  # the first-needed piece's copy time

    def out_offsets(self, recompute_s: float, duration_s: float) -> tuple[float, float]:
        """(queued at, ends no earlier than), after the producer's (effective) start."""
        layer = (duration_s - recompute_s) / self.layers
        return recompute_s + layer, recompute_s + self.pieces * layer + self.first_s

    def in_offsets(self, recompute_s: float, duration_s: float) -> tuple[float, float]:
        """The consumer starts no earlier than (the prefetch's start + the first, its end + the second), and no
        earlier than the prefetch's start."""
        layer = (duration_s - recompute_s) / self.layers
        return max(0.0, self.first_s + self.pieces * layer - duration_s), layer - duration_s


def layer_copy(mem: MemoryPlan, chunk: int, nbytes: float, stash: bool = False, nvme: bool = False) -> LayerCopy | None:
    """How a copy of `nbytes` of `chunk`'s activations (or W stash) moves layer by layer; None when copies move
    whole chunks (memory.copy_granularity = "chunk") or the copy is empty (it then follows the chunk rule)."""
    if not mem.layer_copies or nbytes <= 0:
        return None
    piece = float((mem.stash_piece_bytes if stash else mem.activation_piece_bytes)[chunk])
    if piece <= 0:
        return None
    n = float(mem.copy_layers[chunk])
    u = nbytes / piece
    k = min(max(math.ceil(u - 1e-9), 1), max(int(n), 1))
    return LayerCopy(n, k, (u - (k - 1)) * piece / (mem.nvme_bps if nvme else mem.host_link_bps))


def activation_layer_copies(mem: MemoryPlan) -> list[LayerCopy | None]:
    """Per chunk: how its activations' offload (after F) and prefetch (before B/I) move (layer_copy); it depends
    on the chunk only, so the engine and the step graph compute it once per chunk, not once per action."""
    n = len(mem.offload_bytes)
    if not (mem.layer_copies and mem.offloads):
        return [None] * n
    nvme = activation_nvme(mem)
    return [layer_copy(mem, c, float(mem.offload_bytes[c]), nvme=bool(nvme[c])) for c in range(n)]


def stash_layer_copies(mem: MemoryPlan) -> list[LayerCopy | None]:
    """Per chunk: how its W stash's offload (after I) and prefetch (before W) move (layer_copy)."""
    n = len(mem.offload_bytes)
    if not (mem.layer_copies and mem.offloads_stash):
        return [None] * n
    return [layer_copy(mem, c, float(mem.stash_offload_bytes[c]), stash=True) for c in range(n)]


@dataclass(frozen=True, slots=True)
class SideTask:
    """Work that follows an action off its rank's compute stream, one after another in its chain."""

    kind: NodeKind
    key: str  # the node's key in a StepGraph, with `chunk`: (key, chunk)
    stream: Stream | None  # the rank's copy engine it queues on (FIFO), or None (host work)
    seconds: float
    chunk: int


def side_chains(schedule: Schedule, mem: MemoryPlan) -> dict[int, tuple[SideTask, ...]]:
    """Action node -> the chain of side tasks that starts when it ends; the step ends when every chain has.
    Today: the optimizer step's copies with model states off HBM (gradients out, the host's Adam, weights
    back) after each chunk's last B/W. Another kind of tail work (a data-parallel gradient bucket, a weight
    prefetch) is one more entry here: the engine runs these chains and the freeze DAG adds their nodes."""
    if not mem.has_step_copies:
        return {}
    chains: dict[int, tuple[SideTask, ...]] = {}
    for c, i in step_structure(schedule).last_backward.items():
        chains[i] = (
            SideTask(NodeKind.STEP_D2H, f"step-{Stream.D2H}", Stream.D2H,
                     float(mem.step_d2h_bytes[c] / mem.host_link_bps), c),
            SideTask(NodeKind.STEP_HOST, "step-host", None, float(mem.step_host_s[c]), c),
            SideTask(NodeKind.STEP_H2D, f"step-{Stream.H2D}", Stream.H2D,
                     float(mem.step_h2d_bytes[c] / mem.host_link_bps), c),
        )
    return chains


def add_step_copies(g: GraphBuilder, mem: MemoryPlan) -> None:
    """Each side chain (side_chains) as nodes after its action; each chain's last node ends the step."""
    for i, chain in side_chains(g.schedule, mem).items():
        prev = i
        for task in chain:
            node = g.add_node(task.kind, (task.key, task.chunk), task.seconds)
            g.add_edge(prev, node)
            prev = node
        g.sinks.append(prev)


def prefetch_issuer(schedule: Schedule, lookahead: int, kinds: tuple[Kind, ...] = BACKWARD_KINDS) -> dict[int, int]:
    """B/I node (W node with `kinds` (Kind.W,): its W stash) -> the node whose start issues its prefetch: the
    action `lookahead` places before it on its rank (the first action for the first few:
    sim.copy_rules.prefetch_issue_position)."""
    st = step_structure(schedule)
    issuer = {}
    for r in range(schedule.num_ranks):
        nodes = st.rank_nodes(r)
        for pos, i in enumerate(nodes):
            if st.actions[i].kind in kinds:
                issuer[i] = nodes[prefetch_issue_position(pos, lookahead)]
    return issuer


STASH_KINDS = (Kind.W,)  # what a W stash prefetch precedes (prefetch_issuer's `kinds`)


def splits_backward(schedule: Schedule) -> bool:
    """Whether the schedule splits some backward into I and W, i.e. holds a W stash at all."""
    return any(a.kind is Kind.I for r in schedule.ranks for a in r)


def _pinned_buffer_gates(g: GraphBuilder, nodes_of_rank: Callable[[int], list[int]], copy: CopyKind) -> None:
    """The j-th of a rank's `nodes_of_rank` waits for the `copy` out of its (j - PINNED_BUFFERS)-th
    (sim.copy_rules.PINNED_BUFFERS)."""
    st = g.structure
    for r in range(g.schedule.num_ranks):
        nodes = nodes_of_rank(r)
        for j in range(PINNED_BUFFERS, len(nodes)):
            g.add_edge(g.keys[(copy, st.actions[nodes[j - PINNED_BUFFERS]])], nodes[j])


def add_offload_gates(g: GraphBuilder) -> None:
    """F_j waits for the offload of F_(j - PINNED_BUFFERS)."""
    _pinned_buffer_gates(g, g.structure.forwards, CopyKind.OFFLOAD)


def add_stash_gates(g: GraphBuilder) -> None:
    """I_j waits for the stash offload of I_(j - PINNED_BUFFERS), as forwards do."""
    _pinned_buffer_gates(g, g.structure.splits, CopyKind.STASH_OFFLOAD)


def add_issue_edges(g: GraphBuilder, mem: MemoryPlan) -> None:
    """A prefetch (activations or weights) starts no earlier than its issuer starts, i.e. after every in-edge
    of the issuer (added last, so complete)."""
    st = g.structure
    pairs: list[tuple[int, int]] = []  # (issuer, prefetch node)
    if mem.offloads:
        pairs += [(ahead, g.keys[(CopyKind.PREFETCH, st.actions[b])])
                  for b, ahead in prefetch_issuer(g.schedule, mem.prefetch_lookahead).items()]
    if mem.offloads_stash:
        pairs += [(ahead, g.keys[(CopyKind.STASH_PREFETCH, st.actions[w])])
                  for w, ahead in prefetch_issuer(g.schedule, mem.prefetch_lookahead, STASH_KINDS).items()]
    if mem.offloads_weights:
        pairs += [(w.issuer, g.keys[(CopyKind.WEIGHTS, st.actions[w.next_use])])
                  for w in weight_windows(g.schedule, mem.prefetch_lookahead, mem.weight_offload_bytes > 0)
                  if w.next_use >= 0]
    issue = [(g.u[k], q, g.delay[k]) for ahead, q in pairs for k in g.in_edges[ahead]]
    for u, v, delay in issue:
        g.add_edge(u, v, delay)


# ---- weight offload: a chunk's working weights leave HBM while the chunk is idle -----------------------------
class WeightWindow(NamedTuple):
    """One stretch in which chunk `chunk`'s bf16 weights are off HBM. They leave when `release_after` ends
    (-1: they start the step on the host) and come back on the h2d copy engine, issued when `issuer` starts,
    before `next_use` (-1: not needed again this step)."""

    chunk: int
    release_after: int
    next_use: int
    issuer: int


def weight_windows(
    schedule: Schedule, lookahead: int, chunks: np.ndarray | Sequence[bool] | None = None
) -> list[WeightWindow]:
    """The windows of every chunk (`chunks`: a per-chunk mask, default all), nodes in StepStructure order.

    A chunk uses its weights in every one of its actions (F, B, I; W too: its gradients accumulate next to
    them). Between two uses at positions k1 < k2 of the rank's order the weights may leave when k2 - k1 >
    lookahead + 1: the prefetch is issued `lookahead` actions ahead of k2, as an activation prefetch is, and
    at least one action runs without them. The step boundary is the same rule read cyclically: from the last
    use to the next step's first use at position k0. The weights leave there only when an in-step prefetch
    can bring them back, i.e. when k0 > lookahead (`starts_away`): then they leave after the last use and
    are absent at the step's start; otherwise they stay in HBM across the boundary (no window), since
    nothing would fetch them before their first use. What the optimizer step does with a chunk that starts
    away is `sim.memory.with_weight_offload`'s rule (the one place that prices the boundary)."""
    st = step_structure(schedule)
    windows: list[WeightWindow] = []
    for r in range(schedule.num_ranks):
        nodes = st.rank_nodes(r)
        uses: dict[int, list[int]] = defaultdict(list)  # chunk -> positions of its actions
        for pos, i in enumerate(nodes):
            uses[st.actions[i].stage].append(pos)
        for c, ks in sorted(uses.items()):
            if chunks is not None and not chunks[c]:
                continue
            away_at_boundary = ks[0] > lookahead
            if away_at_boundary:
                windows.append(WeightWindow(c, -1, nodes[ks[0]], nodes[prefetch_issue_position(ks[0], lookahead)]))
            for k1, k2 in itertools.pairwise(ks):
                if k2 - k1 > lookahead + 1:
                    windows.append(WeightWindow(c, nodes[k1], nodes[k2], nodes[prefetch_issue_position(k2, lookahead)]))
            if away_at_boundary:
                windows.append(WeightWindow(c, nodes[ks[-1]], -1, -1))
    return windows


def starts_away(schedule: Schedule, lookahead: int) -> np.ndarray:
    """Per chunk: whether its weights, when offloaded, are off HBM across the step boundary (weight_windows'
    boundary window: the first use lies more than `lookahead` actions into its rank's order)."""
    away = np.zeros(schedule.num_stages, bool)
    for w in weight_windows(schedule, lookahead):
        if w.release_after < 0:
            away[w.chunk] = True
    return away


def has_windows(schedule: Schedule, lookahead: int) -> np.ndarray:
    """Per chunk: whether offloading its weights takes them off HBM at all (it has at least one window)."""
    has = np.zeros(schedule.num_stages, bool)
    for w in weight_windows(schedule, lookahead):
        has[w.chunk] = True
    return has


def add_weight_prefetches(g: GraphBuilder, mem: MemoryPlan) -> None:
    """A weight prefetch node before every next use of an offloading chunk's weights."""
    st = g.structure
    for w in weight_windows(g.schedule, mem.prefetch_lookahead, mem.weight_offload_bytes > 0):
        if w.next_use >= 0:
            use = st.actions[w.next_use]
            q = g.add_node(NodeKind.WEIGHT_PREFETCH, (CopyKind.WEIGHTS, use),
                           mem.weight_offload_bytes[w.chunk] / mem.host_link_bps)
            g.add_edge(q, w.next_use)


def build_step_graph(
    schedule: Schedule,
    costs: CostTable,
    memory: MemoryPlan | None = None,
    copies: CopyOrder | None = None,
    *,
    durations: np.ndarray | None = None,
    implied: bool = True,
    links: bool = False,
) -> StepGraph:
    """The step as a graph: compute nodes (`durations`, default action_durations), precedence with transfer
    delays, transfer nodes on FIFO links if `links`, and a copying `memory` plan's copy nodes in the grant
    order `copies` (a simulated step's, SimResult.copy_order())."""
    g = GraphBuilder(schedule, action_durations(schedule, costs, memory) if durations is None else durations)
    add_precedence(g, costs.p2p_s, implied, costs.p2p_blocking)
    if links:
        add_links(g, costs.p2p_s)
    if memory is not None and memory.uses_copy_engines:
        if copies is None:
            raise ValueError("build_step_graph: a memory plan with copies needs the copy order (copy_order)")
        add_copies(g, memory, copies)
    return g.build()
