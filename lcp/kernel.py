"""The compiled CPU query kernel (numba): one loop over the queries of a batch, no [B × C] temporaries.

Per query, with the same exactness argument as lcp/index.py (S_0 ⊇ S_1 ⊇ … contiguous around the
insertion point p; d* the largest d with |S_d| >= k):

1. *Insertion point.* A bucket table over the top `bucket_bits` bits of the first packed word gives the
   run of rows that can hold p (`starts[b] .. starts[b + 1]`: ~8–16 rows); a binary search inside it,
   then one over the later words only among rows whose first word equals the query's.
2. *d\\**. The LCPs of the two neighbours s_{p-1}, s_p come from the XOR of their words (leading zeros /
   bits per token); walking outward, LCP(q, s_{p-1-i}) = min(LCP(q, s_{p-1}), adj[p-2], …, adj[p-1-i])
   and symmetrically on the right, so both sides are non-increasing and d* is the k-th value of their
   merge — k steps, each reading one byte of `adj`.
3. *S_{d\\*}.* The walk goes on while the LCP stays >= d* (at most WALK rows per side), else the range's
   ends are binary-searched on the rows cut to d* tokens. d* = 0 needs no range: S_0 is every row.
4. *Ties.* The k − |S_{d*+1}| smallest ids of S_{d*} ∖ S_{d*+1}: for d* = 0 the ids 0, 1, 2, … minus
   those above; for a range of at most `direct_cap` rows (default max(8k, 512)), a quickselect over its
   ids; for a wider one (k <= CAP) a k-way merge over the truncated merge-sort tree of lcp/smallest.py —
   the two partial blocks and at most two nodes per level, each already sorted by id, read only as far as
   the merge needs (O(k · lists) steps, whatever the range's size).
5. The rows above d* (fewer than k) are sorted by the key (L − lcp)·N + id, i.e. (LCP desc, id asc), and
   written first; the tie ids follow at LCP d*.

Everything is int64 arithmetic on the index's own arrays (numpy views of its tensors); the loop runs on
the calling thread, so the kernel uses one core whatever torch's thread count is.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros

BLOCK = 64  # as lcp/smallest.py: positions per leaf block
CAP = 1024  # entries per tree node: the merge answers k <= CAP
WALK = 64  # rows walked beyond the k-th on each side before the range's end is searched instead
_MAX = np.iinfo(np.int64).max
_SIGN = np.uint64(1 << 63)


def _jit(fn):
    """njit with an on-disk cache; in memory only when no cache directory is writable (numba raises)."""
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available": compile per process
        return numba.njit(nogil=True)(fn)


@_jit
def pack_queries(q, qlen, length, bits, lo_val, hi_val, words):
    """Queries int64 [B, L'] (token values) -> (packed words [B, W], effective lengths [B]).

    As lcp/tokens.py: a query is cut at min(its length, L, its first token outside [lo_val, hi_val]);
    a token becomes its rank u = v - lo_val, T = 64 / bits per word, first token highest, top bit flipped.
    """
    b, width = q.shape
    per_word = 64 // bits
    qw = np.empty((b, words), np.int64)
    eff = np.empty(b, np.int64)
    for i in range(b):
        ql = min(qlen[i], length, width)
        for t in range(ql):
            if q[i, t] < lo_val or q[i, t] > hi_val:
                ql = t
                break
        eff[i] = ql
        for w in range(words):
            if bits == 64:
                qw[i, w] = q[i, w] if w < ql else lo_val  # int64: the word is the value itself
                continue
            acc = np.uint64(0)
            for t in range(per_word):
                pos = w * per_word + t
                if pos < ql:
                    u = np.uint64(q[i, pos] - lo_val)
                    acc |= u << np.uint64(64 - bits * (t + 1))
            qw[i, w] = np.int64(acc ^ _SIGN)
    return qw, eff


@_jit
def _first_at_least(col0, starts, shift, half, v, strict):
    """First sorted position whose first word is >= v (strict: > v), inside v's bucket."""
    b = (v >> shift) + half
    lo = np.int64(starts[b])
    hi = np.int64(starts[b + 1])
    low_bits = v & ((np.int64(1) << shift) - 1)
    if not strict and low_bits == 0:  # v is its bucket's smallest value
        return lo
    if strict and low_bits == (np.int64(1) << shift) - 1:  # v is its bucket's largest value
        return hi
    while lo < hi:
        mid = (lo + hi) >> 1
        x = col0[mid]
        if x < v or (strict and x == v):
            lo = mid + 1
        else:
            hi = mid
    return lo


@_jit
def _fill_masks(masks, d, per_word, bits):
    """masks[w] keeps the first d tokens of a packed row (and the flipped top bit where any is kept)."""
    for w in range(masks.shape[0]):
        c = min(max(d - w * per_word, 0), per_word)
        masks[w] = 0 if c == 0 else -(np.int64(1) << (64 - c * bits))


@_jit
def _search(cols, starts, shift, half, lengths, has_len, q, masks, short, upper):
    """First position whose row cut by `masks` is >= (upper: >) the query cut the same way; a row whose
    cut equals the query's but whose length is < short counts as smaller (a proper prefix sorts first)."""
    n, words = cols.shape[1], cols.shape[0]
    m0 = masks[0]
    if m0 == 0:
        return n if upper else 0
    v = q[0] & m0
    first = _first_at_least(cols[0], starts, shift, half, v, False)
    past = _first_at_least(cols[0], starts, shift, half, v | ~m0, True)
    more = has_len and short > 0
    for w in range(1, words):
        if masks[w] != 0:
            more = True
    if not more:
        return past if upper else first
    lo, hi = first, past
    while lo < hi:
        mid = (lo + hi) >> 1
        c = 0
        for w in range(1, words):
            a = cols[w, mid] & masks[w]
            z = q[w] & masks[w]
            if a != z:
                c = -1 if a < z else 1
                break
        if c == 0 and has_len and lengths[mid] < short:
            c = -1
        if c < 0 or (upper and c == 0):
            lo = mid + 1
        else:
            hi = mid
    return lo


@_jit
def _lcp(cols, lengths, has_len, j, q, ql, per_word, bits):
    """LCP of the query (words q, length ql) with the row at sorted position j, within both lengths."""
    words = cols.shape[0]
    out = words * per_word
    for w in range(words):
        x = cols[w, j] ^ q[w]
        if x != 0:
            out = w * per_word + leading_zeros(x) // bits
            break
    out = min(out, ql)
    if has_len:
        out = min(out, np.int64(lengths[j]))
    return out


@_jit
def _select(a, m, count):
    """Put the `count` smallest of a[:m] (distinct) in a[:count], ascending (quickselect, then a sort)."""
    lo, hi, target = 0, m - 1, count - 1
    budget = 64  # partition rounds before a plain sort of what is left (guards against bad pivots)
    while hi > lo and budget > 0:
        budget -= 1
        mid = (lo + hi) >> 1
        x, y, z = a[lo], a[mid], a[hi]
        pivot = max(min(x, y), min(max(x, y), z))  # median of three
        i, j = lo, hi
        while i <= j:
            while a[i] < pivot:
                i += 1
            while a[j] > pivot:
                j -= 1
            if i <= j:
                a[i], a[j] = a[j], a[i]
                i += 1
                j -= 1
        if target <= j:
            hi = j
        elif target >= i:
            lo = i
        else:
            break
    if hi > lo and budget == 0:
        a[lo : hi + 1].sort()
    a[:count].sort()


@_jit
def _tree_value(kind, node, idx, ids, lev1, lev2, lev3, lev4, id_rows, row0, unsorted):
    """Entry idx of one merge list: the partial blocks (kind 0), an offset level (1-4), an id level (5+)."""
    if kind == 0:
        return unsorted[idx]
    if kind == 1:
        return np.int64(ids[node * (BLOCK << 1) + lev1[node, idx]])
    if kind == 2:
        return np.int64(ids[node * (BLOCK << 2) + lev2[node, idx]])
    if kind == 3:
        return np.int64(ids[node * (BLOCK << 3) + lev3[node, idx]])
    if kind == 4:
        return np.int64(ids[node * (BLOCK << 4) + lev4[node, idx]])
    return np.int64(id_rows[row0 + node, idx])


@_jit
def _tree_smallest(lo, hi, count, ids, lev1, lev2, lev3, lev4, id_rows, id_starts, excl, n_excl, out, unsorted,
                   kinds, nodes, rows0, lens, heads, cursor):
    """out[:count - n_excl] = the smallest ids of [lo, hi) not in excl[:n_excl] (sorted), ascending.

    [lo, hi) is cut as a segment tree: two partial blocks plus whole blocks and at most two nodes per
    level; the count smallest ids are among the blocks' ids and each node's first min(count, stored)."""
    n_levels = 5 + id_starts.shape[0]
    bl = (lo + BLOCK - 1) // BLOCK
    br = max(hi // BLOCK, bl)
    nu = 0
    if hi // BLOCK < bl:  # inside one block
        for pos in range(lo, hi):
            unsorted[nu] = ids[pos]
            nu += 1
        bl = br = 0
    else:
        for pos in range(lo, bl * BLOCK):
            unsorted[nu] = ids[pos]
            nu += 1
        for pos in range(br * BLOCK, hi):
            unsorted[nu] = ids[pos]
            nu += 1
    n_lists = 1
    left, right = bl, br
    for j in range(n_levels):
        if left >= right:
            break
        for side in range(2):
            if side == 0:
                take = (left & 1) == 1 and left < right
                node = left
                if take:
                    left += 1
            else:
                take = (right & 1) == 1 and left < right
                if take:
                    right -= 1
                node = right
            if not take:
                continue
            if j == 0:  # a whole block: its ids, unsorted
                for pos in range(node * BLOCK, node * BLOCK + BLOCK):
                    unsorted[nu] = ids[pos]
                    nu += 1
                continue
            kinds[n_lists] = min(j, 5)
            nodes[n_lists] = node
            rows0[n_lists] = id_starts[j - 5] if j >= 5 else 0
            lens[n_lists] = min(count, BLOCK << j, CAP)
            n_lists += 1
        left >>= 1
        right >>= 1
    unsorted[:nu].sort()
    kinds[0], nodes[0], rows0[0], lens[0] = 0, 0, 0, nu
    for li in range(n_lists):
        cursor[li] = 0
        heads[li] = _tree_value(kinds[li], nodes[li], 0, ids, lev1, lev2, lev3, lev4, id_rows, rows0[li],
                                unsorted) if lens[li] > 0 else _MAX
    need, got, e = count - n_excl, 0, 0
    while got < need:
        best, at = _MAX, 0
        for li in range(n_lists):
            if heads[li] < best:
                best, at = heads[li], li
        if best == _MAX:
            break
        cursor[at] += 1
        c = cursor[at]
        heads[at] = _tree_value(kinds[at], nodes[at], c, ids, lev1, lev2, lev3, lev4, id_rows, rows0[at],
                                unsorted) if c < lens[at] else _MAX
        while e < n_excl and excl[e] < best:
            e += 1
        if e < n_excl and excl[e] == best:
            continue
        out[got] = best
        got += 1


@_jit
def topk(cols, ids, adj, lengths, has_len, length, per_word, bits, starts, shift, half,
         lev1, lev2, lev3, lev4, id_rows, id_starts, direct_cap, qw, qlen, k, out_lcps, out_ids):
    """Fill out_lcps / out_ids [B, >= min(k, N)] (pre-filled with -1) with each query's exact top-k."""
    n, words = cols.shape[1], cols.shape[0]
    kk = min(k, n)
    left_lcp = np.empty(kk, np.int64)
    right_lcp = np.empty(kk, np.int64)
    keys = np.empty(kk, np.int64)
    excl = np.empty(kk, np.int64)
    masks = np.empty(words, np.int64)
    full = np.full(words, -1, np.int64)
    ties = np.empty(kk, np.int64)
    buf = np.empty(max(8 * kk, 512), np.int64)
    max_lists = 2 * (6 + id_starts.shape[0]) + 1
    unsorted = np.empty(4 * BLOCK, np.int64)
    kinds, nodes, rows0 = np.empty(max_lists, np.int64), np.empty(max_lists, np.int64), np.empty(max_lists, np.int64)
    lens, heads, cursor = np.empty(max_lists, np.int64), np.empty(max_lists, np.int64), np.empty(max_lists, np.int64)
    cap = direct_cap if direct_cap >= 0 else max(8 * kk, 512)
    for i in range(qw.shape[0]):
        q, ql = qw[i], qlen[i]
        p = _search(cols, starts, shift, half, lengths, has_len, q, full, ql, False)
        cl = _lcp(cols, lengths, has_len, p - 1, q, ql, per_word, bits) if p > 0 else -1
        cr = _lcp(cols, lengths, has_len, p, q, ql, per_word, bits) if p < n else -1
        # d*: the kk-th value of the merge of the two non-increasing sides
        nl, nr, d = 0, 0, 0
        for _ in range(kk):
            if cl >= cr:
                left_lcp[nl] = cl
                d = cl
                nl += 1
                cl = min(cl, np.int64(adj[p - 1 - nl])) if p - 1 - nl >= 0 else -1
            else:
                right_lcp[nr] = cr
                d = cr
                nr += 1
                cr = min(cr, np.int64(adj[p + nr - 1])) if p + nr < n else -1
        gt_l, gt_r = 0, 0
        while gt_l < nl and left_lcp[gt_l] > d:
            gt_l += 1
        while gt_r < nr and right_lcp[gt_r] > d:
            gt_r += 1
        n_above = gt_l + gt_r
        # the rows above d*, ranked by (LCP desc, id asc)
        for t in range(gt_l):
            keys[t] = (length - left_lcp[t]) * n + ids[p - 1 - t]
        for t in range(gt_r):
            keys[gt_l + t] = (length - right_lcp[t]) * n + ids[p + t]
        keys[:n_above].sort()
        for t in range(n_above):
            out_lcps[i, t] = length - keys[t] // n
            out_ids[i, t] = keys[t] % n
            excl[t] = keys[t] % n
        for t in range(n_above, kk):
            out_lcps[i, t] = d
        need = kk - n_above
        if d == 0:  # S_0 is every row: the smallest ids overall, less those above
            excl[:n_above].sort()
            e, v = 0, 0
            for t in range(n_above, kk):
                while True:
                    while e < n_above and excl[e] < v:
                        e += 1
                    if e < n_above and excl[e] == v:
                        v += 1
                        continue
                    break
                out_ids[i, t] = v
                v += 1
            continue
        # S_{d*} = [lo, hi): walk on while the LCP stays >= d*, else search the rows cut to d* tokens
        ge_l, steps = nl, 0
        while cl >= d and steps < WALK:
            ge_l += 1
            steps += 1
            cl = min(cl, np.int64(adj[p - 1 - ge_l])) if p - 1 - ge_l >= 0 else -1
        ge_r, steps = nr, 0
        while cr >= d and steps < WALK:
            ge_r += 1
            steps += 1
            cr = min(cr, np.int64(adj[p + ge_r - 1])) if p + ge_r < n else -1
        lo, hi = p - ge_l, p + ge_r
        if cl >= d or cr >= d:
            _fill_masks(masks, d, per_word, bits)
            if cl >= d:
                lo = _search(cols, starts, shift, half, lengths, has_len, q, masks, d, False)
            if cr >= d:
                hi = _search(cols, starts, shift, half, lengths, has_len, q, masks, d, True)
        a, z = p - gt_l, p + gt_r  # S_{d*+1}, inside [lo, hi)
        if hi - lo <= cap or kk > CAP:  # read the range's ids
            m = hi - lo - n_above
            if m > buf.shape[0]:
                buf = np.empty(m, np.int64)
            c = 0
            for pos in range(lo, a):
                buf[c] = ids[pos]
                c += 1
            for pos in range(z, hi):
                buf[c] = ids[pos]
                c += 1
            _select(buf, m, need)
            for t in range(need):
                out_ids[i, n_above + t] = buf[t]
        else:  # the tree: a k-way merge over O(log) sorted lists
            excl[:n_above].sort()
            _tree_smallest(lo, hi, kk, ids, lev1, lev2, lev3, lev4, id_rows, id_starts, excl, n_above, ties,
                           unsorted, kinds, nodes, rows0, lens, heads, cursor)
            for t in range(need):
                out_ids[i, n_above + t] = ties[t]
