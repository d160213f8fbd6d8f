"""The compiled CPU kernel's own paths (lcp/kernel.py), against brute force and closed forms.

The exactness tests of tests/test_lcp_index.py and tests/test_lcp_properties.py already run on both
engines; these add the kernel's edges: bucket boundaries of the first word, d* = 0 (no range), d* = L,
tie ranges of every size through the direct read and the tree (k around the tree's 1,024), k > N, the
query packing against the torch packing for every dtype, its sort and selection, and the cache fallback.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeplan.lcp import LCPError, LCPIndex
from pipeplan.lcp.engine import kernel
from pipeplan.lcp.tokens import prepare_queries, token_format
from tests.test_lcp_index import DTYPES, build, random_case, torch_brute_force

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(kernel() is None, reason="needs numba"),
]


def assert_exact(index, rows, queries, k, lengths=None, qls=None):
    """index.topk equals the brute force over `rows` (the rows it was built from)."""
    full = torch.full((rows.shape[0],), rows.shape[1]) if lengths is None else lengths
    qfull = torch.full((queries.shape[0],), queries.shape[1]) if qls is None else qls
    want_ids, want_lcps = torch_brute_force(rows, full, queries, qfull, k)
    got = index.topk(queries, k, qls)
    assert torch.equal(got.ids, want_ids), f"k={k}\n{got.ids}\n{want_ids}"
    assert torch.equal(got.lcps, want_lcps), f"k={k}\n{got.lcps}\n{want_lcps}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_query_packing_matches_torch(dtype):
    """pack_queries gives the words and cut lengths of lcp.tokens.prepare_queries, for tokens inside and
    outside the index dtype's range and queries longer and shorter than L."""
    g = torch.Generator().manual_seed(DTYPES.index(dtype))
    fmt = token_format(dtype, 7)
    for width in (3, 7, 11):
        queries = torch.randint(-(2**40), 2**40, (64, width), generator=g)
        inside = torch.randint(0, 2, (64, width), generator=g).bool()
        queries = torch.where(inside, queries.clamp(fmt.lo, fmt.hi), queries)  # some tokens outside
        queries[:8] = torch.tensor([fmt.lo, fmt.hi, 0, -1, 1, fmt.hi, fmt.lo, 5][:width] * 2)[:width]
        qls = torch.randint(0, width + 1, (64,), generator=g)
        want_words, want_len = prepare_queries(queries, qls, fmt, torch.device("cpu"))
        pack = kernel().pack_queries
        words, cut = pack(queries.numpy(), qls.numpy(), fmt.length, fmt.bits, fmt.lo, fmt.hi, fmt.words)
        assert np.array_equal(words, want_words.numpy()) and np.array_equal(cut, want_len.numpy())
        narrow = queries.clamp(fmt.lo, fmt.hi).to(fmt.dtype)  # in the index's own dtype, as the engine passes it
        want_words, want_len = prepare_queries(narrow, qls, fmt, torch.device("cpu"))
        words, cut = pack(narrow.numpy(), qls.numpy(), fmt.length, fmt.bits, fmt.lo, fmt.hi, fmt.words)
        assert np.array_equal(words, want_words.numpy()) and np.array_equal(cut, want_len.numpy())


def test_bucket_boundaries():
    """Rows whose first words sit on either side of the bucket table's edges: first tokens 0x00, 0x7f,
    0x80, 0xff and their neighbours (the top bits the table keys on), with queries at the edges too."""
    g = torch.Generator().manual_seed(1)
    edge = torch.tensor([0x00, 0x01, 0x3F, 0x40, 0x7F, 0x80, 0xBF, 0xC0, 0xFE, 0xFF], dtype=torch.uint8)
    rows = torch.randint(0, 256, (6000, 6), generator=g).to(torch.uint8)
    rows[:, 0] = edge[torch.randint(0, len(edge), (6000,), generator=g)]
    rows[:, 1] = edge[torch.randint(0, len(edge), (6000,), generator=g)]
    queries = torch.cartesian_prod(edge, edge).to(torch.uint8)  # (100, 2): every pair of edge tokens
    queries = torch.cat([queries, torch.randint(0, 256, (100, 4), generator=g).to(torch.uint8)], 1)
    index = build(rows, engine="numba")
    for k in (1, 10, 700):
        assert_exact(index, rows, queries, k)
    big = torch.tensor([[-(2**63)], [2**63 - 1], [-1], [0], [1]] * 40)  # int64: the table's first and last bucket
    assert_exact(build(big, engine="numba"), big, big[:5], 3)


