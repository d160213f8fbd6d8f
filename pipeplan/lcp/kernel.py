"""The compiled CPU query kernel (numba): one loop over the queries of a batch, no [B × C] temporaries.

Per query, with the exactness argument of lcp/index.py (S_0 ⊇ S_1 ⊇ … contiguous around the insertion
point p; d* the largest d with |S_d| >= k). Queries are visited sorted by first word, so that neighbours
read neighbouring rows and often share their ranges.

1. *Insertion point.* A first pass over the batch: a bucket table over the top bits of the first packed
   word gives the run of rows that can hold p (`starts[b] .. starts[b + 1]`: 8–16 rows), counted
   branch-free for the lower bound of the query's first word; the table entry FAR ahead and the bucket's
   lines AHEAD are prefetched, so that the misses of several queries overlap. The same pass reads the
   bounds of S_{table_tokens} (the rows sharing the query's first tokens within the table's bits) while
   the table's line is in cache. In the main loop, only a query whose first word equals a row's searches
   the run of rows sharing it on the later words — the rows at p, which the LCPs below read next, are
   prefetched AHEAD there, so they come from memory once.
2. *d\\**. The LCPs of s_{p-1} and s_p come from the XOR of their words (leading zeros ÷ bits per token);
   walking outward, LCP(q, s_{p-1-i}) = min(LCP(q, s_{p-1}), adj[p-2], …, adj[p-1-i]) and symmetrically
   on the right, so both sides are non-increasing and d* is the k-th value of their merge: k branch-free
   steps, each reading one byte of `adj`.
   Where |S_{table_tokens}| < k, d* < table_tokens: |S_d| is read off the table for each d below, and
   only S_{d*+1} (fewer than k rows) is walked on `adj` instead of k + 1 rows a side.
3. *S_{d\\*}.* Where d* <= table_tokens (d* tokens within the table's bits; rows of full length), a run
   of whole buckets: two table entries (for d* = table_tokens, read in the first pass). Else the walk
   goes on while the LCP stays >= d* (at most WALK rows per side), and the range's ends are
   binary-searched on the rows cut to d* tokens. d* = 0 needs no range: S_0 is every row.
4. *Ranking.* Rows deeper than d* + 1 (few) are sorted by the key (L − lcp) << id_bits | id; the rows at
   d* + 1 are every id of S_{d*+1} ascending (read and sorted once per run of queries sharing it: a
   bitonic network up to WIDE_NET int32 ids, else radix), less the deeper ones; the rows at d* are the
   k smallest ids of S_{d*} less those of S_{d*+1} (a merge of two ascending lists). The k smallest ids
   of S_{d*}: 0, 1, 2, … for d* = 0; for a range of at most NET int32 ids, a bitonic sorting network
   (lcp/sortnet.py); for one of at most `direct_cap` rows (default max(8k, 512)) a byte histogram that
   keeps those below the k-th and a radix sort — except where d* is the table's depth, k <= 16 and the
   group S_{d*} has its heads (lcp/engine.py, `group_heads`: its 16 smallest ids as offsets, built when
   groups hold 64-256 rows on average): then k gathers; for a wider one (k <= CAP), where d* = 1 and
   the first token's wide heads exist (lcp/engine.py, `wide_heads`: its CAP smallest ids), a copy of
   them; else a k-way merge over the truncated merge-sort tree of lcp/smallest.py (two partial blocks,
   at most two nodes per level, each sorted by id, read only as far as needed); computed once per run
   of queries sharing the range (one cache for each of the two ways, since the queries whose d* is
   shallower than their neighbours' recur between them).

Everything is int64 arithmetic on numpy views of the index's tensors; the loop runs on the calling
thread, so the kernel uses one core whatever torch's thread count is. The loop and everything it calls
are compiled without numba's runtime (`_loop`: no allocation, no atomic reference counting per query);
`topk` allocates their scratch.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.core.extending import intrinsic
from numba.cpython.unsafe.numbers import leading_zeros

from pipeplan.lcp.sortnet import INT32_MAX, sort16, sort32, sort64, sort128
from pipeplan.lcp.stores import fence, stream

BLOCK = 64  # as lcp/smallest.py: positions per leaf block
CAP = 1024  # entries per tree node: the merge answers k <= CAP
SMALL = 32  # arrays up to this size are insertion-sorted
AHEAD = 8  # queries ahead whose memory is prefetched: a query's misses overlap the ones before it
FAR = 16  # queries ahead whose bucket-table entry is prefetched (read AHEAD to prefetch the bucket)
HEAD_SPAN = 256  # as lcp/engine.py: groups of at most this many rows have heads (uint8 offsets)
NET = 32  # tie ranges of at most this many ids (int32) are sorted by a network (lcp/sortnet.py)
WIDE_NET = 128  # the ids of an S_{d*+1} of at most this many rows (int32) too (_sort_ids)
BLOCKS = 128  # rows of at least this many results are written in blocks (_emit_blocks)
STREAM = 1 << 19  # results of B · k >= this many entries (2 × 4 MiB) are written by streaming stores
WALK = 64  # rows walked beyond the k-th on each side before the range's end is searched instead
_MAX = np.iinfo(np.int64).max
_SIGN = np.uint64(1 << 63)


def _jit(fn, inline="never", nrt=True):
    """njit with an on-disk cache; in memory only when no cache directory is writable (numba raises).

    nrt=False compiles without numba's runtime: no allocation, and no reference counting of arrays —
    which numba otherwise does with atomic (lock-prefixed) instructions, full memory barriers on x86, on
    entry to and exit from every compiled callee and around inlined helpers with loops, wherever it
    cannot prove them redundant: ~30 per query in the main loop, a fifth of its `perf` samples at
    N = 1M, k = 10 (and ~8% more as calls even on arrays without an owner). numba's own sort kernels
    compile their loops the same way (`_nrt=False`, numba/misc/mergesort.py)."""
    options = {"nogil": True, "inline": inline} if nrt else {"nogil": True, "inline": inline, "_nrt": False}
    try:
        return numba.njit(cache=True, **options)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available": compile per process
        return numba.njit(**options)(fn)


def _loop(fn):
    """_jit without numba's runtime (see _jit): every function the query loop calls, which allocates nothing."""
    return _jit(fn, nrt=False)


