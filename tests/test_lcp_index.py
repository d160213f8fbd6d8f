"""LCPIndex and its baselines against brute force: random and adversarial rows, every dtype, CPU and CUDA.

Ground truth is computed here, independently of lcp's packing: the LCP of two token lists is counted
token by token, and the top-k is a sort by (LCP desc, id asc) padded with (-1, -1).
"""

from __future__ import annotations

import pytest
import torch

from pipeplan.lcp import LCPIndex, engine
from pipeplan.lcp.baselines import FullScan, Pairwise
from pipeplan.lcp.engine import kernel
from pipeplan.lcp.trie import Trie

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
# the two ways an index answers: the compiled CPU kernel (needs numba) and the torch ops (CPU and CUDA)
ENGINES = [pytest.param("numba", marks=pytest.mark.skipif(kernel() is None, reason="needs numba")), "torch"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def build(rows, lengths=None, device="cpu", engine="torch"):
    """LCPIndex.build answering through `engine` (the numba kernel exists on CPU only: skip it elsewhere)."""
    if engine == "numba" and device != "cpu":
        pytest.skip("the numba engine is CPU-only")
    index = LCPIndex.build(rows, lengths, device=device)
    index.engine = engine
    return index


def brute_force(rows, lengths, queries, query_lengths, k):
    """Pure-Python top-k by LCP over token lists (small inputs)."""
    out_ids, out_lcps = [], []
    for q, ql in zip(queries, query_lengths, strict=True):
        ranked = []
        for i, (r, rl) in enumerate(zip(rows, lengths, strict=True)):
            lcp, m = 0, min(ql, rl)
            while lcp < m and r[lcp] == q[lcp]:
                lcp += 1
            ranked.append((-lcp, i))
        ranked.sort()
        top = ranked[:k] + [(1, -1)] * max(0, k - len(ranked))
        out_ids.append([i for _, i in top])
        out_lcps.append([-negl for negl, _ in top])
    return torch.tensor(out_ids, dtype=torch.int64), torch.tensor(out_lcps, dtype=torch.int64)


def torch_brute_force(rows, lengths, queries, query_lengths, k):
    """Vectorised brute force on raw tokens (medium inputs): first mismatch by cumprod."""
    n, width = rows.shape[0], min(rows.shape[1], queries.shape[1])
    eq = rows[None, :, :width].long() == queries[:, None, :width].long()  # (B, N, width)
    lcp = eq.long().cumprod(2).sum(2)
    lcp = torch.minimum(lcp, torch.minimum(lengths[None, :], query_lengths[:, None]))
    order = torch.argsort(-lcp * (n + 1) + torch.arange(n), dim=1)[:, :k]
    ids, lcps = order, lcp.gather(1, order)
    pad = torch.full((queries.shape[0], k - ids.shape[1]), -1)
    return torch.cat([ids, pad], 1), torch.cat([lcps, pad], 1)


def random_case(g, n, length, alphabet, dtype=torch.uint8, variable=False, batch=9, query_len=None):
    """Rows, their lengths, and queries that copy a random row's prefix then continue randomly."""
    info = torch.iinfo(dtype)
    base = info.min if info.min < 0 else 0
    rows = (torch.randint(0, alphabet, (n, length), generator=g) + base).to(dtype)
    lengths = torch.randint(0, length + 1, (n,), generator=g) if variable else torch.full((n,), length)
    qlen = length if query_len is None else query_len
    queries = (torch.randint(0, alphabet, (batch, qlen), generator=g) + base).to(dtype)
    src = torch.randint(0, n, (batch,), generator=g)
    for b in range(batch):
        cut = int(torch.randint(0, min(qlen, length) + 1, (1,), generator=g))
        queries[b, :cut] = rows[src[b], :cut]
    query_lengths = torch.randint(0, qlen + 1, (batch,), generator=g)
    return rows, lengths, queries, query_lengths


def expected(rows, lengths, queries, query_lengths, k):
    def to_list(t):
        return [[int(v) for v in r] for r in t]

    return brute_force(to_list(rows), lengths.tolist(), to_list(queries), query_lengths.tolist(), k)


def assert_topk(method, queries, query_lengths, k, want, device="cpu"):
    got = method.topk(queries.to(device), k, query_lengths.to(device))
    ids, lcps = got.ids, got.lcps
    assert ids.device.type == device
    assert ids.dtype == lcps.dtype == torch.int64 and ids.shape == (queries.shape[0], k)
    assert torch.equal(ids.cpu(), want[0]), f"ids differ:\n{ids}\n{want[0]}"
    assert torch.equal(lcps.cpu(), want[1]), f"lcps differ:\n{lcps}\n{want[1]}"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variable", [False, True])
def test_every_dtype_matches_brute_force(dtype, variable, device, engine):
    g = torch.Generator().manual_seed(DTYPES.index(dtype) * 2 + variable)
    for trial in range(6):
        n = int(torch.randint(1, 80, (1,), generator=g))
        length = int(torch.randint(1, 13, (1,), generator=g))
        alphabet = [1, 2, 3, 256][trial % 4]
        qlen = [length, length + 3, max(0, length - 2)][trial % 3]  # queries longer and shorter than L
        rows, lengths, queries, qls = random_case(g, n, length, alphabet, dtype, variable, query_len=qlen)
        k = int(torch.randint(1, n + 6, (1,), generator=g))  # includes k > N
        want = expected(rows, lengths, queries, qls, k)
        index = build(rows, lengths if variable else None, device, engine)
        assert_topk(index, queries, qls, k, want, device)
        index.direct_cap = 0  # force the tree tie-break path
        assert_topk(index, queries, qls, k, want, device)


def _duplicates(g):
    distinct = torch.randint(0, 256, (9, 16), generator=g).to(torch.uint8)
    return distinct[torch.randint(0, 9, (500,), generator=g)]


@pytest.mark.parametrize(
    "name, make",
    [
        ("all-equal rows", lambda g: torch.full((300, 8), 7, dtype=torch.uint8)),
        ("one symbol, all lengths", lambda g: torch.zeros((120, 10), dtype=torch.uint8)),
        ("two symbols", lambda g: torch.randint(0, 2, (400, 6), generator=g).to(torch.uint8)),
        ("many duplicates", _duplicates),
        ("extreme int64", lambda g: torch.tensor([[-(2**63), 2**63 - 1], [2**63 - 1, -(2**63)], [0, -1]] * 40)),
    ],
)
@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("device", DEVICES)
def test_adversarial_rows(name, make, device, engine):
    g = torch.Generator().manual_seed(7)
    rows = make(g)
    n, length = rows.shape
    variable = name == "one symbol, all lengths"
    lengths = torch.arange(n) % (length + 1) if variable else torch.full((n,), length)
    queries = torch.cat([rows[:4], torch.zeros((2, length), dtype=rows.dtype), rows[-3:]])
    qls = torch.tensor([length, length // 2, 0, 1, length, 3, length, 2, length]).clamp(max=length)
    for k in (1, 5, 64, n + 3):
        want = expected(rows, lengths, queries, qls, k)
        index = build(rows, lengths if variable else None, device, engine)
        assert_topk(index, queries, qls, k, want, device)
        index.direct_cap = 0
        assert_topk(index, queries, qls, k, want, device)


@pytest.mark.parametrize("engine", ENGINES)
def test_query_tokens_outside_the_index_dtype_match_nothing(engine):
    rows = torch.tensor([[1, 2, 3], [1, 2, 255], [0, 0, 0]], dtype=torch.uint8)
    queries = torch.tensor([[1, 2, 300], [-1, 2, 3], [1, 2, 255]])  # int64 queries on a uint8 index
    got = build(rows, engine=engine).topk(queries, 3)
    ids, lcps = got.ids, got.lcps
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2], [1, 0, 2]]
    assert lcps.tolist() == [[2, 2, 0], [0, 0, 0], [3, 2, 0]]


@pytest.mark.parametrize("engine", ENGINES)
def test_medium_sizes_and_baselines_agree_with_brute_force(engine):
    g = torch.Generator().manual_seed(11)
    cases = [
        (3000, 12, 2, torch.uint8, True),  # many rows share word 0: binary searches span many fences
        (4000, 32, 256, torch.uint8, False),
        (2500, 9, 3, torch.uint8, False),
        (2000, 6, 3, torch.int64, True),  # one token per word: prefix masks keep all of a word or nothing
        (2000, 7, 2, torch.int16, False),
    ]
    for n, length, alphabet, dtype, variable in cases:
        rows, lengths, queries, qls = random_case(g, n, length, alphabet, dtype, variable, batch=40)
        built = lengths if variable else None
        methods = [
            build(rows, built, engine=engine),
            FullScan.build(rows, built),
            Pairwise.build(rows, built, budget_bytes=1 << 30),
        ] + ([Trie.build(rows, built, k_max=40)] if dtype != torch.int64 else [])
        for k in (1, 10, 40):
            want = torch_brute_force(rows, lengths, queries, qls, k)
            for method in methods:
                assert_topk(method, queries, qls, k, want)


@pytest.mark.parametrize("engine", ENGINES)
def test_large_duplicate_groups_use_the_tree(engine):
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 2, (20_000, 4), generator=g).to(torch.uint8)  # 16 distinct rows, ~1250 each
    queries = torch.randint(0, 2, (16, 4), generator=g).to(torch.uint8)
    qls = torch.tensor([4, 3, 2, 1] * 4)
    want = torch_brute_force(rows, torch.full((20_000,), 4), queries, qls, 25)
    assert_topk(build(rows, engine=engine), queries, qls, 25, want)