def test_d_star_zero_and_full_depth():
    """d* = 0: queries sharing no first token with k rows (the answer is the smallest ids, less those
    above); d* = L: queries equal to a row duplicated more than k times (all of them tie at L)."""
    rows = torch.cat([torch.full((50, 4), 9, dtype=torch.uint8), torch.randint(10, 200, (400, 4)).to(torch.uint8)])
    rows = rows[torch.randperm(450, generator=torch.Generator().manual_seed(2))]
    index = build(rows, engine="numba")
    nothing = torch.full((3, 4), 255, dtype=torch.uint8)  # no row starts with 255
    got = index.topk(nothing, 20)
    assert got.lcps.eq(0).all() and got.ids.tolist() == [list(range(20))] * 3  # closed form
    assert_exact(index, rows, torch.cat([nothing, rows[:5]]), 60)
    nine = torch.full((1, 4), 9, dtype=torch.uint8)
    got = index.topk(nine, 30)
    assert got.lcps.eq(4).all()
    assert got.ids[0].tolist() == torch.nonzero(rows[:, 0] == 9).squeeze(1)[:30].tolist()


@pytest.mark.parametrize("direct_cap", [None, 0, 10**9])
def test_identical_rows_every_k(direct_cap):
    """All N rows equal: every query ties with all of them, so the top-k is ids 0..k-1 (closed form)
    at the query's own LCP — through the direct read, the tree (direct_cap = 0) and k beyond the tree."""
    n = 5000
    rows = torch.full((n, 8), 3, dtype=torch.uint8)
    index = build(rows, engine="numba")
    index.direct_cap = direct_cap
    queries = torch.tensor([[3] * 8, [3] * 5 + [0] * 3, [4] * 8, [3, 3] + [9] * 6], dtype=torch.uint8)
    depth = torch.tensor([8, 5, 0, 2])
    for k in (1, 63, 64, 65, 1000, 1024, 1025, 2000, n, n + 9):
        got = index.topk(queries, k)
        kk = min(k, n)
        assert got.ids[:, :kk].tolist() == [list(range(kk))] * 4, k
        assert torch.equal(got.lcps[:, :kk], depth[:, None].expand(4, kk)), k
        assert got.ids[:, kk:].eq(-1).all() and got.lcps[:, kk:].eq(-1).all()


@pytest.mark.parametrize("direct_cap", [None, 0])
def test_tie_ranges_of_every_size_through_the_tree(direct_cap):
    """A two-letter alphabet over 20,000 rows: tie ranges from a few rows to thousands, so that the tree's
    id levels (nodes of 2,048 positions and more) are read, with k up to and past the tree's 1,024."""
    g = torch.Generator().manual_seed(3)
    rows, lengths, queries, qls = random_case(g, 20_000, 16, 2, torch.uint8, variable=True, batch=24)
    index = build(rows, lengths, engine="numba")
    index.direct_cap = direct_cap
    for k in (1, 10, 200, 1024, 1500):
        assert_exact(index, rows, queries, k, lengths, qls)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_mid_size_variable_lengths(dtype):
    """Every dtype with variable lengths at a size with many buckets and tree levels; queries longer
    and shorter than L."""
    g = torch.Generator().manual_seed(4 + DTYPES.index(dtype))
    rows, lengths, queries, qls = random_case(g, 3000, 9, 3, dtype, variable=True, batch=30, query_len=12)
    index = build(rows, lengths, engine="numba")
    for k in (1, 7, 100, 3001):
        assert_exact(index, rows, queries, k, lengths, qls)


