"""Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", arXiv 2104.04473), with v >= 2 model chunks per rank in loop placement.

This is a port of torch's `ScheduleInterleaved1F1B` (same per-rank order). Microbatches go through the
chunks in rounds of r = m // max(1, m // p) microbatches: a rank runs r forwards of its first chunk, then
r of its second, ..., and the backwards in the mirrored chunk order. Rank i warms up with
min((v-1)·r + 2(p-1-i), m·v) chunk-forwards, then alternates one forward and one backward.

Constraint (torch's, looser than Megatron's m % p == 0): m must be a multiple of max(1, m // p), so that
rounds are equal. With m % p == 0 (r = p) the bubble is the published (p-1)/v of a microbatch's F+B per
rank, i.e. a makespan of (m + (p-1)/v)·v·(T_F + T_B) with per-chunk costs T_F, T_B. Rank i holds up to
(v-1)·r + 2(p-1-i) + 1 chunk-microbatches of activations, at 1/v of a full microbatch each.
"""

from __future__ import annotations

from collections import defaultdict

from pipeplan.sim.ir import Action, Kind, Schedule
from pipeplan.sim.schedules import loop_placement, register


def microbatches_per_round(p: int, m: int) -> int:
    return m // max(1, m // p)


def _check(p: int, m: int, v: int) -> str | None:
    if v < 2:
        return f"needs pipeline.virtual_stages >= 2 (got {v}); use schedule '1f1b' for 1"
    rounds = max(1, m // p)
    if m % rounds:
        return (
            f"needs pipeline.microbatches to be a multiple of max(1, microbatches // stages) = {rounds} "
            f"(got {m}); any multiple of pipeline.stages = {p} works, e.g. {-(-m // p) * p}"
        )
    return None


def interleaved_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    per_round = microbatches_per_round(p, m)
    total = m * v  # chunk-forwards (and chunk-backwards) on this rank
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), total)

    def forward_stage(k: int) -> int:  # stage of the rank's k-th forward
        return (k // per_round) % v * p + rank

    def backward_stage(k: int) -> int:  # stage of the rank's k-th backward: chunks in reverse
        return (v - 1 - (k // per_round) % v) * p + rank

    next_mb: defaultdict[tuple[int, Kind], int] = defaultdict(int)

    def take(stage: int, kind: Kind) -> Action:
        mb = next_mb[stage, kind]
        next_mb[stage, kind] += 1
        return Action(stage, kind, mb)

    order = [take(forward_stage(k), Kind.F) for k in range(warmup)]
    for k in range(total):
        if warmup + k < total:
            order.append(take(forward_stage(warmup + k), Kind.F))
        order.append(take(backward_stage(k), Kind.B))
    return order


@register(
    "interleaved-1f1b",
    _check,
    "Megatron's interleaved 1F1B, v >= 2 chunks per rank (loop placement); bubble (p-1)/v of 1F1B's",
    virtual_stages=2,
    sweep=True,
)
def build_interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    ranks = tuple(tuple(interleaved_order(r, p, m, v)) for r in range(p))
    return Schedule("interleaved-1f1b", p * v, m, ranks, loop_placement(p, v))
