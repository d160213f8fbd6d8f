"""Bytes a query touches in memory, as a model: cache lines of 64 bytes the algorithm must bring in.

Not a hardware counter (none is readable in this VM): each method's reads are counted from what it
does per query, with the per-query ranges the index reports (`LCPIndex.explain`), so that latency can be
set against the measured bandwidth (lcp/bandwidth.py). A binary search over an array of N entries costs
ceil(log2 N) - 2 lines (its last probes share a line); a contiguous run of b bytes costs ceil(b/64) + 1.
"""

from __future__ import annotations

import math

import torch

from pipeplan.lcp.index import LCPIndex
from pipeplan.lcp.smallest import BLOCK
from pipeplan.lcp.tokens import prepare_queries

LINE = 64


def _run(nbytes: torch.Tensor | float) -> torch.Tensor | float:
    """Lines of a contiguous run of `nbytes` bytes at an arbitrary offset."""
    if isinstance(nbytes, torch.Tensor):
        return torch.where(nbytes > 0, torch.ceil(nbytes / LINE) + 1, 0)
    return math.ceil(nbytes / LINE) + 1 if nbytes > 0 else 0


def _search(n: int) -> int:
    return max(1, math.ceil(math.log2(max(n, 2))) - 2)


def index_bytes(index: LCPIndex, queries: torch.Tensor, k: int) -> float:
    """Mean bytes per query for LCPIndex.topk(queries, k) through its torch ops."""
    n, w, kk = index.n, index.fmt.words, min(k, index.n)
    at = index.explain(queries, kk)
    size = (at.hi - at.lo).double().cpu()
    lines = _search(n) + 2 * w + 2 * _run((kk - 1) * index.adj.element_size())  # insertion, 2 rows, window
    lines = lines + at.searched.double().cpu() * 2 * _search(n)  # S_{d*} bounds beyond the window
    lines = lines + _run((at.gt_l + at.gt_r).double().cpu() * index.ids.element_size())  # ids of S_{d*+1}
    direct = _run(size * index.ids.element_size())
    return float((lines + torch.minimum(direct, _tree_lines(index, size, kk))).mean()) * LINE