def test_engines_agree_on_random_bytes():
    """The two engines on 50,000 random byte rows (the bench's data): the same answers at every k."""
    from pipeplan.lcp.bench import make_data

    rows, queries = make_data(50_000, 32, 300, 0)
    fast, slow = build(rows, engine="numba"), build(rows, engine="torch")
    for k in (1, 10, 100, 1000):
        a, b = fast.topk(queries, k), slow.topk(queries, k)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.lcps, b.lcps), k


def test_ranges_from_the_bucket_table():
    """N >= 2^19 byte rows: the bucket table covers two tokens, so S_1 and S_2 are read off it. Against
    the torch engine (itself checked against brute force): the first two tokens from 6 values (ranges of
    ~15,000 rows: d* = 1, 2 and deeper, through the direct read and the tree), 3,000 rows sharing their
    first 8 tokens (a crowded bucket: the binary search of the first word and the gallop over its run)
    among them 40 identical rows, and queries whose first token no row has (d* = 0) or that repeat."""
    from pipeplan.lcp.engine import table_tokens

    n = (1 << 19) + 5
    g = torch.Generator().manual_seed(7)
    rows = torch.randint(0, 256, (n, 32), dtype=torch.uint8, generator=g)
    rows[:, :2] = torch.randint(0, 6, (n, 2), dtype=torch.uint8, generator=g)
    rows[1000:4000, :8] = rows[1000, :8]
    rows[2000:2040] = rows[2000]
    assert table_tokens(n, 8, has_lengths=False) == 2
    src = torch.randint(0, n, (400,), generator=g)
    src[:60] = torch.randint(1000, 4000, (60,), generator=g)
    keep = torch.randint(0, 33, (400, 1), generator=g) > torch.arange(32)
    queries = torch.where(keep, rows[src], torch.randint(0, 256, (400, 32), dtype=torch.uint8, generator=g))
    queries[60:80, 0] = 200  # no row starts with 200
    queries[80:100] = queries[100]
    fast, slow = build(rows, engine="numba"), build(rows, engine="torch")
    for k in (1, 10, 100, 1000):
        a, b = fast.topk(queries, k), slow.topk(queries, k)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.lcps, b.lcps), k
    depths = set(slow.explain(queries, 10).d.tolist()) | set(slow.explain(queries, 100).d.tolist())
    assert {0, 1, 2, 3} <= depths, depths  # S_1 and S_2 from the table, S_3 from the walk or searches


@pytest.mark.parametrize("n", [5000, (1 << 19) + 3])
def test_depth_below_the_table_read_off_it(n):
    """|S_{table_tokens}| < k: d* and S_{d*+1} come from the bucket table and adj is walked over S_{d*+1}
    only. Random byte rows (table_tokens 1 at N = 5,000, 2 at 2^19 + 3), k from below |S_tt| to above
    |S_1| (d* = table_tokens - 1 down to 0), queries cut to 0, 1 or 2 tokens (shorter than the table's
    depth: S_d is empty for d beyond the query) and queries equal to rows; against the torch engine."""
    from pipeplan.lcp.engine import table_tokens

    g = torch.Generator().manual_seed(n)
    rows = torch.randint(0, 256, (n, 32), dtype=torch.uint8, generator=g)
    rows[7:30] = rows[7]  # a duplicate group inside one S_tt
    depth = table_tokens(n, 8, has_lengths=False)
    assert depth == (1 if n < 1 << 19 else 2)
    queries = torch.cat([rows[torch.randint(0, n, (150,), generator=g)],
                         torch.randint(0, 256, (150, 32), dtype=torch.uint8, generator=g)])  # fmt: skip
    queries[150:200, 0] = rows[torch.randint(0, n, (50,), generator=g), 0]  # shares the first token only
    qls = torch.full((300,), 32)
    qls[::5], qls[1::5], qls[2::10] = 0, 1, 2
    fast, slow = build(rows, engine="numba"), build(rows, engine="torch")
    for k in (1, 5, 30, 300, 1000, 3000, n + 4):
        a, b = fast.topk(queries, k, qls), slow.topk(queries, k, qls)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.lcps, b.lcps), k
    d = slow.explain(queries, 1000, qls).d
    assert (d < depth).any() and (d == 0).any()


