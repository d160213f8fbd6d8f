"""The schedule as a DAG (networkx): nodes are actions with durations, edges carry transfer delays.

Edges: each rank's order (a -> next action on the rank), F(s) -> F(s+1), B/I(s+1) -> B/I(s), F -> B/I of
the same stage and microbatch, I -> W. A cross-rank edge carries the P2P time. With uncontended links the
SimPy engine's makespan equals this DAG's longest path; the freeze LP is written over the same graph.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import networkx as nx

from sim.costs import CostTable
from sim.engine import DeadlockError
from sim.ir import Action, Kind, Schedule


def build_dag(schedule: Schedule, costs: CostTable, durations: Mapping[Action, float] | None = None) -> nx.DiGraph:
    durations = durations or {}
    s2r = schedule.stage_to_rank
    g = nx.DiGraph()
    backward_of: dict[tuple[int, int], Action] = {}
    for actions in schedule.ranks:
        for a in actions:
            g.add_node(a, duration=durations.get(a, costs.duration(a)), rank=s2r[a.stage])
            if a.kind in (Kind.B, Kind.I):
                backward_of[(a.stage, a.microbatch)] = a

    def delay(u: Action, v: Action) -> float:
        return costs.p2p_s if s2r[u.stage] != s2r[v.stage] else 0.0

    for actions in schedule.ranks:
        for u, v in itertools.pairwise(actions):
            g.add_edge(u, v, delay=0.0)
    for a in list(g.nodes):
        if a.kind is Kind.F and a.stage > 0:
            g.add_edge(prev := Action(a.stage - 1, Kind.F, a.microbatch), a, delay=delay(prev, a))
        elif a.kind in (Kind.B, Kind.I):
            g.add_edge(Action(a.stage, Kind.F, a.microbatch), a, delay=0.0)
            up = backward_of.get((a.stage + 1, a.microbatch))
            if up is not None:
                g.add_edge(up, a, delay=delay(up, a))
        elif a.kind is Kind.W:
            g.add_edge(Action(a.stage, Kind.I, a.microbatch), a, delay=0.0)
    return g


def longest_path_s(g: nx.DiGraph) -> float:
    """Earliest finish of the whole DAG: max over nodes of start + duration, starts from predecessors."""
    try:
        order = list(nx.topological_sort(g))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(g)
        raise DeadlockError(f"schedule deadlocks: dependency cycle {' -> '.join(str(u) for u, _ in cycle)}") from None
    finish: dict[Action, float] = {}
    for n in order:
        start = max((finish[p] + d for p, _, d in g.in_edges(n, data="delay")), default=0.0)
        finish[n] = start + g.nodes[n]["duration"]
    return max(finish.values(), default=0.0)
