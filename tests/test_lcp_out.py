"""topk(..., out=): the caller's result tensors reused across calls (torch.topk's out=, stricter).

What it must do: write every entry (whatever the tensors held), return the tensors given, give the
answer of a plain call on both engines, for a batch and a 1-D query, k beyond N; and refuse, before
writing anything, whatever could be misread or overwrite what it should not: a bare tuple (a swapped
pair would pass), another shape, dtype or device, a non-contiguous tensor, the two sharing memory,
either sharing memory with the queries or with the index's own arrays.
"""

from __future__ import annotations

import re

import pytest
import torch

from pipeplan.lcp import LCPError, LCPIndex, LCPTopK
from tests.test_lcp_index import ENGINES, build

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rows(n=600, length=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, (n, length), dtype=torch.uint8, generator=g)


def _garbage(shape):
    return LCPTopK(torch.full(shape, 55, dtype=torch.int64), torch.full(shape, 66, dtype=torch.int64))


@pytest.mark.parametrize("engine", ENGINES)
def test_out_is_written_whole_and_returned(engine):
    rows = _rows()
    index = build(rows, engine=engine)
    g = torch.Generator().manual_seed(1)
    out = _garbage((40, 25))
    for call in range(3):  # the same tensors over several calls: each answer replaces the last whole
        queries = torch.randint(0, 3, (40, 6), dtype=torch.uint8, generator=g)
        want = index.topk(queries, 25)
        got = index.topk(queries, 25, out=out)
        assert got is out, call
        assert torch.equal(out.ids, want.ids) and torch.equal(out.lcps, want.lcps), call
    one = _garbage((25,))
    assert index.topk(rows[3], 25, out=one) is one  # a 1-D query: out is [k]
    assert torch.equal(one.ids, index.topk(rows[3], 25).ids)
    wide = _garbage((2, 700))  # k > N: -1 past N, as a plain call
    index.topk(rows[:2], 700, out=wide)
    assert (wide.ids[:, 600:] == -1).all() and (wide.lcps[:, 600:] == -1).all()
    assert torch.equal(wide.ids, index.topk(rows[:2], 700).ids)


def _refusals(index, queries):
    """(out, what the message names) pairs that must be refused for topk(queries, 4)."""
    b = queries.shape[0]
    good = _garbage((b, 4))
    shared = torch.zeros((2, b, 4), dtype=torch.int64)
    return [
        ((good.lcps, good.ids), "LCPTopK"),  # a bare tuple: swapped or not, it cannot be told
        ([good.lcps, good.ids], "LCPTopK"),
        (LCPTopK(good.lcps, "ids"), "out.ids must be a tensor"),
        (LCPTopK(good.lcps[:, :3].contiguous(), good.ids), "out.lcps must be int64 [5, 4]"),
        (LCPTopK(good.lcps, good.ids.to(torch.int32)), "out.ids must be int64"),
        (LCPTopK(good.lcps, torch.zeros((4, b), dtype=torch.int64).t()), "out.ids must be contiguous"),
        (LCPTopK(good.lcps, good.lcps), "share memory"),
        (LCPTopK(shared.view(-1)[: b * 4].view(b, 4), shared.view(-1)[1 : b * 4 + 1].view(b, 4)), "share memory"),
        (LCPTopK(good.lcps, good.ids.to("meta")), "on meta"),
    ]


@pytest.mark.parametrize("engine", ENGINES)
def test_bad_out_is_refused_before_anything_is_written(engine):
    index = build(_rows(), engine=engine)
    queries = _rows(5, 6, seed=3)
    for out, says in _refusals(index, queries):
        held = [t for t in out if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
        before = [t.clone() for t in held]
        with pytest.raises(LCPError, match=re.escape(says)):
            index.topk(queries, 4, out=out)
        assert all(torch.equal(t, c) for t, c in zip(held, before, strict=True)), says  # nothing written


@pytest.mark.parametrize("engine", ENGINES)
def test_out_may_not_overwrite_the_queries_or_the_index(engine):
    """int64 queries [B, k] and the index's packed rows [W, N] (int64) have the shape of some result:
    writing the answer into them would corrupt the input or the index, so they are refused."""
    rows = _rows(n=4, length=4)
    index = build(rows, engine=engine)
    queries = rows.to(torch.int64).contiguous()  # [4, 4] int64: the shape of topk(queries, 4)
    spare = torch.zeros((4, 4), dtype=torch.int64)
    with pytest.raises(LCPError, match=re.escape("out.lcps shares memory with the queries or the index")):
        index.topk(queries, 4, out=LCPTopK(queries, spare))
    assert torch.equal(queries, rows.to(torch.int64))
    cols = index.cols  # [1, 4] int64: the shape of topk(one query of 4 tokens as a batch of 1, 4)
    saved = cols.clone()
    with pytest.raises(LCPError, match=re.escape("out.ids shares memory with the queries or the index")):
        index.topk(rows[:1], 4, out=LCPTopK(torch.zeros((1, 4), dtype=torch.int64), cols))
    assert torch.equal(index.cols, saved)
    assert torch.equal(index.topk(rows, 2).ids[:, 0], torch.arange(4))


def test_out_as_two_halves_of_one_buffer():
    """Disjoint parts of one allocation are two tensors as good as any: accepted and written."""
    index = LCPIndex.build(_rows())
    queries = _rows(5, 6, seed=4)
    buf = torch.full((2, 5, 4), 9, dtype=torch.int64)
    out = index.topk(queries, 4, out=LCPTopK(buf[0], buf[1]))
    want = index.topk(queries, 4)
    assert torch.equal(out.lcps, want.lcps) and torch.equal(out.ids, want.ids)
    assert torch.equal(buf[1], want.ids)
