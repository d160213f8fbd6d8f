"""ZB-2p (Qi et al., "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, §3 and Table 4): split backward,
with up to 2p microbatches in flight per rank, spending about twice 1F1B's activation memory to remove the
bubbles ZB-H1 leaves.

The paper finds ZB-2p with its automatic scheduler under a memory limit of 2p·M_B; this is its heuristic
(§3.2) run on unit-time passes (T_F = T_I = T_W, no communication), which gives the handcrafted ZB-H2 shape:

  * every rank runs the passes that are ready, one per time unit, preferring I (it is on the critical path
    between ranks), then F while fewer than 2p microbatches are in flight (a microbatch is in flight from its
    F until its W frees what it keeps), then a deferred W to fill what would be a bubble;
  * so rank i warms up with min(2(p-i)-1, m) forwards, runs I, F, W in the steady state, and drains its
    deferred W passes at the end.

The order is a valid topological order of the step (each pass is taken only once its inputs exist in the
unit-time run), so it never deadlocks under real durations.
"""

from __future__ import annotations

from pipeplan.sim.ir import Action, Kind, Schedule
from pipeplan.sim.schedules import exact_virtual_stages, loop_placement, register


def _check(p: int, m: int, v: int) -> str | None:
    return exact_virtual_stages(v, 1)


def zb_2p_orders(p: int, m: int, limit: int | None = None) -> list[list[Action]]:
    """Per-rank orders from the unit-time greedy run with `limit` microbatches in flight (default 2p)."""
    limit = 2 * p if limit is None else limit
    f_done = [[-1] * m for _ in range(p)]  # time unit in which F(s, mb) ran
    i_done = [[-1] * m for _ in range(p)]
    next_f = [0] * p
    next_i = [0] * p  # I passes run in microbatch order on each rank
    pending_w = [0] * p  # W passes owed (run in microbatch order)
    next_w = [0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    t = 0
    while any(next_w[s] < m for s in range(p)):
        for s in range(p):
            mb = next_i[s]
            i_ready = (mb < m and 0 <= f_done[s][mb] < t
                       and (s == p - 1 or 0 <= i_done[s + 1][mb] < t))
            fb = next_f[s]
            f_ready = fb < m and (s == 0 or 0 <= f_done[s - 1][fb] < t) and next_f[s] - next_w[s] < limit
            if i_ready:
                i_done[s][mb] = t
                next_i[s] += 1
                pending_w[s] += 1
                orders[s].append(Action(s, Kind.I, mb))
            elif f_ready:
                f_done[s][fb] = t
                next_f[s] += 1
                orders[s].append(Action(s, Kind.F, fb))
            elif pending_w[s]:
                pending_w[s] -= 1
                orders[s].append(Action(s, Kind.W, next_w[s]))
                next_w[s] += 1
        t += 1
    return orders


@register("zb-2p", _check, "zero bubble 2p: split backward, up to 2p microbatches in flight, bubbles filled")
def build_zb_2p(p: int, m: int, v: int) -> Schedule:
    ranks = tuple(tuple(order) for order in zb_2p_orders(p, m))
    return Schedule("zb-2p", p, m, ranks, loop_placement(p, 1))
