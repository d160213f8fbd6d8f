"""The Triton kernel of lcp/gpu.py (see there for the algorithm): one program per query of a batch.

Kept apart so that importing lcp/gpu.py never needs triton; importing this module decorates the functions,
interpreted when TRITON_INTERPRET=1 is set then (Triton's interpreter: numpy on CPU tensors).
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK: tl.constexpr = tl.constexpr(64)  # lcp/smallest.py's BLOCK: positions per leaf block
NODE: tl.constexpr = tl.constexpr(1024)  # lcp/smallest.py's CAP: entries a tree node stores at most
BIG: tl.constexpr = tl.constexpr(9223372036854775807)  # larger than every id


@triton.jit
def mask_of(c, bits: tl.constexpr):
    """int64 mask keeping the high c tokens of a word (AND keeps the flipped top bit)."""
    one = tl.full((), 1, tl.int64)
    shift = tl.minimum(64 - c * bits, 63).to(tl.int64)
    return tl.where(c <= 0, tl.zeros((), tl.int64), -(one << shift))


@triton.jit
def bound(cols, lens, qw, n, d, upper, W, T: tl.constexpr, bits: tl.constexpr, HAS_LENS: tl.constexpr):
    """First sorted position whose row cut to d tokens is >= (upper: >) the query cut the same way;
    a row cut-equal to the query but shorter than d is smaller."""
    lo = tl.zeros((), tl.int64)
    hi = n + tl.zeros((), tl.int64)
    nw = tl.minimum((d + T - 1) // T, W)
    while lo < hi:
        mid = (lo + hi) // 2
        c = tl.zeros((), tl.int64)
        w = tl.zeros((), tl.int64)
        while (w < nw) & (c == 0):
            m = mask_of(tl.minimum(d - w * T, T), bits)
            r = tl.load(cols + w * n + mid) & m
            q = tl.load(qw + w) & m
            c = tl.where(r < q, -1, tl.where(r > q, 1, 0)).to(tl.int64)
            w += 1
        if HAS_LENS:
            short = tl.load(lens + mid).to(tl.int64) < d
            c = tl.where((c == 0) & short, -1, c)
        go_right = tl.where(upper != 0, c <= 0, c < 0)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def piece(ids, lev1, lev2, lev3, lev4, id_rows, id_starts, n, level, node):
    """Ids [NODE] of one whole tree node of level >= 1, ascending, BIG past its stored entries."""
    t = tl.arange(0, NODE)
    big = tl.full((NODE,), BIG, tl.int64)
    if level <= 4:
        width = BLOCK << level
        ok = t < width
        if level == 1:
            off = tl.load(lev1 + node * width + t, mask=ok, other=0).to(tl.int64)
        elif level == 2:
            off = tl.load(lev2 + node * width + t, mask=ok, other=0).to(tl.int64)
        elif level == 3:
            off = tl.load(lev3 + node * width + t, mask=ok, other=0).to(tl.int64)
        else:
            off = tl.load(lev4 + node * width + t, mask=ok, other=0).to(tl.int64)
        pos = node * width + (off & 0xFFFF)  # uint8 / int16 offsets (< 1024)
        ok = ok & (pos < n)
        out = tl.where(ok, tl.load(ids + pos, mask=ok, other=0).to(tl.int64), big)
    else:
        row = tl.load(id_starts + level - 5) + node
        got = tl.load(id_rows + row * NODE + t).to(tl.int64)
        out = tl.where(got < n, got, big)
    return out


@triton.jit
def partial(ids, a, b):
    """Ids [BLOCK] at positions [a, b) (b - a <= BLOCK), BIG elsewhere."""
    t = tl.arange(0, BLOCK)
    pos = a + t
    ok = pos < b
    big = tl.full((BLOCK,), BIG, tl.int64)
    return tl.where(ok, tl.load(ids + pos, mask=ok, other=0).to(tl.int64), big)


@triton.jit
def count_below(ids, lev1, lev2, lev3, lev4, id_rows, id_starts, n, a, b, t_val):
    """How many ids in positions [a, b) are < t_val (each tree node's count capped at its stored
    entries: exact where the answer is <= CAP)."""
    total = tl.zeros((), tl.int64)
    if a < b:
        bl = (a + BLOCK - 1) // BLOCK
        br = b // BLOCK
        if br <= bl:  # inside one or two blocks, no whole block
            total += tl.sum((partial(ids, a, tl.minimum(b, a + BLOCK)) < t_val).to(tl.int64))
            total += tl.sum((partial(ids, tl.minimum(b, a + BLOCK), b) < t_val).to(tl.int64))
        else:
            total += tl.sum((partial(ids, a, bl * BLOCK) < t_val).to(tl.int64))
            total += tl.sum((partial(ids, br * BLOCK, b) < t_val).to(tl.int64))
            lv = tl.zeros((), tl.int64)
            while bl < br:
                if bl % 2 == 1:
                    if lv == 0:
                        total += tl.sum((partial(ids, bl * BLOCK, bl * BLOCK + BLOCK) < t_val).to(tl.int64))
                    else:
                        v = piece(ids, lev1, lev2, lev3, lev4, id_rows, id_starts, n, lv, bl)
                        total += tl.sum((v < t_val).to(tl.int64))
                    bl += 1
                if br % 2 == 1:
                    br -= 1
                    if lv == 0:
                        total += tl.sum((partial(ids, br * BLOCK, br * BLOCK + BLOCK) < t_val).to(tl.int64))
                    else:
                        v = piece(ids, lev1, lev2, lev3, lev4, id_rows, id_starts, n, lv, br)
                        total += tl.sum((v < t_val).to(tl.int64))
                bl = bl // 2
                br = br // 2
                lv += 1
    return total


@triton.jit
def emit(v, t_val, scratch, at):
    """Append the ids of v below t_val to scratch[at:], in v's order; returns the new end."""
    keep = v < t_val
    rank = tl.cumsum(keep.to(tl.int64), 0) - 1
    tl.store(scratch + at + rank, v, mask=keep & (at + rank < NODE))
    return at + tl.sum(keep.to(tl.int64))


