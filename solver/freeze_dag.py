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
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from sim.config import FreezeConfig
from sim.costs import CostTable
from sim.dag import build_dag
from sim.ir import Action, Kind, Schedule
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

    def latest_finishes(self, duration: np.ndarray, makespan: float) -> np.ndarray:
        """ALAP finish of every node for a step that must end by `makespan` (the graph must be acyclic)."""
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


def build_freeze_dag(
    schedule: Schedule, costs: CostTable, freeze: FreezeConfig, recompute_s: np.ndarray | None = None
) -> FreezeDag:
    """The step's DAG as arrays; `recompute_s` (per chunk) lengthens every B and I, frozen or not."""
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
    return FreezeDag(
        schedule, actions, w_max, w_min, freezable, edge_u, edge_v, edge_delay, sinks, curves, link_nodes
    )


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
