"""Baselines for the LCP index, with its API (build / topk / nbytes):

* `FullScan` — brute force on the device: the LCP of every query with every row, in chunks, then top-k.
* `Pairwise` — materialises the whole [queries × rows] LCP matrix at once, as dense-similarity code does;
  it refuses, naming the bytes it would need, when that matrix does not fit the memory budget.
* `Trie` (lcp/trie.py) — the paper's trie with per-node smallest-id lists, for moderate N.
* `NumpySorted`, `MarisaTrie` (lcp/bytes_baselines.py) — sorted byte strings in numpy, and marisa-trie.

`METHODS` names every method for the benchmark and the CLI.
"""

from __future__ import annotations

import torch

from pipeplan.common.units import GIB
from pipeplan.lcp import ranking
from pipeplan.lcp.bytes_baselines import MarisaTrie, NumpySorted
from pipeplan.lcp.errors import LCPError
from pipeplan.lcp.index import LCPIndex, check_k
from pipeplan.lcp.limits import available_bytes, check_results
from pipeplan.lcp.ranking import LCPTopK
from pipeplan.lcp.tokens import (
    TokenFormat,
    as_batch,
    check_lengths,
    check_rows,
    lead_tokens,
    pack_rows,
    prepare_queries,
    resolve_device,
    token_format,
)
from pipeplan.lcp.trie import Trie

_CHUNK_ELEMS = 1 << 20  # (query, row) pairs per scan step: temporaries of a few MB stay cache-friendly