def _inline(fn):
    """_loop, inlined into its callers: a small helper called per query, whose call would cost more than
    its work (numba passes each array as ~7 values on the stack)."""
    return _jit(fn, inline="always", nrt=False)


def _prefetch_codegen(context, builder, signature, args):
    """Emit LLVM's llvm.prefetch (read, high locality, data cache) for the element args[1:] of array args[0]."""
    array = context.make_array(signature.args[0])(context, builder, args[0])
    ptr = cgutils.get_item_pointer(context, builder, signature.args[0], array, list(args[1:]))
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
    )
    builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
    return context.get_dummy_value()


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Hint the CPU to fetch the cache line of arr[idx] (1-D)."""
    return types.void(arr, types.intp), _prefetch_codegen


@intrinsic
def _prefetch_at(typingctx, arr, row, idx):
    """_prefetch for arr[row, idx] of a 2-D array (no view of the row is made)."""
    return types.void(arr, types.intp, types.intp), _prefetch_codegen


@_inline
def _prefetch_run(arr, first, last):
    """Prefetch the cache lines of arr[first:last] (1-D), clipped to the array."""
    first, last = max(first, 0), min(last, arr.shape[0])
    step = max(64 // arr.itemsize, 1)
    for pos in range(first, last, step):
        _prefetch(arr, pos)
    if last > first:
        _prefetch(arr, last - 1)


@_loop
def _first_words(cols, starts, shift, half, qw, order, deep, out, group_lo, group_hi):
    """A first pass over the batch in `order`: out[i] = the first row whose first word is >= query i's
    (its insertion point unless rows share that word), and where `deep` != 0 the bounds of the rows
    sharing the query's first table_tokens tokens (a run of whole buckets, read while the table's line
    is in cache). The table entry of the query FAR ahead and the bucket's lines of the one AHEAD are
    prefetched, so that the misses of several queries overlap instead of queueing."""
    b, n = order.shape[0], cols.shape[1]
    for ii in range(b):
        if ii + FAR < b:
            _prefetch(starts, (qw[order[ii + FAR], 0] >> shift) + half)
        if ii + AHEAD < b:
            bucket = (qw[order[ii + AHEAD], 0] >> shift) + half
            first, last = min(np.int64(starts[bucket]), n - 1), min(np.int64(starts[bucket + 1]), n - 1)
            _prefetch_at(cols, 0, first)
            _prefetch_at(cols, 0, (first + last) >> 1)
            _prefetch_at(cols, 0, last)
        i = order[ii]
        v = qw[i, 0]
        out[i] = _first_at_least(cols, starts, shift, half, v, False)
        if deep != 0:
            group_lo[i] = starts[((v & deep) >> shift) + half]
            group_hi[i] = starts[((v | ~deep) >> shift) + half + 1]


@_inline
def _run_end(cols, lo, v):
    """The end of the run of rows from lo whose first word is v (cols[0, lo] == v), galloping: O(log run)."""
    n = cols.shape[1]
    good, bad, step = lo, lo + 1, 1  # cols[0, good] == v; the run ends in (good, bad]
    while bad < n and cols[0, bad] == v:
        good, step = bad, step << 1
        bad = min(lo + step, n)
    while bad - good > 1:
        mid = (good + bad) >> 1
        if cols[0, mid] == v:
            good = mid
        else:
            bad = mid
    return bad


@_jit
def pack_queries(q, qlen, length, bits, lo_val, hi_val, words):
    """Queries [B, L'] (token values; int64, or a narrower integer dtype as given: no int64 copy) ->
    (packed words [B, W], effective lengths [B]).

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


@_inline
def _first_at_least(cols, starts, shift, half, v, strict):
    """First sorted position whose first word is >= v (strict: > v), inside v's bucket."""
    b = (v >> shift) + half
    lo = np.int64(starts[b])
    hi = np.int64(starts[b + 1])
    low_bits = v & ((np.int64(1) << shift) - 1)
    if not strict and low_bits == 0:  # v is its bucket's smallest value
        return lo
    if strict and low_bits == (np.int64(1) << shift) - 1:  # v is its bucket's largest value
        return hi
    m = hi - lo
    if m <= SMALL:  # a bucket as built (8-16 rows): count the rows below v, with no branch to mispredict
        below = 0
        for j in range(lo, hi):
            x = cols[0, j]
            below += np.int64((x < v) | (strict & (x == v)))
        return lo + below
    while m > 1:  # a crowded bucket (duplicate first words): a binary search whose steps are selects
        step = m >> 1
        x = cols[0, lo + step]
        lo = lo + step if (x < v) | (strict & (x == v)) else lo
        m -= step
    x = cols[0, lo]
    return lo + np.int64((x < v) | (strict & (x == v)))


@_inline
def _fill_masks(masks, d, per_word, bits):
    """masks[w] keeps the first d tokens of a packed row (and the flipped top bit where any is kept)."""
    for w in range(masks.shape[0]):
        c = min(max(d - w * per_word, 0), per_word)
        masks[w] = 0 if c == 0 else -(np.int64(1) << (64 - c * bits))


@_loop
def _search(cols, starts, shift, half, lengths, has_len, qw, i, masks, short, upper):
    """First position whose row cut by `masks` is >= (upper: >) query i (qw[i]) cut the same way; a row
    whose cut equals the query's but whose length is < short counts as smaller (a proper prefix sorts
    first). Takes qw and i, not a view qw[i]: see _prefetch_at."""
    n, words = cols.shape[1], cols.shape[0]
    m0 = masks[0]
    if m0 == 0:
        return n if upper else 0
    v = qw[i, 0] & m0
    first = _first_at_least(cols, starts, shift, half, v, False)
    past = _first_at_least(cols, starts, shift, half, v | ~m0, True)
    more = has_len and short > 0
    for w in range(1, words):
        if masks[w] != 0:
            more = True
    if not more:
        return past if upper else first
    return _refine(cols, lengths, has_len, qw, i, masks, short, upper, first, past)


@_inline
def _refine(cols, lengths, has_len, qw, i, masks, short, upper, lo, hi):
    """_search inside [lo, hi), a run of rows whose cut first words equal the query's: a binary search
    on the later words (and the length)."""
    words = cols.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        c = 0
        for w in range(1, words):
            a = cols[w, mid] & masks[w]
            z = qw[i, w] & masks[w]
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


@_inline
def _point_lcps(cols, lengths, has_len, p, qw, i, ql, per_word, bits):
    """(LCP with s_{p-1}, LCP with s_p) of query i (words qw[i], length ql), within both lengths; -1
    for a row beyond either end. One helper for both: each inlined helper taking arrays costs a few
    calls of numba's reference counting, even on borrowed arrays."""
    words, n = cols.shape[0], cols.shape[1]
    cl, cr = np.int64(-1), np.int64(-1)
    for j in range(max(p - 1, 0), min(p + 1, n)):
        out = words * per_word
        for w in range(words):
            x = cols[w, j] ^ qw[i, w]
            if x != 0:
                out = w * per_word + leading_zeros(x) // bits
                break
        out = min(out, ql)
        if has_len:
            out = min(out, np.int64(lengths[j]))
        if j < p:
            cl = out
        else:
            cr = out
    return cl, cr


@_inline
def _table_depth(starts, shift, half, bits, v, top, kk):
    """(d*, lo, hi) for a query with first word v when |S_d| < kk for every d > top (top < the table's
    tokens): d* = the largest d <= top with |S_d| >= kk (0 if none: S_0 is every row), and [lo, hi) =
    S_{d*+1} read off the table (meaningful for 1 <= d* + 1 <= top; the caller handles d* + 1 beyond)."""
    lo, hi = np.int64(0), np.int64(0)
    for d in range(top, 0, -1):  # S_d = the buckets of the words sharing v's first d tokens
        keep = -(np.int64(1) << (64 - d * bits))
        a = np.int64(starts[((v & keep) >> shift) + half])
        b = np.int64(starts[((v | ~keep) >> shift) + half + 1])
        if b - a >= kk:
            return d, lo, hi
        lo, hi = a, b
    return 0, lo, hi


@_loop
def _sort(a, m, tmp, counts):
    """Sort a[:m] (non-negative int64) in place: insertion sort up to SMALL, else an LSD radix sort by
    bytes of value − min, skipping bytes all values share (no data-dependent branches to mispredict)."""
    if m <= SMALL:
        for i in range(1, m):
            v, j = a[i], i - 1
            while j >= 0 and a[j] > v:
                a[j + 1] = a[j]
                j -= 1
            a[j + 1] = v
        return
    low, high = a[0], a[0]
    for i in range(1, m):
        low, high = min(low, a[i]), max(high, a[i])
    src, dst, flipped, shift = a, tmp, False, 0
    while ((high - low) >> shift) > 0:
        for b in range(256):
            counts[b] = 0
        for i in range(m):
            counts[((src[i] - low) >> shift) & 255] += 1
        if counts[((src[0] - low) >> shift) & 255] < m:  # else every value has this byte: nothing to move
            total = 0
            for b in range(256):
                c = counts[b]
                counts[b] = total
                total += c
            for i in range(m):
                v = src[i]
                d = ((v - low) >> shift) & 255
                dst[counts[d]] = v
                counts[d] += 1
            src, dst, flipped = dst, src, not flipped
        shift += 8
    if flipped:
        for i in range(m):
            a[i] = tmp[i]


@_inline
def _network(net, m):
    """Sort net[:m] (int32, m <= WIDE_NET) by the smallest bitonic network that holds it (16, 32, 64 or
    128 lanes), the lanes past m padded with INT32_MAX."""
    lanes = 16 if m <= 16 else (32 if m <= 32 else (64 if m <= 64 else WIDE_NET))
    for t in range(m, lanes):
        net[t] = INT32_MAX
    if lanes == 16:
        sort16(net)
    elif lanes == 32:
        sort32(net)
    elif lanes == 64:
        sort64(net)
    else:
        sort128(net)


@_loop
def _sort_ids(a, m, tmp, counts, net, narrow):
    """_sort for ids: 9 to WIDE_NET int32 ids (`narrow`: N < 2^31) padded to 16, 32, 64 or 128 lanes and
    sorted by a bitonic network (no branch on the ids; the ~76 ids of S_2 that every k = 100 or 1000
    query at N = 5M sorts: 1.0 against 2.1 µs per k = 100 query), else _sort."""
    if not narrow or m > WIDE_NET or m <= 8:
        _sort(a, m, tmp, counts)
        return
    for t in range(m):
        net[t] = a[t]
    _network(net, m)
    for t in range(m):
        a[t] = net[t]


@_loop
def _smallest(a, m, count, tmp, counts):
    """Put the `count` smallest of a[:m] (distinct, non-negative) in a[:count], ascending."""
    low, high = a[0], a[0]
    for i in range(1, m):
        low, high = min(low, a[i]), max(high, a[i])
    _select(a, m, count, low, high, tmp, counts)


@_loop
def _select(a, m, count, low, high, tmp, counts):
    """_smallest with the minimum and maximum of a[:m] already known (read along with the values).

    Well above count, a histogram of the top byte of value − low finds the byte below which the count
    smallest lie; only those are kept (a branch-free filter) and sorted. No step's branch depends on
    the order of the values, which matters for small counts too: keeping a sorted list of the count
    smallest while reading mispredicts on each of its ~count · (1 + ln(m / count)) insertions."""
    if m <= 2 * count:
        _sort(a, m, tmp, counts)
        return
    span = high - low
    shift = max(64 - leading_zeros(span | 1) - 8, 0)  # (high - low) >> shift <= 255
    for b in range(256):
        counts[b] = 0
    for i in range(m):
        counts[(a[i] - low) >> shift] += 1
    below, b = 0, 0
    while below + counts[b] < count:
        below += counts[b]
        b += 1
    limit = (b + 1) << shift  # every value with value - low < limit, and no other, is kept
    kept = 0
    for i in range(m):
        tmp[kept] = a[i]
        kept += np.int64(a[i] - low < limit)
    for i in range(kept):
        a[i] = tmp[i]
    _sort(a, kept, tmp, counts)


@_inline
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


@_loop
def _tree_smallest(lo, hi, count, ids, lev1, lev2, lev3, lev4, id_rows, id_starts, out, unsorted,
                   kinds, nodes, rows0, lens, heads, cursor, tmp, counts):
    """out[:count] = the `count` smallest ids of [lo, hi) (hi - lo >= count), ascending.

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
    for li in range(1, n_lists):  # the first entry of every list: their misses overlap the blocks' sort
        kind, node = kinds[li], nodes[li]
        if kind == 1:
            _prefetch_at(lev1, node, 0)
        elif kind == 2:
            _prefetch_at(lev2, node, 0)
        elif kind == 3:
            _prefetch_at(lev3, node, 0)
        elif kind == 4:
            _prefetch_at(lev4, node, 0)
        else:
            _prefetch_at(id_rows, rows0[li] + node, 0)
    head = min(count, nu)  # of the partial and whole blocks' ids, only the count smallest can be taken
    if nu > 0:
        _smallest(unsorted, nu, head, tmp, counts)
    kinds[0], nodes[0], rows0[0], lens[0] = 0, 0, 0, head
    for li in range(n_lists):
        cursor[li] = 0
        heads[li] = _tree_value(kinds[li], nodes[li], 0, ids, lev1, lev2, lev3, lev4, id_rows, rows0[li],
                                unsorted) if lens[li] > 0 else _MAX
    got = 0
    while got < count:
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
        out[got] = best
        got += 1


@_loop
def _direct_smallest(ids, lo, hi, count, out, buf, tmp, counts, net):
    """out[:count] = the count smallest ids of [lo, hi), ascending, read directly. At most NET ids of
    an int32 index (N < 2^31): padded to 16 or 32 lanes and sorted by a bitonic network (lcp/sortnet.py;
    no branch on the ids — the group of ~15 rows that every k = 10 query at N = 1M selects from); else
    into buf and selected (_select): buf and tmp hold at least hi - lo values (the caller sees to it)."""
    m = hi - lo
    if m <= NET and ids.itemsize == 4:
        for t in range(m):
            net[t] = ids[lo + t]
        _network(net, m)
        for t in range(count):
            out[t] = net[t]
        return
    low, high = _MAX, np.int64(0)  # their extremes, for the histogram
    for pos in range(lo, hi):
        v = np.int64(ids[pos])
        buf[pos - lo] = v
        low, high = min(low, v), max(high, v)
    _select(buf, m, count, low, high, tmp, counts)
    for t in range(count):
        out[t] = buf[t]


@_inline
def _put(out, row, start, src, first, count, streamed):
    """out[row, start:start + count] = src[first:first + count]: a block copy (streaming stores where
    `streamed`: results beyond the caches, lcp/stores.py)."""
    if streamed:
        for t in range(count):
            stream(out, row, start + t, src[first + t])
    else:
        for t in range(count):
            out[row, start + t] = src[first + t]


@_inline
def _fill(out, row, start, stop, value, streamed):
    """out[row, start:stop] = value (streaming stores where `streamed`)."""
    if streamed:
        for t in range(start, stop):
            stream(out, row, t, value)
    else:
        for t in range(start, stop):
            out[row, t] = value


@_inline
def _count_up(out, row, start, stop, value, streamed):
    """out[row, t] = value + t − start for t in [start, stop): a run of consecutive ids."""
    if streamed:
        for t in range(start, stop):
            stream(out, row, t, value + (t - start))
    else:
        for t in range(start, stop):
            out[row, t] = value + (t - start)


@_inline
def _emit(src, m, skip, n_skip, out, row, start, stop, mode):
    """out[row, start:stop] = the first values of src[:m] not in skip[:n_skip] (both ascending, distinct):
    a merge step per value for short rows (mode 0: k < BLOCKS), else _emit_blocks (mode 2: streaming)."""
    if mode != 0:
        _emit_blocks(src, m, skip, n_skip, out, row, start, stop, mode == 2)
        return
    e, t = 0, start
    for c in range(m):
        if t == stop:
            break
        v = src[c]
        while e < n_skip and skip[e] < v:
            e += 1
        if e < n_skip and skip[e] == v:
            continue
        out[row, t] = v
        t += 1


@_loop
def _emit_blocks(src, m, skip, n_skip, out, row, start, stop, streamed):
    """_emit for long rows: block copies between the skipped values that fall among src's first values,
    each found by galloping from the last (O(log gap)) — at k = 1000 the ~1,000 ids of a row are a few
    block copies, not a merge step (three branches) per value; skipped values beyond src[m - 1] end the
    search. Not inlined: its setup would cost more than the merge for k = 10's few values (and its code
    would crowd the loop's)."""
    c, t = 0, start
    for e in range(n_skip):
        if t >= stop or c >= m:
            return
        v = skip[e]
        if v > src[m - 1]:
            break
        if v < src[c]:
            continue
        j = c  # the first position >= c whose value is >= v (exists: src[m - 1] >= v)
        if src[c] < v:
            lo, step = c, 1  # src[lo] < v <= src[hi]
            hi = min(c + 1, m - 1)
            while src[hi] < v:
                lo, step = hi, step << 1
                hi = min(c + step, m - 1)
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if src[mid] < v:
                    lo = mid
                else:
                    hi = mid
            j = hi
        count = min(j - c, stop - t)
        _put(out, row, t, src, c, count, streamed)
        t += count
        c = j + np.int64(src[j] == v)
    _put(out, row, t, src, c, max(min(m - c, stop - t), 0), streamed)


@_inline
def _emit_range(skip, n_skip, out, row, start, stop, mode):
    """out[row, start:stop] = the first values of 0, 1, 2, … not in skip[:n_skip] (ascending, distinct):
    a merge step per value for short rows (mode 0), else _range_blocks."""
    if mode != 0:
        _range_blocks(skip, n_skip, out, row, start, stop, mode == 2)
        return
    e, v = 0, 0
    for t in range(start, stop):
        while e < n_skip and skip[e] <= v:
            if skip[e] == v:
                v += 1
            e += 1
        out[row, t] = v
        v += 1


@_loop
def _range_blocks(skip, n_skip, out, row, start, stop, streamed):
    """_emit_range for long rows: runs of consecutive ids between the skipped ones."""
    v, t = np.int64(0), start
    for e in range(n_skip):
        if t >= stop:
            return
        s = skip[e]
        if s < v:
            continue
        count = min(s - v, stop - t)
        _count_up(out, row, t, t + count, v, streamed)
        t += count
        v = s + 1
    _count_up(out, row, t, stop, v, streamed)


@_jit
def topk(cols, ids, adj, lengths, has_len, length, per_word, bits, starts, shift, half,
         lev1, lev2, lev3, lev4, id_rows, id_starts, direct_cap, table_tokens, group_heads, head_shift, head_half,
         wide_heads, wide_shift, wide_half, qw, qlen, order, k, out_lcps, out_ids):
    """Fill out_lcps / out_ids [B, k] with each query's exact top-k (-1 past min(k, N)).

    Queries are visited in `order` (sorted by first word: neighbours in the sorted rows, so that the
    searches share cache lines and consecutive queries often share their tie range, whose smallest ids
    are then computed once). The scratch arrays are allocated here; the loop (`_answer`) allocates
    nothing (it is compiled without numba's runtime: _jit), and returns early where a tie range needs
    more scratch than it has (k > CAP, or a direct_cap wider than max(8k, 512)), to go on with more."""
    kk, b, words = min(k, cols.shape[1]), qw.shape[0], cols.shape[0]
    per_k = np.empty((7, kk + 1), np.int64)  # left_lcp, right_lcp, keys, cached, wide, above, inner
    per_query = np.empty((3, b), np.int64)  # points, group_lo, group_hi (S_{table_tokens})
    lists = np.empty((6, 2 * (6 + id_starts.shape[0]) + 1), np.int64)  # the tree merge's lists
    select = np.empty((2, max(8 * kk, 512)), np.int64)  # a tie range's ids and the radix sort's other half
    small = np.empty((2, 4 * BLOCK), np.int64)  # byte counts (256), the tree's partial blocks' ids
    word_masks = np.empty((2, words), np.int64)  # a prefix's masks, all-ones masks
    net = np.empty(WIDE_NET, np.int32)  # a small tie range's ids (or S_{d*+1}'s), sorted by a network
    deep = -(np.int64(1) << (64 - table_tokens * bits)) if table_tokens > 0 else np.int64(0)
    # rows of >= BLOCKS results are written in blocks; results beyond the caches by streaming stores
    mode = 0 if kk < BLOCKS else (2 if b * kk >= STREAM else 1)
    _first_words(cols, starts, shift, half, qw, order, deep, per_query[0], per_query[1], per_query[2])
    start = 0
    while start < b:
        start, need = _answer(cols, ids, adj, lengths, has_len, length, per_word, bits, starts, shift, half,
                              lev1, lev2, lev3, lev4, id_rows, id_starts, direct_cap, table_tokens, group_heads,
                              head_shift, head_half, wide_heads, wide_shift, wide_half, qw, qlen, order, k,
                              out_lcps, out_ids,
                              per_k, per_query, lists, select, small, word_masks, net, start, mode)
        if start < b:  # query order[start] reads a longer tie range than `select` holds
            select = np.empty((2, need), np.int64)
    fence()  # the streaming stores, ordered before the caller reads the results


@_loop
def _answer(cols, ids, adj, lengths, has_len, length, per_word, bits, starts, shift, half,
            lev1, lev2, lev3, lev4, id_rows, id_starts, direct_cap, table_tokens, group_heads, head_shift,
            head_half, wide_heads, wide_shift, wide_half, qw, qlen, order, k, out_lcps, out_ids, per_k, per_query,
            lists, select, small, word_masks, net, start, mode):
    """topk's loop over the queries order[start:]; returns (B, 0) when done, else (ii, m) where query
    order[ii] needs `select` to hold m values (it is answered again, whole, by the next call)."""
    n, words = cols.shape[1], cols.shape[0]
    kk = min(k, n)
    left_lcp, right_lcp = per_k[0], per_k[1]  # LCPs of the nearest rows on either side of the point
    keys = per_k[2]
    masks, full = word_masks[0], word_masks[1]
    full[:] = -1
    buf, tmp = select[0], select[1]  # a tie range's ids, the radix sort's other half
    counts, unsorted = small[0], small[1]
    kinds, nodes, rows0, lens, heads, cursor = lists[0], lists[1], lists[2], lists[3], lists[4], lists[5]
    cap = direct_cap if direct_cap >= 0 else max(8 * kk, 512)
    id_bits = 1
    while (np.int64(1) << id_bits) < n:  # keys (L - lcp) << id_bits | id: shifts, not divisions by N
        id_bits += 1
    id_mask = (np.int64(1) << id_bits) - 1
    cached = per_k[3]  # the smallest ids of the last tie range: queries in `order` share it
    cached_lo, cached_hi = -1, -1
    wide = per_k[4]  # the same for the last range answered by the tree: queries sharing a
    wide_lo, wide_hi = -1, -1  # shorter prefix (d* below the others') recur among them in `order`
    above = per_k[5]  # every id of the last S_{d*+1}, ascending
    above_lo, above_hi = -1, -1
    inner = per_k[6]  # ids of the rows deeper than d* + 1, ascending
    points, group_lo, group_hi = per_query[0], per_query[1], per_query[2]  # S_{table_tokens} per query
    refine = words > 1 or has_len  # rows sharing a query's first word are told apart by later words
    for ii in range(start, order.shape[0]):
        # memory of a later query, AHEAD: the rows at its point (the search on later words and the two
        # LCPs read them), the adjacent LCPs the walks read and the ids of S_{table_tokens} (which holds
        # every tie range of d* >= table_tokens) near the point, else those within WALK rows
        if ii + AHEAD < order.shape[0]:
            j = order[ii + AHEAD]
            ahead = max(points[j] - 1, 0)
            for w in range(words):
                _prefetch_at(cols, w, ahead)
                _prefetch_at(cols, w, min(ahead + 1, n - 1))
            if has_len:
                _prefetch(lengths, ahead)
            reach = kk + 1 if table_tokens > 0 else kk + WALK
            if table_tokens > 0 and group_hi[j] - group_lo[j] < kk:  # as a rule its S_{d*+1}: walked alone
                _prefetch_run(adj, max(ahead - reach, group_lo[j]), min(ahead + reach + 1, group_hi[j]))
            else:
                _prefetch_run(adj, ahead - reach, ahead + reach + 1)
            first, last = ahead - WALK, ahead + WALK + 1
            if table_tokens > 0:
                first, last = max(first, group_lo[j]), min(last, group_hi[j])
            _prefetch_run(ids, first, last)
            if group_heads.shape[0] > 0:
                _prefetch_at(group_heads, (qw[j, 0] >> head_shift) + head_half, 0)
        i = order[ii]
        ql, p = qlen[i], points[i]
        if refine and p < n and cols[0, p] == qw[i, 0]:  # rows share the first word: search their run
            p = _refine(cols, lengths, has_len, qw, i, full, ql, False, p, _run_end(cols, p, qw[i, 0]))
        cl, cr = _point_lcps(cols, lengths, has_len, p, qw, i, ql, per_word, bits)
        last = adj.shape[0] - 1
        if table_tokens > 0 and (ql < table_tokens or group_hi[i] - group_lo[i] < kk):
            # |S_{table_tokens}| < kk, so d* < table_tokens: |S_d| for each d below is two table entries,
            # and the rows above d* are S_{d*+1}, a run of whole buckets too (fewer than kk rows): their
            # LCPs are walked over that run only, not over kk + 1 rows a side (k = 1000 at N = 100k-5M)
            d, lo, hi = _table_depth(starts, shift, half, bits, qw[i, 0], min(table_tokens - 1, ql), kk)
            if d + 1 > ql:  # S_{d*+1} is empty: no row shares more tokens than the query has
                lo, hi = p, p
            elif d + 1 == table_tokens:
                lo, hi = group_lo[i], group_hi[i]
            gt_l, gt_r = p - lo, hi - p
            v = cl
            for t in range(gt_l):
                left_lcp[t] = v
                v = min(v, np.int64(adj[p - 2 - t])) if t < gt_l - 1 else v
            v = cr
            for t in range(gt_r):
                right_lcp[t] = v
                v = min(v, np.int64(adj[p + t])) if t < gt_r - 1 else v
            nl, nr = 0, 0  # unused: S_{d*} is read off the table (d* < table_tokens) or is every row
        else:
            # the LCPs of the kk + 1 nearest rows on either side: running minima of adj, one chain of
            # independent loads per side (a merge that alternates sides makes each load wait for the last)
            v = cl
            for t in range(kk + 1):
                left_lcp[t] = v
                v = min(v, np.int64(adj[max(p - 2 - t, 0)])) if p - 2 - t >= 0 else -1
            v = cr
            for t in range(kk + 1):
                right_lcp[t] = v
                v = min(v, np.int64(adj[min(p + t, last)])) if p + t + 1 < n else -1
            # d* = the kk-th largest of the two non-increasing lists = max over the i taken from the left
            # of min(left[i - 1], right[kk - i - 1]); then how many of the kk each side gives: every row
            # above d*, and of those at d* the left ones first (the merge's order, which the walks follow)
            d = max(left_lcp[kk - 1], right_lcp[kk - 1])
            for t in range(1, kk):
                d = max(d, min(left_lcp[t - 1], right_lcp[kk - t - 1]))
            gt_l, gt_r, eq_l = 0, 0, 0  # rows above d* on each side, rows at d* on the left
            for t in range(kk):
                gt_l += np.int64(left_lcp[t] > d)
                gt_r += np.int64(right_lcp[t] > d)
                eq_l += np.int64(left_lcp[t] == d)
            nl = gt_l + min(eq_l, kk - gt_l - gt_r)
            nr = kk - nl
            cl, cr = left_lcp[nl], right_lcp[nr]  # the LCPs of the next row on either side
        in_l, in_r = 0, 0  # rows above d* + 1
        while in_l < gt_l and left_lcp[in_l] > d + 1:
            in_l += 1
        while in_r < gt_r and right_lcp[in_r] > d + 1:
            in_r += 1
        n_above, n_in = gt_l + gt_r, in_l + in_r
        _fill(out_lcps, i, kk, k, -1, mode == 2)  # past min(k, N)
        _fill(out_ids, i, kk, k, -1, mode == 2)
        # 1. rows deeper than d* + 1 (few, as a rule): by the key (L - lcp) << id_bits | id
        for t in range(in_l):
            keys[t] = ((length - left_lcp[t]) << id_bits) | ids[p - 1 - t]
        for t in range(in_r):
            keys[in_l + t] = ((length - right_lcp[t]) << id_bits) | ids[p + t]
        if n_in > 1:  # (a call is not free: skipped for the usual 0 or 1)
            _sort(keys, n_in, tmp, counts)
        for t in range(n_in):
            out_lcps[i, t] = length - (keys[t] >> id_bits)
            out_ids[i, t] = inner[t] = keys[t] & id_mask
        if n_in > 1:
            _sort(inner, n_in, tmp, counts)
        # 2. rows at d* + 1: every id of S_{d*+1} = [p - gt_l, p + gt_r) ascending, less those of step 1
        if n_above > 0:
            if p - gt_l != above_lo or p + gt_r != above_hi:  # neighbouring queries often share it
                above_lo, above_hi = p - gt_l, p + gt_r
                for pos in range(above_lo, above_hi):
                    above[pos - above_lo] = ids[pos]
                if n_above > 1:
                    _sort_ids(above, n_above, tmp, counts, net, ids.itemsize == 4)
            _emit(above, n_above, inner, n_in, out_ids, i, n_in, n_above, mode)
        _fill(out_lcps, i, n_in, n_above, d + 1, mode == 2)
        _fill(out_lcps, i, n_above, kk, d, mode == 2)
        # 3. rows at d*: the smallest ids of S_{d*}, less those of S_{d*+1}
        if d == 0:  # S_0 is every row: ids 0, 1, 2, ...
            _emit_range(above, n_above, out_ids, i, n_above, kk, mode)
            continue
        # S_{d*} = [lo, hi): read off the bucket table when d* tokens lie within its bits, else walk on
        # while the LCP stays >= d*, else search the rows cut to d* tokens
        if d == table_tokens:  # the rows whose first d* tokens are the query's: read in the first pass
            lo, hi = group_lo[i], group_hi[i]
        elif d < table_tokens:  # a run of whole buckets
            keep = -(np.int64(1) << (64 - d * bits))
            lo = np.int64(starts[((qw[i, 0] & keep) >> shift) + half])
            hi = np.int64(starts[((qw[i, 0] | ~keep) >> shift) + half + 1])
        else:
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
                    lo = _search(cols, starts, shift, half, lengths, has_len, qw, i, masks, d, False)
                if cr >= d:
                    hi = _search(cols, starts, shift, half, lengths, has_len, qw, i, masks, d, True)
        direct = hi - lo <= cap or kk > CAP  # read the range's ids, else the tree
        if direct and (lo != cached_lo or hi != cached_hi):  # the kk smallest ids of [lo, hi), ascending
            cached_lo, cached_hi = lo, hi
            if d == table_tokens and kk <= group_heads.shape[1] and hi - lo <= HEAD_SPAN and group_heads.shape[0] > 0:
                g = (qw[i, 0] >> head_shift) + head_half  # [lo, hi) is this group: its heads, kk gathers
                for t in range(kk):
                    cached[t] = np.int64(ids[lo + np.int64(group_heads[g, t])])
                _emit(cached, kk, above, n_above, out_ids, i, n_above, kk, mode)
                continue
            if hi - lo > buf.shape[0] and not (hi - lo <= NET and ids.itemsize == 4):
                return ii, hi - lo  # more scratch first (topk), then this query again from its start
            _direct_smallest(ids, lo, hi, kk, cached, buf, tmp, counts, net)
        elif not direct and (lo != wide_lo or hi != wide_hi):  # a k-way merge over O(log) sorted lists
            wide_lo, wide_hi = lo, hi
            if d == 1 and wide_heads.shape[0] > 0:  # S_1 = the rows starting with the query's first token:
                g = (qw[i, 0] >> wide_shift) + wide_half  # its WIDE (= CAP >= kk) smallest ids, stored
                for t in range(kk):
                    wide[t] = np.int64(wide_heads[g, t])
            else:
                _tree_smallest(lo, hi, kk, ids, lev1, lev2, lev3, lev4, id_rows, id_starts, wide,
                               unsorted, kinds, nodes, rows0, lens, heads, cursor, tmp, counts)
        if direct:
            _emit(cached, kk, above, n_above, out_ids, i, n_above, kk, mode)
        else:
            _emit(wide, kk, above, n_above, out_ids, i, n_above, kk, mode)
    return order.shape[0], 0
