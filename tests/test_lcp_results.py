"""lcp/results.py: the compiled kernel's result memory, recycled between calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeplan.lcp import results
from pipeplan.lcp.engine import kernel
from tests.test_lcp_index import build, torch_brute_force

MIB = 1 << 20


@pytest.fixture(autouse=True)
def empty_pool():
    results.release()
    yield
    results.release()


def test_small_arrays_are_plain_numpy():
    a = results.empty((10, 10), np.int64)
    assert a.flags.owndata and a.shape == (10, 10) and a.dtype == np.int64
    del a
    assert results.held_bytes() == 0


def test_freed_memory_is_taken_again_only_when_every_view_is_gone():
    a = results.empty((512, 256), np.int64)  # 1 MiB
    assert a.shape == (512, 256) and a.flags.writeable
    where = a.ctypes.data
    row = torch.from_numpy(a)[3]  # a view (through torch) keeps the memory
    del a
    assert results.held_bytes() == 0
    b = results.empty((512, 256), np.int64)
    assert b.ctypes.data != where  # still in use: fresh memory
    del row
    assert results.held_bytes() == MIB
    c = results.empty((256, 512), np.int64)  # same bytes, any shape
    assert c.ctypes.data == where and results.held_bytes() == 0
    c[:] = 7
    b[:] = 5
    assert (c == 7).all() and (b == 5).all()  # two live arrays never share memory
    del b, c
    assert results.held_bytes() == 2 * MIB
    assert results.release() == 2 * MIB and results.held_bytes() == 0


def test_pool_keeps_at_most_its_cap(monkeypatch):
    monkeypatch.setattr(results, "POOL_MAX_BYTES", 3 * MIB)
    arrays = [results.empty((MIB,), np.uint8) for _ in range(5)]
    del arrays
    assert results.held_bytes() == 3 * MIB


@pytest.mark.skipif(kernel() is None, reason="needs numba")
def test_topk_results_recycled_and_exact():
    """Two calls of 1 MiB results each: the second writes into the first's freed memory, and both
    equal brute force; results still held are never overwritten."""
    g = torch.Generator().manual_seed(2)
    rows = torch.randint(0, 4, (3000, 12), dtype=torch.uint8, generator=g)
    index = build(rows, engine="numba")
    q1, q2 = (torch.randint(0, 4, (256, 12), dtype=torch.uint8, generator=g) for _ in range(2))
    full = torch.full((3000,), 12)
    qfull = torch.full((256,), 12)
    first = index.topk(q1, 512)
    kept = index.topk(q2, 512)
    where = first.ids.data_ptr(), first.lcps.data_ptr()
    del first
    again = index.topk(q1, 512)
    assert {again.ids.data_ptr(), again.lcps.data_ptr()} == set(where)
    for got, q in ((again, q1), (kept, q2)):
        want_ids, want_lcps = torch_brute_force(rows, full, q, qfull, 512)
        assert torch.equal(got.ids, want_ids) and torch.equal(got.lcps, want_lcps)
