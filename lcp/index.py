"""Exact top-k longest-common-prefix retrieval: sorted packed rows, binary search, range-bounded scan.

Why it is exact. Let s_0 <= ... <= s_{N-1} be the rows in lexicographic order and p the insertion point
of a query q. For j < p, LCP(q, s_j) = min(LCP(q, s_{p-1}), LCP(s_{j}, s_{j+1}), ..., LCP(s_{p-2}, s_{p-1}))
and symmetrically for j >= p, so LCP(q, s_j) rises towards p and falls after it: for every depth d the
rows with LCP >= d form one contiguous range S_d (the rows whose first d tokens equal q's), and
S_0 ⊇ S_1 ⊇ ... . Let d* be the largest d with |S_d| >= k. Then the top-k is all of S_{d*+1} (fewer than
k rows) plus the k - |S_{d*+1}| smallest ids of S_{d*} \\ S_{d*+1} (all at LCP d*). Both are cheap:

* S_{d*+1} lies within the window [p - k, p + k), and |S_d| >= k iff the window holds >= k rows with LCP
  >= d (a range containing p-1 or p that leaves the window covers k window rows); so d* is the k-th
  largest LCP in the window, whose 2k LCPs are computed directly from the packed words.
* S_{d*} = [lo, hi) comes from two binary searches on the rows cut to d* tokens; the tie set
  [lo, a) ∪ [b, hi) around S_{d*+1} = [a, b) yields its smallest ids through `MinIdTable`, or by a direct
  gather when it is small.

Cost per query: three binary searches of ceil(log2(N+1)) steps over W = ceil(L·bits/64) words, 2k window
LCPs, and O(k · 64) gathers for the tie-break; memory: the packed rows (the raw bytes, rounded up to whole
words), ids in sorted order, lengths if they vary, and an O(N/64 · log N) sparse table.
"""

from __future__ import annotations

import operator
from pathlib import Path

import torch

