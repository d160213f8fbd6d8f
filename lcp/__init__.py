"""Exact, deterministic top-k retrieval by longest common prefix on torch tensors (CPU or CUDA).

    from lcp import LCPIndex
    index = LCPIndex.build(seqs)                  # seqs: integer tensor [N, L]; lengths=[N] optional
    ids, lcps = index.topk(queries, k=10)         # [B, k] each: LCP descending, ties by smallest id
    index.save("rows.lcp"); LCPIndex.load("rows.lcp")

Design, file format and measured results: docs/lcp.md.
"""

from lcp.errors import LCPError
from lcp.index import LCPIndex

__all__ = ["LCPError", "LCPIndex"]
