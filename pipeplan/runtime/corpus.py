"""Text corpora with a held-out split that shares no evaluation window with the training split.

    python   the Python standard library's sources (every *.py under the interpreter's stdlib, test suites
             and site-packages left out) and its Language Reference topics (`pydoc_data.topics`, what
             `help("if")` prints): the text every CPython install ships, ~8 MiB here (CORPUS_MAX_BYTES)
    pydoc    the Language Reference topics alone (79 topics, ~465 KB in 3.11)

Split, deterministically and before any window is drawn:

1. documents (one file, one topic) deduplicated by content (the stdlib holds some files twice);
2. documents assigned whole to held-out or training by a hash of their name (HELDOUT_SHARE of them held out);
3. window-level deduplication: every held-out window of the evaluation length (seq_len + 1 tokens) whose bytes
   also occurs in the training split is dropped, as is every repeat of a held-out window (pydoc topics repeat
   paragraphs; licence headers and boilerplate repeat across sources). Evaluation windows are drawn only from
   the positions left.

Step 3 compares 64-bit polynomial hashes of all windows (vectorised, numpy); a hash collision can only drop a
clean window, never keep a leaked one. tests/test_corpus.py checks the result byte for byte.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeplan.sim.errors import PipeplanError

CORPORA = ("python", "pydoc")
HELDOUT_SHARE = 0.1  # documents held out, by name hash
CORPUS_MAX_BYTES = 8 * 2**20  # python: documents in sorted name order up to this size (memory: hashing)
SEPARATOR = b"\n\n"
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
_P = np.uint64(0x9E3779B97F4A7C15)  # odd, so invertible modulo 2^64


def _documents(name: str) -> list[tuple[str, bytes]]:
    """(name, bytes) of every document of a corpus, in sorted name order."""
    from pydoc_data.topics import topics

    docs = [(f"pydoc:{k}", topics[k].encode("utf-8")) for k in sorted(topics)]
    if name == "pydoc":
        return docs
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts))
    if not files:
        raise PipeplanError(f"--corpus python: no Python sources under {root}; use --corpus pydoc")
    total = sum(len(d) for _, d in docs)
    for path in files:
        data = path.read_bytes()
        if total + len(data) > CORPUS_MAX_BYTES:
            break
        docs.append((str(path.relative_to(root)), data))
        total += len(data)
    return docs


def _held_out(name: str) -> bool:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") % 1000 < HELDOUT_SHARE * 1000


@functools.cache
def split(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(training bytes, held-out bytes) of corpus `name`: documents deduplicated by content, assigned whole
    by name hash, each split's documents joined by a blank line."""
    if name not in CORPORA:
        raise PipeplanError(f"--corpus {name}: choose one of {', '.join(CORPORA)}")
    seen: set[bytes] = set()
    parts: dict[bool, list[bytes]] = {True: [], False: []}
    for doc, data in _documents(name):
        digest = hashlib.sha256(data).digest()
        if digest in seen or not data:
            continue
        seen.add(digest)
        parts[_held_out(doc)].append(data)
    train, heldout = (np.frombuffer(SEPARATOR.join(parts[h]), dtype=np.uint8) for h in (False, True))
    return train, heldout


def window_hashes(data: np.ndarray, length: int) -> np.ndarray:
    """A 64-bit polynomial hash of every window data[i : i + length], i = 0 .. len - length (uint64, wrapping
    arithmetic: sum_k data[i+k] P^k, from prefix sums scaled by P^-i)."""
    n = len(data) - length + 1
    if n <= 0:
        return np.empty(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        powers = np.concatenate(([np.uint64(1)], np.cumprod(np.full(len(data) - 1, _P, dtype=np.uint64))))
        prefix = np.concatenate(([np.uint64(0)], np.cumsum(data.astype(np.uint64) * powers, dtype=np.uint64)))
        inverse = np.uint64(pow(int(_P), -1, 2**64))
        inv_powers = np.concatenate(([np.uint64(1)], np.cumprod(np.full(n - 1, inverse, dtype=np.uint64))))
        return (prefix[length:] - prefix[:n]) * inv_powers


@dataclass(frozen=True)
class HeldOut:
    """The held-out bytes and the window starts whose `length` bytes occur nowhere in training (the first
    occurrence of each, where the held-out split repeats one)."""

    data: np.ndarray
    starts: np.ndarray
    length: int


@functools.cache
def heldout_windows(name: str, length: int) -> HeldOut:
    """Corpus `name`'s held-out split with its clean windows of `length` bytes (module docstring, step 3)."""
    train, heldout = split(name)
    held = window_hashes(heldout, length)
    leaked = np.isin(held, np.unique(window_hashes(train, length)))
    unique = np.zeros(len(held), dtype=bool)
    unique[np.unique(held, return_index=True)[1]] = True  # the first of each repeated window
    starts = np.flatnonzero(unique & ~leaked)
    if len(starts) == 0:
        raise PipeplanError(f"--corpus {name}: no held-out window of {length} bytes is absent from training; "
                            "use a shorter model.seq_len or another corpus")
    return HeldOut(heldout, starts, length)
