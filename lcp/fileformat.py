"""The index file: a fixed header, a JSON description and raw little-endian arrays, sealed by SHA-256.

    offset  size  field
    0       8     magic b"PPLCPIX\\0"
    8       4     format version (uint32 LE)
    12      4     JSON header length H (uint32 LE)
    16      8     payload length P (uint64 LE)
    24      32    SHA-256 of the JSON header followed by the payload
    56      H     JSON header: {"meta": {...}, "arrays": {name: {"dtype", "shape", "offset"}}}
    56+H    P     payload: the arrays back to back, C order

Nothing is unpickled: a foreign, truncated or corrupted file fails the magic, length or checksum test
and raises LCPError before any array is built.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.io import atomic_write_bytes
from lcp.errors import LCPError

MAGIC = b"PPLCPIX\0"
VERSION = 1
_FIXED = struct.Struct("<8sIIQ32s")
_NUMPY_DTYPES = {"int64", "int32", "int16", "uint8"}


def write_index_file(path: str | Path, meta: dict[str, Any], arrays: dict[str, torch.Tensor]) -> None:
    """Write `meta` and `arrays` atomically: the file at `path` is the old one or the new one, never half."""
    layout: dict[str, dict[str, Any]] = {}
    chunks: list[bytes] = []
    offset = 0
    for name, t in arrays.items():
        a = t.detach().cpu().contiguous().numpy()
        data = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()
        layout[name] = {"dtype": str(a.dtype), "shape": list(a.shape), "offset": offset}
        chunks.append(data)
        offset += len(data)
    header = json.dumps({"meta": meta, "arrays": layout}, sort_keys=True).encode()
    digest = hashlib.sha256(header)
    for c in chunks:
        digest.update(c)
    fixed = _FIXED.pack(MAGIC, VERSION, len(header), offset, digest.digest())
    atomic_write_bytes(path, b"".join([fixed, header, *chunks]))


def read_index_file(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, arrays) from an index file, or LCPError saying what is wrong with it."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise LCPError(f"cannot read index file {path}: {exc.strerror or exc}") from None
    if len(data) < _FIXED.size or data[:8] != MAGIC:
        raise LCPError(f"{path} is not an LCP index file (bad magic header)")
    _, version, hlen, plen, digest = _FIXED.unpack_from(data)
    if version != VERSION:
        raise LCPError(f"{path} has index format version {version}; this build reads version {VERSION}")
    if len(data) != _FIXED.size + hlen + plen:
        raise LCPError(
            f"{path} is truncated or has trailing bytes: {len(data)} bytes, header says {_FIXED.size + hlen + plen}"
        )
    body = memoryview(data)[_FIXED.size :]
    if hashlib.sha256(body).digest() != digest:
        raise LCPError(f"{path} is corrupted (SHA-256 checksum mismatch)")
    try:
        header = json.loads(bytes(body[:hlen]))
        meta, layout = header["meta"], header["arrays"]
        arrays = {name: _array(body[hlen:], spec) for name, spec in layout.items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise LCPError(f"{path} has a malformed header: {exc}") from None
    return meta, arrays


def _array(payload: memoryview, spec: dict[str, Any]) -> np.ndarray:
    dtype = spec["dtype"]
    if dtype not in _NUMPY_DTYPES:
        raise ValueError(f"unexpected array dtype {dtype!r}")
    shape = [int(s) for s in spec["shape"]]
    if any(s < 0 for s in shape):
        raise ValueError(f"negative array shape {shape}")
    dt = np.dtype(dtype).newbyteorder("<")
    start = int(spec["offset"])
    size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if start < 0 or start + size > len(payload):
        raise ValueError(f"array of shape {shape} at offset {start} runs past the payload")
    return np.frombuffer(payload[start : start + size], dtype=dt).reshape(shape).astype(dtype)
