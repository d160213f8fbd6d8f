"""Exact top-k longest-common-prefix retrieval: sorted packed rows, adjacent LCPs, a smallest-id tree.

Why it is exact. Let s_0 <= ... <= s_{N-1} be the rows in lexicographic order and p the insertion point
of a query q. For j < p, LCP(q, s_j) = min(LCP(q, s_{p-1}), LCP(s_j, s_{j+1}), ..., LCP(s_{p-2}, s_{p-1}))
and symmetrically for j >= p, so LCP(q, s_j) falls away from p on both sides: for every depth d the rows
with LCP >= d form one contiguous range S_d (the rows whose first d tokens equal q's), and
S_0 ⊇ S_1 ⊇ ... . Let d* be the largest d with |S_d| >= k. Then the top-k is all of S_{d*+1} (fewer than
k rows) plus the k - |S_{d*+1}| smallest ids of S_{d*} \\ S_{d*+1} (all at LCP d*). Each piece is cheap:

* Window. S_{d*+1} lies within [p - k, p + k), and the window's 2k LCPs are two running minima of the
  stored adjacent LCPs (`adj`) started from LCP(q, s_{p-1}) and LCP(q, s_p); each side is non-increasing,
  so d* is the k-th largest of two sorted lists (a max-min over the k + 1 ways to split k between them).
* Range. S_{d*} = [lo, hi) is read off the window when it ends inside it, else found by binary search on
  the rows cut to d* tokens (`searchsorted` on the first words, then a short refinement).
* Ties. The k smallest ids of [lo, hi) come from `SmallestIds` (lcp/smallest.py) in O(k log(R/k)) per
  query whatever R = hi - lo is; those inside S_{d*+1} are dropped and the rest fill the free slots.

Cost per query: two `searchsorted` calls on the first words plus refinement steps only where first words
tie, O(k) for the window and O(k log(R/k) + 64) for the tie-break. Host syncs per batch chunk (matter on
CUDA): five in the common case (refinement steps of the insertion point, which ranges leave the window,
the gather widths, the tie ranges' size classes), two to four more when ranges must be searched.
Memory: the packed rows (raw bytes rounded up to whole words), int32 ids, lengths if they vary, N
adjacent LCPs (1 byte each for L < 256) and the tree (about 10 bytes per row).

This module's code is the torch engine (CUDA, or a CPU without numba). On CPU with numba installed,
`topk` goes through the compiled kernel instead (lcp/engine.py, lcp/kernel.py): the same steps in one
loop over the queries, with the same answers; `LCPIndex.engine` says which one runs.
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import NamedTuple

import torch

from pipeplan.lcp import engine, fileformat, gpu, ranking
from pipeplan.lcp.errors import LCPError
from pipeplan.lcp.limits import check_device_fits, check_results, trim_heap
from pipeplan.lcp.ranking import LCPTopK
from pipeplan.lcp.smallest import CAP, SmallestIds, smallest_by_sort, smallest_direct
from pipeplan.lcp.sort import lex_order
from pipeplan.lcp.tokens import (
    DTYPE_NAMES,
    TokenFormat,
    as_batch,
    as_tensor,
    check_lengths,
    check_rows,
    lcp_words,
    lex_compare,
    pack_rows,
    prefix_masks,
    prepare_queries,
    resolve_device,
    token_format,
)

_NONE = torch.iinfo(torch.int64).max  # an id no row has
WINDOW_EXTRA = 32  # window rows read beyond k on each side (bytes of `adj`): spares most range searches
_ELEMS = 1 << 21  # (query, window column) pairs per chunk of the batch: bounds every temporary


def check_k(k: object) -> int:
    """k as a positive int, or LCPError."""
    try:
        if isinstance(k, bool):
            raise TypeError
        k = operator.index(k)
    except TypeError:
        raise LCPError(f"k must be a positive integer, got {k!r}") from None
    if k <= 0:
        raise LCPError(f"k must be a positive integer, got {k}")
    return k


def build_bytes(seqs: torch.Tensor, device: torch.device) -> int:
    """Device bytes a build needs at its peak, about: the rows moved there (unless already there), their
    packed words three times (packed, gathered in sorted order, column-major), the sort's keys and indices
    and the id tree's construction (int64 ids and offsets per row, twice while merging)."""
    n, length = seqs.shape
    words = n * token_format(seqs.dtype, length).words * 8
    moved = 0 if seqs.device == device else seqs.numel() * seqs.element_size()
    return moved + 3 * words + 64 * n


