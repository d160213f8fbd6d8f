"""AutoFreeze (Liu, Agarwal, Venkataraman 2021, arXiv 2102.01386): freeze converged blocks, front to back.

The paper's rule (sec. 3): every evaluation interval, compute each still-trained block's gradient norm over
the interval and its relative change since the previous interval, η_b = |‖g_b‖_now - ‖g_b‖_prev| / ‖g_b‖_prev;
blocks whose change falls at or below a percentile of the active blocks' changes (the median: the paper's
choice, the threshold that matched its SVCCA ground truth best) have converged; a block is frozen only if
every block before it is frozen already (front to back), and stays frozen. The classifier head is never frozen.

Here a block is a decoder layer (`layers.K.*`); the token embedding belongs to the first block (nothing runs
before it) and the final norm and output head are the head. ‖g_b‖ over an interval is the root of the summed
squared per-step gradient norms (the paper accumulates the gradient over the interval; a sum of squares needs
no second copy of the gradients). Freezing stops at `cap`, the largest share of the model's parameters
frozen, so that a study can compare methods at an equal frozen share. Frozen blocks are frozen for every
microbatch: their backward ends early on the first stage and their W is skipped everywhere (runtime/freeze.py).
Every rank holds only its chunks' blocks, so the trainer gathers every rank's norms and sizes at the end of an
interval; each rank then takes the same decision from the same numbers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import nn

_LAYER = re.compile(r"^layers\.(\d+)\.")
PERCENTILE = 50.0  # the paper's median threshold
INTERVAL = 4  # steps per evaluation (the paper evaluates a few times per epoch; our runs are tens of steps)


def block_of(name: str) -> int | None:
    """The block a parameter belongs to: its decoder layer, 0 for the embedding, None for the head."""
    m = _LAYER.match(name)
    if m:
        return int(m.group(1))
    return 0 if name.startswith("tok_embeddings") else None


@dataclass
class AutoFreeze:
    """One rank's AutoFreeze state: the gradient norms of its blocks over the current interval and the
    decision so far (identical on every rank)."""

    cap: float
    interval: int = INTERVAL
    percentile: float = PERCENTILE
    squares: dict[int, float] = field(default_factory=dict)  # block -> Σ ‖g_b‖² over this interval
    previous: dict[int, float] = field(default_factory=dict)  # block -> ‖g_b‖ over the previous interval
    frozen_through: int = -1  # blocks 0..frozen_through are frozen
    history: list[dict[str, Any]] = field(default_factory=list)  # one record per evaluation

    def observe(self, chunks: Mapping[int, nn.Module]) -> None:
        """Add this step's gradient norms (before the optimizer step); frozen blocks have no gradient."""
        for chunk in chunks.values():
            for name, p in chunk.named_parameters():
                b = block_of(name)
                if b is not None and p.grad is not None:
                    self.squares[b] = self.squares.get(b, 0.0) + float(p.grad.detach().float().square().sum())

    def local(self, chunks: Mapping[int, nn.Module]) -> dict[str, dict[int, float]]:
        """This rank's interval norms and parameter counts per block, for the all-gather."""
        sizes: dict[int, float] = {}
        head = 0.0
        for chunk in chunks.values():
            for name, p in chunk.named_parameters():
                b = block_of(name)
                if b is None:
                    head += p.numel()
                else:
                    sizes[b] = sizes.get(b, 0.0) + p.numel()
        return {"norms": {b: math.sqrt(v) for b, v in self.squares.items()}, "sizes": sizes, "head": {0: head}}

    def decide(self, gathered: list[dict[str, dict[int, float]]], step: int) -> None:
        """Every rank's interval norms -> the blocks to freeze (front to back, within the cap)."""
        norms: dict[int, float] = {}
        sizes: dict[int, float] = {}
        total = 0.0
        for g in gathered:
            norms.update(g["norms"])
            sizes.update(g["sizes"])
            total += sum(g["sizes"].values()) + sum(g["head"].values())
        active = sorted(b for b in norms if b > self.frozen_through)
        change = {b: abs(norms[b] - self.previous[b]) / self.previous[b]
                  for b in active if self.previous.get(b, 0.0) > 0}
        if change:
            threshold = float(np.percentile(list(change.values()), self.percentile))
            share = sum(sizes.get(b, 0.0) for b in range(self.frozen_through + 1)) / max(total, 1.0)
            for b in active:  # front to back: stop at the first block that has not converged
                if b != self.frozen_through + 1 or b not in change or change[b] > threshold:
                    break
                if share + sizes.get(b, 0.0) / max(total, 1.0) > self.cap + 1e-12:
                    break
                self.frozen_through = b
                share += sizes.get(b, 0.0) / max(total, 1.0)
        self.history.append({"step": step, "frozen_through": self.frozen_through,
                             "change": {int(b): float(c) for b, c in change.items()}})
        self.previous = dict(norms)
        self.squares = {}

    def frozen_names(self, names: list[str]) -> list[str]:
        """Of a chunk's parameter names, those of frozen blocks."""
        return [n for n in names if (b := block_of(n)) is not None and b <= self.frozen_through]

    def due(self, step: int, warmup: int) -> bool:
        """Whether an evaluation ends after `step` (every `interval` steps, the first after the warm-up)."""
        return step + 1 >= warmup + self.interval and (step + 1 - warmup) % self.interval == 0

    def state_dict(self) -> dict[str, Any]:
        return {"squares": dict(self.squares), "previous": dict(self.previous),
                "frozen_through": self.frozen_through, "history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.squares, self.previous = dict(state["squares"]), dict(state["previous"])
        self.frozen_through, self.history = state["frozen_through"], list(state["history"])
