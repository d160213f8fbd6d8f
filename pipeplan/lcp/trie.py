"""The trie of the paper, as a baseline for moderate N: one node per distinct prefix, O(N·L) nodes.

Each node keeps its subtree size and the k_max smallest ids below it. A query walks its path down
(one sorted-key lookup per depth, O(L)); the rows at LCP exactly d are subtree(v_d) minus
subtree(v_{d+1}) along that path, so reading the id lists from the deepest node upwards and skipping
ids already listed one level deeper yields the top-k in O(L + k) per query (k <= k_max). Levels are
built and walked for all rows / queries at once; the Python loops run over depth only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeplan.lcp import ranking
from pipeplan.lcp.errors import LCPError
from pipeplan.lcp.index import check_k
from pipeplan.lcp.ranking import LCPTopK
from pipeplan.lcp.tokens import (
    INT64_MIN,
    TokenFormat,
    check_lengths,
    check_rows,
    prepare_queries,
    resolve_device,
    token_format,
)


@dataclass
class _Level:
    """Nodes at one depth, sorted by key = parent · 2^bits + token."""

    key: torch.Tensor  # (M,) int64
    count: torch.Tensor  # (M,) rows in the subtree
    list_off: torch.Tensor  # (M + 1,) offsets into list_ids
    list_ids: torch.Tensor  # (sum of min(count, k_max),) smallest ids per node, ascending

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.key, self.count, self.list_off, self.list_ids))


class Trie:
    """Pointer-free trie over rows [N, L] of tokens up to 32 bits; exact top-k for k <= k_max."""

    def __init__(self, fmt: TokenFormat, n: int, levels: list[_Level], k_max: int) -> None:
        self.fmt, self.n, self.levels, self.k_max = fmt, n, levels, k_max

    @classmethod
    def build(
        cls,
        seqs: torch.Tensor,
        lengths: torch.Tensor | None = None,
        device: str | torch.device | None = None,
        k_max: int = 16,
    ) -> Trie:
        check_rows(seqs, "seqs")
        n, length = seqs.shape
        if n == 0:
            raise LCPError("cannot build a trie over zero sequences (seqs has shape [0, L])")
        fmt = token_format(seqs.dtype, length)
        if fmt.bits > 32:
            raise LCPError("the trie baseline packs (parent, token) into int64 keys: tokens up to 32 bits")
        k_max = check_k(k_max)
        dev = resolve_device(device, seqs.device)
        x = seqs.to(dev)
        lens = check_lengths(lengths, n, length, "lengths")
        lens = lens.to(dev) if lens is not None else torch.full((n,), length, device=dev)
        alive = torch.arange(n, device=dev)  # rows still descending, ascending ids
        parent = torch.zeros(n, dtype=torch.int64, device=dev)
        levels: list[_Level] = []
        for d in range(length):
            keep = lens[alive] > d
            alive, parent = alive[keep], parent[keep]
            if alive.numel() == 0:
                break
            token = x[alive, d].to(torch.int64) - fmt.lo  # (M,) u in [0, 2^bits)
            key, node, count = torch.unique(
                parent * (1 << fmt.bits) + token, sorted=True, return_inverse=True, return_counts=True
            )
            order = torch.sort(node, stable=True).indices  # rows grouped by node, ids ascending
            start = torch.cumsum(count, 0) - count
            rank = torch.arange(order.numel(), device=dev) - start[node[order]]
            listed = alive[order][rank < k_max]
            off = torch.cat([count.new_zeros(1), torch.cumsum(count.clamp(max=k_max), 0)])
            levels.append(_Level(key, count, off, listed.to(torch.int32)))
            parent = node
        return cls(fmt, n, levels, k_max)

    @property
    def nbytes(self) -> int:
        return sum(level.nbytes for level in self.levels)

    def _tokens(self, qw: torch.Tensor) -> torch.Tensor:
        """Unsigned token ranks [B, W·T] unpacked from packed query words [B, W]."""
        bits, per = self.fmt.bits, self.fmt.per_word
        pattern = qw ^ INT64_MIN  # (B, W) plain big-endian bit strings
        shifts = torch.tensor([64 - (t + 1) * bits for t in range(per)], device=qw.device)
        return ((pattern[:, :, None] >> shifts) & ((1 << bits) - 1)).flatten(1)

    def _list(self, depth: int, node: torch.Tensor) -> torch.Tensor:
        """Id lists [B, k_max] of `node` at `depth` (root: depth 0); -1 where absent."""
        t = torch.arange(self.k_max, device=node.device)
        if depth == 0:
            return torch.where(t < self.n, t, -1).expand(node.shape[0], -1)
        level = self.levels[depth - 1]
        safe = node.clamp(min=0)
        start, stop = level.list_off[safe], level.list_off[safe + 1]
        idx = start[:, None] + t  # (B, k_max)
        ok = (idx < stop[:, None]) & (node >= 0)[:, None]
        got = level.list_ids[idx.clamp(max=max(level.list_ids.numel() - 1, 0))].to(torch.int64)
        return torch.where(ok, got, -1)

    def topk(
        self, queries: torch.Tensor, k: int, query_lengths: torch.Tensor | None = None
    ) -> LCPTopK:
        k = check_k(k)
        if k > self.k_max:
            raise LCPError(f"this trie keeps {self.k_max} ids per node; rebuild with k_max >= {k}")
        dev = self.levels[0].key.device if self.levels else torch.device("cpu")
        qw, qlen = prepare_queries(queries, query_lengths, self.fmt, dev)
        tokens, b = self._tokens(qw), qw.shape[0]
        path = torch.full((b, len(self.levels) + 1), -1, dtype=torch.int64, device=dev)
        path[:, 0] = 0  # the root
        cur = torch.zeros(b, dtype=torch.int64, device=dev)
        alive = torch.ones(b, dtype=torch.bool, device=dev)
        for d, level in enumerate(self.levels):  # walk down: one sorted lookup per depth
            key = cur * (1 << self.fmt.bits) + tokens[:, d]
            j = torch.searchsorted(level.key, key).clamp(max=level.key.numel() - 1)
            alive &= (qlen > d) & (level.key[j] == key)
            cur = torch.where(alive, j, 0)
            path[:, d + 1] = torch.where(alive, j, -1)
        top = torch.full((b, k), -1, dtype=torch.int64, device=dev)
        below = torch.full((b, self.k_max), -1, dtype=torch.int64, device=dev)
        for d in range(len(self.levels), -1, -1):  # read answers upwards: LCP exactly d at depth d
            ids = self._list(d, path[:, d])  # (B, k_max)
            deeper = (ids[:, :, None] == below[:, None, :]).any(2) | (ids < 0)
            top = ranking.best(torch.cat([top, ranking.encode(torch.where(deeper, -1, d), ids, self.n)], 1), k)
            below = ids
        return ranking.decode(top, self.n)