def test_group_heads_are_each_groups_smallest_ids():
    """engine.group_heads against a sort of each group's ids: groups of 0, 1, fewer than HEADS, between
    HEADS and HEAD_SPAN and beyond HEAD_SPAN rows (left unfilled: the kernel selects there)."""
    from pipeplan.lcp.engine import HEAD_MIN_ROWS, HEAD_SPAN, HEADS, group_heads

    g = np.random.default_rng(5)
    sizes = np.concatenate([[0, 1, 5, HEADS, HEADS + 1, HEAD_SPAN, HEAD_SPAN + 1], g.integers(64, 120, 249)])
    group = np.repeat(np.arange(256), sizes)  # the group of each sorted row: non-decreasing
    first_words = ((group - 128) << 56) | g.integers(0, 1 << 56, len(group))
    first_words.sort()
    ids = g.permutation(len(group)).astype(np.int32)
    heads = group_heads(first_words, ids, 8)
    assert heads.shape == (256, HEADS) and heads.dtype == np.uint8
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for b in range(256):
        lo, hi = starts[b], starts[b + 1]
        if hi - lo > HEAD_SPAN:
            continue
        m = min(hi - lo, HEADS)
        assert np.array_equal(ids[lo + heads[b, :m].astype(np.int64)], np.sort(ids[lo:hi])[:m]), b
    few = np.sort(g.integers(-(2**63), 2**63 - 1, 1000))  # 4 rows a group on average: not worth it
    assert group_heads(few, np.arange(1000, dtype=np.int32), 8).shape == (0, HEADS)
    # the build rule's edge: HEAD_MIN_ROWS rows a group on average, so at most a quarter byte per row (the
    # index's 1.5x memory bound at L = 32 has no more to spare next to a 0.5-byte-per-row bucket table)
    edge = np.sort(g.integers(-(2**63), 2**63 - 1, HEAD_MIN_ROWS * 256))
    assert 0 < group_heads(edge, np.arange(len(edge), dtype=np.int32), 8).nbytes <= len(edge) / 4
    assert group_heads(edge[1:], np.arange(len(edge) - 1, dtype=np.int32), 8).shape == (0, HEADS)


def test_head_span_is_one_value():
    """HEAD_SPAN is written twice (lcp/engine.py builds the heads, lcp/kernel.py reads them; the kernel
    cannot import the engine, and a global from another module would outlive numba's on-disk cache):
    the two agree, and every offset within a group of HEAD_SPAN rows fits the heads' uint8."""
    from pipeplan.lcp import engine
    from pipeplan.lcp import kernel as module

    assert module.HEAD_SPAN == engine.HEAD_SPAN == np.iinfo(np.uint8).max + 1


def test_ties_from_the_group_heads():
    """N = 20,000 byte rows: table_tokens = 1 and ~78 rows per first byte, so the group heads are built
    and answer every k <= HEADS whose d* is 1, read as k gathers; a group of 700 rows (beyond
    HEAD_SPAN: selected instead), one of 5 rows (fewer than k for k > 5: d* = 0) and duplicate rows.
    Against brute force, and the same index with the heads removed."""
    from pipeplan.lcp.engine import HEADS

    g = torch.Generator().manual_seed(11)
    rows = torch.randint(0, 256, (20_000, 32), dtype=torch.uint8, generator=g)
    rows[:700, 0] = 5
    rows[(rows[:, 0] == 7).nonzero()[5:, 0], 0] = 8
    rows[900:930] = rows[900]
    queries = torch.cat([rows[torch.randint(0, 20_000, (200,), generator=g)],
                         torch.randint(0, 256, (100, 32), dtype=torch.uint8, generator=g)])  # fmt: skip
    queries[:20, 0], queries[20:40, 0], queries[40:50] = 5, 7, rows[900]
    queries[60:200, 1:] = torch.randint(0, 256, (140, 31), dtype=torch.uint8, generator=g)  # d* = 1 mostly
    index = build(rows, engine="numba")
    assert index._engine.heads.shape == (256, HEADS)
    plain = build(rows, engine="numba")
    plain._engine.heads = plain._engine.heads[:0]  # no heads: every tie range selected
    for k in (1, 2, 5, 6, 10, HEADS, HEADS + 1, 40):
        assert_exact(index, rows, queries, k)
        a, b = index.topk(queries, k), plain.topk(queries, k)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.lcps, b.lcps), k