@triton.jit
def emit_range(ids, lev1, lev2, lev3, lev4, id_rows, id_starts, n, a, b, t_val, scratch, at):
    """emit for every piece of [a, b) (count_below's decomposition)."""
    if a < b:
        bl = (a + BLOCK - 1) // BLOCK
        br = b // BLOCK
        if br <= bl:
            at = emit(partial(ids, a, tl.minimum(b, a + BLOCK)), t_val, scratch, at)
            at = emit(partial(ids, tl.minimum(b, a + BLOCK), b), t_val, scratch, at)
        else:
            at = emit(partial(ids, a, bl * BLOCK), t_val, scratch, at)
            at = emit(partial(ids, br * BLOCK, b), t_val, scratch, at)
            lv = tl.zeros((), tl.int64)
            while bl < br:
                if bl % 2 == 1:
                    if lv == 0:
                        at = emit(partial(ids, bl * BLOCK, bl * BLOCK + BLOCK), t_val, scratch, at)
                    else:
                        v = piece(ids, lev1, lev2, lev3, lev4, id_rows, id_starts, n, lv, bl)
                        at = emit(v, t_val, scratch, at)
                    bl += 1
                if br % 2 == 1:
                    br -= 1
                    if lv == 0:
                        at = emit(partial(ids, br * BLOCK, br * BLOCK + BLOCK), t_val, scratch, at)
                    else:
                        v = piece(ids, lev1, lev2, lev3, lev4, id_rows, id_starts, n, lv, br)
                        at = emit(v, t_val, scratch, at)
                bl = bl // 2
                br = br // 2
                lv += 1
    return at


