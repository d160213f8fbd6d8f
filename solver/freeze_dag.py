"""One step's DAG (sim.dag, networkx) as the arrays the freeze LP is written over.

Node i < len(actions) is `actions[i]`, in per-rank order. Each node has an unfrozen duration w_max and a
fully frozen duration w_min (equal unless the node is freezable: B, or W when backward is split). Edges keep
sim.dag's precedence with its transfer delays, minus same-rank edges already implied by the rank's order
(F -> B of one stage and microbatch, I -> W, and F(s) -> F(s+1) when both chunks share a rank), which would
only be redundant LP rows.

Links. The engine sends every cross-rank result over a FIFO link (one transfer at a time, p2p_s each). A
link's transfers all come from one rank, so their order is that rank's order, whatever the durations: the
queue is a fixed chain and stays linear. When no transfer can ever wait (p2p_s no longer than the shortest
possible gap between two sends on a link, counting fully frozen durations) the plain DAG is exact. Otherwise
each cross-rank edge u -> v becomes a transfer node x (duration p2p_s) with u -> x -> v and the link chain
x_prev -> x, so the LP sees exactly the queueing the engine simulates.

Copy engines. With a memory plan that offloads (activations, or model states with the optimizer step's
copies), each copy is a node of fixed duration on its rank's d2h or h2d chain, in the order the engine
granted the stream (`copy_order`, from a simulated step): an offload starts after its F and after the
previous d2h copy, and F_j waits for the offload of F_(j-2) (bounded pinned buffers); a prefetch starts
after its F's offload, after the previous h2d copy, and no earlier than the action `prefetch_lookahead`
places before its B/I starts (written as that action's own in-edges, so every row stays finish-to-start),
and the B/I waits for it; a chunk's optimizer-step copies (d2h, host work, h2d) follow its last B/W and
bound the makespan. A FIFO stream's order depends on when copies are requested, so the planner re-reads
the order from the planned step's simulation and re-solves if it changed (solver.plan).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sim.config import FreezeConfig
from sim.costs import CostTable
from sim.dag import build_dag
from sim.engine import SimResult
from sim.ir import Action, Kind, Schedule
from sim.memory import MemoryPlan
from solver.errors import FreezeInputError

FREEZABLE_KINDS = (Kind.B, Kind.W)


@dataclass(frozen=True)
class FreezeDag:
    schedule: Schedule
    actions: tuple[Action, ...]  # nodes 0..n_actions-1, rank by rank in schedule order
    w_max: np.ndarray  # (n_nodes,) unfrozen duration, s; transfer nodes take p2p_s
    w_min: np.ndarray  # (n_nodes,) fully frozen duration, s; = w_max where nothing can be frozen
    freezable: np.ndarray  # (n_freezable,) node index of each B/W action
    edge_u: np.ndarray  # (n_edges,) precedence u -> v: start(v) >= finish(u) + delay
    edge_v: np.ndarray
    edge_delay: np.ndarray
    sinks: np.ndarray  # the last node of every rank: their finishes bound the makespan
    curves: list[list[tuple[float, float]]] | None  # per chunk (ratio, share still spent), None = linear
    link_nodes: int  # transfer nodes added for queueing links (0: plain DAG is exact)
    copy_nodes: int = 0  # copy-engine nodes (offloads, prefetches, optimizer-step copies)
    copies: CopyOrder | None = None  # the copy order those nodes are chained in (None: no copies)

    @property
    def n_actions(self) -> int:
        return len(self.actions)

    @property
    def n_nodes(self) -> int:
        return len(self.w_max)

    @property
    def freezable_stage(self) -> np.ndarray:
        return np.fromiter((self.actions[i].stage for i in self.freezable), np.int64, len(self.freezable))

    def node_durations(self, ratio: np.ndarray) -> np.ndarray:
        """(n_nodes,) every node's duration at freeze ratios `ratio` (aligned with `freezable`)."""
        dur = self.w_max.copy()
        dur[self.freezable] = self.durations(ratio)
        return dur

    def earliest_starts(self, duration: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """ASAP start of every node and the in-edge that sets it (-1 for none), in topological order, as
        the engine runs it; None if the graph has a cycle (the schedule deadlocks)."""
        n = self.n_nodes
        order = np.argsort(self.edge_u, kind="stable")  # out-edges of each node, contiguous
        heads = np.searchsorted(self.edge_u[order], np.arange(n + 1)).tolist()
        edge_ids, dst, delay = order.tolist(), self.edge_v[order].tolist(), self.edge_delay[order].tolist()
        dur = duration.tolist()
        start_l, tight_l = [0.0] * n, [-1] * n
        indeg_l = np.bincount(self.edge_v, minlength=n).tolist()
        ready = [i for i in range(n) if indeg_l[i] == 0]
        seen = 0
        while ready:
            u = ready.pop()
            seen += 1
            finish = start_l[u] + dur[u]
            for k in range(heads[u], heads[u + 1]):
                v, at = dst[k], finish + delay[k]
                if tight_l[v] < 0 or at > start_l[v]:
                    start_l[v], tight_l[v] = at, edge_ids[k]
                indeg_l[v] -= 1
                if indeg_l[v] == 0:
                    ready.append(v)
        if seen < n:
            return None
        return np.asarray(start_l), np.asarray(tight_l, dtype=np.int64)

    def latest_finishes(
        self, duration: np.ndarray, makespan: float, settle: Callable[[int, float], float] | None = None
    ) -> np.ndarray:
        """ALAP finish of every node for a step that must end by `makespan` (the graph must be acyclic).
        Nodes are visited in reverse topological order; `settle(v, latest_finish_v)`, if given, returns the
        duration v takes from then on (a caller may lengthen it into its float)."""
        n = self.n_nodes
        order = np.argsort(self.edge_v, kind="stable")  # in-edges of each node, contiguous
        heads = np.searchsorted(self.edge_v[order], np.arange(n + 1)).tolist()
        src, delay = self.edge_u[order].tolist(), self.edge_delay[order].tolist()
        dur = duration.tolist()
        latest = [float(makespan)] * n
        outdeg = np.bincount(self.edge_u, minlength=n).tolist()
        ready = [i for i in range(n) if outdeg[i] == 0]
        while ready:
            v = ready.pop()
            if settle is not None:
                dur[v] = settle(v, latest[v])
            begin = latest[v] - dur[v]
            for k in range(heads[v], heads[v + 1]):
                u = src[k]
                latest[u] = min(latest[u], begin - delay[k])
                outdeg[u] -= 1
                if outdeg[u] == 0:
                    ready.append(u)
        return np.asarray(latest)

    def durations(self, ratio: np.ndarray) -> np.ndarray:
        """(n_freezable,) durations at freeze ratios `ratio`: linear, or through each chunk's curve."""
        lo, hi = self.w_min[self.freezable], self.w_max[self.freezable]
        if self.curves is None:
            return hi - (hi - lo) * ratio
        share = np.empty_like(ratio)
        for k, (s, r) in enumerate(zip(self.freezable_stage, ratio, strict=True)):
            xs, ys = zip(*self.curves[s], strict=True)
            share[k] = np.interp(r, xs, ys)
        return lo + (hi - lo) * share


def freeze_bounds(costs: CostTable, freeze: FreezeConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per chunk, the fully frozen B and W durations; FreezeInputError if one exceeds the unfrozen time."""
    chunks = costs.num_chunks
    b_max = costs.backward_input_s + costs.backward_weight_s
    b_min = (
        costs.backward_input_s if freeze.backward_min_s is None else _per_chunk(freeze.backward_min_s, chunks)
    )
    w_min = np.zeros(chunks) if freeze.weight_min_s is None else _per_chunk(freeze.weight_min_s, chunks)
    for key, lo, hi, unfrozen in (
        ("backward_min_s", b_min, b_max, "backward_input_s + backward_weight_s"),
        ("weight_min_s", w_min, costs.backward_weight_s, "backward_weight_s"),
    ):
        bad = np.flatnonzero(lo > hi * (1 + 1e-12))
        if bad.size:
            s = int(bad[0])
            raise FreezeInputError(
                f"freeze.{key}: chunk {s} fully frozen takes {lo[s]:.6g} s, more than unfrozen "
                f"({unfrozen} = {hi[s]:.6g} s); w_min must not exceed w_max"
            )
    return b_min, w_min


CopyItem = tuple[str, "Action | int"]  # ("offload", F) | ("prefetch", B/I) | ("step", chunk)
CopyOrder = dict[tuple[int, str], list[CopyItem]]  # (rank, "d2h" | "h2d") -> items in grant order


def copy_order(result: SimResult) -> CopyOrder | None:
    """Per rank and stream, the copies in the order the engine granted them; None if the step made none."""
    if not result.copies:
        return None
    order: CopyOrder = defaultdict(list)
    for c in result.copies:
        order[(c.rank, c.stream)].append((c.what, c.action if c.action is not None else c.stage))
    return dict(order)


def build_freeze_dag(
    schedule: Schedule,
    costs: CostTable,
    freeze: FreezeConfig,
    recompute_s: np.ndarray | None = None,
    memory: MemoryPlan | None = None,
    copies: CopyOrder | None = None,
) -> FreezeDag:
    """The step's DAG as arrays; `recompute_s` (per chunk) lengthens every B and I, frozen or not; a
    `memory` plan that copies adds its copy-engine nodes in the grant order `copies` (see copy_order)."""
    chunks = costs.num_chunks
    b_min, wt_min = freeze_bounds(costs, freeze)
    curves = freeze.curves(chunks)
    if curves is not None and len(curves) != chunks:
        raise FreezeInputError(
            f"freeze.curve: has {len(curves)} per-chunk curves; give one curve or one per chunk "
            f"(pipeline.stages * pipeline.virtual_stages = {chunks})"
        )
    g = build_dag(schedule, costs)
    actions = tuple(a for rank in schedule.ranks for a in rank)
    index = {a: i for i, a in enumerate(actions)}
    rank_of = np.fromiter((schedule.stage_to_rank[a.stage] for a in actions), np.int64, len(actions))
    w_max = np.fromiter((costs.duration(a) for a in actions), np.float64, len(actions))
    w_min = w_max.copy()
    freezable = np.fromiter((i for i, a in enumerate(actions) if a.kind in FREEZABLE_KINDS), np.int64)
    for i in freezable:
        a = actions[i]
        w_min[i] = b_min[a.stage] if a.kind is Kind.B else wt_min[a.stage]
    if recompute_s is not None and recompute_s.any():
        extra = np.fromiter((recompute_s[a.stage] if a.kind in (Kind.B, Kind.I) else 0.0 for a in actions),
                            np.float64, len(actions))
        w_max += extra
        w_min += extra

    us, vs, ds = [], [], []
    for u, v, delay in g.edges(data="delay"):
        iu, iv = index[u], index[v]
        if rank_of[iu] == rank_of[iv] and iu < iv and iv != iu + 1:
            continue  # implied by the rank's own order
        us.append(iu)
        vs.append(iv)
        ds.append(delay)
    edge_u, edge_v = np.asarray(us, np.int64), np.asarray(vs, np.int64)
    edge_delay = np.asarray(ds, np.float64)
    offsets = np.cumsum([0] + [len(r) for r in schedule.ranks])
    sinks = offsets[1:][np.diff(offsets) > 0] - 1

    cross = rank_of[edge_u] != rank_of[edge_v]
    link_nodes = 0
    if (
        costs.p2p_s > 0
        and cross.any()
        and _links_can_queue(edge_u[cross], edge_v[cross], rank_of, w_min, costs.p2p_s)
    ):
        edge_u, edge_v, edge_delay, w_max, w_min, link_nodes = _with_link_nodes(
            edge_u, edge_v, edge_delay, cross, rank_of, w_max, w_min, costs.p2p_s
        )
    copy_nodes = 0
    if memory is not None and memory.uses_copy_engines:
        if copies is None:
            raise ValueError("build_freeze_dag: a memory plan with copies needs the copy order (copy_order)")
        graph = _CopyGraph(actions, index, len(w_max), edge_u, edge_v, edge_delay)
        graph.add_copies(schedule, memory, copies)
        edge_u, edge_v, edge_delay, extra = graph.arrays()
        w_max, w_min = np.concatenate([w_max, extra]), np.concatenate([w_min, extra])
        sinks = np.concatenate([sinks, np.asarray(graph.step_ends, np.int64)])
        copy_nodes = len(extra)
    return FreezeDag(
        schedule, actions, w_max, w_min, freezable, edge_u, edge_v, edge_delay, sinks, curves, link_nodes,
        copy_nodes, copies if copy_nodes else None,
    )


class _CopyGraph:
    """The step's edges plus copy-engine nodes (module docstring): node keys are ("offload", F),
    ("prefetch", B/I), ("step-d2h" | "step-host" | "step-h2d", chunk)."""

    def __init__(self, actions: tuple[Action, ...], index: dict[Action, int], n_nodes: int,
                 edge_u: np.ndarray, edge_v: np.ndarray, edge_delay: np.ndarray):
        self.actions, self.index, self.n = actions, index, n_nodes
        self.u, self.v, self.delay = edge_u.tolist(), edge_v.tolist(), edge_delay.tolist()
        self.in_edges: dict[int, list[int]] = defaultdict(list)
        for k, v in enumerate(self.v):
            self.in_edges[v].append(k)
        self.node: dict[tuple[str, object], int] = {}
        self.duration: list[float] = []
        self.step_ends: list[int] = []  # each chunk's last optimizer-step copy: a sink

    def add_node(self, key: tuple[str, object], seconds: float) -> int:
        self.node[key] = self.n + len(self.duration)
        self.duration.append(float(seconds))
        return self.node[key]

    def add_edge(self, u: int, v: int, delay: float = 0.0) -> None:
        self.in_edges[v].append(len(self.u))
        self.u.append(u)
        self.v.append(v)
        self.delay.append(delay)

    def add_copies(self, schedule: Schedule, mem: MemoryPlan, copies: CopyOrder) -> None:
        if mem.offloads:
            self._activation_copies(mem)
        if mem.has_step_copies:
            self._step_copies(mem)
        for (_rank, stream), items in copies.items():  # FIFO chains in grant order
            chain = [self.node[("step-" + stream, x) if what == "step" else (what, x)] for what, x in items]
            for u, v in itertools.pairwise(chain):
                self.add_edge(u, v)
        if mem.offloads:
            self._gates_and_prefetch_issue(schedule, mem.prefetch_lookahead)

    def _activation_copies(self, mem: MemoryPlan) -> None:
        """An offload after every F, a prefetch before every B/I (after that F's offload)."""
        nvme = mem.offload_nvme if mem.offload_nvme is not None else np.zeros(len(mem.offload_bytes), bool)
        copy_s = mem.offload_bytes / np.where(nvme, mem.nvme_bps, mem.host_link_bps)  # per chunk
        for a in self.actions:
            if a.kind is Kind.F:
                self.add_edge(self.index[a], self.add_node(("offload", a), copy_s[a.stage]))
        for a in self.actions:
            if a.kind in (Kind.B, Kind.I):
                q = self.add_node(("prefetch", a), copy_s[a.stage])
                self.add_edge(self.node[("offload", Action(a.stage, Kind.F, a.microbatch))], q)
                self.add_edge(q, self.index[a])

    def _step_copies(self, mem: MemoryPlan) -> None:
        """Gradients out, the host's optimizer step, weights back: after each chunk's last B/W."""
        last: dict[int, int] = {}
        for i, a in enumerate(self.actions):
            if a.kind in (Kind.B, Kind.W):
                last[a.stage] = i
        for c, i in last.items():
            d2h = self.add_node(("step-d2h", c), mem.step_d2h_bytes[c] / mem.host_link_bps)
            host = self.add_node(("step-host", c), mem.step_host_s[c])
            h2d = self.add_node(("step-h2d", c), mem.step_h2d_bytes[c] / mem.host_link_bps)
            self.add_edge(i, d2h)
            self.add_edge(d2h, host)
            self.add_edge(host, h2d)
            self.step_ends.append(h2d)

    def _gates_and_prefetch_issue(self, schedule: Schedule, lookahead: int) -> None:
        """F_j waits for the offload of F_(j-2); a prefetch starts no earlier than the action `lookahead`
        places before its B/I starts, i.e. after every in-edge of that action (added last, so complete)."""
        for rank_actions in schedule.ranks:
            forwards = [self.index[a] for a in rank_actions if a.kind is Kind.F]
            for j in range(2, len(forwards)):
                self.add_edge(self.node[("offload", self.actions[forwards[j - 2]])], forwards[j])
        issue = []
        for rank_actions in schedule.ranks:
            for pos, a in enumerate(rank_actions):
                if a.kind in (Kind.B, Kind.I):
                    ahead = self.index[rank_actions[max(pos - lookahead, 0)]]
                    q = self.node[("prefetch", a)]
                    issue += [(self.u[k], q, self.delay[k]) for k in self.in_edges[ahead]]
        for u, v, delay in issue:
            self.add_edge(u, v, delay)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Edges (u, v, delay) and the copy nodes' durations."""
        return (np.asarray(self.u, np.int64), np.asarray(self.v, np.int64), np.asarray(self.delay, np.float64),
                np.asarray(self.duration, np.float64))





def _links_can_queue(
    edge_u: np.ndarray, edge_v: np.ndarray, rank_of: np.ndarray, w_min: np.ndarray, p2p_s: float
) -> bool:
    """Can a transfer ever wait for the previous one on its link? Sends a < b on one link finish at least
    the fully frozen durations of actions a+1..b apart; no wait is possible when every such gap >= p2p_s."""
    prefix = np.concatenate([[0.0], np.cumsum(w_min)])  # prefix[i] = sum of w_min[:i]
    links: dict[tuple[int, int], list[int]] = defaultdict(list)
    for u, v in zip(edge_u.tolist(), edge_v.tolist(), strict=True):
        links[(int(rank_of[u]), int(rank_of[v]))].append(u)
    for senders in links.values():
        a = np.sort(np.asarray(senders))
        if a.size > 1 and (prefix[a[1:] + 1] - prefix[a[:-1] + 1]).min() < p2p_s:
            return True
    return False


def _with_link_nodes(edge_u, edge_v, edge_delay, cross, rank_of, w_max, w_min, p2p_s):
    """Replace each cross-rank edge u -> v by u -> x -> v with a transfer node x, chained per link."""
    n = len(w_max)
    cu, cv = edge_u[cross], edge_v[cross]
    order = np.argsort(cu, kind="stable")  # a link's sends leave in the sending rank's order
    cu, cv = cu[order], cv[order]
    x = n + np.arange(len(cu))
    us = [edge_u[~cross], cu, x]
    vs = [edge_v[~cross], x, cv]
    last_on_link: dict[tuple[int, int], int] = {}
    chain_u, chain_v = [], []
    for xi, u, v in zip(x, cu, cv, strict=True):
        link = (int(rank_of[u]), int(rank_of[v]))
        if link in last_on_link:
            chain_u.append(last_on_link[link])
            chain_v.append(int(xi))
        last_on_link[link] = int(xi)
    us.append(np.asarray(chain_u, np.int64))
    vs.append(np.asarray(chain_v, np.int64))
    new_u, new_v = np.concatenate(us), np.concatenate(vs)
    delay = np.concatenate([edge_delay[~cross], np.zeros(len(new_u) - int((~cross).sum()))])
    xdur = np.full(len(cu), p2p_s)
    return new_u, new_v, delay, np.concatenate([w_max, xdur]), np.concatenate([w_min, xdur]), len(cu)


def _per_chunk(value: float | list[float], chunks: int) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    return np.full(chunks, float(arr)) if arr.ndim == 0 else arr.copy()