class FullScan:
    """Every row, every query: O(N·L) work per query and no index beyond the packed rows."""

    def __init__(self, fmt: TokenFormat, words: torch.Tensor, lengths: torch.Tensor | None) -> None:
        self.fmt, self.words, self.lengths = fmt, words, lengths

    @classmethod
    def build(
        cls, seqs: torch.Tensor, lengths: torch.Tensor | None = None, device: str | torch.device | None = None
    ) -> FullScan:
        check_rows(seqs, "seqs")
        if seqs.shape[0] == 0:
            raise LCPError("cannot scan zero sequences (seqs has shape [0, L])")
        dev = resolve_device(device, seqs.device)
        lens = check_lengths(lengths, seqs.shape[0], seqs.shape[1], "lengths")
        lens = lens.to(dev) if lens is not None else None
        fmt = token_format(seqs.dtype, seqs.shape[1])
        return cls(fmt, pack_rows(seqs.to(dev), lens, fmt), lens)

    @property
    def n(self) -> int:
        return self.words.shape[0]

    @property
    def nbytes(self) -> int:
        held = [self.words] + ([self.lengths] if self.lengths is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

    def lcp_block(self, qw: torch.Tensor, qlen: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """LCP [B, stop - start] of each query with rows start..stop-1 (original order).

        Word 0 settles almost every pair; only pairs equal so far read the next word (sparse refinement).
        """
        words = self.words[start:stop]  # (C, W)
        x = words[None, :, 0] ^ qw[:, :1]  # (B, C)
        lcp = lead_tokens(x, self.fmt)
        qi, ci = (x == 0).nonzero(as_tuple=True)
        for w in range(1, self.fmt.words):
            if qi.numel() == 0:
                break
            xw = words[ci, w] ^ qw[qi, w]
            lcp[qi, ci] += lead_tokens(xw, self.fmt)
            same = xw == 0
            qi, ci = qi[same], ci[same]
        cap = qlen[:, None]
        if self.lengths is not None:
            cap = torch.minimum(cap, self.lengths[None, start:stop])
        return torch.minimum(lcp, cap)

    def topk(
        self, queries: torch.Tensor, k: int, query_lengths: torch.Tensor | None = None
    ) -> LCPTopK:
        k = check_k(k)
        queries, query_lengths, single = as_batch(queries, query_lengths)
        check_rows(queries, "queries")
        check_results(queries.shape[0], k)
        qw, qlen = prepare_queries(queries, query_lengths, self.fmt, self.words.device)
        b, n = qw.shape[0], self.n
        top = torch.full((b, k), -1, dtype=torch.int64, device=qw.device)
        q_chunk = min(max(b, 1), 64)
        rows = max(1, _CHUNK_ELEMS // q_chunk)
        for s in range(0, b, q_chunk):
            run = top[s : s + q_chunk]
            for start in range(0, n, rows):
                stop = min(n, start + rows)
                lcp = self.lcp_block(qw[s : s + q_chunk], qlen[s : s + q_chunk], start, stop)
                ids = torch.arange(start, stop, device=qw.device)
                run = ranking.best(torch.cat([run, ranking.encode(lcp, ids[None, :], n)], 1), k)
            top[s : s + q_chunk] = run
        got = ranking.decode(top, n)
        return LCPTopK(got.lcps[0], got.ids[0]) if single else got


def memory_budget_bytes(device: torch.device) -> int:
    """What one allocation may take: 90% of free GPU memory, or half of the available host memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0] * 0.9)
    return available_bytes() // 2


def pairwise_bytes(rows: int, cols: int, length: int) -> int:
    """Bytes of a dense [rows × cols] LCP matrix (int16 when L < 32768)."""
    return rows * cols * (2 if length < 2**15 else 4)


class Pairwise:
    """Dense all-pairs: materialise the [B, N] LCP matrix, then top-k; refuses what would not fit."""

    def __init__(self, scan: FullScan, budget_bytes: int) -> None:
        self.scan, self.budget_bytes = scan, budget_bytes

    @classmethod
    def build(
        cls,
        seqs: torch.Tensor,
        lengths: torch.Tensor | None = None,
        device: str | torch.device | None = None,
        budget_bytes: int | None = None,
    ) -> Pairwise:
        scan = FullScan.build(seqs, lengths, device)
        budget = budget_bytes if budget_bytes is not None else memory_budget_bytes(scan.words.device)
        return cls(scan, budget)

    @property
    def nbytes(self) -> int:
        return self.scan.nbytes

    def bytes_needed(self, batch: int) -> int:
        return pairwise_bytes(batch, self.scan.n, self.scan.fmt.length)

    def topk(
        self, queries: torch.Tensor, k: int, query_lengths: torch.Tensor | None = None
    ) -> LCPTopK:
        k = check_k(k)
        check_rows(queries, "queries")
        b, n = queries.shape[0], self.scan.n
        need = self.bytes_needed(b)
        if need > self.budget_bytes:
            raise LCPError(
                f"pairwise materialisation refused: a {b}×{n} LCP matrix needs {need} bytes "
                f"({need / GIB:.2f} GiB) but the memory budget is {self.budget_bytes} bytes "
                f"({self.budget_bytes / GIB:.2f} GiB); use LCPIndex or fewer queries"
            )
        qw, qlen = prepare_queries(queries, query_lengths, self.scan.fmt, self.scan.words.device)
        dtype = torch.int16 if self.scan.fmt.length < 2**15 else torch.int32
        full = torch.empty((b, n), dtype=dtype, device=qw.device)  # the materialised matrix
        rows = max(1, _CHUNK_ELEMS // max(b, 1))
        for start in range(0, n, rows):
            stop = min(n, start + rows)
            full[:, start:stop] = self.scan.lcp_block(qw, qlen, start, stop)
        ids = torch.arange(n, device=qw.device)
        top = torch.full((b, k), -1, dtype=torch.int64, device=qw.device)
        q_chunk = max(1, _CHUNK_ELEMS // n)
        for s in range(0, b, q_chunk):
            top[s : s + q_chunk] = ranking.best(ranking.encode(full[s : s + q_chunk].long(), ids[None, :], n), k)
        return ranking.decode(top, n)


METHODS = {"index": LCPIndex, "numpy": NumpySorted, "marisa": MarisaTrie, "scan": FullScan, "trie": Trie,
           "pairwise": Pairwise}  # fmt: skip
