"""The step graph (sim/graph.py) plus freezable durations: the arrays the freeze LP is written over.

Node i < len(actions) is `actions[i]`, in per-rank order. Each node has an unfrozen duration w_max and a
fully frozen duration w_min (equal unless the node is freezable: B, or W when backward is split, or tied).
The first chunk needs no input gradient (its input is tokens), so freezing shortens its backward's input
part too: its fully frozen B does nothing (freeze_bounds), and with a split backward its I is a tied node,
w_max - (w_max - w_min) r with r its W's ratio (one LP column for both), down to nothing when fully frozen. Edges keep
the step graph's precedence with its transfer delays, minus same-rank edges already implied by the rank's order
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

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeplan.sim.config import FreezeConfig
from pipeplan.sim.costs import CostTable
from pipeplan.sim.engine import SimResult
from pipeplan.sim.graph import (
    CopyItem,
    CopyOrder,
    GraphBuilder,
    NodeKind,
    StepGraph,
    action_durations,
    add_copies,
    add_links,
    add_precedence,
    links_can_queue,
)
from pipeplan.sim.ir import BACKWARD_KINDS, GRADIENT_KINDS, Action, Kind, Schedule
from pipeplan.sim.memory_plan import MemoryPlan
from pipeplan.solver.errors import FreezeInputError

FREEZABLE_KINDS = GRADIENT_KINDS  # B and W compute weight gradients: what freezing skips
__all__ = ["CopyItem", "CopyOrder", "FreezeDag", "build_freeze_dag", "copy_order", "freeze_bounds"]


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
    graph: StepGraph | None = None  # the step graph these arrays are (node kinds, copy-node keys)
    tied: np.ndarray | None = None  # (n_tied,) nodes shortened by another action's freeze ratio: the first
    tied_slot: np.ndarray | None = None  # stage's I, by its W's ratio (slot into `freezable`); see below

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
        if self.tied is not None and len(self.tied):
            lo, hi = self.w_min[self.tied], self.w_max[self.tied]
            dur[self.tied] = hi - (hi - lo) * ratio[self.tied_slot]
        return dur

    def action_durations(self, ratio: np.ndarray) -> dict[Action, float]:
        """The actions whose duration freezing changes (freezable and tied), at freeze ratios `ratio`: what
        the engine is given to simulate the planned step."""
        dur = self.node_durations(ratio)
        nodes = self.freezable if self.tied is None else np.concatenate([self.freezable, self.tied])
        return {self.actions[i]: float(dur[i]) for i in nodes.tolist()}

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
        out: np.ndarray
        if self.curves is None:
            out = hi - (hi - lo) * ratio
            return out
        share = np.empty_like(ratio)
        for k, (s, r) in enumerate(zip(self.freezable_stage, ratio, strict=True)):
            xs, ys = zip(*self.curves[s], strict=True)
            share[k] = np.interp(r, xs, ys)
        out = lo + (hi - lo) * share
        return out


def freeze_bounds(costs: CostTable, freeze: FreezeConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per chunk, the fully frozen B and W durations; FreezeInputError if one exceeds the unfrozen time. A
    fully frozen B computes only the input gradient, except on the first chunk, which needs none (its input
    is tokens): there it does nothing (the runtime's backward does not run, runtime/executor.py)."""
    chunks = costs.num_chunks
    b_max = costs.backward_input_s + costs.backward_weight_s
    if freeze.backward_min_s is None:
        b_min = costs.backward_input_s.copy()
        b_min[0] = 0.0
    else:
        b_min = _per_chunk(freeze.backward_min_s, chunks)
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


def copy_order(result: SimResult) -> CopyOrder | None:
    """Per rank and stream, the copies in the order the engine granted them; None if the step made none."""
    return result.copy_order()


def build_freeze_dag(
    schedule: Schedule,
    costs: CostTable,
    freeze: FreezeConfig,
    recompute_s: np.ndarray | None = None,
    memory: MemoryPlan | None = None,
    copies: CopyOrder | None = None,
    input_min_s: float = 0.0,
) -> FreezeDag:
    """The step's DAG as arrays; `recompute_s` (per chunk) lengthens every B and I, frozen or not; a
    `memory` plan that copies adds its copy-engine nodes in the grant order `copies` (see copy_order);
    `input_min_s` is the first chunk's I when every parameter is frozen."""
    chunks = costs.num_chunks
    b_min, wt_min = freeze_bounds(costs, freeze)
    curves = freeze.curves(chunks)
    if curves is not None and len(curves) != chunks:
        raise FreezeInputError(
            f"freeze.curve: has {len(curves)} per-chunk curves; give one curve or one per chunk "
            f"(pipeline.stages * pipeline.virtual_stages = {chunks})"
        )
    g = GraphBuilder(schedule, action_durations(schedule, costs))
    actions = g.structure.actions
    w_max = np.asarray(g.duration)
    w_min = w_max.copy()
    freezable = np.fromiter((i for i, a in enumerate(actions) if a.kind in FREEZABLE_KINDS), np.int64)
    for i in freezable:
        a = actions[i]
        w_min[i] = b_min[a.stage] if a.kind is Kind.B else wt_min[a.stage]
    # the first chunk needs no input gradient: its I only carries gradients back to earlier weights, so it
    # shrinks with its W's ratio and is skipped when every parameter is frozen (input_min_s, default 0)
    slot_of = {actions[i]: k for k, i in enumerate(freezable.tolist())}
    tied = np.fromiter((i for i, a in enumerate(actions) if a.kind is Kind.I and a.stage == 0
                        and Action(0, Kind.W, a.microbatch) in slot_of), np.int64)
    tied_slot = np.fromiter((slot_of[Action(0, Kind.W, actions[i].microbatch)] for i in tied), np.int64, len(tied))
    w_min[tied] = input_min_s
    if recompute_s is not None and recompute_s.any():
        extra = np.fromiter((recompute_s[a.stage] if a.kind in BACKWARD_KINDS else 0.0 for a in actions),
                            np.float64, len(actions))
        w_max += extra
        w_min += extra
    g.duration = w_max.tolist()

    add_precedence(g, costs.p2p_s, implied=False, blocking=costs.p2p_blocking)
    if links_can_queue(g, w_min, costs.p2p_s):
        add_links(g, costs.p2p_s)
    if memory is not None and memory.uses_copy_engines:
        if copies is None:
            raise ValueError("build_freeze_dag: a memory plan with copies needs the copy order (copy_order)")
        add_copies(g, memory, copies)
    graph = g.build()
    fixed = graph.duration[len(actions):]  # transfer and copy nodes take what they take
    link_nodes, copy_nodes = graph.count(NodeKind.TRANSFER), graph.n_nodes - len(actions) - graph.count(
        NodeKind.TRANSFER)
    return FreezeDag(
        schedule, actions, graph.duration, np.concatenate([w_min, fixed]), freezable, graph.edge_u, graph.edge_v,
        graph.edge_delay, graph.sinks, curves, link_nodes, copy_nodes, copies if copy_nodes else None, graph,
        tied, tied_slot,
    )


def _per_chunk(value: float | list[float], chunks: int) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    return np.full(chunks, float(arr)) if arr.ndim == 0 else arr.copy()
