"""Smallest original ids inside ranges of the sorted order: the exact tie-break of the top-k.

Items that tie on LCP with a query form at most two contiguous ranges of the sorted order, which may be
huge (duplicates, tiny alphabets). `MinIdTable` is a sparse table over blocks of 64 positions: the
position of the smallest id in any range is one of two table entries or lies in the two partial blocks at
its ends, so a range-argmin costs O(block) gathers and the table O(N/64 · log N) words. The k smallest ids
of a range come from repeated splitting: take the range's argmin, split the range around it, repeat on
the range with the smallest minimum (a tournament over at most k + 2 open ranges).
"""

from __future__ import annotations

import torch

BLOCK = 64
_NO_ID = torch.iinfo(torch.int64).max


def _floor_log2(c: torch.Tensor) -> torch.Tensor:
    """floor(log2(c)) for integer c >= 1 (exact through float64 frexp)."""
    return torch.frexp(c.to(torch.float64))[1].to(torch.int64) - 1


class MinIdTable:
    """Range-argmin of `ids` (original ids by sorted position) over blocks of BLOCK positions."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        n = ids.shape[0]
        nb = -(-n // BLOCK)
        pad = torch.full((nb * BLOCK - n,), _NO_ID, dtype=torch.int64, device=ids.device)
        blocks = torch.cat([ids.to(torch.int64), pad]).view(nb, BLOCK)  # (nb, BLOCK)
        best_id, arg = blocks.min(1)
        best_pos = arg + torch.arange(nb, device=ids.device) * BLOCK
        levels, offsets, span = [best_pos], [0], 1
        while 2 * span <= nb:  # level j covers 2^j consecutive blocks
            left, right = slice(0, nb - 2 * span + 1), slice(span, nb - span + 1)
            take_left = best_id[left] < best_id[right]
            best_pos = torch.where(take_left, best_pos[left], best_pos[right])
            best_id = torch.where(take_left, best_id[left], best_id[right])
            offsets.append(offsets[-1] + levels[-1].shape[0])
            levels.append(best_pos)
            span *= 2
        pos_dtype = torch.int32 if n < 2**31 else torch.int64
        self.table = torch.cat(levels).to(pos_dtype)
        self.offsets = torch.tensor(offsets, dtype=torch.int64, device=ids.device)

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size() + self.offsets.numel() * 8

    def _id_at(self, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        got = self.ids[pos.clamp(0, self.ids.shape[0] - 1)].to(torch.int64)
        return torch.where(valid, got, _NO_ID)

    def argmin(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(position, id) of the smallest id in [a, b) per entry; id = int64 max for empty ranges."""
        t = torch.arange(BLOCK, device=a.device)
        first_blk = a // BLOCK
        last_blk = (b - 1).clamp(min=0) // BLOCK
        left = a[:, None] + t  # (M, BLOCK) from a to the end of its block
        left_ok = (left < b[:, None]) & (left < (first_blk[:, None] + 1) * BLOCK)
        right = last_blk[:, None] * BLOCK + t  # (M, BLOCK) the block holding b-1, when different
        right_ok = (right < b[:, None]) & (last_blk > first_blk)[:, None]
        inner = last_blk - first_blk - 1  # whole blocks strictly between
        has_inner = inner > 0
        j = _floor_log2(inner.clamp(min=1))
        base = self.offsets[j]
        c1 = self.table[(base + first_blk + 1).clamp(max=self.table.shape[0] - 1)].to(torch.int64)
        c2 = self.table[(base + last_blk - (1 << j)).clamp(0, self.table.shape[0] - 1)].to(torch.int64)
        pos = torch.cat([left, right, c1[:, None], c2[:, None]], 1)  # (M, 2*BLOCK + 2)
        ok = torch.cat([left_ok, right_ok, has_inner[:, None], has_inner[:, None]], 1) & (a < b)[:, None]
        ids = self._id_at(pos, ok)
        best_id, arg = ids.min(1)
        return pos.gather(1, arg[:, None]).squeeze(1), best_id

    def smallest(self, lo: torch.Tensor, hi: torch.Tensor, count: int) -> torch.Tensor:
        """Positions [M, count] of the `count` smallest ids in the union of ranges [lo[:, r], hi[:, r]).

        Ranges are disjoint; a row with fewer items gets -1 in the missing places. Ascending by id.
        """
        m, r0 = lo.shape
        slots = r0 + count
        lo_s = torch.zeros((m, slots), dtype=torch.int64, device=lo.device)
        hi_s = torch.zeros_like(lo_s)
        lo_s[:, :r0], hi_s[:, :r0] = lo, hi
        cpos, cid = (x.view(m, slots) for x in self.argmin(lo_s.flatten(), hi_s.flatten()))
        out = torch.full((m, count), -1, dtype=torch.int64, device=lo.device)
        rows = torch.arange(m, device=lo.device)
        for s in range(count):
            best_id, r = cid.min(1)  # the open range holding the next smallest id
            pos = cpos[rows, r]
            found = best_id != _NO_ID
            out[:, s] = torch.where(found, pos, -1)
            # split range r around pos: [lo, pos) stays in slot r, [pos + 1, hi) goes to slot r0 + s
            new_lo = torch.stack([lo_s[rows, r], pos + 1], 1)
            new_hi = torch.stack([pos, hi_s[rows, r]], 1)
            new_lo = torch.where(found[:, None], new_lo, 0)
            new_hi = torch.where(found[:, None], new_hi, 0)
            npos, nid = (x.view(m, 2) for x in self.argmin(new_lo.flatten(), new_hi.flatten()))
            lo_s[rows, r], hi_s[rows, r] = new_lo[:, 0], new_hi[:, 0]
            lo_s[:, r0 + s], hi_s[:, r0 + s] = new_lo[:, 1], new_hi[:, 1]
            cpos[rows, r], cid[rows, r] = npos[:, 0], nid[:, 0]
            cpos[:, r0 + s], cid[:, r0 + s] = npos[:, 1], nid[:, 1]
        return out
