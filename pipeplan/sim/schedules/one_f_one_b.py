"""1F1B, non-interleaved (PipeDream-flush, Narayanan et al. 2021; Megatron-LM's default schedule).

Rank i warms up with w_i = min(p-1-i, m) forwards, then alternates one forward and one backward until the
forwards run out, then drains the remaining w_i backwards. At most min(p-i, m) microbatches are in flight
on rank i (versus m for GPipe); the bubble is the same as GPipe's, (p-1)(T_F + T_B) per rank. For m >= p
the order equals torch's `Schedule1F1B`.
"""

from __future__ import annotations

from pipeplan.sim.ir import Action, Kind, Schedule
from pipeplan.sim.schedules import exact_virtual_stages, loop_placement, register


def _check(p: int, m: int, v: int) -> str | None:
    return exact_virtual_stages(v, 1)


def one_f_one_b_order(rank: int, p: int, m: int, backward: Kind = Kind.B) -> list[Action]:
    """Rank `rank`'s warm-up / steady / cool-down order, with `backward` (B, or I for split backward)."""
    warmup = min(p - 1 - rank, m)
    order = [Action(rank, Kind.F, mb) for mb in range(warmup)]
    for mb in range(m):
        if warmup + mb < m:
            order.append(Action(rank, Kind.F, warmup + mb))
        order.append(Action(rank, backward, mb))
    return order


@register("1f1b", _check, "one-forward-one-backward (PipeDream-flush); rank i holds min(p-i, m) microbatches",
          sweep=True)
def build_1f1b(p: int, m: int, v: int) -> Schedule:
    ranks = tuple(tuple(one_f_one_b_order(r, p, m)) for r in range(p))
    return Schedule("1f1b", p, m, ranks, loop_placement(p, 1))
