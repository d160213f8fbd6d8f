"""Zero-bubble schedules with split backward (Qi et al.): B becomes I (backward for inputs, on the critical
path between ranks) and W (backward for weights, local), and W passes are moved into the bubbles.

zb-h1 — ZB-H1 ("Zero Bubble Pipeline Parallelism", arXiv 2401.10241, §3.1), v = 1, loop placement.
    1F1B with B replaced by I: rank i warms up with min(p-1-i, m) forwards, so its peak activation count is
    1F1B's. Rank i runs no W after its first i backward-inputs, and those deferred W passes fill its
    cool-down. Bubble (p-1)(T_F + T_I - T_W) per rank, against 1F1B's (p-1)(T_F + T_I + T_W). Same order as
    torch's `ScheduleInterleavedZeroBubble` with one stage per rank.

zbv — ZB-V ("Pipeline Parallelism with Controllable Memory", arXiv 2405.15362), v = 2, V placement: rank i
    holds stages i and 2p-1-i, so the first and last stage share rank 0. A port of torch's
    `ScheduleZBVZeroBubble` (same per-rank order). Peak activations match 1F1B's (2p chunk-microbatches of
    half size on rank 0); with T_F = T_I = T_W and m >= 2p the bubble is close to zero. Any m >= 1 gives a
    valid, deadlock-free order (torch builds the m = max(m, 2p-1) order and drops the extra microbatches),
    but below 2p microbatches the warm-up and cool-down are not filled.
"""

from __future__ import annotations

from pipeplan.sim.ir import Action, Kind, Schedule
from pipeplan.sim.schedules import exact_virtual_stages, loop_placement, register, v_placement
from pipeplan.sim.schedules.one_f_one_b import one_f_one_b_order


def _check_zb_h1(p: int, m: int, v: int) -> str | None:
    return exact_virtual_stages(v, 1)


def zb_h1_order(rank: int, p: int, m: int) -> list[Action]:
    order: list[Action] = []
    next_w = 0
    for a in one_f_one_b_order(rank, p, m, backward=Kind.I):
        order.append(a)
        if a.kind is Kind.I and a.microbatch >= rank:  # the first `rank` W passes wait for the cool-down
            order.append(Action(rank, Kind.W, next_w))
            next_w += 1
    order.extend(Action(rank, Kind.W, mb) for mb in range(next_w, m))
    return order


@register("zb-h1", _check_zb_h1, "zero bubble H1: 1F1B memory, split backward, W passes fill the cool-down")
def build_zb_h1(p: int, m: int, v: int) -> Schedule:
    ranks = tuple(tuple(zb_h1_order(r, p, m)) for r in range(p))
    return Schedule("zb-h1", p, m, ranks, loop_placement(p, 1))


def _check_zbv(p: int, m: int, v: int) -> str | None:
    return exact_virtual_stages(v, 2)


def zbv_order(rank: int, p: int, m: int) -> list[Action]:
    """torch's ScheduleZBVZeroBubble order for `rank`, built for max(m, 2p-1) microbatches then trimmed."""
    n = max(2 * p - 1, m)
    down, up = rank, 2 * p - 1 - rank  # chunk 0 (on the way down the V) and chunk 1 (on the way up)
    order: list[Action] = []
    count = {(s, k): 0 for s in (down, up) for k in (Kind.F, Kind.I, Kind.W)}

    def run(stage: int, kind: Kind) -> None:
        order.append(Action(stage, kind, count[stage, kind]))
        count[stage, kind] += 1

    # Warm-up: fill the V; the last stage's first I and W come as soon as its forward does.
    for _ in range(2 * (p - rank) - 1):
        run(down, Kind.F)
    for _ in range(rank):
        run(up, Kind.F)
        run(down, Kind.F)
    for _ in range(p - rank):
        run(up, Kind.F)
        run(up, Kind.I)
        run(up, Kind.W)
    # Steady state: F I W on chunk 0, then F I W on chunk 1.
    while count[up, Kind.F] < count[down, Kind.F] or count[down, Kind.F] < n:
        if count[down, Kind.F] < n:
            run(down, Kind.F)
        run(down, Kind.I)
        run(down, Kind.W)
        run(up, Kind.F)
        run(up, Kind.I)
        run(up, Kind.W)
    # Cool-down: the remaining backward-inputs first, their W passes after.
    for _ in range(rank):
        run(down, Kind.I)
        run(up, Kind.I)
    for _ in range(p - rank):
        run(down, Kind.I)
        run(down, Kind.W)
    while count[up, Kind.W] < count[up, Kind.I]:
        run(up, Kind.W)
    while count[down, Kind.W] < count[down, Kind.I]:
        run(down, Kind.W)
    return [a for a in order if a.microbatch < m]


@register("zbv", _check_zbv, "zero bubble V: 2 chunks per rank in V placement, split backward, 1F1B memory",
          virtual_stages=2, sweep=True)
def build_zbv(p: int, m: int, v: int) -> Schedule:
    ranks = tuple(tuple(zbv_order(r, p, m)) for r in range(p))
    return Schedule("zbv", 2 * p, m, ranks, v_placement(p))