def test_wide_heads_are_each_first_tokens_smallest_ids():
    """engine.wide_heads against a sort of each first token's ids: groups of 0, 1, 5, WIDE − 1, WIDE,
    WIDE + 1 and ~3,000 rows; -1 past a smaller group; the ids' dtype; not built below WIDE_MIN_ROWS rows a
    group on average, and at that edge at most a quarter byte per row (int32 ids)."""
    from pipeplan.lcp import kernel as module
    from pipeplan.lcp.engine import WIDE, WIDE_MIN_ROWS, wide_heads

    room = 1 << 40  # bytes: no budget limit

    assert WIDE == module.CAP  # the kernel reads them where the tree's merge would answer k <= CAP
    g = np.random.default_rng(7)
    sizes = np.concatenate([[0, 1, 5, WIDE - 1, WIDE, WIDE + 1], g.integers(2_000, 4_000, 250)])
    group = np.repeat(np.arange(256), sizes)
    first_words = ((group - 128) << 56) | g.integers(0, 1 << 56, len(group))
    first_words.sort()
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for dtype in (np.int32, np.int64):
        ids = g.permutation(len(group)).astype(dtype)
        heads = wide_heads(first_words, ids, 8, room)
        assert heads.shape == (0, WIDE)  # ~2,900 rows a group: below WIDE_MIN_ROWS
        heads = wide_heads(np.repeat(first_words, 6), np.repeat(ids, 6), 8, room)  # each id 6 times: ~17k a group
        assert heads.shape == (256, WIDE) and heads.dtype == dtype
        for b in range(256):
            want = np.sort(np.repeat(ids[starts[b] : starts[b + 1]], 6))[:WIDE]
            assert np.array_equal(heads[b, : len(want)], want), b
            assert (heads[b, len(want) :] == -1).all(), b
    edge = np.sort(g.integers(-(2**63), 2**63 - 1, WIDE_MIN_ROWS * 256))
    ids = np.arange(len(edge), dtype=np.int32)
    assert 0 < wide_heads(edge, ids, 8, room).nbytes <= len(edge) / 4
    assert wide_heads(edge[1:], ids[1:], 8, room).shape == (0, WIDE)
    assert wide_heads(edge, ids, 8, 256 * WIDE * 4).shape == (256, WIDE)  # exactly the budget
    assert wide_heads(edge, ids, 8, 256 * WIDE * 4 - 1).shape == (0, WIDE)


