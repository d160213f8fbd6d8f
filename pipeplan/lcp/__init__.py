"""Exact, deterministic top-k retrieval by longest common prefix on torch tensors (CPU or CUDA).

    from pipeplan.lcp import LCPIndex
    index = LCPIndex.build(seqs)                  # seqs: integer tensor [N, L]; lengths=[N] optional
    top = index.topk(queries, k=10)               # LCPTopK(lcps, ids), [B, k] each ([k] for a 1-D query):
    top.lcps, top.ids                             # LCP descending, ties by smallest id
    index.save("rows.lcp"); LCPIndex.load("rows.lcp")
    index.engine                                  # "numba": compiled CPU kernel (pip install .[lcp]); else "torch"

Design, file format and measured results: docs/lcp.md.
"""

from pipeplan.lcp.errors import LCPError
from pipeplan.lcp.index import LCPIndex
from pipeplan.lcp.ranking import LCPTopK

__all__ = ["LCPError", "LCPIndex", "LCPTopK"]
