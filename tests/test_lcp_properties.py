"""Property tests (hypothesis): every method equals a brute force on random small inputs — k from 1 to
beyond N, tie sets larger than the tree's blocks and than the window, variable lengths, every dtype —
and the API holds its promises (named result, 1-D queries, len, repr)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeplan.lcp import LCPTopK
from pipeplan.lcp.bytes_baselines import MarisaTrie, NumpyLoop, NumpySorted
from pipeplan.lcp.smallest import BLOCK, SmallestIds, smallest_by_sort, smallest_direct
from tests.test_lcp_index import DTYPES, ENGINES, build, torch_brute_force

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def cases(draw, fixed_lengths: bool = False):
    """Rows drawn from a tiny alphabet (so that ties are the rule), queries, lengths and k."""
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(1, 300))
    length = draw(st.integers(1, 10))
    alphabet = draw(st.sampled_from([1, 2, 3, 256]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    info = torch.iinfo(dtype)
    base = info.min if info.min < 0 else 0
    rows = (torch.randint(0, alphabet, (n, length), generator=g) + base).to(dtype)
    batch = draw(st.integers(1, 6))
    queries = (torch.randint(0, alphabet, (batch, length), generator=g) + base).to(dtype)
    queries[: min(batch, n) // 2] = rows[: min(batch, n) // 2]
    variable = not fixed_lengths and draw(st.booleans())
    lengths = torch.randint(0, length + 1, (n,), generator=g) if variable else None
    qls = torch.randint(0, length + 1, (batch,), generator=g) if variable else None
    k = draw(st.one_of(st.integers(1, 12), st.integers(1, n + 5), st.just(n), st.just(n + 7)))
    return rows, lengths, queries, qls, k


def _expected(rows, lengths, queries, qls, k):
    full = torch.full((rows.shape[0],), rows.shape[1]) if lengths is None else lengths
    qfull = torch.full((queries.shape[0],), queries.shape[1]) if qls is None else qls
    return torch_brute_force(rows, full, queries, qfull, k)


@pytest.mark.parametrize("engine", ENGINES)
@SETTINGS
@given(case=cases(), direct_cap=st.sampled_from([None, 0]))
def test_index_equals_brute_force(engine, case, direct_cap):
    rows, lengths, queries, qls, k = case
    index = build(rows, lengths, engine=engine)
    index.direct_cap = direct_cap  # 0: every tie range wider than k goes through the tree
    got = index.topk(queries, k, qls)
    want_ids, want_lcps = _expected(rows, lengths, queries, qls, k)
    assert isinstance(got, LCPTopK)
    assert torch.equal(got.ids, want_ids) and torch.equal(got.lcps, want_lcps)
    # out=: written over whatever it held (here garbage), every entry, and returned as given
    out = LCPTopK(torch.full_like(want_lcps, 77), torch.full_like(want_ids, 77))
    assert index.topk(queries, k, qls, out=out) is out
    assert torch.equal(out.ids, want_ids) and torch.equal(out.lcps, want_lcps)


@SETTINGS
@given(case=cases(fixed_lengths=True))
def test_byte_string_baselines_equal_brute_force(case):
    rows, _, queries, _, k = case
    want_ids, want_lcps = _expected(rows, None, queries, None, k)
    for method in (NumpySorted, NumpyLoop, MarisaTrie):
        got = method.build(rows).topk(queries, k)
        assert torch.equal(got.ids, want_ids) and torch.equal(got.lcps, want_lcps), method.__name__


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 5000),
    count=st.sampled_from([1, 3, 64, 200, 1024, 1500]),
    seed=st.integers(0, 2**31 - 1),
    sorted_ids=st.booleans(),
)
def test_smallest_ids_of_any_range(n, count, seed, sorted_ids):
    """The tree, the direct read and the sort give the `count` smallest ids of [lo, hi), for any range."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(n, dtype=torch.int32) if sorted_ids else torch.randperm(n, generator=g).to(torch.int32)
    a = torch.randint(0, n + 1, (16,), generator=g)
    b = torch.randint(0, n + 1, (16,), generator=g)
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    lo[0], hi[0] = 0, n  # the whole array: a tie set as large as N
    want = torch.full((16, count), -1, dtype=torch.int64)
    for i in range(16):
        best = ids[lo[i] : hi[i]].long().sort().values[:count]
        want[i, : best.numel()] = best
    width = int((hi - lo).max())
    assert torch.equal(smallest_direct(ids, lo, hi, count, width), want)
    assert torch.equal(smallest_by_sort(ids, lo, hi, count), want)
    if count <= 1024:
        tree = SmallestIds(ids)
        assert torch.equal(tree.smallest(lo, hi, count, (width // BLOCK).bit_length()), want)


@pytest.mark.parametrize("engine", ENGINES)
def test_tie_set_larger_than_every_cap_and_k_above_the_tree(engine):
    """3,000 identical rows and k up to 2,500 (> the tree's 1,024): the smallest ids, in order."""
    rows = torch.cat([torch.full((3000, 4), 7, dtype=torch.uint8), torch.zeros((50, 4), dtype=torch.uint8)])
    rows = rows[torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(1))]
    queries = torch.tensor([[7, 7, 7, 7], [7, 7, 0, 0], [0, 0, 0, 1]], dtype=torch.uint8)
    index = build(rows, engine=engine)
    for k in (1, 10, 1000, 1024, 1025, 2500, 3100):
        want_ids, want_lcps = _expected(rows, None, queries, None, k)
        got = index.topk(queries, k)
        assert torch.equal(got.ids, want_ids) and torch.equal(got.lcps, want_lcps), k


@pytest.mark.parametrize("engine", ENGINES)
def test_api_named_result_single_query_len_repr(engine):
    rows = torch.tensor([[1, 2, 3], [1, 2, 4], [9, 9, 9], [1, 2, 3]], dtype=torch.uint8)
    index = build(rows, engine=engine)
    top = index.topk(torch.tensor([1, 2, 4], dtype=torch.uint8), 3)  # one query, 1-D
    assert top.lcps.tolist() == [3, 2, 2] and top.ids.tolist() == [1, 0, 3]
    lcps, ids = top  # unpacks like torch.topk's (values, indices)
    assert torch.equal(lcps, top.lcps) and torch.equal(ids, top.ids)
    batch = index.topk(rows, 2)
    assert batch.ids.shape == batch.lcps.shape == (4, 2)
    assert torch.equal(index.topk(rows[2], 2).ids, batch.ids[2])
    assert torch.equal(index.topk(rows[1], 2, 2).ids, index.topk(rows[1:2], 2, torch.tensor([2])).ids[0])
    assert len(index) == 4
    assert repr(index).startswith("LCPIndex(n=4, length=3, dtype=uint8, lengths=fixed, device=cpu, nbytes=")
