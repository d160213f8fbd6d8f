"""The k smallest original ids inside a range of sorted positions: the exact tie-break of the top-k.

Rows that tie with a query at the k-th LCP form one contiguous range [lo, hi) of the sorted order, which
may hold anything from a few rows to all N (duplicates, tiny alphabets). `SmallestIds` answers "the
`count` smallest ids in [lo, hi)" for a whole batch with a fixed number of tensor ops, whatever the range:

* a *truncated merge-sort tree* over blocks of BLOCK = 64 positions: a node at level j covers
  64·2^j aligned positions and keeps its first min(64·2^j, CAP) ids in ascending order — as offsets
  inside the node (1 byte up to 256 positions, 2 up to 1,024: the ids are then read within a span of
  <= 4 KB) or, for larger nodes, as the ids themselves (a random read per entry would miss the cache);
  a single block (level 0) is read directly;
* [lo, hi) is cut into two partial blocks (at most 63 positions each, read directly) and at most two
  whole nodes per level (the usual bottom-up segment-tree decomposition). The `count` smallest ids of the
  range are among the two partial blocks and the first min(count, stored) entries of every node, so one
  gather and one `topk` over 126 + sum_j 2·min(count, 64·2^j) columns answer every query of the batch.

Cost per query for count <= CAP: O(count · log2(R / count) + 126) elements, R = hi - lo — independent of
how many rows tie. Memory: about 10 bytes per row (levels of 128 and 256 positions 1 byte per row each,
512 and 1,024 2 bytes each, all larger levels together <= CAP int32 ids per node, ~4 bytes per row).
count > CAP (k > 1024) falls back to sorting the ids of the range itself (`smallest_by_sort`), chunked
so that no call holds more than a few million elements: O(R log R) per query.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BLOCK = 64  # positions per leaf block: the partial ends of a range are read directly
CAP = 1024  # entries kept per node: the tree answers count <= CAP
_BIG = torch.iinfo(torch.int64).max
_ELEMS = 1 << 21  # (query, column) pairs per gather: bounds the temporaries of one step


def _offset_dtype(size: int) -> torch.dtype:
    return torch.uint8 if size <= 256 else torch.int16 if size <= 1 << 15 else torch.int32


class SmallestIds:
    """Truncated merge-sort tree over `ids` (original id at each sorted position)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self.pad = torch.iinfo(ids.dtype).max  # larger than every id: marks "no entry"
        n = ids.shape[0]
        nb = -(-n // BLOCK)
        # built in the ids' own dtype (int32 below 2^31 rows) and int16 offsets, which hold every offset
        # stored (< 2 * CAP): half the build's peak of int64 columns
        vals = torch.cat([ids, ids.new_full((nb * BLOCK - n,), self.pad)])
        vals, offsets = vals.view(nb, BLOCK).sort(1)  # (nb, 64) ids ascending, offsets inside the block
        local: torch.Tensor | None = offsets.to(torch.int16)
        del offsets
        # level 0 (a block) is read directly; small nodes keep offsets, large ones their ids themselves
        self.levels: list[torch.Tensor | None] = [None]
        self.holds_ids: list[bool] = [False]
        size = BLOCK
        while vals.shape[0] > 1:  # level j + 1 = first entries of the merge of two level-j children
            if vals.shape[0] % 2:
                vals = torch.cat([vals, vals.new_full((1, vals.shape[1]), self.pad)])
                if local is not None:
                    local = torch.cat([local, local.new_zeros((1, local.shape[1]))])
            m = vals.shape[1]
            vals = vals.view(-1, 2 * m)
            direct = 2 * size > CAP  # reading ids across a span this large would miss the cache per entry
            if local is not None and not direct:  # offsets into the merged node (the id levels need none)
                local = torch.cat([local.view(-1, 2, m)[:, 0], local.view(-1, 2, m)[:, 1] + size], 1)
            vals, order = vals.sort(1)
            keep = min(2 * m, CAP)
            vals = vals[:, :keep].contiguous()
            size *= 2
            if direct:
                self.levels.append(vals)
                local = None
            elif local is not None:
                local = local.gather(1, order[:, :keep])
                self.levels.append(local.to(_offset_dtype(size)))
            del order
            self.holds_ids.append(direct)
        # the id levels in one array (the compiled kernel takes one table and a start row per level)
        big = [lvl for lvl, held in zip(self.levels, self.holds_ids, strict=True) if held]
        self.id_rows = torch.cat(big) if big else ids.new_zeros((0, CAP))  # (sum of nodes, CAP)
        starts = [0]
        for j, held in enumerate(self.holds_ids):
            if held:
                self.levels[j] = self.id_rows[starts[-1] : starts[-1] + self.levels[j].shape[0]]
                starts.append(starts[-1] + self.levels[j].shape[0])
        self.id_row_starts = starts[:-1]  # first row in id_rows of each id level, bottom up

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.levels if t is not None)

    def move_arrays(self, move: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every stored array by move(array) (same content; e.g. other memory), keeping the id
        levels views of one table."""
        self.ids = move(self.ids)
        self.id_rows = move(self.id_rows)
        row = iter(self.id_row_starts)
        for j, level in enumerate(self.levels):
            if level is not None:
                start = next(row) if self.holds_ids[j] else 0
                self.levels[j] = self.id_rows[start : start + level.shape[0]] if self.holds_ids[j] else move(level)

    def _width(self, j: int) -> int:
        level = self.levels[j]
        return BLOCK if level is None else level.shape[1]

    def columns(self, count: int, levels: int) -> int:
        """Candidate columns per query when `levels` tree levels are read for `count` ids."""
        n_levels = min(levels, len(self.levels))
        return 2 * (BLOCK - 1) + 2 * BLOCK * (n_levels > 0) + sum(
            2 * min(count, self._width(j)) for j in range(1, n_levels)
        )

    def smallest(self, lo: torch.Tensor, hi: torch.Tensor, count: int, levels: int) -> torch.Tensor:
        """Ids [B, count] of the `count` smallest ids in [lo[b], hi[b]), ascending; -1 pads.

        `levels` >= the tree levels any range needs: bit_length(max whole blocks in a range).
        """
        b = lo.shape[0]
        out = torch.full((b, count), -1, dtype=torch.int64, device=lo.device)
        step = max(1, _ELEMS // self.columns(count, levels))
        for s in range(0, b, step):
            out[s : s + step] = self._smallest(lo[s : s + step], hi[s : s + step], count, levels)
        return out

    def _smallest(self, lo: torch.Tensor, hi: torch.Tensor, count: int, levels: int) -> torch.Tensor:
        dev, n = lo.device, self.ids.shape[0]
        hi = torch.maximum(hi, lo)
        bl = (lo + BLOCK - 1) // BLOCK  # first whole block
        br = torch.maximum(hi // BLOCK, bl)  # end of the whole blocks
        same = hi // BLOCK < bl  # [lo, hi) inside one block: all of it is the "left" part
        t = torch.arange(BLOCK, device=dev)
        left_end = torch.where(same, hi, bl * BLOCK)
        right_start = torch.where(same, hi, br * BLOCK)
        left = lo[:, None] + t[:-1]  # (B, 63) partial blocks, read directly
        right = right_start[:, None] + t[:-1]
        pos, ok, vals = [left, right], [left < left_end[:, None], right < hi[:, None]], []
        l, r = torch.where(same, 0, bl), torch.where(same, 0, br)  # whole blocks [l, r) at level 0
        size = BLOCK
        for j in range(min(levels, len(self.levels))):  # take node l if it is a right child, r-1 if r is
            take_l = ((l & 1) == 1) & (l < r)
            node_l, l = l, l + take_l.to(l.dtype)
            take_r = ((r & 1) == 1) & (l < r)
            r = r - take_r.to(r.dtype)
            level = self.levels[j]
            for node, take in ((node_l, take_l), (r, take_r)):
                node = torch.where(take, node, 0)
                if level is None:  # a whole block: its positions
                    pos.append(node[:, None] * BLOCK + t)
                    ok.append(take[:, None].expand(-1, BLOCK))
                    continue
                m = min(count, level.shape[1])
                got = level[:, :m][node].to(torch.int64)  # (B, m)
                if self.holds_ids[j]:
                    vals.append(torch.where(take[:, None], got, _BIG))
                else:
                    pos.append(node[:, None] * size + got)
                    ok.append(take[:, None].expand(-1, m))
            l, r, size = l >> 1, r >> 1, size * 2
        pos_t, ok_t = torch.cat(pos, 1), torch.cat(ok, 1)  # (B, C)
        vals.append(torch.where(ok_t, self.ids[pos_t.clamp(0, n - 1)].to(torch.int64), _BIG))
        every = torch.cat(vals, 1) if len(vals) > 1 else vals[0]
        take = min(count, every.shape[1])
        best = every.topk(take, 1, largest=False).values
        got = torch.where(best >= self.pad, -1, best)
        if take < count:
            got = torch.cat([got, got.new_full((got.shape[0], count - take), -1)], 1)
        return got


def smallest_direct(ids: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Ids [B, count]: the `count` smallest ids in [lo, hi), ascending, reading every position (hi - lo <= width)."""
    b, n = lo.shape[0], ids.shape[0]
    out = torch.full((b, count), -1, dtype=torch.int64, device=lo.device)
    if width == 0:
        return out
    t = torch.arange(width, device=lo.device)
    step = max(1, _ELEMS // width)
    take = min(count, width)
    for s in range(0, b, step):
        pos = lo[s : s + step, None] + t  # (b', width)
        vals = torch.where(pos < hi[s : s + step, None], ids[pos.clamp(0, n - 1)].to(torch.int64), _BIG)
        best = vals.topk(take, 1, largest=False).values
        out[s : s + step, :take] = torch.where(best != _BIG, best, -1)
    return out


def smallest_by_sort(ids: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, count: int) -> torch.Tensor:
    """Ids [B, count]: the `count` smallest ids in [lo, hi), ascending, by sorting each range (any count).

    Ranges are laid end to end (no padding) and sorted by (query, id) in chunks of about _ELEMS
    positions; a single range longer than that is sorted alone.
    """
    b, dev = lo.shape[0], lo.device
    out = torch.full((b, count), -1, dtype=torch.int64, device=dev)
    sizes = (hi - lo).clamp(min=0)
    bounds, total, start = [], 0, 0
    for i, r in enumerate(sizes.tolist()):  # one host read of the sizes: chunk boundaries
        if total and total + r > _ELEMS:
            bounds.append((start, i))
            start, total = i, 0
        total += r
    bounds.append((start, b))
    for s, e in bounds:
        r = sizes[s:e]
        seg = torch.repeat_interleave(torch.arange(e - s, device=dev), r)  # (M,) query of each position
        if seg.numel() == 0:
            continue
        first = torch.cumsum(r, 0) - r
        pos = lo[s:e][seg] + torch.arange(seg.numel(), device=dev) - first[seg]
        key = torch.sort(seg * (1 << 32) + ids[pos].to(torch.int64)).values  # by query, then id
        rank = torch.arange(seg.numel(), device=dev) - first[seg]  # seg is already non-decreasing
        keep = rank < count
        out[s:e][seg[keep], rank[keep]] = key[keep] & ((1 << 32) - 1)
    return out
