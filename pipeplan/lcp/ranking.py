"""The ranking every method shares: LCP descending, then smallest id, folded into one int64 score; and the
named result every method returns.

score = lcp · (N + 1) + (N - 1 - id) is unique per row and orders exactly as (lcp desc, id asc), so a
plain `topk` on scores is the deterministic top-k; -1 marks "no row" and decodes to id -1, lcp -1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pipeplan.lcp.errors import LCPError


class LCPTopK(NamedTuple):
    """A top-k answer, named like `torch.topk`'s (values, indices): read `.lcps` and `.ids`, not by position.

    lcps: int64 [B, k] (or [k] for a 1-D query), descending; ids: int64, the rows' original indices,
    ascending within equal LCPs. Both are -1 where k exceeds the number of rows.
    """

    lcps: torch.Tensor
    ids: torch.Tensor


def check_out(out: object, shape: tuple[int, ...], device: torch.device, keep: Sequence[torch.Tensor]) -> LCPTopK:
    """`out` of `topk(..., out=)`, checked before anything is written: an LCPTopK (read by name, so a
    swapped pair cannot pass: a bare tuple is refused) of two contiguous int64 tensors of exactly
    `shape` on `device`, neither overlapping the other nor any tensor of `keep` (the queries, their
    lengths, the index's arrays). Unlike torch.topk's out=, nothing is resized: a wrong shape is an error."""
    if not isinstance(out, LCPTopK):
        raise LCPError(
            f"out must be an LCPTopK(lcps=..., ids=...) (a previous result, or built by name), got "
            f"{type(out).__name__}; wrap a pair as LCPTopK(lcps=a, ids=b)"
        )
    for name in LCPTopK._fields:
        t = getattr(out, name)
        if not isinstance(t, torch.Tensor):
            raise LCPError(f"out.{name} must be a tensor, got {type(t).__name__}")
        if t.dtype != torch.int64 or tuple(t.shape) != shape or t.device != device:
            raise LCPError(
                f"out.{name} must be int64 {list(shape)} on {device}, got {str(t.dtype).replace('torch.', '')} "
                f"{list(t.shape)} on {t.device}"
            )
        if not t.is_contiguous():
            raise LCPError(f"out.{name} must be contiguous")
    if _overlap(out.lcps, out.ids):
        raise LCPError("out.lcps and out.ids share memory: each needs its own")
    for name in LCPTopK._fields:
        if any(_overlap(getattr(out, name), other) for other in keep):
            raise LCPError(f"out.{name} shares memory with the queries or the index: it would be overwritten")
    return out


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a's bytes (a contiguous) meet b's: b's own span when contiguous, else its whole storage."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    start = a.data_ptr()
    end = start + a.numel() * a.element_size()
    if b.is_contiguous():
        other, other_end = b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()
    else:
        other = b.untyped_storage().data_ptr()
        other_end = other + b.untyped_storage().nbytes()
    return start < other_end and other < end


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
