"""Tokens as order-preserving bit patterns, packed big-endian into int64 words so that one signed word
compare is a lexicographic compare of up to 64/bits tokens.

A token v of a b-bit dtype maps to its unsigned rank u = v - min(dtype) in [0, 2^b). Tokens past a row's
length become u = 0, the smallest token, so two padded rows compare like the rows themselves once the
length is used as the last key (a proper prefix sorts first). Each word holds T = 64/b tokens, the first
token in the most significant bits; the word's top bit is flipped so that signed int64 order equals the
unsigned order of the bit string. The LCP of two packed rows is then the index of the first differing
token, read from the leading zero bits of the XOR of their first differing word.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pipeplan.lcp.errors import LCPError

INT64_MIN = -(1 << 63)

# dtype -> (bits per token, smallest value)
_DTYPES: dict[torch.dtype, tuple[int, int]] = {
    torch.uint8: (8, 0),
    torch.int8: (8, -(1 << 7)),
    torch.int16: (16, -(1 << 15)),
    torch.uint16: (16, 0),
    torch.int32: (32, -(1 << 31)),
    torch.uint32: (32, 0),
    torch.int64: (64, INT64_MIN),
}
_CONTAINER = {8: torch.uint8, 16: torch.int16, 32: torch.int32}
DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in _DTYPES}


@dataclass(frozen=True)
class TokenFormat:
    """How tokens of one dtype are packed: `bits` per token, `per_word` tokens in each int64 word."""

    dtype: torch.dtype
    length: int  # L: tokens per row (the longest row)

    @property
    def bits(self) -> int:
        return _DTYPES[self.dtype][0]

    @property
    def lo(self) -> int:
        return _DTYPES[self.dtype][1]

    @property
    def hi(self) -> int:
        return self.lo + (1 << self.bits) - 1

    @property
    def per_word(self) -> int:
        return 64 // self.bits

    @property
    def words(self) -> int:
        return max(1, math.ceil(self.length / self.per_word))


def token_format(dtype: torch.dtype, length: int) -> TokenFormat:
    if dtype not in _DTYPES:
        supported = ", ".join(DTYPE_NAMES)
        raise LCPError(f"token dtype {dtype} is not supported; use an integer dtype ({supported})")
    return TokenFormat(dtype, length)


def resolve_device(device: str | torch.device | None, default: torch.device) -> torch.device:
    """`device` as a torch.device (None -> default), or LCPError when it is unknown or absent here."""
    if device is None:
        return default
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise LCPError(f"unknown device {str(device)[:40]!r}: {str(exc)[:80]}") from None
    if dev.type not in ("cpu", "cuda"):
        raise LCPError(f"device {str(device)[:40]!r} is not supported; use cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LCPError(f"device {device!r} requested but CUDA is not available (torch.cuda.is_available() is False)")
    return dev


def check_rows(x: object, name: str) -> torch.Tensor:
    """A rank-2 integer tensor [rows, tokens], or LCPError naming what is wrong."""
    if not isinstance(x, torch.Tensor):
        raise LCPError(f"{name} must be a torch.Tensor of shape [rows, tokens], got {type(x).__name__}")
    if x.dim() != 2:
        raise LCPError(f"{name} must have rank 2 [rows, tokens], got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise LCPError(f"{name} has dtype {x.dtype}; use an integer dtype ({', '.join(DTYPE_NAMES)})")
    return x


def check_lengths(lengths: object, rows: int, max_len: int, name: str) -> torch.Tensor | None:
    """Per-row lengths as int64 in [0, max_len], or None when absent."""
    if lengths is None:
        return None
    if not isinstance(lengths, torch.Tensor) or lengths.dim() != 1 or lengths.shape[0] != rows:
        shape = tuple(lengths.shape) if isinstance(lengths, torch.Tensor) else type(lengths).__name__
        raise LCPError(f"{name} must be a 1-D integer tensor of {rows} entries, got {shape}")
    if lengths.dtype not in _DTYPES:
        raise LCPError(f"{name} must have an integer dtype, got {lengths.dtype}")
    out = lengths.to(torch.int64)
    if rows and (int(out.min()) < 0 or int(out.max()) > max_len):
        raise LCPError(
            f"{name} must lie in [0, {max_len}] (the row width); got [{int(out.min())}, {int(out.max())}]"
        )
    return out


def _patterns(x: torch.Tensor) -> torch.Tensor:
    """Bit pattern of u = v - min(dtype) in a container of the same width (uint8, int16 or int32)."""
    bits, lo = _DTYPES[x.dtype]
    if x.dtype in (torch.uint16, torch.uint32):
        return x.view(_CONTAINER[bits])  # unsigned: the pattern of u is the value's own bits
    if lo == 0:
        return x
    return x ^ lo  # signed: flipping the sign bit adds 2^(b-1) modulo 2^b


def pack_rows(
    x: torch.Tensor, lengths: torch.Tensor | None, fmt: TokenFormat, chunk_rows: int = 1 << 16
) -> torch.Tensor:
    """Pack rows [N, L'] (L' <= fmt.length, tokens of fmt.dtype) into words [N, W] int64."""
    n, width = x.shape
    W, T = fmt.words, fmt.per_word
    out = torch.empty((n, W), dtype=torch.int64, device=x.device)
    cols = torch.arange(W * T, device=x.device)
    for start in range(0, n, chunk_rows):
        rows = x[start : start + chunk_rows]
        m = rows.shape[0]
        if fmt.bits == 64:
            p = torch.full((m, W), INT64_MIN, dtype=torch.int64, device=x.device)  # word = v for int64
            p[:, :width] = rows
        else:
            p = torch.zeros((m, W * T), dtype=_CONTAINER[fmt.bits], device=x.device)
            p[:, :width] = _patterns(rows)
        if lengths is not None:
            past = cols[None, : p.shape[1]] >= lengths[start : start + m, None]  # (m, W*T)
            p = p.masked_fill(past, INT64_MIN if fmt.bits == 64 else 0)
        if fmt.bits != 64:
            # (m, W, T) tokens; reversing T puts the first token in the high bits of a little-endian word
            p = p.view(m, W, T).flip(-1).contiguous().view(torch.int64).view(m, W) ^ INT64_MIN
        out[start : start + m] = p
    return out


def as_tensor(x: object, name: str) -> object:
    """A numpy array or (nested) list of integers as a tensor (numpy shares memory); anything else as given,
    for the checks that follow to name."""
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "iu":
            raise LCPError(f"{name} must hold integers, got a numpy array of {x.dtype}")
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, (list, tuple)):
        try:
            t = torch.tensor(x)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise LCPError(f"{name} as a list must be rectangular integers: {str(exc)[:80]}") from None
        if t.is_floating_point() or t.dtype == torch.bool or t.is_complex():
            raise LCPError(f"{name} as a list must hold integers, got {str(t.dtype).removeprefix('torch.')}")
        return t if t.numel() else t.to(torch.int64)
    return x


def as_batch(queries: object, query_lengths: object) -> tuple[object, object, bool]:
    """A 1-D query [L'] (and a scalar length) as a batch of one: (queries, lengths, was_single)."""
    if isinstance(queries, torch.Tensor) and queries.dim() == 1:
        if isinstance(query_lengths, int) and not isinstance(query_lengths, bool):
            query_lengths = torch.tensor([query_lengths])
        elif isinstance(query_lengths, torch.Tensor) and query_lengths.dim() == 0:
            query_lengths = query_lengths.reshape(1)
        return queries[None, :], query_lengths, True
    return queries, query_lengths, False


def prepare_queries(
    queries: torch.Tensor, query_lengths: torch.Tensor | None, fmt: TokenFormat, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries [B, L'] of any integer dtype -> (words [B, W], effective length [B]) in the index's format.

    Only the first L tokens can match an item, and a token outside the index dtype's range matches none,
    so each query is cut at min(its length, L, first out-of-range token): the LCPs are unchanged.
    """
    check_rows(queries, "queries")
    b, width = queries.shape
    qlen = check_lengths(query_lengths, b, width, "query_lengths")
    q = queries.to(device)
    qlen = torch.full((b,), width, dtype=torch.int64, device=device) if qlen is None else qlen.to(device)
    q, qlen = q[:, : fmt.length], qlen.clamp(max=fmt.length)
    if q.dtype != fmt.dtype:
        v = q.to(torch.int64)  # (B, L)
        bad = (v < fmt.lo) | (v > fmt.hi)
        if q.shape[1]:
            first_bad = torch.where(bad.any(1), bad.to(torch.int8).argmax(1), q.shape[1])
            qlen = torch.minimum(qlen, first_bad)
        q = v.clamp(fmt.lo, fmt.hi).to(fmt.dtype)
    return pack_rows(q, qlen, fmt), qlen


def prefix_masks(d: torch.Tensor, fmt: TokenFormat) -> torch.Tensor:
    """Masks [B, W] keeping the first d[b] tokens of each packed row (AND keeps the flipped top bit)."""
    T, bits = fmt.per_word, fmt.bits
    table = [0] + [-(1 << (64 - c * bits)) for c in range(1, T + 1)]  # c tokens kept -> high c*bits bits
    table_t = torch.tensor(table, dtype=torch.int64, device=d.device)
    start = torch.arange(fmt.words, device=d.device) * T  # first token of each word
    keep = (d[:, None] - start[None, :]).clamp(0, T)  # (B, W) tokens kept per word
    return table_t[keep]


def bit_length(x: torch.Tensor) -> torch.Tensor:
    """Bit length of int64 values read as unsigned (negative -> 64), exactly: the float64 exponent field
    of a value cut below 2^53 (where the conversion is exact)."""
    big = x >= (1 << 52)
    v = torch.where(big, x >> 11, x)
    e = (v.to(torch.float64).view(torch.int64) >> 52) - 1022  # biased exponent - 1022 = bit length
    return torch.where(x < 0, 64, e.clamp(min=0) + 11 * big)


def lead_tokens(x: torch.Tensor, fmt: TokenFormat) -> torch.Tensor:
    """Equal leading tokens of a word pair from their XOR x: T when x == 0."""
    return (64 - bit_length(x)) // fmt.bits


def lcp_words(a: torch.Tensor, b: torch.Tensor, fmt: TokenFormat) -> torch.Tensor:
    """Token LCP of packed rows a, b [..., W] (broadcasting), ignoring lengths: in [0, W*T]."""
    x = a ^ b  # (..., W)
    nz = x != 0
    first = nz.to(torch.int8).argmax(-1, keepdim=True)  # first differing word
    xf = x.gather(-1, first.expand(*x.shape[:-1], 1)).squeeze(-1)
    lead = lead_tokens(xf, fmt)  # equal tokens inside that word
    return torch.where(nz.any(-1), first.squeeze(-1) * fmt.per_word + lead, fmt.words * fmt.per_word)


def lex_compare(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Sign of x - y in lexicographic order of int64 words [..., W]: -1, 0 or 1 (int64)."""
    ne = x != y
    first = ne.to(torch.int8).argmax(-1, keepdim=True)
    xv = x.gather(-1, first).squeeze(-1)
    yv = y.gather(-1, first).squeeze(-1)
    return (xv > yv).to(torch.int64) - (xv < yv).to(torch.int64)