def test_ties_from_the_wide_heads(monkeypatch):
    """N = 20,000 byte rows with the wide heads built (WIDE_MIN_ROWS and ROW_BUDGET relaxed) and every tie range
    above d* = 0 sent past the direct read (direct_cap = 0): each k whose d* is 1 copies S_1's smallest
    ids from the heads, less S_2's, which are sorted by the 16- to 128-lane networks (groups of 12, 40, 100
    and 128 rows sharing two bytes) or the radix sort (200). Against brute force and the same index with
    the heads removed (the tree's merge)."""
    from pipeplan.lcp import engine
    from pipeplan.lcp.engine import WIDE

    monkeypatch.setattr(engine, "WIDE_MIN_ROWS", 1)
    monkeypatch.setattr(engine, "ROW_BUDGET", 100)  # 1 MiB of heads over 20,000 rows: 52 bytes a row
    g = torch.Generator().manual_seed(13)
    rows = torch.randint(0, 256, (20_000, 32), dtype=torch.uint8, generator=g)
    at = 0
    for first, size in ((3, 12), (4, 40), (5, 100), (6, 128), (9, 200)):
        rows[at : at + size, :2] = torch.tensor([first, 77], dtype=torch.uint8)
        at += size
    queries = torch.cat([rows[torch.randint(0, 20_000, (150,), generator=g)],
                         torch.randint(0, 256, (50, 32), dtype=torch.uint8, generator=g)])  # fmt: skip
    queries[:50, :2] = torch.tensor([3, 4, 5, 6, 9] * 10, dtype=torch.uint8)[:, None].expand(50, 2)
    queries[:50, 1] = 77
    queries[60:150, 1:] = torch.randint(0, 256, (90, 31), dtype=torch.uint8, generator=g)  # d* = 1 mostly
    index = build(rows, engine="numba")
    assert index._engine.wide.shape == (256, WIDE)
    index.direct_cap = 0
    plain = build(rows, engine="numba")
    plain._engine.wide = plain._engine.wide[:0]
    plain.direct_cap = 0
    for k in (17, 60, 129, 150, 250, 400, WIDE):
        assert_exact(index, rows, queries, k)
        a, b = index.topk(queries, k), plain.topk(queries, k)
        assert torch.equal(a.ids, b.ids) and torch.equal(a.lcps, b.lcps), k