def kernel_bytes(index: LCPIndex, queries: torch.Tensor, k: int) -> float:
    """Mean bytes per query for LCPIndex.topk through the compiled kernel (lcp/kernel.py).

    The bucket table's entry and the bucket's first words replace the binary search; where d* is within
    the table's depth (`engine.table_tokens`) S_{d*} is two more table entries and adj is read only
    over the window of d* (k + 1 entries) — below that depth only over S_{d*+1} (< k entries) — else
    adj is walked on to the ends of S_{d*} (at most WALK rows a side, else two bucket searches); the
    ids of S_{d*+1}; the ids of S_{d*} read directly up to the kernel's direct cap, else the tree as
    for the torch path, plus the group heads' line where they answer; nothing for d* = 0 (the ids are
    0, 1, 2, ...).
    The kernel visits queries in `engine.visiting_order` and reads a range shared with the query
    before it once: the model counts it once too.
    """
    from pipeplan.lcp.engine import HEAD_SPAN, HEADS, bucket_bits, table_entry_bytes, table_tokens, visiting_order
    from pipeplan.lcp.kernel import CAP, WALK

    n, w, kk = index.n, index.fmt.words, min(k, index.n)
    at = index.explain(queries, kk)
    size = (at.hi - at.lo).double().cpu()
    d = at.d.cpu()
    bits = bucket_bits(n)
    search = 1 + _run(n / 2**bits * 8)  # a table entry, then the bucket's first words
    depth = table_tokens(n, index.fmt.bits, index.lengths is not None)
    tabled = (d >= 1) & (d <= depth)
    # the two entries bounding S_{d*}: 2^(bits - d*·token bits) entries apart
    apart = (2.0 ** (bits - d.clamp(max=max(depth, 0)) * index.fmt.bits)) * table_entry_bytes(n)
    entries = torch.where(apart < LINE, 1.0, 2.0)
    # d* below the table's depth (|S_depth| < k): adj only over S_{d*+1}, fewer than k rows
    shallow = (d < depth) if depth > 0 else torch.zeros_like(tabled)
    above = (at.gt_l + at.gt_r).double().cpu()
    walked = torch.where(shallow, above, torch.where(tabled, float(kk + 1), torch.clamp(size, max=kk + 2 * WALK)))
    lines = search + 2 * w + _run(walked * index.adj.element_size())
    # the ends of S_{d*}, searched (none at d* = 0: the kernel answers ids 0, 1, 2, ... without a search)
    searched = ((size > kk + 2 * WALK) & ~tabled & (d > 0)).double() * 2 * search
    lines = lines + torch.where(tabled, entries, searched)
    words, _ = prepare_queries(queries, None, index.fmt, torch.device("cpu"))
    order = torch.from_numpy(visiting_order(words[:, 0].numpy()))  # the kernel's visiting order
    above_lo, above_hi = (at.p - at.gt_l).cpu(), (at.p + at.gt_r).cpu()
    lines = lines + _run(above * index.ids.element_size()) * _first_of_runs(
        order, above_lo, above_hi
    )  # the ids of S_{d*+1}
    cap = max(8 * kk, 512) if index.direct_cap is None else index.direct_cap
    direct = _run(size * index.ids.element_size())
    ties = torch.where((size <= cap) | (kk > CAP), direct, _tree_lines(index, size, kk))
    heads = index._engine is not None and index._engine.heads.shape[0] > 0
    if heads:  # the group heads' line (the group's ids are still read: prefetched whole)
        ties = ties + ((d == depth) & (size <= HEAD_SPAN) & (kk <= HEADS)).double()
    ties = torch.where(d == 0, 0.0, ties) * _first_of_runs(order, at.lo.cpu(), at.hi.cpu())
    return float((lines + ties).mean()) * LINE


def _first_of_runs(order: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """1.0 for a query whose range [lo, hi) differs from the one visited before it in `order`, else 0.0."""
    lo_o, hi_o = lo[order], hi[order]
    new = torch.ones_like(lo_o, dtype=torch.float64)
    new[1:] = ((lo_o[1:] != lo_o[:-1]) | (hi_o[1:] != hi_o[:-1])).double()
    out = torch.empty_like(new)
    out[order] = new
    return out


def _tree_lines(index: LCPIndex, size: torch.Tensor, kk: int) -> torch.Tensor:
    """Lines the tree's read of a range of `size` positions brings in: two partial blocks, then up to two
    nodes per level (their first min(kk, stored) entries, and for offset levels the ids they point at)."""
    tree = torch.full_like(size, float(2 * _run((BLOCK - 1) * 4)))
    levels = torch.floor(torch.log2(torch.clamp(size / BLOCK, min=1))).long() + 1
    span = BLOCK
    for j, level in enumerate(index.tree.levels[: int(levels.max()) if len(levels) else 0]):
        used = (levels > j).double()
        if level is None:
            cost = 2 * _run(BLOCK * 4)
        else:
            m = min(kk, level.shape[1])
            cost = 2 * _run(m * level.element_size())
            if not index.tree.holds_ids[j]:  # offsets: ids gathered within the node's span
                cost += 2 * min(m, span * 4 // LINE)
        tree += used * cost
        span *= 2
    return tree


def numpy_bytes(n: int, row_bytes: int, k: int, tie_sizes: torch.Tensor) -> float:
    """Mean bytes per query for NumpySorted: three searches, 2k rows and ids, the tie range's ids."""
    kk = min(k, n)
    per_probe = _run(row_bytes) - 1
    lines = 3 * _search(n) * per_probe + _run(2 * kk * row_bytes) + _run(2 * kk * 8)
    return float((lines + _run(tie_sizes.double() * 8)).mean()) * LINE


def scan_bytes(n: int, words: int) -> float:
    """The full scan reads every packed row (word 0 of all, more words for the few rows that tie)."""
    return float(n * words * 8)
