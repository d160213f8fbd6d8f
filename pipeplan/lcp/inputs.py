"""Rows from files for the CLI: .npy (2-D integer array), .pt (a tensor, or {"seqs", "lengths"}), or text.

Text: one sequence per line, its UTF-8 bytes as uint8 tokens (the newline dropped), zero-padded to the
longest line, with per-line lengths. .npy is read with allow_pickle=False and .pt with
weights_only=True, so a file can never run code.
"""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np
import torch

from pipeplan.lcp.errors import LCPError
from pipeplan.lcp.limits import check_fits, gib

MAX_TEXT_BYTES = 256 << 20  # text is split into lines in Python: beyond this, write a .npy instead


def load_rows(path: str | Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rows [N, L] integer tensor, lengths [N] or None) from `path`; LCPError if unreadable."""
    path = Path(path)
    try:
        info = path.stat()
    except OSError:
        raise LCPError(f"no such input file: {path}") from None
    if not stat.S_ISREG(info.st_mode):
        raise LCPError(f"input {path} is not a regular file (devices and pipes are not read)")
    check_fits(f"reading {path} ({info.st_size} bytes)", 2 * info.st_size)
    try:
        if path.suffix == ".npy":
            return _rows(torch.from_numpy(np.load(path, allow_pickle=False)), None, path)
        if path.suffix == ".pt":
            obj = torch.load(path, weights_only=True, map_location="cpu")
            if isinstance(obj, dict):
                return _rows(obj.get("seqs"), obj.get("lengths"), path)
            return _rows(obj, None, path)
        if info.st_size > MAX_TEXT_BYTES:
            raise LCPError(f"text input {path} has {info.st_size} bytes; at most {MAX_TEXT_BYTES} (use .npy)")
        lines = path.read_bytes().splitlines()
    except LCPError:
        raise
    except Exception as exc:  # numpy, pickle (weights_only refusals) and zip errors have no common base
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise LCPError(f"cannot read {path}: {first[:160]}") from None
    width = max((len(line) for line in lines), default=0)
    if len(lines) * width > 2**31:
        raise LCPError(f"text input {path}: {len(lines)} lines × {width} bytes ({gib(len(lines) * width)}) padded")
    rows = np.zeros((len(lines), width), dtype=np.uint8)
    for i, line in enumerate(lines):
        rows[i, : len(line)] = np.frombuffer(line, dtype=np.uint8)
    return torch.from_numpy(rows), torch.tensor([len(line) for line in lines], dtype=torch.int64)


def _rows(seqs: object, lengths: object, path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not isinstance(seqs, torch.Tensor):
        raise LCPError(f"{path} holds {type(seqs).__name__}, not a tensor of sequences")
    if lengths is not None and not isinstance(lengths, torch.Tensor):
        raise LCPError(f"{path}: 'lengths' must be a tensor, got {type(lengths).__name__}")
    return seqs, lengths