@pytest.mark.parametrize("engine", ENGINES)
def test_results_are_deterministic_and_ordered(engine):
    g = torch.Generator().manual_seed(5)
    rows, _, queries, qls = random_case(g, 2000, 8, 3, batch=30)
    index = build(rows, engine=engine)
    a, b = index.topk(queries, 17, qls), index.topk(queries, 17, qls)
    assert torch.equal(a.ids, b.ids) and torch.equal(a.lcps, b.lcps)
    ids, lcps = a.ids, a.lcps
    assert (lcps[:, :-1] >= lcps[:, 1:]).all()
    ties = lcps[:, :-1] == lcps[:, 1:]
    assert (ids[:, :-1][ties] < ids[:, 1:][ties]).all()


@pytest.mark.parametrize("engine", ENGINES)
def test_save_load_roundtrip(tmp_path, engine):
    g = torch.Generator().manual_seed(2)
    rows, lengths, queries, qls = random_case(g, 500, 10, 4, torch.int16, variable=True, batch=12)
    index = build(rows, lengths, engine=engine)
    index.save(tmp_path / "rows.lcp")
    loaded = LCPIndex.load(tmp_path / "rows.lcp")
    loaded.engine = engine
    assert loaded.n == 500 and loaded.length == 10 and loaded.nbytes == index.nbytes
    for k in (1, 7, 600):
        got, want = loaded.topk(queries, k, qls), index.topk(queries, k, qls)
        assert torch.equal(got.ids, want.ids) and torch.equal(got.lcps, want.lcps)


