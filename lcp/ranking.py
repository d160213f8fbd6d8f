"""The ranking every method shares: LCP descending, then smallest id, folded into one int64 score; and the
named result every method returns.

score = lcp · (N + 1) + (N - 1 - id) is unique per row and orders exactly as (lcp desc, id asc), so a
plain `topk` on scores is the deterministic top-k; -1 marks "no row" and decodes to id -1, lcp -1.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LCPTopK(NamedTuple):
    """A top-k answer, named like `torch.topk`'s (values, indices): read `.lcps` and `.ids`, not by position.

    lcps: int64 [B, k] (or [k] for a 1-D query), descending; ids: int64, the rows' original indices,
    ascending within equal LCPs. Both are -1 where k exceeds the number of rows.
    """

    lcps: torch.Tensor
    ids: torch.Tensor


def encode(lcp: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Scores for rows `ids` at LCP `lcp` (negative lcp = not a candidate -> -1)."""
    return torch.where(lcp >= 0, lcp * (n + 1) + (n - 1 - ids), -1)


def decode(scores: torch.Tensor, n: int) -> LCPTopK:
    """LCPTopK from scores; -1 stays -1 in both."""
    valid = scores >= 0
    ids = torch.where(valid, n - 1 - scores % (n + 1), -1)
    return LCPTopK(lcps=torch.where(valid, scores // (n + 1), -1), ids=ids)


def best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest scores per row [B, k], descending, padded with -1 when a row has fewer columns."""
    top = scores.topk(min(k, scores.shape[1]), 1).values
    if top.shape[1] < k:
        top = torch.cat([top, top.new_full((top.shape[0], k - top.shape[1]), -1)], 1)
    return top