def batch_bytes(queries: torch.Tensor, k: int, n: int) -> int:
    """Device bytes one topk batch needs on the torch engine, about: the queries and their packed words, the
    two int64 [B, k] results and one chunk's temporaries (about 12 int64 tensors of _ELEMS pairs)."""
    b, width = queries.shape
    return b * width * (queries.element_size() + 8) + 16 * b * k + 12 * 8 * _ELEMS


def _length_dtype(length: int) -> torch.dtype:
    return torch.uint8 if length < 256 else torch.int16 if length < 2**15 else torch.int32


def _adjacent_lcps(words: torch.Tensor, lengths: torch.Tensor | None, fmt: TokenFormat) -> torch.Tensor:
    """LCP of each sorted row with the next, within both lengths: [max(N - 1, 1)] in the narrowest dtype."""
    n = words.shape[0]
    out = torch.zeros(max(n - 1, 1), dtype=_length_dtype(fmt.length), device=words.device)
    step = 1 << 16  # rows per chunk: its temporaries (several int64 [step, W]) stay a few MiB
    for s in range(0, n - 1, step):
        e = min(n - 1, s + step)
        lcp = torch.clamp(lcp_words(words[s:e], words[s + 1 : e + 1], fmt), max=fmt.length)
        if lengths is not None:
            lcp = torch.minimum(lcp, torch.minimum(lengths[s:e], lengths[s + 1 : e + 1]).to(torch.int64))
        out[s:e] = lcp
    return out


class _Located(NamedTuple):
    """Where a batch of queries lands: per query, positions are in sorted order."""

    p: torch.Tensor  # insertion point
    left: torch.Tensor  # [B, k] LCP(q, s_{p-1-i}), -1 past the start
    right: torch.Tensor  # [B, k] LCP(q, s_{p+i}), -1 past the end
    d: torch.Tensor  # the k-th largest LCP
    gt_l: torch.Tensor  # rows above d* left of p
    gt_r: torch.Tensor  # rows above d* from p on
    lo: torch.Tensor  # S_{d*} = [lo, hi)
    hi: torch.Tensor
    searched: torch.Tensor  # S_{d*} left the window: found by binary search


