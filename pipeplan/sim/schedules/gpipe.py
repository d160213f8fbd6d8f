"""GPipe (Huang et al. 2019, arXiv 1811.06965): every rank runs all m forwards, then all m backwards.

The order is torch's `ScheduleGPipe`: forwards and backwards both in ascending microbatch order. Each rank
holds the activations of all m microbatches at the turn; the bubble is (p-1)(T_F + T_B) per rank.
"""

from __future__ import annotations

from pipeplan.sim.ir import Action, Kind, Schedule
from pipeplan.sim.schedules import exact_virtual_stages, loop_placement, register


def _check(p: int, m: int, v: int) -> str | None:
    return exact_virtual_stages(v, 1)


@register("gpipe", _check, "all forwards, then all backwards (fill-drain); holds m microbatches", sweep=True)
def build_gpipe(p: int, m: int, v: int) -> Schedule:
    ranks = tuple(
        tuple(Action(r, Kind.F, mb) for mb in range(m)) + tuple(Action(r, Kind.B, mb) for mb in range(m))
        for r in range(p)
    )
    return Schedule("gpipe", p, m, ranks, loop_placement(p, 1))
