"""The GPU engine of `LCPIndex`: one Triton kernel answers a whole batch (one program per query), on the
index's own layout (column-major packed rows, ids, lengths, lcp/smallest.py's tree) with the same answers
as the CPU kernel and the torch ops.

Per query (the exactness argument of lcp/index.py: S_0 ⊇ S_1 ⊇ … contiguous ranges of the sorted rows):

1. *d\\** by binary search on d in [0, min(query length, L)]: |S_d| = upper - lower, two binary searches
   over the rows cut to d tokens (a row cut-equal to the query but shorter than d counts as smaller, as
   in LCPIndex._search), largest d with |S_d| >= k. S_{d*} = [lo0, hi0) and S_{d*+1} = [lo1, hi1) come
   with it. No `adj` walk: O(log L · log N · W) scalar steps, no per-query branch on data size.
2. *Rows above d\\** (fewer than k): their LCPs from the XOR of their words, ranked by one score
   (lcp · (N + 1) + N − 1 − id, lcp/ranking.py) with `tl.sort`.
3. *Ties*: the k' smallest ids of [lo0, lo1) ∪ [hi1, hi0). A binary search on the id value t counts the
   ids below t over the tree's decomposition of each range (partial blocks read directly, at most two
   nodes per level, each node's stored ascending entries compared as one vector; a node truncated to
   CAP entries is exact for k' <= CAP); the ids below the k'-th are then copied out of each piece into a
   per-query scratch row, sorted, and written after the rows above.

One launch per batch, no host sync (nothing is read back before the results); k <= CAP (1,024) — larger
k, and a batch whose scratch would not fit, take the torch ops. Triton is optional (it ships with CUDA
builds of torch); `TRITON_INTERPRET=1` runs the same kernel on CPU tensors through Triton's interpreter,
which is how tests/test_lcp_triton.py checks it against brute force without a GPU.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from pipeplan.lcp.ranking import LCPTopK
from pipeplan.lcp.smallest import CAP

if TYPE_CHECKING:
    from pipeplan.lcp.index import LCPIndex

NODE = CAP  # entries of a query's scratch row (the tie candidates below the k'-th id)


@functools.cache
def triton_module() -> ModuleType | None:
    """triton, or None when it is not installed."""
    try:
        import triton
    except ImportError:
        return None
    return triton


@functools.cache
def _kernel(interpret: bool) -> Any:
    """lcp/gpu_kernel.py's kernel, imported on first use (one per mode: Triton decides at decoration time
    whether a function is interpreted)."""
    del interpret  # the cache key only
    from pipeplan.lcp import gpu_kernel

    return gpu_kernel.topk_kernel


def runs_on(device: torch.device) -> bool:
    """Whether the Triton kernel can run on `device`: triton importable, and CUDA (or the CPU under
    TRITON_INTERPRET=1, Triton's interpreter)."""
    if triton_module() is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def _arrays(index: LCPIndex) -> tuple[torch.Tensor, ...]:
    """The tree's offset levels 1-4, its id table and level starts, and the lengths, as the kernel takes them
    (a one-element stand-in for what this index lacks); made once per index, so that a batch copies
    nothing from the host."""
    if index._gpu_arrays is not None:
        return index._gpu_arrays
    tree, dev = index.tree, index.device
    dummy = torch.zeros(1, dtype=torch.int16, device=dev)
    levels = [tree.levels[j] if j < len(tree.levels) else None for j in range(1, 5)]
    lev = [t if t is not None and t.numel() else dummy for t in levels]
    id_rows = tree.id_rows if tree.id_rows.numel() else torch.zeros((1, CAP), dtype=index.ids.dtype, device=dev)
    id_starts = torch.tensor(tree.id_row_starts or [0], dtype=torch.int64, device=dev)
    lens = index.lengths if index.lengths is not None else dummy
    held = (*lev, id_rows, id_starts, lens)
    index._gpu_arrays = held
    return held


def topk(index: LCPIndex, qw: torch.Tensor, qlen: torch.Tensor, k: int) -> LCPTopK:
    """LCPTopK [B, k] of packed queries (words [B, W] and cut lengths [B], lcp/tokens.prepare_queries) in one
    kernel launch; k <= CAP."""
    dev = index.device
    b, n = qw.shape[0], index.n
    lcps = torch.empty((b, k), dtype=torch.int64, device=dev)
    ids = torch.empty((b, k), dtype=torch.int64, device=dev)
    if b == 0:
        return LCPTopK(lcps, ids)
    lev1, lev2, lev3, lev4, id_rows, id_starts, lens = _arrays(index)
    scratch = torch.empty((b, NODE), dtype=torch.int64, device=dev)
    kk = min(k, n)
    kb = max(16, 1 << (kk - 1).bit_length())
    fmt = index.fmt
    _kernel(os.environ.get("TRITON_INTERPRET") == "1")[(b,)](
        index.cols, lens, index.ids, lev1, lev2, lev3, lev4, id_rows, id_starts,
        qw.contiguous(), qlen.contiguous(), scratch, lcps, ids,
        n, fmt.words, fmt.length, k, kk,
        T=fmt.per_word, bits=fmt.bits, HAS_LENS=index.lengths is not None, KB=kb,
    )  # fmt: skip
    return LCPTopK(lcps, ids)
