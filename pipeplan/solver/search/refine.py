"""One candidate, exactly: its cost table, schedule and memory plan, tighter bounds from them, then (if it may
still win) the event simulation that `pipeplan simulate` would run on the same scenario.

The refined bounds read the real per-chunk table: the step is at least each rank's own work (m times its
chunks' F + I + W + recomputation) plus its step tail (the engine runs one action at a time per rank and the
tail after the rank's last one); peak HBM is at least each rank's static HBM plus the largest sum of
activations its order keeps alive at a forward's end (the share not offloaded).
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from pipeplan.sim.config import Scenario
from pipeplan.sim.errors import PipeplanError
from pipeplan.sim.ir import BACKWARD_KINDS, Kind, Schedule
from pipeplan.solver.search.screen import LB_SAFETY

_BASE: dict[str, Any] = {}
"""The base scenario of this process (set_base): raw TOML dict, its source name and folder."""


def set_base(raw: dict[str, Any], source: str, base_dir: str | None) -> None:
    """Install the scenario every candidate starts from (in the main process and in each worker)."""
    _BASE.update(raw=raw, source=source, base_dir=base_dir)


def candidate_scenario(overrides: dict[str, Any]) -> Scenario:
    """The base scenario with a candidate's keys set, validated like any scenario file."""
    from pipeplan.sim.config import parse_scenario, set_dotted

    raw = copy.deepcopy(_BASE["raw"])
    for key, value in overrides.items():
        set_dotted(raw, key, value)
    base_dir = _BASE.get("base_dir")
    return parse_scenario(raw, source=_BASE["source"], base_dir=Path(base_dir) if base_dir else None)


@lru_cache(maxsize=64)
def _schedule(name: str, p: int, m: int, v: int, cap: int | None, stash: int | None) -> Schedule:
    from pipeplan.sim.schedules import build_schedule

    return build_schedule(name, p, m, v, cap, stash)


def refined_bounds(schedule: Schedule, costs: Any, plan: Any) -> tuple[float, float]:
    """(step-time, peak-HBM) lower bounds from the candidate's real cost table and memory plan."""
    from pipeplan.sim.costs import per_rank_sum

    ranks, m = schedule.num_ranks, schedule.num_microbatches
    work = costs.forward_s + costs.backward_input_s + costs.backward_weight_s + plan.recompute_s
    busy = m * per_rank_sum(work, schedule.stage_to_rank, ranks)
    tail = costs.step_tail_s if costs.step_tail_s is not None else np.zeros(ranks)
    step_lb = float((busy + tail).max())
    if plan.offload_bytes.any():  # each rank's copy stream moves its offloaded activations out, one at a time
        out = m * per_rank_sum(plan.offload_bytes, schedule.stage_to_rank, ranks) / plan.host_link_bps
        step_lb = max(step_lb, float(out.max()))
    if not costs.post_validation:  # the step runs from the first rank's start: add each rank's forced wait
        fwd, bwd = costs.forward_s, costs.backward_input_s + costs.backward_weight_s
        s2r = np.asarray(schedule.stage_to_rank)
        hops = np.concatenate([[0], np.cumsum(s2r[1:] != s2r[:-1])])  # P2P hops before each chunk
        before_f = np.concatenate([[0.0], np.cumsum(fwd)[:-1]]) + hops * costs.p2p_s
        before_b = np.concatenate([[0.0], np.cumsum(bwd)[:-1]]) + hops * costs.p2p_s
        split = schedule.uses_split_backward
        for r in range(ranks):
            first = int(np.flatnonzero(s2r == r).min())  # a rank's first forward waits for every chunk before
            drain = 0.0 if split else before_b[first]  # its last B is followed by the chunks' below it
            step_lb = max(step_lb, before_f[first] + busy[r] + max(tail[r], drain))
    held = plan.kept_bytes - plan.offload_bytes
    static = plan.static_hbm_bytes
    if len(plan.weight_offload_bytes) == len(static):  # weights away in their idle windows
        static = static - plan.weight_offload_bytes
    static_r = per_rank_sum(static, schedule.stage_to_rank, ranks)
    hbm_lb = 0.0
    for r, acts in enumerate(schedule.ranks):
        stage = np.fromiter((a.stage for a in acts), dtype=np.int64, count=len(acts))
        kind = [a.kind for a in acts]
        is_f = np.fromiter((k is Kind.F for k in kind), dtype=bool, count=len(acts))
        is_b = np.fromiter((k in BACKWARD_KINDS for k in kind), dtype=bool, count=len(acts))
        delta = np.where(is_f, held[stage], 0.0) - np.where(is_b, held[stage], 0.0)
        live = np.cumsum(delta)
        peak = float(live[is_f].max()) if is_f.any() else 0.0
        hbm_lb = max(hbm_lb, static_r[r] + peak)
    return step_lb * LB_SAFETY, hbm_lb * LB_SAFETY