@pytest.mark.parametrize("n", [200_000, 2**21 + 1, 2**22])
def test_index_memory_is_raw_bytes_plus_o_n(n):
    """The 1.5x bound at L = 32 bytes. At N = 2^21 + 1 the kernel's bucket table is 0.5 bytes per row and the
    tree a little over 10: group heads built there at 0.5 bytes per row (32 rows a group, the first rule)
    made 1.5007x; under engine.HEAD_MIN_ROWS = 64 they start at N = 2^22 (1.4922x, measured once). The wide
    heads start there too, within what engine.ROW_BUDGET leaves (0.25 bytes per row: 1.49997x)."""
    rows = torch.randint(0, 256, (n, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    index = LCPIndex.build(rows)
    raw = rows.numel()
    # packed rows (= raw) + int32 ids (4 B/row) + adjacent LCPs (1 B/row) + smallest-id tree (~10 B/row)
    assert raw < index.nbytes <= raw + engine.ROW_BUDGET * rows.shape[0]
    assert index.nbytes <= 1.5 * raw


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    g = torch.Generator().manual_seed(9)
    for dtype, variable in [(torch.uint8, False), (torch.int32, True), (torch.int64, False)]:
        rows, lengths, queries, qls = random_case(g, 3000, 12, 3, dtype, variable, batch=64)
        built = lengths if variable else None
        cpu = LCPIndex.build(rows, built)
        gpu = LCPIndex.build(rows, built, device="cuda")
        assert gpu.words.is_cuda
        for k in (1, 10, 3500):
            want = cpu.topk(queries, k, qls)
            got = gpu.topk(queries.cuda(), k, qls.cuda())
            assert got.ids.is_cuda
            assert torch.equal(got.ids.cpu(), want.ids) and torch.equal(got.lcps.cpu(), want.lcps)
        scan = FullScan.build(rows, built, device="cuda").topk(queries, 10, qls)
        assert torch.equal(scan.ids.cpu(), cpu.topk(queries, 10, qls).ids)


def test_without_numba_the_torch_engine_answers(monkeypatch):
    """numba is optional: without it an index answers through torch, and asking for numba says why."""
    import pipeplan.lcp.engine
    from pipeplan.lcp import LCPError

    monkeypatch.setattr(pipeplan.lcp.engine, "kernel", lambda: None)
    g = torch.Generator().manual_seed(8)
    rows, lengths, queries, qls = random_case(g, 300, 6, 3, batch=10)
    index = LCPIndex.build(rows)
    assert index.engine == "torch"
    assert_topk(index, queries, qls, 7, torch_brute_force(rows, lengths, queries, qls, 7))
    with pytest.raises(LCPError, match="numba is not installed"):
        index.engine = "numba"