class LCPIndex:
    """Rows sorted lexicographically as packed words; answers batched exact top-k LCP queries.

    `topk(queries, k)` returns `LCPTopK(lcps, ids)`. Its cost grows with k as O(k log(R/k)) per query
    (R: rows tied at the k-th LCP) and is linear in the batch; batches are processed in chunks of about
    2M (query × window column) pairs, so memory stays bounded at any k and batch size.
    """

    # tie ranges up to this many rows are read directly, larger ones through the tree; None: the cheaper
    direct_cap: int | None = None

    def __init__(
        self, fmt: TokenFormat, words: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor | None
    ) -> None:
        self.fmt, self.ids, self.lengths = fmt, ids, lengths
        self.cols = words.t().contiguous()  # (W, N): each word position contiguous, for searchsorted
        self.adj = _adjacent_lcps(words, lengths, fmt)  # (N - 1,)
        trim_heap()  # what the build freed, before the tree's merge columns
        self.tree = SmallestIds(ids)
        self._engine: engine.CPUEngine | None = None
        self._triton = False  # the Triton kernel (lcp/gpu.py) answers k <= 1024
        self._gpu_arrays: tuple[torch.Tensor, ...] | None = None  # its arguments, made on first use
        if self.device.type == "cpu" and engine.kernel() is not None:
            self.engine = "numba"
        else:
            self.engine = "triton" if self.device.type == "cuda" and gpu.triton_module() is not None else "torch"

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        seqs: torch.Tensor,
        lengths: torch.Tensor | None = None,
        device: str | torch.device | None = None,
    ) -> LCPIndex:
        """Index rows seqs [N, L] (any integer dtype; a tensor, numpy array or nested list); lengths [N] in
        [0, L] when rows vary in length."""
        seqs, lengths = as_tensor(seqs, "seqs"), as_tensor(lengths, "lengths")
        check_rows(seqs, "seqs")
        n, length = seqs.shape
        if n == 0:
            raise LCPError("cannot build an index over zero sequences (seqs has shape [0, L])")
        lens = check_lengths(lengths, n, length, "lengths")
        dev = resolve_device(device, seqs.device)
        check_device_fits(f"building an index of {n:,} rows × {length} tokens", build_bytes(seqs, dev), dev)
        x = seqs.to(dev)
        if lens is not None:
            lens = lens.to(dev)
            if bool((lens == length).all()):
                lens = None  # all full: the implicit length L saves N bytes
        fmt = token_format(x.dtype, length)
        words = pack_rows(x, lens, fmt)  # (N, W)
        ids = lex_order(words, lens).to(torch.int32 if n < 2**31 else torch.int64)  # (N,) the sorted order
        trim_heap()  # the sort's freed keys, before the rows are gathered into fresh memory
        numba = dev.type == "cpu" and engine.kernel() is not None  # where the compiled kernel will read it
        shape = (fmt.words, n)
        cols = engine.host_empty(shape, torch.int64) if numba else torch.empty(shape, dtype=torch.int64, device=dev)
        for w in range(fmt.words):  # gathered column by column: the sorted rows are never held twice
            torch.index_select(words[:, w], 0, ids, out=cols[w])
        del words
        if lens is not None:
            lens = lens.index_select(0, ids).to(_length_dtype(length))
        return cls(fmt, cols.t(), ids, lens)

    @property
    def n(self) -> int:
        return self.cols.shape[1]

    def __len__(self) -> int:
        return self.n

    def __repr__(self) -> str:
        dtype = str(self.fmt.dtype).removeprefix("torch.")
        lengths = "variable" if self.lengths is not None else "fixed"
        return (
            f"LCPIndex(n={self.n:,}, length={self.length}, dtype={dtype}, lengths={lengths}, "
            f"device={self.device}, nbytes={self.nbytes:,})"
        )

    @property
    def words(self) -> torch.Tensor:
        """Packed sorted rows [N, W] (a view of the column-major storage)."""
        return self.cols.t()

    @property
    def length(self) -> int:
        return self.fmt.length

    @property
    def device(self) -> torch.device:
        return self.cols.device

    @property
    def nbytes(self) -> int:
        """Bytes held by the index: packed rows, ids, lengths (if any), adjacent LCPs, the id tree and, with
        the compiled engine, its bucket table."""
        held = [self.cols, self.ids, self.adj] + ([self.lengths] if self.lengths is not None else [])
        table = self._engine.nbytes if self._engine is not None else 0
        return sum(t.numel() * t.element_size() for t in held) + self.tree.nbytes + table

    @property
    def engine(self) -> str:
        """What answers `topk`: "numba" (the compiled CPU kernel, lcp/kernel.py), "triton" (one GPU kernel per
        batch, lcp/gpu.py, for k <= 1024; the torch ops beyond) or "torch" (tensor ops; CUDA, or a CPU
        without numba). All give the same answers; set it to compare them."""
        return "numba" if self._engine is not None else "triton" if self._triton else "torch"

    @engine.setter
    def engine(self, name: str) -> None:
        if name in ("torch", "triton"):
            if name == "triton" and not gpu.runs_on(self.device):
                raise LCPError(
                    "the triton engine needs triton and a CUDA index (or a CPU one under TRITON_INTERPRET=1)"
                )
            self._engine, self._triton = None, name == "triton"
        elif name != "numba":
            raise LCPError(f"engine must be 'numba', 'triton' or 'torch', got {str(name)[:40]!r}")
        elif self.device.type != "cpu" or engine.kernel() is None:
            why = (
                "numba is not installed (pip install pipeplan[lcp]) or NUMBA_DISABLE_JIT=1 is set"
                if engine.kernel() is None
                else "CUDA"
            )
            raise LCPError(f"the numba engine runs on CPU indexes with numba installed; here: {why}")
        elif self._engine is None:
            self._engine, self._triton = engine.CPUEngine(self, engine.kernel()), False

    # ---- queries ------------------------------------------------------------------------------------
    def topk(
        self,
        queries: torch.Tensor,
        k: int,
        query_lengths: torch.Tensor | None = None,
        *,
        out: LCPTopK | None = None,
    ) -> LCPTopK:
        """LCPTopK(lcps, ids), int64 [B, k] ([k] for a 1-D query): LCP descending, ties by smallest id.

        -1 pads both when k > N. Query tokens may have any integer dtype; a token outside the index's
        dtype matches nothing.

        out: where to write the answer instead of fresh tensors (torch.topk's out=, stricter): an
        LCPTopK of int64 tensors of exactly the result's shape on the index's device, e.g. the result of
        a previous call of the same shape, which is then overwritten and returned. The numba CPU kernel
        recycles freed result memory itself (lcp/results.py), so this mainly makes the buffers the
        caller's; the torch engine builds its answer as before and copies it in. Anything else —
        a bare tuple, another shape or dtype, tensors sharing memory with each other, the queries or
        the index — is an LCPError before anything is written.
        """
        k = check_k(k)
        queries, query_lengths = as_tensor(queries, "queries"), as_tensor(query_lengths, "query_lengths")
        queries, query_lengths, single = as_batch(queries, query_lengths)
        check_rows(queries, "queries")  # first, and once for out= and the numba engine, which take it as checked
        if out is not None:
            out = self._check_out(out, queries, query_lengths, single, k)
        if self._engine is not None:
            return self._engine.topk(queries, k, query_lengths, single, self.direct_cap, out)
        if self.device.type == "cuda":
            check_device_fits(f"k = {k} for {queries.shape[0]} queries", batch_bytes(queries, k, self.n), self.device)
        else:
            check_results(queries.shape[0], k)
        qw, qlen = prepare_queries(queries, query_lengths, self.fmt, self.device)
        b, kk = qw.shape[0], min(k, self.n)
        if self._triton and k <= gpu.CAP:  # one launch for the batch
            lcps, ids = gpu.topk(self, qw, qlen, k)
        else:
            ids = torch.full((b, k), -1, dtype=torch.int64, device=self.device)
            lcps = torch.full((b, k), -1, dtype=torch.int64, device=self.device)
            chunk = max(1, _ELEMS // (2 * kk + 128))  # the window's columns; independent of any tie size
            for s in range(0, b, chunk):
                got = self._topk(qw[s : s + chunk], qlen[s : s + chunk], kk)
                ids[s : s + chunk, :kk], lcps[s : s + chunk, :kk] = got.ids, got.lcps
        top = LCPTopK(lcps[0], ids[0]) if single else LCPTopK(lcps, ids)
        if out is None:
            return top
        out.lcps.copy_(top.lcps)
        out.ids.copy_(top.ids)
        return out

    def _check_out(self, out: object, queries: torch.Tensor, query_lengths: object, single: bool, k: int) -> LCPTopK:
        """topk's `out`, checked against the shape the answer will have (see ranking.check_out), for the batch
        topk has checked (`single`: it was one query [L'])."""
        shape = (k,) if single else (queries.shape[0], k)
        keep = [queries, self.cols, self.ids, self.adj] + [
            t for t in (query_lengths, self.lengths) if isinstance(t, torch.Tensor)
        ]
        return ranking.check_out(out, shape, self.device, keep)

    def explain(self, queries: torch.Tensor, k: int, query_lengths: torch.Tensor | None = None) -> _Located:
        """Per query of a batch: insertion point p, k-th LCP d*, the range [lo, hi) of rows sharing it and
        whether that range had to be searched beyond the window (for the bench's bytes-touched model)."""
        k = check_k(k)
        queries, query_lengths = as_tensor(queries, "queries"), as_tensor(query_lengths, "query_lengths")
        queries, query_lengths, _ = as_batch(queries, query_lengths)
        qw, qlen = prepare_queries(queries, query_lengths, self.fmt, self.device)
        return self._locate(qw, qlen, min(k, self.n))

    def _locate(self, qw: torch.Tensor, qlen: torch.Tensor, k: int) -> _Located:
        """The window, d*, S_{d*+1} = [p - gt_l, p + gt_r) and S_{d*} = [lo, hi) of each query."""
        n, dev, b = self.n, self.device, qw.shape[0]
        full = torch.full_like(qw, -1)  # every token kept
        p = self._search(qw, full, qlen, upper=False)  # (B,) insertion point
        ends = torch.stack([p - 1, p], 1)  # (B, 2) the two neighbours of q
        edge = self._lcp_at(ends.clamp(0, n - 1), qw, qlen).masked_fill((ends < 0) | (ends >= n), -1)
        kw = min(k + WINDOW_EXTRA, n)  # a little wider than k: most tie ranges end inside it
        t = torch.arange(kw, device=dev)
        last = self.adj.shape[0] - 1
        # left[i] = LCP(q, s_{p-1-i}), right[i] = LCP(q, s_{p+i}): running minima of adjacent LCPs
        left_adj = self.adj[(p[:, None] - 2 - t[:-1]).clamp(0, last)].to(torch.int64)
        left = torch.cat([edge[:, :1], left_adj], 1).cummin(1).values.masked_fill(p[:, None] - 1 - t < 0, -1)
        right_adj = self.adj[(p[:, None] + t[:-1]).clamp(0, last)].to(torch.int64)
        right = torch.cat([edge[:, 1:], right_adj], 1).cummin(1).values.masked_fill(p[:, None] + t >= n, -1)
        # d* = k-th largest of two non-increasing lists = max over splits i of min(left[i-1], right[k-i-1])
        top = torch.full((b, 1), self.length + 1, dtype=torch.int64, device=dev)
        d = torch.minimum(torch.cat([top, left[:, :k]], 1), torch.cat([top, right[:, :k]], 1).flip(1)).amax(1)
        gt_l, gt_r = (left > d[:, None]).sum(1), (right > d[:, None]).sum(1)  # S_{d*+1} = [p-gt_l, p+gt_r)
        ge_l, ge_r = (left >= d[:, None]).sum(1), (right >= d[:, None]).sum(1)
        lo, hi = p - ge_l, p + ge_r  # S_{d*} when it ends inside the window
        out_l, out_r = (ge_l == kw) & (p - kw > 0), (ge_r == kw) & (p + kw < n)  # it may not
        out = (out_l | out_r).nonzero().squeeze(1)
        if out.numel():  # binary search for the queries whose range leaves the window, only
            dd, qo = d[out], qw[out]
            masks = prefix_masks(dd, self.fmt)
            lo[out] = torch.where(out_l[out], self._search(qo, masks, dd, upper=False, active=out_l[out]), lo[out])
            hi[out] = torch.where(out_r[out], self._search(qo, masks, dd, upper=True, active=out_r[out]), hi[out])
        return _Located(p, left, right, d, gt_l, gt_r, lo, hi, out_l | out_r)

    def _topk(self, qw: torch.Tensor, qlen: torch.Tensor, k: int) -> LCPTopK:
        n, dev, b = self.n, self.device, qw.shape[0]
        p, left, right, d, gt_l, gt_r, lo, hi, _ = self._locate(qw, qlen, k)
        t = torch.arange(k, device=dev)
        width, ml, mr = torch.stack([(hi - lo).max(), gt_l.max(), gt_r.max()]).tolist()
        # rows above d*: at most k - 1, ranked by (lcp desc, id asc)
        pos = torch.cat([p[:, None] - 1 - t[:ml], p[:, None] + t[:mr]], 1)  # (B, ml + mr)
        lcp = torch.cat([left[:, :ml], right[:, :mr]], 1)
        above_ids = self._ids_at(pos)
        score = ranking.encode(torch.where(lcp > d[:, None], lcp, -1), above_ids, n)
        out = torch.full((b, k + 1), -1, dtype=torch.int64, device=dev)  # column k: a sink for unused ties
        tie = self._smallest(lo, hi, k, width)  # (B, k) the smallest ids of S_{d*}, ascending; -1 pads
        keep = tie >= 0
        if ml + mr:
            out[:, : min(k, ml + mr)] = score.topk(min(k, ml + mr), 1).values
            # rows of S_{d*+1} are also in S_{d*}: drop their ids from the tie list
            listed = torch.where(lcp > d[:, None], above_ids, _NONE).sort(1).values  # (B, ml + mr)
            at = torch.searchsorted(listed, tie).clamp(max=ml + mr - 1)
            keep &= listed.gather(1, at) != tie
        # rows at d*: the smallest ids of S_{d*} outside S_{d*+1} fill the remaining slots in id order
        rank = keep.cumsum(1) - 1
        n_above = gt_l + gt_r
        slot = torch.where(keep & (rank < (k - n_above)[:, None]), n_above[:, None] + rank, k)
        out.scatter_(1, slot, ranking.encode(d[:, None].expand(-1, k), tie, n))
        return ranking.decode(out[:, :k], n)

    def _ids_at(self, pos: torch.Tensor) -> torch.Tensor:
        return self.ids[pos.clamp(0, self.n - 1)].to(torch.int64)

    def _lcp_at(self, pos: torch.Tensor, qw: torch.Tensor, qlen: torch.Tensor) -> torch.Tensor:
        """LCP [B, C] of query b with the row at sorted position pos[b, c]."""
        b, c = pos.shape
        rows = self.cols[:, pos.flatten()].t().reshape(b, c, -1)  # (B, C, W)
        lcp = lcp_words(rows, qw[:, None, :], self.fmt)
        cap = qlen[:, None].expand(b, c)
        if self.lengths is not None:
            cap = torch.minimum(cap, self.lengths[pos].to(torch.int64))
        return torch.minimum(lcp, cap)

    def _search(
        self,
        qw: torch.Tensor,
        masks: torch.Tensor,
        short: torch.Tensor,
        upper: bool,
        active: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """First sorted position whose row, cut by `masks`, is >= (upper: >) the query cut the same way.

        A row whose cut equals the query's but whose length is < short[b] counts as smaller (a proper
        prefix sorts first). The first words settle it through `searchsorted`, exact for the tokens of
        word 0: (x & m) >= q iff x >= q, and (x & m) <= q iff x <= q | ~m, for a mask m that keeps the
        sign bit. Only rows whose cut first word equals the query's are then binary-searched on the rest.
        """
        n, m0 = self.n, masks[:, 0]
        q0 = (qw[:, 0] & m0).contiguous()
        everything = m0 == 0  # no token kept: every row's cut equals the query's
        more = masks[:, 1:].ne(0).any(1) if masks.shape[1] > 1 else torch.zeros_like(everything)
        if self.lengths is not None:
            more = more | (short > 0)
        if active is not None:
            more = more & active
        refine = bool(more.any())  # else one side of the first-word range is the answer
        first = past = None
        if refine or not upper:
            first = torch.where(everything, 0, torch.searchsorted(self.cols[0], q0, side="left"))
        if refine or upper:
            past = torch.where(everything, n, torch.searchsorted(self.cols[0], q0 | ~m0, side="right"))
        settled = past if upper else first
        if not refine:
            return settled
        lo, hi = torch.where(more, first, settled), torch.where(more, past, settled)
        steps = int((hi - lo).max()).bit_length() if lo.numel() else 0
        qm = qw[:, 1:] & masks[:, 1:]
        for _ in range(steps):  # halve [lo, hi] until lo == hi
            mid = (lo + hi) >> 1
            at = mid.clamp(max=n - 1)
            rest = self.cols[1:, at].t() & masks[:, 1:]  # (B, W - 1) words after the first
            c = lex_compare(rest, qm) if qm.shape[1] else torch.zeros_like(at)
            if self.lengths is not None:
                c = torch.where((c == 0) & (self.lengths[at].to(torch.int64) < short), -1, c)
            right = c <= 0 if upper else c < 0
            active_now = lo < hi
            lo = torch.where(active_now & right, mid + 1, lo)
            hi = torch.where(active_now & ~right, mid, hi)
        return lo

    def _smallest(self, lo: torch.Tensor, hi: torch.Tensor, count: int, width: int) -> torch.Tensor:
        """Ids [B, count]: the `count` smallest ids in [lo, hi), ascending, -1 pads (width >= every hi - lo).

        Ranges no wider than the tree's columns (or `direct_cap`) are read directly, grouped by size to
        powers of two so that a few wide ranges do not widen the whole batch; the rest use the tree
        (count <= CAP) or a segmented sort (count > CAP).
        """
        levels = (width // 64).bit_length()
        cap = max(count, self.tree.columns(count, levels) if self.direct_cap is None else self.direct_cap)
        size = hi - lo
        wide = size > cap
        bucket = torch.where(wide, -1, torch.ceil(torch.log2(size.clamp(min=1).double())).long())
        groups = torch.unique(bucket).tolist()
        out = torch.full((lo.shape[0], count), -1, dtype=torch.int64, device=lo.device)
        for bits in groups:
            rows = None if len(groups) == 1 else (bucket == bits).nonzero().squeeze(1)
            a, b = (lo, hi) if rows is None else (lo[rows], hi[rows])
            if bits >= 0:
                got = smallest_direct(self.ids, a, b, count, min(1 << bits, width))
            elif count > CAP:
                got = smallest_by_sort(self.ids, a, b, count)
            else:
                got = self.tree.smallest(a, b, count, levels)
            if rows is None:
                return got
            out[rows] = got
        return out

    # ---- persistence --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, object]:
        """The index as plain data: {"kind", "n", "length", "dtype"} and the tensors "cols" (sorted packed rows,
        column-major [W, N]), "ids" and, when rows vary in length, "lengths". It holds only str, int and tensors,
        so `torch.save(index.state_dict(), f)` loads back with `torch.load(f, weights_only=True)`; pass it to
        `LCPIndex.from_state_dict`. The derived arrays (adjacent LCPs, id tree, bucket table) are rebuilt."""
        state: dict[str, object] = {"kind": "lcp-index", "n": self.n, "length": self.length}
        state |= {"dtype": str(self.fmt.dtype).removeprefix("torch."), "cols": self.cols, "ids": self.ids}
        if self.lengths is not None:
            state["lengths"] = self.lengths
        return state

    @classmethod
    def from_state_dict(cls, state: object, device: str | torch.device | None = None) -> LCPIndex:
        """The index `state_dict` described, on `device` (default: where its tensors are); LCPError when the
        dict is not one (wrong kind, shapes or dtypes, ids not a permutation, rows out of order)."""
        try:
            if not isinstance(state, dict):
                raise ValueError(f"expected a dict, got {type(state).__name__}")
            n, length, fmt = _meta(state)
            cols, ids, lengths = state["cols"], state["ids"], state.get("lengths")
            if not all(isinstance(t, torch.Tensor) for t in (cols, ids) + ((lengths,) if lengths is not None else ())):
                raise ValueError("cols, ids and lengths must be tensors")
            if cols.shape != (fmt.words, n) or cols.dtype != torch.int64 or ids.shape != (n,):
                shapes = f"{tuple(cols.shape)}, {tuple(ids.shape)}"
                raise ValueError(f"tensor shapes {shapes} do not match n={n}, L={length}")
            if ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"ids have dtype {ids.dtype}, expected int32 or int64")
            if lengths is not None and (lengths.shape != (n,) or lengths.dtype not in DTYPE_NAMES.values()):
                raise ValueError(f"lengths has shape {tuple(lengths.shape)}, expected ({n},) integers")
        except (KeyError, TypeError, ValueError, LCPError) as exc:
            raise LCPError(f"not a valid LCP index state: {exc}") from None
        dev = resolve_device(device, cols.device)
        lens = lengths.to(dev) if lengths is not None else None
        cols, ids = cols.to(dev), ids.to(dev)
        _validate("the state dict", n, length, cols.t(), ids, lens)
        if lens is not None:
            lens = lens.to(_length_dtype(length))
        index = cls(fmt, cols.t(), ids.to(torch.int32 if n < 2**31 else torch.int64), lens)
        return index

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        """pickle, copy.deepcopy and torch.save of the index itself go through its state dict (the engine,
        which holds a module and views, is rebuilt on load; its choice of engine is kept)."""
        return _restore, (self.state_dict(), self.engine, self.direct_cap)

    def to(self, device: str | torch.device) -> LCPIndex:
        """This index on `device` (itself when it is there already), like torch.Tensor.to; the engine is
        the one that runs there (numba on CPU when installed, torch otherwise)."""
        dev = resolve_device(device, self.device)
        if dev == self.device:
            return self
        index = LCPIndex.from_state_dict(self.state_dict(), dev)
        index.direct_cap = self.direct_cap
        return index

    def save(self, path: str | Path) -> None:
        """Write the index to `path` atomically (format: lcp/fileformat.py)."""
        meta = {"kind": "lcp-index", "n": self.n, "length": self.length, "dtype": str(self.fmt.dtype)[6:]}
        arrays = {"words": self.words, "ids": self.ids}
        if self.lengths is not None:
            arrays["lengths"] = self.lengths.to(torch.int32)
        fileformat.write_index_file(path, meta, arrays)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device | None = None) -> LCPIndex:
        """Read an index written by `save`; LCPError if the file is foreign, truncated or corrupted."""
        meta, arrays = fileformat.read_index_file(path)
        try:
            n, length, fmt = _meta(meta)
            words, ids = arrays["words"], arrays["ids"]
            lengths = arrays.get("lengths")
            if words.shape != (n, fmt.words) or str(words.dtype) != "int64" or ids.shape != (n,):
                raise ValueError(f"array shapes {words.shape}, {ids.shape} do not match n={n}, L={length}")
            if str(ids.dtype) not in ("int32", "int64"):
                raise ValueError(f"ids have dtype {ids.dtype}, expected int32 or int64")
            if lengths is not None and (lengths.shape != (n,) or str(lengths.dtype) != "int32"):
                raise ValueError(f"lengths has shape {lengths.shape} and dtype {lengths.dtype}, expected ({n},) int32")
        except (KeyError, TypeError, ValueError, LCPError) as exc:
            raise LCPError(f"{path} is not a valid LCP index: {exc}") from None
        dev = resolve_device(device, torch.device("cpu"))
        w, i = torch.from_numpy(words).to(dev), torch.from_numpy(ids).to(dev)
        lens = torch.from_numpy(lengths).to(dev) if lengths is not None else None
        _validate(path, n, length, w, i, lens)
        if lens is not None:
            lens = lens.to(_length_dtype(length))
        return cls(fmt, w, i.to(torch.int32 if n < 2**31 else torch.int64), lens)


def _restore(state: dict, engine_name: str, direct_cap: int | None) -> LCPIndex:
    """Unpickle an index (LCPIndex.__reduce__): its state, then its engine where that one can run here."""
    index = LCPIndex.from_state_dict(state)
    index.direct_cap = direct_cap
    if engine_name == "torch" or (engine_name == "triton" and gpu.runs_on(index.device)):
        index.engine = engine_name
    return index


def _meta(meta: dict) -> tuple[int, int, TokenFormat]:
    """(n, length, format) from a file's or state dict's metadata; ValueError naming the bad field."""
    if meta.get("kind") != "lcp-index":
        raise ValueError(f"kind {str(meta.get('kind'))[:40]!r} is not 'lcp-index'")
    n = _meta_int(meta, "n", 1, fileformat.MAX_DIM)
    length = _meta_int(meta, "length", 1, fileformat.MAX_DIM)
    if not isinstance(meta.get("dtype"), str) or meta["dtype"] not in DTYPE_NAMES:
        raise ValueError(f"dtype {str(meta.get('dtype'))[:40]!r} is not one of {', '.join(DTYPE_NAMES)}")
    return n, length, token_format(DTYPE_NAMES[meta["dtype"]], length)


def _meta_int(meta: dict, key: str, lo: int, hi: int) -> int:
    """meta[key] as an integer in [lo, hi]: JSON floats, bools, strings and infinities are refused."""
    value = meta.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{key} must be an integer in [{lo}, {hi}], got {str(value)[:40]}")
    return value


def _validate(
    path: str | Path, n: int, length: int, words: torch.Tensor, ids: torch.Tensor, lens: torch.Tensor | None
) -> None:
    """Reject a well-formed file whose content is not an index: ids a permutation, rows sorted."""
    if int(ids.min()) < 0 or int(ids.max()) >= n or bool((torch.bincount(ids.long(), minlength=n) != 1).any()):
        raise LCPError(f"{path} is not a valid LCP index: ids are not a permutation of 0..{n - 1}")
    if lens is not None and (int(lens.min()) < 0 or int(lens.max()) > length):
        raise LCPError(f"{path} is not a valid LCP index: lengths outside [0, {length}]")
    c = lex_compare(words[:-1], words[1:])
    if lens is not None:
        c = torch.where(c == 0, torch.sign(lens[:-1].long() - lens[1:].long()), c)
    if bool((c > 0).any()):
        raise LCPError(f"{path} is not a valid LCP index: rows are not in sorted order")
