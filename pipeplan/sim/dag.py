"""The step graph (sim/graph.py) as a networkx DiGraph: nodes are actions with durations, edges carry the
transfer delays. With uncontended links the SimPy engine's makespan equals this DAG's longest path, an
independent check of the engine in the tests.
"""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx
import numpy as np

from pipeplan.sim.costs import CostTable
from pipeplan.sim.engine import DeadlockError
from pipeplan.sim.graph import build_step_graph, step_structure
from pipeplan.sim.ir import Action, Schedule


def build_dag(schedule: Schedule, costs: CostTable, durations: Mapping[Action, float] | None = None) -> nx.DiGraph:
    st = step_structure(schedule)
    dur = None
    if durations:
        dur = np.fromiter((durations.get(a, costs.duration(a)) for a in st.actions), np.float64, st.n_actions)
    sg = build_step_graph(schedule, costs, durations=dur)
    g = nx.DiGraph()
    for a, d, r in zip(st.actions, sg.duration.tolist(), st.rank_of, strict=True):
        g.add_node(a, duration=d, rank=r)
    acts = st.actions
    for u, v, delay in zip(sg.edge_u.tolist(), sg.edge_v.tolist(), sg.edge_delay.tolist(), strict=True):
        g.add_edge(acts[u], acts[v], delay=delay)
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
