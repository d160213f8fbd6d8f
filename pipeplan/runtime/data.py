"""Training tokens: deterministic synthetic sequences, or byte-level tokens from a text file.

Every microbatch is a pure function of (seed, step, microbatch): ranks never exchange data, a resumed run
reads what the uninterrupted run read, and the single-process reference sees the same tokens.

    synthetic   x_t = (a + c t) mod V with a, c drawn per row: learnable, no file needed
    FILE        bytes of FILE as tokens 0..255 (vocab >= 256), windows at random offsets
    (default)   the Python standard library's own sources: a real text corpus every machine has
    python      the standard library's sources and Language Reference topics, training split
                (runtime/corpus.py: documents deduplicated, a tenth of them held out by name hash)
    pydoc       the Language Reference topics alone (`pydoc_data/topics.py`, what `help("if")` prints),
                training split the same way
`heldout_batches` draws evaluation windows from a corpus's held-out split, only where the window's bytes
occur nowhere in the training split (runtime/corpus.py, step 3).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch

from pipeplan.runtime.corpus import CORPORA, heldout_windows, split
from pipeplan.sim.errors import PipeplanError

SYNTHETIC = "synthetic"
STDLIB = "stdlib"
PYDOC = "pydoc"
PYTHON = "python"
NAMED_SOURCES = (SYNTHETIC, STDLIB, PYDOC, PYTHON)  # --data values that are not files
STDLIB_MAX_BYTES = 8 * 2**20  # the first sorted stdlib modules up to this size


def stdlib_corpus() -> np.ndarray:
    """Bytes of the standard library's top-level *.py files, in sorted order, up to STDLIB_MAX_BYTES."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= STDLIB_MAX_BYTES:
            break
    if not chunks:
        raise PipeplanError(f"--data: no Python sources under {root}; give --data FILE or --data synthetic")
    return np.frombuffer(b"".join(chunks)[:STDLIB_MAX_BYTES], dtype=np.uint8)


class TokenData:
    """Microbatches of (inputs, labels), each (micro_batch, seq_len) int64; labels are inputs shifted by one."""

    def __init__(self, source: str | None, vocab: int, seq_len: int, micro_batch: int, seed: int = 0):
        self.source = source or STDLIB
        self.vocab, self.seq_len, self.micro_batch, self.seed = vocab, seq_len, micro_batch, seed
        self.corpus: torch.Tensor | None = None
        if self.source != SYNTHETIC:
            if vocab < 256:
                raise PipeplanError(
                    f"--data {self.source}: byte-level tokens need model.vocab >= 256 (got {vocab}); "
                    "raise model.vocab or use --data synthetic"
                )
            if self.source == STDLIB:
                arr = stdlib_corpus()
            elif self.source in CORPORA:
                arr = split(self.source)[0]
            else:
                try:
                    arr = np.fromfile(self.source, dtype=np.uint8)
                except OSError as exc:
                    raise PipeplanError(f"--data {self.source}: cannot read ({exc.strerror})") from None
            if len(arr) < seq_len + 2:
                raise PipeplanError(
                    f"--data {self.source}: {len(arr)} bytes, need at least seq_len + 2 = {seq_len + 2}"
                )
            self.corpus = torch.from_numpy(arr.astype(np.int64))

    def microbatch(self, step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(((self.seed * 1_000_003 + step) * 10_007 + microbatch) & (2**63 - 1))
        b, T = self.micro_batch, self.seq_len
        if self.corpus is None:
            start = torch.randint(0, self.vocab, (b, 1), generator=gen)
            stride = torch.randint(1, max(2, self.vocab // 4), (b, 1), generator=gen)
            rows = (start + stride * torch.arange(T + 1)) % self.vocab  # (b, T + 1)
        else:
            offsets = torch.randint(0, len(self.corpus) - T - 1, (b,), generator=gen)
            rows = self.corpus[offsets[:, None] + torch.arange(T + 1)]  # (b, T + 1)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def step(self, step: int, microbatches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.microbatch(step, mb) for mb in range(microbatches)]


def heldout_batches(vocab: int, seq_len: int, micro_batch: int, count: int, seed: int = 0, corpus: str = PYDOC
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` microbatches of `corpus`'s held-out split: distinct windows none of whose seq_len + 1 bytes
    occur in the training split, at offsets fixed by the seed (the same evaluation set for every run)."""
    if vocab < 256:
        raise PipeplanError(f"--corpus {corpus}: byte-level tokens need model.vocab >= 256 (got {vocab})")
    held = heldout_windows(corpus, seq_len + 1)
    need = count * micro_batch
    if len(held.starts) < need:
        raise PipeplanError(f"--corpus {corpus}: {len(held.starts)} clean held-out windows, need {need}")
    gen = torch.Generator().manual_seed(seed)
    pick = torch.from_numpy(held.starts)[torch.randperm(len(held.starts), generator=gen)[:need]]
    data = torch.from_numpy(held.data.astype(np.int64))
    rows = data[pick[:, None] + torch.arange(seq_len + 1)].view(count, micro_batch, seq_len + 1)
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows]
