"""Shared fixtures: explicit-cost tables and schedules built without any scenario file."""

from __future__ import annotations

import itertools

import networkx as nx
import numpy as np
import pytest

from pipeplan.sim.costs import CostTable
from pipeplan.sim.ir import Action, Kind


def make_costs(p: int, v: int, m: int, f=1.0, i=1.0, w=1.0, act=1.0, static=0.0, p2p=0.0, hbm=float("inf")):
    """A CostTable with the same (or given per-chunk) costs on every chunk."""
    n = p * v

    def arr(x):
        a = np.asarray(x, dtype=float)
        return np.full(n, float(a)) if a.ndim == 0 else a

    return CostTable(p, v, m, arr(f), arr(i), arr(w), arr(act), arr(static), p2p_s=p2p, hbm_bytes=hbm)


def independent_longest_path_s(sched, duration) -> float:
    """The step's makespan with free links, from the rules of a pipeline step written out from scratch: a
    rank runs its actions in order; F(s) needs F(s-1); B/I(s) needs F(s) and the backward of s+1; W needs I."""
    g = nx.DiGraph()
    acts = {a for r in sched.ranks for a in r}
    for rank in sched.ranks:
        for u, v in itertools.pairwise(rank):
            g.add_edge(u, v)
    for a in acts:
        needs = []
        if a.kind is Kind.F and a.stage > 0:
            needs.append(Action(a.stage - 1, Kind.F, a.microbatch))
        if a.kind in (Kind.B, Kind.I):
            needs.append(Action(a.stage, Kind.F, a.microbatch))
            needs += [Action(a.stage + 1, k, a.microbatch) for k in (Kind.B, Kind.I)]
        if a.kind is Kind.W:
            needs.append(Action(a.stage, Kind.I, a.microbatch))
        g.add_edges_from((u, a) for u in needs if u in acts)
    for u, v in g.edges:
        g.edges[u, v]["w"] = duration(u)
    for a in acts:
        g.add_edge(a, "end", w=duration(a))
    return nx.dag_longest_path_length(g, weight="w")


@pytest.fixture
def unit_costs():
    return make_costs


@pytest.fixture
def one_torch_thread():
    """One torch thread: tiny tensor ops dominate these tests, and OpenMP stalls when the other core is busy."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def world_of_one():
    """A one-rank gloo group in this process (the Trainer's barriers and checkpoint need one); torch is imported
    here, not at the top, so that the tests which need no torch collect without it."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
