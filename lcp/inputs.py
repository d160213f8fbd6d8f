"""Rows from files for the CLI: .npy (2-D integer array), .pt (a tensor, or {"seqs", "lengths"}), or text.

Text: one sequence per line, its UTF-8 bytes as uint8 tokens (the newline dropped), zero-padded to the
longest line, with per-line lengths. .npy is read with allow_pickle=False and .pt with
weights_only=True, so a file can never run code.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lcp.errors import LCPError


def load_rows(path: str | Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rows [N, L] integer tensor, lengths [N] or None) from `path`; LCPError if unreadable."""
    path = Path(path)
    if not path.is_file():
        raise LCPError(f"no such input file: {path}")
    try:
        if path.suffix == ".npy":
            return _rows(torch.from_numpy(np.load(path, allow_pickle=False)), None, path)
        if path.suffix == ".pt":
            obj = torch.load(path, weights_only=True, map_location="cpu")
            if isinstance(obj, dict):
                return _rows(obj.get("seqs"), obj.get("lengths"), path)
            return _rows(obj, None, path)
        lines = path.read_bytes().splitlines()
    except (OSError, ValueError, RuntimeError, EOFError) as exc:
        raise LCPError(f"cannot read {path}: {exc}") from None
    width = max((len(line) for line in lines), default=0)
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
