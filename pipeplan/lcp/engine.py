"""The CPU engine of `LCPIndex`: the compiled kernel (lcp/kernel.py) over numpy views of the index's tensors.

numba is optional (`pip install pipeplan[lcp]`): without it, or on CUDA, the index answers with its torch
ops (lcp/index.py). With it, a query batch is one call into the kernel after a light check and packing of
the queries — no torch ops beyond reading the inputs — so a single query costs microseconds, not the
~60 tensor operations of the torch path.

The engine adds one structure to the index, rebuilt whenever an index is built or loaded: a bucket table
over the top `bucket_bits(N)` bits of the first packed word, `starts[b]` = first sorted row in bucket b
(2^bits + 1 entries, int32 below 2^31 rows; bits = bit_length(N) − 4 in [2, 20]: 8–16 rows per bucket,
0.25–0.5 bytes per row). Every binary search on the first words starts inside one bucket. And, where
the rows sharing their first `table_tokens` tokens form groups of 64–256 rows on average (N = 4M–16M
byte rows, 16k–64k at the one-token depth), each group's 16 smallest ids as uint8 offsets
(`group_heads`: 16 bytes a group, at most 0.25 bytes per row), which answer k <= 16 at that depth
without a selection.

Compiled code is cached on disk by numba (`cache=True`): next to lcp/kernel.py in `__pycache__` when that
is writable, else in the user's cache directory (`~/.cache/numba`), or under $NUMBA_CACHE_DIR when set; if
none is writable the kernel compiles in memory once per process.
"""

from __future__ import annotations

import functools
import mmap
import weakref
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeplan.lcp import results
from pipeplan.lcp.limits import check_results, trim_heap
from pipeplan.lcp.ranking import LCPTopK
from pipeplan.lcp.tokens import check_lengths

if TYPE_CHECKING:
    from pipeplan.lcp.index import LCPIndex

BUCKET_BITS_MAX = 20  # 2^20 + 1 int32 entries = 4 MiB at most, reached from N = 16M rows on
BUCKET_ROWS_BITS = 4  # bit_length(N) - 4: about N / 8 to N / 16 buckets (8-16 rows each)
# tree levels 1-4 (nodes of 128 .. 1,024 positions) store offsets: (level, dtype, entries per node), as
# lcp/smallest.py builds them
OFFSET_LEVELS = ((1, np.uint8, 128), (2, np.uint8, 256), (3, np.int16, 512), (4, np.int16, 1024))


@functools.cache
def kernel() -> ModuleType | None:
    """lcp.kernel, compiled on first use; None when numba is not importable or its JIT is off
    (NUMBA_DISABLE_JIT=1 runs the kernel as plain Python, which cannot run its intrinsics): the index then
    answers through the torch engine."""
    try:
        import numba
    except ImportError:
        return None
    if numba.config.DISABLE_JIT:
        return None
    try:
        from pipeplan.lcp import kernel as module
    except ImportError:
        return None
    return module


