"""The copy engines' rules, named once: the two streams, the kinds of copy they carry, how many pinned host
buffers bound the copies out, and which action's start issues a prefetch. The engine, the step graph, the
memory MILP and the runtime read them from here, so the rules cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import TypeVar

T = TypeVar("T")


class Stream(StrEnum):
    """A rank's copy engines, one per direction, each serving its copies one at a time in FIFO order."""

    D2H = "d2h"
    H2D = "h2d"


class CopyKind(StrEnum):
    """What a copy moves; the value is its name in copy orders (SimResult.copy_order), graph keys and traces."""

    OFFLOAD = "offload"  # an F's offloaded activations, device -> host after the F
    PREFETCH = "prefetch"  # the same bytes back, host -> device before its B/I
    STASH_OFFLOAD = "stash-offload"  # an I's offloaded W stash, device -> host after the I
    STASH_PREFETCH = "stash-prefetch"  # the same bytes back before its W
    WEIGHTS = "weights"  # a chunk's offloaded weights back before their next use (sim.graph.weight_windows)
    STEP = "step"  # the optimizer step's copies with model states off HBM (sim.graph.side_chains)


# Copies out of one kind (activations after F, W stashes after I) go through this many pinned host buffers:
# one drains on the d2h engine while the next producer fills the other, so the j-th producer of a kind on a
# rank may not start before the copy out of the (j - PINNED_BUFFERS)-th has ended. Double buffering is what
# TransformerEngine's activation offload does (AsyncDoubleBufferGroupOffloadHandler,
# transformer_engine/pytorch/cpu_offload.py): offload of one group overlaps the next group's compute.
PINNED_BUFFERS = 2


def buffer_gate(earlier: Sequence[T]) -> T | None:
    """Of the producers of one kind that ran before on a rank (in order), the one whose copy out the next
    must wait for (PINNED_BUFFERS), or None while buffers are free."""
    return earlier[-PINNED_BUFFERS] if len(earlier) >= PINNED_BUFFERS else None


def prefetch_issue_position(pos: int, lookahead: int) -> int:
    """The position, in its rank's order, of the action whose start issues the prefetch for the action at
    `pos`: `lookahead` places before it (memory.prefetch_lookahead), the rank's first action for the first few."""
    return max(pos - lookahead, 0)


def prefetch_window(pos: int, lookahead: int) -> slice:
    """The positions whose prefetches are due once the action at `pos` has started: every later position
    whose issuer (prefetch_issue_position) is at or before `pos`; those before `pos` were due earlier."""
    return slice(pos, pos + lookahead + 1)