@triton.jit
def topk_kernel(
    cols, lens, ids, lev1, lev2, lev3, lev4, id_rows, id_starts,
    qws, qlens, scratch, out_lcps, out_ids,
    n, W, L, k, kk,
    T: tl.constexpr, bits: tl.constexpr, HAS_LENS: tl.constexpr, KB: tl.constexpr,
):  # fmt: skip
    q = tl.program_id(0).to(tl.int64)
    qw = qws + q * W
    dmax = tl.minimum(tl.load(qlens + q).to(tl.int64), L)
    # 1. d*: the largest d with |S_d| >= kk (|S_0| = n >= kk)
    lo_d = tl.zeros((), tl.int64)
    hi_d = dmax
    while lo_d < hi_d:
        mid = (lo_d + hi_d + 1) // 2
        size = bound(cols, lens, qw, n, mid, 1, W, T, bits, HAS_LENS) - bound(
            cols, lens, qw, n, mid, 0, W, T, bits, HAS_LENS
        )
        lo_d = tl.where(size >= kk, mid, lo_d)
        hi_d = tl.where(size >= kk, hi_d, mid - 1)
    d = lo_d
    lo0 = bound(cols, lens, qw, n, d, 0, W, T, bits, HAS_LENS)
    hi0 = bound(cols, lens, qw, n, d, 1, W, T, bits, HAS_LENS)
    lo1 = lo0
    hi1 = lo0
    if d < dmax:
        lo1 = bound(cols, lens, qw, n, d + 1, 0, W, T, bits, HAS_LENS)
        hi1 = bound(cols, lens, qw, n, d + 1, 1, W, T, bits, HAS_LENS)
    above = hi1 - lo1  # < kk rows, all ranked before the ties
    # 2. rows above d*: LCP from the words' XOR, ranked by one score
    t = tl.arange(0, KB)
    base = q * k
    if above > 0:  # (tl.sort is the costly step; skipped where no row is above d*)
        pos = lo1 + t
        ok = t < above
        lcp = tl.zeros((KB,), tl.int64)
        alive = ok
        for w in range(0, W):
            x = (tl.load(cols + w * n + pos, mask=ok, other=0) ^ tl.load(qw + w)).to(tl.uint64, bitcast=True)
            for j in tl.static_range(T):
                same = alive & ((x >> (64 - bits * (j + 1))) == 0)
                lcp += same.to(tl.int64)
                alive = same
        lcp = tl.minimum(lcp, dmax)
        if HAS_LENS:
            lcp = tl.minimum(lcp, tl.load(lens + pos, mask=ok, other=0).to(tl.int64))
        row_id = tl.load(ids + pos, mask=ok, other=0).to(tl.int64)
        score = tl.where(ok, lcp * (n + 1) + (n - 1 - row_id), -1)
        score = tl.sort(score, 0, descending=True)
        tl.store(out_lcps + base + t, tl.where(score >= 0, score // (n + 1), -1), mask=t < above)
        tl.store(out_ids + base + t, tl.where(score >= 0, n - 1 - score % (n + 1), -1), mask=t < above)
    # 3. ties: the `need` smallest ids of [lo0, lo1) ∪ [hi1, hi0), ascending, after the rows above
    need = kk - above
    left = lo1 - lo0
    width = left + hi0 - hi1
    u = tl.arange(0, KB)  # need <= kk <= KB: every sort is KB wide
    if (need > 0) & (width <= KB):  # narrow: every tied id read and sorted at once
        at_pos = tl.where(u < left, lo0 + u, hi1 + u - left)
        ok_u = u < width
        tie = tl.sort(tl.where(ok_u, tl.load(ids + at_pos, mask=ok_u, other=0).to(tl.int64), BIG), 0)
        tl.store(out_ids + base + above + u, tie, mask=u < need)
        tl.store(out_lcps + base + above + u, tl.zeros((KB,), tl.int64) + d, mask=u < need)
    if (need > 0) & (width > KB):
        lo_t = tl.zeros((), tl.int64)
        hi_t = (n - 1) + tl.zeros((), tl.int64)
        while lo_t < hi_t:  # the need-th smallest id: the least t with count(ids <= t) >= need
            mid = (lo_t + hi_t) // 2
            got = count_below(ids, lev1, lev2, lev3, lev4, id_rows, id_starts, n, lo0, lo1, mid + 1)
            got += count_below(ids, lev1, lev2, lev3, lev4, id_rows, id_starts, n, hi1, hi0, mid + 1)
            lo_t = tl.where(got >= need, lo_t, mid + 1)
            hi_t = tl.where(got >= need, mid, hi_t)
        row = scratch + q * NODE
        at = emit_range(ids, lev1, lev2, lev3, lev4, id_rows, id_starts, n, lo0, lo1, lo_t + 1, row, lo_t * 0)
        at = emit_range(ids, lev1, lev2, lev3, lev4, id_rows, id_starts, n, hi1, hi0, lo_t + 1, row, at)
        tl.debug_barrier()
        tie = tl.load(row + u, mask=u < need, other=BIG)
        tie = tl.sort(tie, 0)
        slot = above + u
        tl.store(out_ids + base + slot, tie, mask=(u < need))
        tl.store(out_lcps + base + slot, tl.zeros((KB,), tl.int64) + d, mask=(u < need))
    # slots kk .. k - 1 (k > n): -1
    if kk < k:
        for s in range(0, k - kk, KB):
            v = s + t
            tl.store(out_ids + base + kk + v, tl.full((KB,), -1, tl.int64), mask=v < k - kk)
            tl.store(out_lcps + base + kk + v, tl.full((KB,), -1, tl.int64), mask=v < k - kk)