def test_visiting_order():
    """engine.visiting_order: a permutation of the batch, non-decreasing in the first word's high bits."""
    from pipeplan.lcp.engine import visiting_order

    for b in (0, 1, 2, 7, 4096):
        words = np.random.default_rng(b).integers(-(2**63), 2**63 - 1, b, dtype=np.int64)
        words[: b // 2] = words[0] if b else 0  # ties
        order = visiting_order(words)
        assert sorted(order.tolist()) == list(range(b))
        low = max(b - 1, 0).bit_length()
        assert (np.diff(words[order] >> low) >= 0).all()


@pytest.mark.parametrize("m", [1, 2, 31, 32, 33, 100, 257, 5000])
def test_sort_and_selection(m):
    """The kernel's radix sort and quickselect against numpy's sort: random, sorted, reversed, organ-pipe
    and values sharing all but their low byte."""
    g = np.random.default_rng(m)
    shapes = [g.permutation(10 * m)[:m], np.arange(m), np.arange(m)[::-1],
              np.concatenate([np.arange(m)[::2], np.arange(m)[1::2][::-1]]),
              (1 << 40) + g.permutation(m)]  # fmt: skip
    kern = kernel()
    for values in shapes:
        values = np.ascontiguousarray(values, dtype=np.int64)
        tmp, counts = np.empty(max(m, 512), np.int64), np.empty(256, np.int64)
        a = values.copy()
        kern._sort(a, m, tmp, counts)
        assert np.array_equal(a, np.sort(values))
        for count in {1, max(1, m // 3), m}:
            a = values.copy()
            kern._smallest(a, m, count, tmp, counts)
            assert np.array_equal(a[:count], np.sort(values)[:count])


@pytest.mark.parametrize("lanes", [16, 32, 64, 128])
def test_sorting_network(lanes):
    """lcp/sortnet.py's bitonic networks against numpy's sort: random int32 over the whole range, the
    extremes, duplicates, sorted, reversed and padded sets (what the kernel passes: ids, then INT32_MAX)."""
    import numba

    from pipeplan.lcp.sortnet import INT32_MAX, sort16, sort32, sort64, sort128

    net = {16: sort16, 32: sort32, 64: sort64, 128: sort128}[lanes]

    @numba.njit
    def run(a):
        net(a)

    g = np.random.default_rng(lanes)
    info = np.iinfo(np.int32)
    cases = [
        g.integers(info.min, info.max, lanes, endpoint=True),
        g.integers(0, 3, lanes),
        np.arange(lanes),
        np.arange(lanes)[::-1],
        np.full(lanes, info.min),
        np.tile([info.max, info.min], lanes // 2),
    ]
    cases += [np.concatenate([g.permutation(1_000_000)[:m], np.full(lanes - m, INT32_MAX)]) for m in range(1, lanes)]
    for values in cases * 3 + [g.integers(info.min, info.max, lanes) for _ in range(200)]:
        a = np.ascontiguousarray(values, dtype=np.int32)
        run(a)
        assert np.array_equal(a, np.sort(values.astype(np.int32)))


def test_small_tie_ranges_through_the_network():
    """Groups of 1 to 40 rows sharing a 3-byte prefix (ids shuffled): a query on each prefix ties with
    its group at d* = 3, so the top-k for k <= the group's size is its k smallest ids — sorted by the
    network up to 32 rows (16 or 32 lanes), selected beyond. Against brute force, for k = 1 to 40."""
    g = torch.Generator().manual_seed(40)
    sizes = list(range(1, 41))
    prefix = torch.stack([torch.tensor([s, 255 - s, 7]) for s in sizes]).to(torch.uint8)
    rows = torch.cat([prefix[i].expand(s, 3) for i, s in enumerate(sizes)])
    rows = torch.cat([rows, torch.randint(0, 256, (rows.shape[0], 5), generator=g, dtype=torch.uint8)], 1)
    rows = rows[torch.randperm(rows.shape[0], generator=g)]  # ids in no order within a group
    rows = torch.cat([rows, torch.randint(0, 256, (3000, 8), generator=g, dtype=torch.uint8)])
    queries = torch.cat([prefix, torch.full((len(sizes), 5), 0, dtype=torch.uint8)], 1)
    index = build(rows, engine="numba")
    for k in (1, 2, 9, 10, 15, 16, 17, 31, 32, 33, 40):
        assert_exact(index, rows, queries, k)


def test_scratch_grows_for_wide_direct_ranges():
    """A tie range wider than the loop's scratch (k > 1,024 reads 9,000 tied ids, more than 8k) makes the
    loop return to topk for more and resume with that query: the queries visited before and after it
    keep their answers. 9,000 identical rows and 1,000 others; queries alternate between the two."""
    g = torch.Generator().manual_seed(9)
    rows = torch.cat([torch.full((9000, 6), 5, dtype=torch.uint8),
                      torch.randint(6, 256, (1000, 6), generator=g, dtype=torch.uint8)])  # fmt: skip
    queries = torch.cat([rows[:1], rows[9000:9003], rows[:1], rows[9500:9502]])
    index = build(rows, engine="numba")
    for k in (1030, 1100):
        assert_exact(index, rows, queries, k)
        assert index.topk(rows[:1], k).ids[0].tolist() == list(range(k))  # closed form


@pytest.mark.parametrize("direct_cap", [None, 0])
def test_long_rows_written_in_blocks(direct_cap):
    """k >= BLOCKS: a row's ids are written as block copies between the ids of S_{d*+1} that fall among
    the k smallest of S_{d*} (each found by galloping) — runs 0, 1, 2, … for d* = 0, a cached list (read
    directly or from the tree: direct_cap 0) for d* = 1 — and by streaming stores where B · k >= STREAM.
    Skipped ids at a row's start, in runs, near its k-th id and beyond it. Against brute force, for
    k = BLOCKS − 1 (a merge step per value), BLOCKS and 1,000, at 64 queries and at 640 (streamed)."""
    from pipeplan.lcp.kernel import BLOCKS, STREAM

    g = torch.Generator().manual_seed(128)
    n = 12_000
    rows = torch.randint(0, 256, (n, 8), dtype=torch.uint8, generator=g)
    rows[::3, 0] = 7  # S_1 of first byte 7: ~4,000 rows, so d* = 1 at k = 1000 for queries (7, 9, ...)
    pair = [3, 6, 9, 12, 15, 300, 303, 2997, 3000, 3003, 6000]  # S_2 of (7, 9): skipped among S_1's smallest
    rows[pair, 0], rows[pair, 1] = 7, 9
    single = [0, 1, 2, 4, 5, 50, 52, 53, 998, 1000, 1001, 1003]  # S_1 of first byte 201 (d* = 0 at k = 1000)
    rows[single, 0] = 201
    queries = torch.randint(0, 256, (64, 8), dtype=torch.uint8, generator=g)
    queries[:16, :2] = torch.tensor([7, 9], dtype=torch.uint8)
    queries[16:20] = rows[pair[:4]]  # rows deeper than d* + 1 too
    queries[20:32, 0] = 201
    queries[32:36] = rows[single[:4]]
    queries[36:48, 0] = 7
    index = build(rows, engine="numba")
    index.direct_cap = direct_cap
    full = torch.full((n,), 8)
    assert 64 * 1000 < STREAM <= 640 * 1000 and 640 * BLOCKS < STREAM  # streamed only for k = 1000 at 640
    for k in (BLOCKS - 1, BLOCKS, 1000):
        want_ids, want_lcps = torch_brute_force(rows, full, queries, torch.full((64,), 8), k)
        for reps in (1, 10):
            got = index.topk(queries.repeat(reps, 1), k)
            assert torch.equal(got.ids, want_ids.repeat(reps, 1)), (k, reps)
            assert torch.equal(got.lcps, want_lcps.repeat(reps, 1)), (k, reps)
    d = index.explain(queries, 1000).d
    assert (d[:16] == 1).all() and (d[20:36] == 0).all()



def test_streamed_rows_pad_past_n():
    """k > N with N >= BLOCKS and B · k >= STREAM: the blocks and the padding (lcp and id −1 past N) are written
    by streaming stores; the answer equals brute force (N = 300 rows, k = 1,000, 600 queries)."""
    from pipeplan.lcp.kernel import BLOCKS, STREAM

    g = torch.Generator().manual_seed(5)
    n, k, b = 300, 1000, 600
    rows = torch.randint(0, 4, (n, 6), dtype=torch.uint8, generator=g)
    queries = torch.randint(0, 4, (b, 6), dtype=torch.uint8, generator=g)
    assert n >= BLOCKS and b * k >= STREAM
    got = build(rows, engine="numba").topk(queries, k)
    want_ids, want_lcps = torch_brute_force(rows, torch.full((n,), 6), queries, torch.full((b,), 6), k)
    assert torch.equal(got.ids, want_ids) and torch.equal(got.lcps, want_lcps)
    assert (got.ids[:, n:] == -1).all() and (got.lcps[:, n:] == -1).all()

def test_engine_choice_and_refusals():
    rows = torch.randint(0, 256, (100, 4), dtype=torch.uint8)
    index = LCPIndex.build(rows)
    assert index.engine == "numba"  # the default on CPU with numba installed
    index.engine = "torch"
    assert index.engine == "torch"
    with pytest.raises(LCPError, match="engine must be 'numba', 'triton' or 'torch'"):
        index.engine = "cuda"
    with pytest.raises(LCPError, match="queries must have rank 2"):
        build(rows, engine="numba").topk(torch.zeros((1, 1, 4), dtype=torch.uint8), 3)


def test_uncacheable_kernel_still_compiles(monkeypatch):
    """A read-only install where numba finds no cache directory: the kernel compiles in memory instead."""
    import numba

    from pipeplan.lcp import kernel as module

    real = numba.njit

    def njit(*args, **kwargs):
        if kwargs.get("cache"):
            raise RuntimeError("cannot cache function 'f': no locator available for file 'f.py'")
        return real(*args, **kwargs)

    monkeypatch.setattr(numba, "njit", njit)

    def twice(x):
        return 2 * x

    assert module._jit(twice)(21) == 42