def evaluate(overrides: dict[str, Any], best_s: float, prune: bool = True) -> dict[str, Any]:
    """Candidate `overrides`: pruned by its refined bounds against `best_s` (the fastest fitting step simulated
    so far), else simulated. `prune=False` simulates regardless (exhaustive reference)."""
    import time

    from pipeplan.sim.costs import build_cost_table
    from pipeplan.sim.engine import simulate
    from pipeplan.sim.memory import build_memory_plan
    from pipeplan.sim.trace import hbm_fit

    t0 = time.perf_counter()
    row: dict[str, Any] = {}
    try:
        sc = candidate_scenario(overrides)
        costs = build_cost_table(sc)
        p = sc.pipeline
        if p.order_timing == "costs":
            from pipeplan.sim.step import resolve_schedule

            schedule = resolve_schedule(sc)
        else:
            schedule = _schedule(p.schedule, p.stages, p.microbatches, p.virtual_stages, p.admission_cap,
                                 p.stash_limit)
        plan = build_memory_plan(sc, costs, schedule)
        step_lb, hbm_lb = refined_bounds(schedule, costs, plan)
        row["refined_lb_s"] = step_lb
        if prune and hbm_lb > plan.hbm_limit_bytes + 1e-6:
            return row | {"status": "pruned", "reason": "memory (refine)", "refine_wall_s": time.perf_counter() - t0}
        if prune and step_lb > best_s:
            return row | {"status": "pruned", "reason": "bound (refine)", "refine_wall_s": time.perf_counter() - t0}
        res = simulate(schedule, costs, memory=plan)
    except PipeplanError as exc:
        return row | {"status": "invalid", "reason": str(exc)}
    fit = hbm_fit(res)
    gpus = p.stages * sc.parallel.tp * sc.parallel.dp
    limit = fit.limit_bytes if fit.limit_bytes is not None else float("inf")
    return row | {
        "status": "ok", "reason": "", "gpus": gpus,
        "global_batch": p.microbatches * sc.training.micro_batch_size * sc.parallel.dp,
        "tokens_per_s": res.tokens_per_s,
        "tokens_per_s_per_gpu": None if res.tokens_per_s is None else res.tokens_per_s / gpus,
        "step_time_s": res.step_time_s, "bubble_ratio": res.bubble_ratio, "p2p_wait_share": res.p2p_wait_share,
        "step_tail_share": max(0.0, 1.0 - res.makespan_s / res.step_time_s) if res.step_time_s > 0 else 0.0,
        "max_peak_hbm_bytes": float(res.peak_hbm_bytes.max()), "peak_hbm_gib": float(res.peak_hbm_bytes.max()) / 2**30,
        "headroom_gib": (limit - float(res.peak_hbm_bytes.max())) / 2**30,
        "fits": fit.fits, "tightest_rank": fit.rank, "over_capacity_bytes": fit.over_bytes, "mfu": res.mfu,
        "sim_wall_s": time.perf_counter() - t0,
    }
