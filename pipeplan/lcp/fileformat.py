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
import math
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeplan.common.io import atomic_write_bytes
from pipeplan.lcp.errors import LCPError
from pipeplan.lcp.limits import check_fits

MAGIC = b"PPLCPIX\0"
VERSION = 1
_FIXED = struct.Struct("<8sIIQ32s")
_NUMPY_DTYPES = {"int64", "int32", "int16", "uint8"}
MAX_HEADER_BYTES = 1 << 16  # the JSON layout of three arrays takes a few hundred bytes
MAX_DIM = 1 << 48  # no array axis is longer (checked before any size arithmetic)


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
    """(meta, arrays) from an index file, or LCPError saying what is wrong with it.

    Sizes are checked before the file is read whole: it must be a regular file (never a device or a
    pipe), start with the magic, and be exactly as long as its fixed header says, which must fit memory.
    """
    try:
        info = Path(path).stat()
        if not stat.S_ISREG(info.st_mode):
            raise LCPError(f"{path} is not a regular file; an index file is read whole")
        with open(path, "rb") as f:
            fixed = f.read(_FIXED.size)
            if len(fixed) < _FIXED.size or fixed[:8] != MAGIC:
                raise LCPError(f"{path} is not an LCP index file (bad magic header)")
            _, version, hlen, plen, digest = _FIXED.unpack(fixed)
            if version != VERSION:
                raise LCPError(f"{path} has index format version {version}; this build reads version {VERSION}")
            if hlen > MAX_HEADER_BYTES:
                raise LCPError(f"{path} has a {hlen}-byte JSON header; at most {MAX_HEADER_BYTES} bytes are allowed")
            if info.st_size != _FIXED.size + hlen + plen:
                raise LCPError(
                    f"{path} is truncated or has trailing bytes: {info.st_size} bytes, "
                    f"header says {_FIXED.size + hlen + plen}"
                )
            check_fits(f"reading index file {path} ({info.st_size} bytes)", 2 * info.st_size)
            body = f.read(hlen + plen)
    except OSError as exc:
        raise LCPError(f"cannot read index file {path}: {exc.strerror or exc}") from None
    if len(body) != hlen + plen:
        raise LCPError(f"{path} changed while it was read ({len(body)} of {hlen + plen} bytes)")
    if hashlib.sha256(body).digest() != digest:
        raise LCPError(f"{path} is corrupted (SHA-256 checksum mismatch)")
    try:
        header = json.loads(body[:hlen])
        if not isinstance(header, dict):
            raise ValueError("the JSON header is not an object")
        meta, layout = header["meta"], header["arrays"]
        if not isinstance(meta, dict) or not isinstance(layout, dict):
            raise ValueError("'meta' and 'arrays' must be JSON objects")
        payload = memoryview(body)[hlen:]
        arrays = {str(name): _array(payload, spec) for name, spec in layout.items()}
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise LCPError(f"{path} has a malformed header: {str(exc)[:120]}") from None
    return meta, arrays


def _whole(value: object, what: str, hi: int) -> int:
    """A JSON integer in [0, hi] (not a bool, float or string), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= hi:
        raise ValueError(f"{what} must be an integer in [0, {hi}], got {str(value)[:40]}")
    return value


def _array(payload: memoryview, spec: object) -> np.ndarray:
    if not isinstance(spec, dict):
        raise ValueError("an array entry must be a JSON object")
    dtype = spec["dtype"]
    if not isinstance(dtype, str) or dtype not in _NUMPY_DTYPES:
        raise ValueError(f"unexpected array dtype {str(dtype)[:40]!r}")
    if not isinstance(spec["shape"], list) or len(spec["shape"]) > 2:
        raise ValueError("an array shape must be a list of at most two integers")
    shape = [_whole(s, "an array axis", MAX_DIM) for s in spec["shape"]]
    dt = np.dtype(dtype).newbyteorder("<")
    start = _whole(spec["offset"], "an array offset", MAX_DIM)
    size = math.prod(shape) * dt.itemsize  # Python ints: no overflow
    if start + size > len(payload):
        raise ValueError(f"array of shape {shape} at offset {start} runs past the payload")
    return np.frombuffer(payload[start : start + size], dtype=dt).reshape(shape).astype(dtype)
