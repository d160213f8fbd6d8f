"""Shared fixtures: explicit-cost tables and schedules built without any scenario file."""

from __future__ import annotations

import numpy as np
import pytest

from sim.costs import CostTable


def make_costs(p: int, v: int, m: int, f=1.0, i=1.0, w=1.0, act=1.0, static=0.0, p2p=0.0, hbm=float("inf")):
    """A CostTable with the same (or given per-chunk) costs on every chunk."""
    n = p * v

    def arr(x):
        a = np.asarray(x, dtype=float)
        return np.full(n, float(a)) if a.ndim == 0 else a

    return CostTable(p, v, m, arr(f), arr(i), arr(w), arr(act), arr(static), p2p_s=p2p, hbm_bytes=hbm)


@pytest.fixture
def unit_costs():
    return make_costs


@pytest.fixture
def one_torch_thread():
    """Tiny tensor ops dominate the LCP tests; one thread avoids OpenMP stalls when the other core is busy."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