from lcp import fileformat, ranking
from lcp.errors import LCPError
from lcp.rmq import _NO_ID, MinIdTable
from lcp.sort import lex_order
from lcp.tokens import (
    DTYPE_NAMES,
    TokenFormat,
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

FENCE = 64  # rows between the sampled first words that start each binary search


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


def _length_dtype(length: int) -> torch.dtype:
    return torch.uint8 if length < 256 else torch.int16 if length < 2**15 else torch.int32


class LCPIndex:
    """Rows sorted lexicographically as packed words; answers batched exact top-k LCP queries."""

    # tie sets up to this many rows are gathered directly; larger ones go through the sparse table
    direct_cap: int = 1024

    def __init__(
        self, fmt: TokenFormat, words: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor | None
    ) -> None:
        self.fmt, self.words, self.ids, self.lengths = fmt, words, ids, lengths
        self.table = MinIdTable(ids)
        self.fences = words[::FENCE, 0].contiguous()  # (ceil(N / FENCE),) narrows every binary search

    # ---- construction -------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        seqs: torch.Tensor,
        lengths: torch.Tensor | None = None,
        device: str | torch.device | None = None,
    ) -> LCPIndex:
        """Index rows seqs [N, L] (any integer dtype); lengths [N] in [0, L] when rows vary in length."""
        check_rows(seqs, "seqs")
        n, length = seqs.shape
        if n == 0:
            raise LCPError("cannot build an index over zero sequences (seqs has shape [0, L])")
        lens = check_lengths(lengths, n, length, "lengths")
        dev = resolve_device(device, seqs.device)
        x = seqs.to(dev)
        if lens is not None:
            lens = lens.to(dev)
            if bool((lens == length).all()):
                lens = None  # all full: the implicit length L saves N bytes
        fmt = token_format(x.dtype, length)
        words = pack_rows(x, lens, fmt)  # (N, W)
        order = lex_order(words, lens)  # (N,)
        words = words.index_select(0, order)
        ids = order.to(torch.int32 if n < 2**31 else torch.int64)
        if lens is not None:
            lens = lens.index_select(0, order).to(_length_dtype(length))
        return cls(fmt, words, ids, lens)

    @property
    def n(self) -> int:
        return self.words.shape[0]

    @property
    def length(self) -> int:
        return self.fmt.length

    @property
    def device(self) -> torch.device:
        return self.words.device

    @property
    def nbytes(self) -> int:
        """Bytes held by the index: packed rows, ids, lengths (if any), fences and the tie-break table."""
        held = [self.words, self.ids, self.fences] + ([self.lengths] if self.lengths is not None else [])
        return sum(t.numel() * t.element_size() for t in held) + self.table.nbytes

    # ---- queries ------------------------------------------------------------------------------------
    def topk(
        self, queries: torch.Tensor, k: int, query_lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, lcps), both int64 [B, k]: by LCP descending, ties by smallest id; -1 pads when k > N."""
        k = check_k(k)
        qw, qlen = prepare_queries(queries, query_lengths, self.fmt, self.device)
        b, kk = qw.shape[0], min(k, self.n)
        ids = torch.full((b, k), -1, dtype=torch.int64, device=self.device)
        lcps = torch.full((b, k), -1, dtype=torch.int64, device=self.device)
        chunk = max(1, (1 << 22) // (2 * kk * (self.fmt.words + 1) + self.direct_cap))  # bounds temporaries
        for s in range(0, b, chunk):
            ids[s : s + chunk, :kk], lcps[s : s + chunk, :kk] = self._topk(qw[s : s + chunk], qlen[s : s + chunk], kk)
        return ids, lcps

    def _topk(self, qw: torch.Tensor, qlen: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.n
        p = self._bound(qw, qlen, upper=False)  # (B,) insertion point
        pos = p[:, None] + torch.arange(-k, k, device=self.device)  # (B, 2k) window
        inside = (pos >= 0) & (pos < n)
        pos = pos.clamp(0, n - 1)
        lcp = self._lcp_at(pos, qw, qlen).masked_fill(~inside, -1)  # (B, 2k)
        d = lcp.topk(k, 1).values[:, -1]  # (B,) d*: the k-th largest LCP
        above = lcp > d[:, None]  # S_{d*+1}, wholly inside the window
        n_above = above.sum(1)
        lo = self._bound(qw, d, upper=False)  # S_{d*} = [lo, hi)
        hi = self._bound(qw, d, upper=True)
        a = pos.gather(1, above.to(torch.int8).argmax(1, keepdim=True)).squeeze(1)
        a = torch.where(n_above > 0, a, lo)  # S_{d*+1} = [a, a + n_above)
        need = k - n_above  # (B,) >= 1 slots filled at LCP d*
        tie = self._smallest_ids(torch.stack([lo, a + n_above], 1), torch.stack([a, hi], 1), need)
        cand_pos = torch.cat([pos, tie.clamp(min=0)], 1)  # (B, 2k + c)
        cand_lcp = torch.cat([lcp.masked_fill(~above, -1), torch.where(tie >= 0, d[:, None], -1)], 1)
        score = ranking.encode(cand_lcp, self.ids[cand_pos].to(torch.int64), n)
        return ranking.decode(ranking.best(score, k), n)  # exactly k valid candidates

    def _lcp_at(self, pos: torch.Tensor, qw: torch.Tensor, qlen: torch.Tensor) -> torch.Tensor:
        """LCP [B, C] of query b with the row at sorted position pos[b, c]."""
        b, c = pos.shape
        rows = self.words.index_select(0, pos.flatten()).view(b, c, -1)  # (B, C, W)
        lcp = lcp_words(rows, qw[:, None, :], self.fmt)
        cap = qlen[:, None].expand(b, c)
        if self.lengths is not None:
            cap = torch.minimum(cap, self.lengths[pos].to(torch.int64))
        return torch.minimum(lcp, cap)

    def _bound(self, qw: torch.Tensor, d: torch.Tensor, upper: bool) -> torch.Tensor:
        """First sorted position whose row cut to d tokens is >= (upper: >) the query cut to d tokens."""
        masks = prefix_masks(d, self.fmt)  # (B, W)
        qm = qw & masks
        lo, hi = self._fence_range(qm[:, 0].contiguous(), masks[:, 0].contiguous())
        steps = int((hi - lo).max()).bit_length() if d.numel() else 0
        for _ in range(steps):  # ceil(log2(hi - lo + 1)) halvings of [lo, hi]
            mid = (lo + hi) >> 1
            at = mid.clamp(max=self.n - 1)
            c = lex_compare(self.words.index_select(0, at) & masks, qm)  # (B,)
            if self.lengths is not None:  # a row shorter than d sorts before q's d-prefix
                c = torch.where((c == 0) & (self.lengths[at].to(torch.int64) < d), -1, c)
            right = c <= 0 if upper else c < 0
            active = lo < hi
            lo = torch.where(active & right, mid + 1, lo)
            hi = torch.where(active & ~right, mid, hi)
        return lo

    def _fence_range(self, q0: torch.Tensor, m0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[lo, hi] holding every row whose first word, cut by mask m0, equals q0: where the bound lies.

        Cutting keeps the sign bit, so (x & m0) >= q0 iff x >= q0 and (x & m0) <= q0 iff x <= q0 | ~m0;
        the fences (every FENCE-th row's first word) bound both positions to within FENCE rows.
        """
        below = torch.searchsorted(self.fences, q0, side="left")  # fences < q0
        upto = torch.searchsorted(self.fences, q0 | ~m0, side="right")  # fences <= q0's largest extension
        everything = m0 == 0  # no token of word 0 kept: every row matches
        lo = torch.where(everything, 0, (below - 1).clamp(min=0) * FENCE)
        hi = torch.where(everything, self.n, (upto * FENCE).clamp(max=self.n))
        return lo, hi

    def _smallest_ids(self, lo: torch.Tensor, hi: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
        """Positions [B, max(need)] of the need[b] smallest ids in ranges [lo[b, r], hi[b, r]); -1 pads."""
        count = int(need.max())
        size = (hi - lo).clamp(min=0).sum(1)
        out = torch.full((lo.shape[0], count), -1, dtype=torch.int64, device=self.device)
        direct = size <= self.direct_cap
        rows = direct.nonzero().squeeze(1)
        if rows.numel():
            width = max(1, int(size[rows].max()))
            t = torch.arange(width, device=self.device)
            l0, l1 = lo[rows, :1], lo[rows, 1:]
            n0 = (hi[rows, :1] - l0).clamp(min=0)
            pos = torch.where(t < n0, l0 + t, l1 + t - n0)  # (R, width) both ranges back to back
            ok = t < size[rows, None]
            ids = torch.where(ok, self.ids[pos.clamp(0, self.n - 1)].to(torch.int64), _NO_ID)
            take = min(count, width)
            best, j = ids.topk(take, 1, largest=False)
            out[rows, :take] = torch.where(best != _NO_ID, pos.gather(1, j), -1)
        rows = (~direct).nonzero().squeeze(1)
        if rows.numel():
            out[rows] = self.table.smallest(lo[rows], hi[rows], count)
        slot = torch.arange(count, device=self.device)
        return out.masked_fill(slot[None, :] >= need[:, None], -1)

    # ---- persistence --------------------------------------------------------------------------------
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
            if meta.get("kind") != "lcp-index":
                raise ValueError(f"kind {meta.get('kind')!r} is not 'lcp-index'")
            n, length, dtype = int(meta["n"]), int(meta["length"]), DTYPE_NAMES[meta["dtype"]]
            fmt = token_format(dtype, length)
            words, ids = arrays["words"], arrays["ids"]
            lengths = arrays.get("lengths")
            if n < 1 or words.shape != (n, fmt.words) or str(words.dtype) != "int64" or ids.shape != (n,):
                raise ValueError(f"array shapes {words.shape}, {ids.shape} do not match n={n}, L={length}")
            if lengths is not None and lengths.shape != (n,):
                raise ValueError(f"lengths has shape {lengths.shape}, expected ({n},)")
        except (KeyError, TypeError, ValueError, LCPError) as exc:
            raise LCPError(f"{path} is not a valid LCP index: {exc}") from None
        dev = resolve_device(device, torch.device("cpu"))
        w, i = torch.from_numpy(words).to(dev), torch.from_numpy(ids).to(dev)
        lens = torch.from_numpy(lengths).to(dev) if lengths is not None else None
        _validate(path, n, length, w, i, lens)
        if lens is not None:
            lens = lens.to(_length_dtype(length))
        return cls(fmt, w, i.to(torch.int32 if n < 2**31 else torch.int64), lens)


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
