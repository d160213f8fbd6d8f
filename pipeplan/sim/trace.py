"""One trace schema for simulated and measured steps: timeline, memory and summary tables.

timeline.csv: rank,stage,microbatch,kind,start_s,end_s - one row per action, whoever produced it.
memory.csv:   rank,time_s,hbm_bytes,...                 - HBM in use after every change, split into static
              (weights, gradients, optimizer) and activations, plus what lives in DRAM and on NVMe.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from pipeplan.sim.engine import SimResult

TIMELINE_COLUMNS = ["rank", "stage", "microbatch", "kind", "start_s", "end_s"]
MEMORY_COLUMNS = ["rank", "time_s", "hbm_bytes", "static_hbm_bytes", "activation_hbm_bytes", "dram_bytes", "nvme_bytes"]


def timeline_frame(result: SimResult) -> pd.DataFrame:
    df = pd.DataFrame(
        {
            "rank": result.rank,
            "stage": result.stage,
            "microbatch": result.microbatch,
            "kind": result.kind,
            "start_s": result.start_s,
            "end_s": result.end_s,
        },
        columns=TIMELINE_COLUMNS,
    )
    return df.sort_values(["rank", "start_s", "end_s"], kind="stable").reset_index(drop=True)


def memory_frame(result: SimResult) -> pd.DataFrame:
    return pd.DataFrame(result.memory, columns=MEMORY_COLUMNS).sort_values(["rank", "time_s"], kind="stable")


class HbmFit(NamedTuple):
    """Does the step fit HBM? The rank with the least headroom decides: its peak against capacity - margin."""

    fits: bool
    rank: int
    """The tightest rank: largest peak minus limit (the most over, or the least headroom)."""
    peak_bytes: float
    limit_bytes: float | None
    """Capacity minus memory.hbm_margin_gib; None when the scenario sets no capacity."""
    over_bytes: float
    """How far the tightest rank's peak exceeds the limit (0 when it fits)."""


def hbm_fit(result: SimResult) -> HbmFit:
    """The one place that decides whether a simulated step fits (what summary.json, plan.json and sweep.csv
    report as `fits`)."""
    peaks = np.asarray(result.peak_hbm_bytes, dtype=float)
    limit = result.hbm_limit_bytes
    rank = int(np.argmax(peaks - (limit if np.isfinite(limit) else 0.0)))
    if not np.isfinite(limit):
        return HbmFit(True, rank, float(peaks[rank]), None, 0.0)
    over = max(0.0, float(peaks[rank]) - limit)
    return HbmFit(not result.oom_over_limit, rank, float(peaks[rank]), float(limit), over)


def fit_fields(result: SimResult) -> dict[str, Any]:
    """`fits` and what explains it, as flat keys for summary.json and plan.json."""
    fit = hbm_fit(result)
    return {"fits": fit.fits, "tightest_rank": fit.rank, "hbm_limit_bytes": fit.limit_bytes,
            "over_capacity_bytes": fit.over_bytes}


def simulation_summary(result: SimResult) -> dict[str, Any]:
    sched, costs = result.schedule, result.costs
    out: dict[str, Any] = {
        "schedule": sched.name,
        "stages": sched.num_ranks,
        "virtual_stages": sched.virtual_stages,
        "microbatches": sched.num_microbatches,
        "actions": sched.num_actions,
        "makespan_s": result.makespan_s,
        "step_time_s": result.step_time_s,
        "bubble_ratio": result.bubble_ratio,
        "p2p_wait_share": result.p2p_wait_share,
        "peak_activation_bytes": [float(x) for x in result.peak_activation_bytes],
        "peak_hbm_bytes": [float(x) for x in result.peak_hbm_bytes],
        "static_bytes": [float(x) for x in result.static_bytes],
        "hbm_capacity_bytes": costs.hbm_bytes if costs.hbm_bytes != float("inf") else None,
        "oom": result.oom,
        **fit_fields(result),
        "peak_at": [moment.as_dict() for moment in result.peak_at],
        "sim_wall_s": result.sim_wall_s,
    }
    if costs.step_tail_s is not None:  # per rank: DP reduction + optimizer step after its last action
        out["step_tail_s"] = [float(x) for x in costs.step_tail_s]
    if costs.post_validation and result.rank_span_s is not None:  # the step is the longest of these
        out["rank_span_s"] = [float(x) for x in result.rank_span_s]
    if result.stall_s is not None and result.stall_s.any():
        out["offload_stall_s"] = [float(x) for x in result.stall_s]
    dram, nvme = result.peak_dram_bytes, result.peak_nvme_bytes  # the engine sets both or neither
    if dram is not None and nvme is not None and (dram.any() or nvme.any()):
        out["peak_dram_bytes"] = [float(x) for x in dram]
        out["peak_nvme_bytes"] = [float(x) for x in nvme]
    if result.oom:
        worst = max(result.oom_events, key=lambda e: e.excess_bytes)
        out["oom_detail"] = {
            "rank": worst.rank,
            "time_s": worst.time_s,
            "action": worst.action,
            "excess_bytes": worst.excess_bytes,
            "ranks": sorted({e.rank for e in result.oom_events}),
        }
    if result.tokens_per_s is not None:
        out["tokens_per_s"] = result.tokens_per_s
    if result.mfu is not None:
        out["mfu"] = result.mfu
    return out