def set_threads(count: int) -> int | None:
    """Give numba `count` threads (at most the cores it was started with); returns the count it took, or
    None without numba. The kernel itself runs on the calling thread: this bounds numba's pool, which
    the kernel does not use today (a `prange` over query chunks would)."""
    if kernel() is None:
        return None
    import numba

    taken = max(1, min(count, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(taken)
    return taken


def bucket_bits(n: int) -> int:
    return max(2, min(BUCKET_BITS_MAX, n.bit_length() - BUCKET_ROWS_BITS))


def table_tokens(n: int, token_bits: int, has_lengths: bool) -> int:
    """Depths d <= this have S_d (the rows whose first d tokens are the query's) read off the bucket
    table: d tokens lie within its bits, so S_d is a run of whole buckets. 0 with per-row lengths (a short
    row's padding would pass for tokens) and for 64-bit tokens."""
    return 0 if has_lengths or token_bits >= 64 else bucket_bits(n) // token_bits


HEADS = 16  # smallest ids kept per group of rows sharing their first table_tokens tokens (k <= HEADS)
HEAD_SPAN = 256  # groups of at most this many rows: a head is a uint8 offset into its group (lcp/kernel.py)
# built when groups hold this many rows on average: at most HEADS / 64 = 0.25 bytes per row. 32 (0.5 bytes per
# row) broke the 1.5x-raw memory bound at L = 32 bytes just above N = 2^21 (1.5007x at 2^21 + 1: the table is
# 0.5 bytes per row there and the tree a little over 10), tests/test_lcp_index.py
HEAD_MIN_ROWS = 64


def group_heads(first_words: np.ndarray, ids: np.ndarray, group_bits: int) -> np.ndarray:
    """heads uint8 [2^group_bits, HEADS]: for the rows whose first word's top `group_bits` bits are g
    (one group: a run of sorted rows, as the bucket table's), the offsets from the group's first row of
    its HEADS smallest ids, ascending by id — filled for groups of at most HEAD_SPAN rows (the kernel
    checks the size), so that a query whose d* is the table's depth reads its k <= HEADS smallest ids
    with k gathers instead of selecting among the group's ids (~76 at N = 5M). (0, HEADS) when the
    groups are too small on average to be worth it (fewer than HEAD_MIN_ROWS rows: the selection
    is over a few ids then) or too large for uint8 offsets."""
    n, count = len(first_words), 1 << group_bits
    if group_bits <= 0 or n < HEAD_MIN_ROWS * count or n > HEAD_SPAN * count:
        return np.zeros((0, HEADS), np.uint8)
    group = (first_words >> (64 - group_bits)) + (1 << (group_bits - 1))  # (N,) non-decreasing
    first = np.searchsorted(group, np.arange(count + 1))  # (G + 1,) each group's first row
    by_id = np.argsort((group << 32) | ids.astype(np.int64), kind="stable")  # groups in order, ids ascending
    rank = np.arange(n) - first[group[by_id]]  # rank by id within its group
    size = np.diff(first)[group[by_id]]
    keep = (rank < HEADS) & (size <= HEAD_SPAN)
    heads = np.zeros((count, HEADS), np.uint8)
    heads[group[by_id][keep], rank[keep]] = (by_id - first[group[by_id]])[keep]
    return heads


WIDE = 1024  # smallest ids kept per first token (lcp/kernel.py's CAP: the merge's and these answer k <= WIDE)
# built when the rows sharing a first token number this many on average (byte tokens: N >= 2^22, 4.2M rows;
# WIDE int32 ids a group is then at most 0.25 bytes per row) and when they fit ROW_BUDGET
WIDE_MIN_ROWS = 16 * WIDE
ROW_BUDGET = 16  # bytes per row an index holds beyond its packed rows: the 1.5x-raw bound at L = 32 bytes


def wide_heads(first_words: np.ndarray, ids: np.ndarray, bits: int, budget: int) -> np.ndarray:
    """heads [2^bits, WIDE] (ids' dtype): for each first token (the top `bits` bits of the first word, as
    group_heads groups them), the WIDE smallest ids of the rows that start with it, ascending, -1 past a
    smaller group — so that a query whose tie range is S_1 (d* = 1: k = 17 … 1024 at N = 5M byte rows)
    copies its smallest ids instead of merging them out of the tree (~30 µs per range at k = 1000).
    (0, WIDE) when the groups average fewer than WIDE_MIN_ROWS rows (the tree is cheap there, or the
    heads would cost too many bytes per row) or the heads would take more than `budget` bytes (what
    ROW_BUDGET leaves: 0.251 bytes per row at N = 2^22, where they take 0.25). One partition and sort per
    group: O(N) in all."""
    n, count = len(first_words), 1 << bits
    if bits <= 0 or n < WIDE_MIN_ROWS * count or count * WIDE * ids.itemsize > budget:
        return np.zeros((0, WIDE), ids.dtype)
    group = (first_words >> (64 - bits)) + (1 << (bits - 1))  # (N,) non-decreasing
    first = np.searchsorted(group, np.arange(count + 1))  # (G + 1,) each group's first row
    heads = np.full((count, WIDE), -1, ids.dtype)
    for g in range(count):
        part = ids[first[g] : first[g + 1]]
        if len(part) > WIDE:
            part = np.partition(part, WIDE - 1)[:WIDE]
        heads[g, : len(part)] = np.sort(part)
    return heads


def table_entry_bytes(n: int) -> int:
    """Bytes of one bucket-table entry: int32 below 2^31 rows, else int64."""
    return 4 if n < 2**31 else 8


def bucket_starts(first_words: torch.Tensor, bits: int) -> torch.Tensor:
    """starts [2^bits + 1]: first sorted position whose first word's top `bits` bits (as an unsigned
    bucket number: arithmetic shift plus 2^(bits-1), monotone in the signed word) are >= b."""
    n = first_words.shape[0]
    buckets = (first_words >> (64 - bits)) + (1 << (bits - 1))  # (N,) non-decreasing
    edges = torch.arange((1 << bits) + 1, dtype=torch.int64, device=first_words.device)
    return torch.searchsorted(buckets, edges).to(torch.int32 if table_entry_bytes(n) == 4 else torch.int64)


def visiting_order(first_words: np.ndarray) -> np.ndarray:
    """The order in which the kernel visits a batch: by first word, so that neighbouring queries read
    neighbouring rows and often share a tie range. Only speed depends on it (every query is answered on
    its own), so it is one sort of int64 keys — the word's high bits, then the query's index in the
    low ⌈log₂ B⌉ bits — instead of a stable argsort (~5× slower at B = 4096)."""
    low = max(len(first_words) - 1, 0).bit_length()
    keys = ((first_words >> low) << low) | np.arange(len(first_words), dtype=np.int64)
    keys.sort()
    return keys & ((1 << low) - 1)


HUGE_PAGE = 1 << 21  # bytes of a transparent huge page on x86-64 (and of the alignment it needs)


_MAPPED: set[int] = set()  # data pointers of the live arrays host_empty mapped (removed when freed)


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in the memory the kernel reads with few TLB misses (see _to_numpy_memory),
    so that a build can write its largest array there directly instead of copying it over later: the copy
    would hold it twice at the build's peak."""
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    nbytes = int(np.prod(shape)) * np_dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(area, dtype=np.uint8)
    skip = -raw.ctypes.data % HUGE_PAGE
    area.madvise(mmap.MADV_HUGEPAGE, skip - skip % mmap.PAGESIZE, nbytes + skip % mmap.PAGESIZE)
    out = raw[skip : skip + nbytes].view(np_dtype).reshape(shape)
    _MAPPED.add(out.ctypes.data)
    weakref.finalize(out, _MAPPED.discard, out.ctypes.data)
    return torch.from_numpy(out)


def _to_numpy_memory(t: torch.Tensor) -> torch.Tensor:
    """The same array in memory the kernel reads with few TLB misses: arrays of a huge page and more go
    into a fresh anonymous mapping aligned to 2 MiB and advised MADV_HUGEPAGE, so that the kernel's
    random reads miss the TLB far less (torch's CPU allocator does not advise it, and numpy's advice
    is lost when malloc hands back heap memory already backed by 4 KiB pages — measured: the ids,
    adjacent LCPs, tree and bucket table of a 5M-row index got none). Smaller arrays, or where mmap
    or madvise are missing, are a numpy copy. The mapping lives as long as the array. An array that
    host_empty made is kept as it is."""
    if t.is_contiguous() and t.data_ptr() in _MAPPED:
        return t
    src = t.numpy()
    if src.nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.from_numpy(np.array(src, copy=True))
    out = host_empty(tuple(src.shape), t.dtype)
    out.numpy()[...] = src
    return out


class CPUEngine:
    """Numpy views of one CPU index plus its bucket table; `topk` runs the kernel.

    On construction the index's arrays move into numpy-allocated memory (huge pages where the system
    allows them), one array at a time, so that they are not held twice."""

    def __init__(self, index: LCPIndex, module: ModuleType) -> None:
        self.kernel, self.fmt = module, index.fmt
        tree = index.tree
        trim_heap()  # the build's freed temporaries, before the moves below map fresh memory
        index.cols, index.adj = _to_numpy_memory(index.cols), _to_numpy_memory(index.adj)
        if index.lengths is not None:
            index.lengths = _to_numpy_memory(index.lengths)
        tree.move_arrays(_to_numpy_memory)
        index.ids = tree.ids
        self.bits = bucket_bits(index.n)
        self.starts = _to_numpy_memory(bucket_starts(index.cols[0], self.bits))
        self.cols, self.ids, self.adj = index.cols.numpy(), index.ids.numpy(), index.adj.numpy()
        self.has_lengths = index.lengths is not None
        self.lengths = index.lengths.numpy() if index.lengths is not None else np.zeros(0, self.adj.dtype)

        def offsets(j: int, dtype: type, width: int) -> np.ndarray:  # levels 1-4 hold offsets, if present
            return tree.levels[j].numpy() if j < len(tree.levels) else np.zeros((0, width), dtype)

        self.offset_levels = [offsets(j, dt, w) for j, dt, w in OFFSET_LEVELS]
        self.id_rows = tree.id_rows.numpy()
        self.id_starts = np.asarray(tree.id_row_starts, dtype=np.int64)
        self.table_tokens = table_tokens(index.n, index.fmt.bits, self.has_lengths)
        self.group_bits = self.table_tokens * index.fmt.bits
        self.heads = group_heads(self.cols[0], self.ids, self.group_bits)
        self.wide_bits = index.fmt.bits if self.table_tokens > 0 else 0  # one token, within the table's depth
        self.wide = np.zeros((0, WIDE), self.ids.dtype)  # none yet: what the rest holds sets their budget
        # bytes beyond the packed rows so far: ids, adjacent LCPs, lengths, tree (index.nbytes while the engine
        # is being built), bucket table, group heads
        held = index.nbytes - index.cols.numel() * index.cols.element_size() + self.nbytes
        self.wide = wide_heads(self.cols[0], self.ids, self.wide_bits, ROW_BUDGET * index.n - held)

    @property
    def nbytes(self) -> int:
        return self.starts.numel() * self.starts.element_size() + self.heads.nbytes + self.wide.nbytes

    def topk(
        self, queries: torch.Tensor, k: int, query_lengths: object, single: bool, direct_cap: int | None,
        out: LCPTopK | None = None,
    ) -> LCPTopK:
        """LCPTopK of a batch of queries [B, L'] of any integer dtype, as LCPIndex.topk checked it (`single`: one
        query [L'], answered as [k]); see LCPIndex.topk. `out` (checked there too) is written in place of fresh
        arrays and returned."""
        b, width = queries.shape
        check_results(b, k)
        q = queries.detach().cpu().numpy()  # narrow dtypes as they are (pack_queries compiles per dtype):
        q = np.ascontiguousarray(q, dtype=q.dtype if q.itemsize < 8 else np.int64)  # no int64 copy of B × L'
        if query_lengths is None:
            qlen = np.full(b, width, dtype=np.int64)
        else:
            lens = check_lengths(query_lengths, b, width, "query_lengths")
            qlen = np.ascontiguousarray(lens.cpu().numpy(), dtype=np.int64)
        fmt, kern = self.fmt, self.kernel
        qw, qlen = kern.pack_queries(q, qlen, fmt.length, fmt.bits, fmt.lo, fmt.hi, fmt.words)
        if out is None:
            lcps = results.empty((b, k), np.int64)  # the kernel writes every entry; recycled memory
            ids = results.empty((b, k), np.int64)
        else:  # the caller's tensors (contiguous int64 of the answer's shape): numpy views of them
            lcps, ids = out.lcps.numpy().reshape(b, k), out.ids.numpy().reshape(b, k)
        lev1, lev2, lev3, lev4 = self.offset_levels
        kern.topk(
            self.cols, self.ids, self.adj, self.lengths, self.has_lengths, fmt.length,
            fmt.per_word, fmt.bits, self.starts.numpy(), 64 - self.bits, 1 << (self.bits - 1),
            lev1, lev2, lev3, lev4, self.id_rows, self.id_starts, -1 if direct_cap is None else direct_cap,
            self.table_tokens, self.heads, 64 - self.group_bits,
            1 << max(self.group_bits - 1, 0), self.wide, 64 - self.wide_bits, 1 << max(self.wide_bits - 1, 0),
            qw, qlen, visiting_order(qw[:, 0]), k, lcps, ids,
        )  # fmt: skip
        if out is not None:
            return out
        top = LCPTopK(torch.from_numpy(lcps), torch.from_numpy(ids))
        return LCPTopK(top.lcps[0], top.ids[0]) if single else top
