"""Rank 0's results, in the simulator's schema, next to what the simulator predicted for the same step.

    metrics.csv     step,loss,step_time_s,tokens_per_s (then makespan_s, phase, freeze_ratio)
    timeline.csv    rank,stage,microbatch,kind,start_s,end_s of the measured step with the (low) median makespan
    timelines.csv   the same for every step, with a step column
    memory.csv      rank,time_s,hbm_bytes: static bytes + live saved activations over that step
    schedule.csv    the action order every rank ran (torch action strings)
    summary.json    measured vs predicted makespan and peak activation memory, relative errors, throughput,
                    the dtype the step ran in, the clock alignment and its uncertainty

and for `pipeplan profile`: scenario.toml (explicit costs, runtime/calibration.py), profile.json, timelines.csv.
The runtime writes measured data only; `pipeplan run` (analysis/commands/run.py) draws it after the job.

"Measured" steps are the steady ones: every step but the first (allocator and cache warm-up) and, when
freezing, only steps of the steady phase; medians over them. Every time is on one clock: each rank's
timeline is mapped onto rank 0's clock (runtime/clock.py) and a step starts when its first rank starts.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeplan.common.io import atomic_write_json, atomic_write_text
from pipeplan.runtime.calibration import chunk_costs, dependency_gaps, steady_steps
from pipeplan.runtime.clock import IDENTITY, aligned_actions, rank_shifts
from pipeplan.runtime.config import RunConfig
from pipeplan.sim.config import Scenario, load_scenario
from pipeplan.sim.costs import build_cost_table
from pipeplan.sim.engine import SimResult, simulate
from pipeplan.sim.errors import PipeplanError
from pipeplan.sim.ir import Schedule
from pipeplan.sim.trace import MEMORY_COLUMNS, TIMELINE_COLUMNS
from pipeplan.solver.step import resolve_memory_plan

RankResult = dict[str, Any]  # {"rank", "history": [StepRecord], "static_bytes", "clock": ClockFit, ...}


def step_table(ranks: list[RankResult], tokens_per_step: int) -> pd.DataFrame:
    """One row per step; `cpu_time_s` sums every rank's process CPU time (the work, less the load's noise)."""
    rows = []
    for i, rec in enumerate(ranks[0]["history"]):
        recs = [r["history"][i] for r in ranks]
        losses = [v for r in recs for v in r.trace.losses.values()]
        step_time = max(r.step_time_s for r in recs)
        rows.append({
            "step": rec.step,
            "loss": float(np.mean(losses)),
            "step_time_s": step_time,
            "tokens_per_s": tokens_per_step / step_time,
            "makespan_s": max(end for acts in aligned_actions(ranks, i) for _a, _s, end in acts),
            "phase": rec.phase,
            "freeze_ratio": float(np.mean([r.freeze_ratio for r in recs])),
            "cpu_time_s": float(sum(r.cpu_time_s for r in recs)),
        })
    return pd.DataFrame(rows)


def timeline_rows(ranks: list[RankResult], index: int) -> pd.DataFrame:
    """Step `index` of every rank, on the common clock."""
    rows = [(r["rank"], a.stage, a.microbatch, a.kind.value, s, e)
            for r, acts in zip(ranks, aligned_actions(ranks, index), strict=True) for a, s, e in acts]
    df = pd.DataFrame(rows, columns=TIMELINE_COLUMNS)
    return df.sort_values(["rank", "start_s", "end_s"], kind="stable").reset_index(drop=True)


def memory_rows(ranks: list[RankResult], index: int) -> pd.DataFrame:
    """HBM = static + live saved activations on the device; DRAM = offloaded activations + host states."""
    shifts = rank_shifts(ranks, index)
    rows = [(r["rank"], t + sh, r["static_bytes"] + dev, r["static_bytes"], dev,
             r.get("static_host_bytes", 0.0) + host, 0.0)
            for r, sh in zip(ranks, shifts, strict=True) for t, dev, host in r["history"][index].trace.memory]
    return pd.DataFrame(rows, columns=MEMORY_COLUMNS)


def clock_summary(ranks: list[RankResult], schedule: Schedule, indices: list[int]) -> dict[str, Any]:
    """The alignment (per-rank offset to rank 0 and drift), its uncertainty, and the check that it holds:
    on one clock no consumer may start before its cross-rank producer ended by more than the uncertainty."""
    fits = [r.get("clock") or IDENTITY for r in ranks]
    uncertainty = max(f.uncertainty_s for f in fits)
    gaps = [g for i in indices for g in dependency_gaps(aligned_actions(ranks, i), schedule)]
    worst = -min(gaps) if gaps else 0.0
    return {
        "method": "NTP ping-pong with rank 0 (min round trip of 16) at the job's start and end, drift linear",
        "offset_s": [f.start.offset_s for f in fits],
        "drift_ppm": [f.drift * 1e6 for f in fits],
        "uncertainty_s": uncertainty,
        "cross_rank_dependencies": len(gaps),
        "worst_apparent_violation_s": max(worst, 0.0),
        "violations_beyond_uncertainty": sum(g < -uncertainty for g in gaps),
    }


def predict(cfg: RunConfig, scenario: Scenario, schedule: Schedule) -> tuple[SimResult, str]:
    """Simulate the step under --costs (a profiled explicit-costs scenario) or the run scenario's own costs,
    with that scenario's [memory] plan (a profile already measured the run's recompute and offload)."""
    source = cfg.costs or "scenario"
    sc = load_scenario(cfg.costs) if cfg.costs else scenario
    costs = build_cost_table(sc).with_microbatches(schedule.num_microbatches)
    if costs.num_chunks != schedule.num_stages:
        raise PipeplanError(
            f"--costs {cfg.costs}: describes {costs.num_chunks} chunks, the run has {schedule.num_stages}; "
            "profile with the same pipeline.stages and virtual_stages"
        )
    memory = resolve_memory_plan(sc, costs, schedule, cfg.choice() if cfg.costs is None else None)
    return simulate(schedule, costs, memory=memory.plan), source


def rel_error(predicted: float, measured: float) -> float | None:
    return (predicted - measured) / measured if measured > 0 else None


def write_run(cfg: RunConfig, scenario: Scenario, schedule: Schedule, ranks: list[RankResult],
              extra: dict[str, Any]) -> dict[str, Any]:
    assert cfg.out_dir is not None  # the worker writes outputs only when given a folder
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = sorted(ranks, key=lambda r: r["rank"])
    m = scenario.model
    assert m is not None  # a run's scenario has a [model]
    tokens_per_step = scenario.training.micro_batch_size * m.seq_len * schedule.num_microbatches
    metrics = step_table(ranks, tokens_per_step)
    steps = steady_steps(ranks[0]["history"])
    chosen = metrics[metrics["step"].isin(steps)]
    makespan = float(statistics.median_low(chosen["makespan_s"]))  # a real step's: timeline.csv shows it
    rep_step = int(chosen.iloc[(chosen["makespan_s"] - makespan).abs().argmin()]["step"])
    rep = int(metrics.index[metrics["step"] == rep_step][0])
    timeline = timeline_rows(ranks, rep)
    memory = memory_rows(ranks, rep)
    all_timelines = pd.concat([timeline_rows(ranks, i).assign(step=int(s)) for i, s in enumerate(metrics["step"])])
    sim, source = predict(cfg, scenario, schedule)
    idx = [int(metrics.index[metrics["step"] == s][0]) for s in steps]
    peak_act = [max(r["history"][i].trace.peak_activation_bytes for i in idx) for r in ranks]
    pred_act = [float(x) for x in sim.peak_activation_bytes]
    summary: dict[str, Any] = {
        "schedule": schedule.name,
        "stages": schedule.num_ranks,
        "virtual_stages": schedule.virtual_stages,
        "microbatches": schedule.num_microbatches,
        "steps": int(metrics["step"].max()) + 1,
        "measured_steps": steps,
        "measured_makespan_s": makespan,
        "predicted_makespan_s": sim.makespan_s,
        "makespan_rel_error": rel_error(sim.makespan_s, makespan),
        "prediction_costs": source,
        "step_time_s": float(chosen["step_time_s"].median()),
        "tokens_per_s": float(chosen["tokens_per_s"].median()),
        "final_loss": float(metrics["loss"].iloc[-1]),
        "measured_peak_activation_bytes": peak_act,
        "predicted_peak_activation_bytes": pred_act,
        "peak_activation_rel_error": [rel_error(p, q) for p, q in zip(pred_act, peak_act, strict=True)],
        "static_bytes": [r["static_bytes"] for r in ranks],
        "offloaded_activation_bytes": [max(r["history"][i].trace.offloaded_bytes for i in idx) for r in ranks],
        "offloaded_stash_bytes": [max(r["history"][i].trace.stash_offloaded_bytes for i in idx) for r in ranks],
        "device": ranks[0].get("device", "cpu"),
        "dtype": scenario.training.dtype,  # the forwards' autocast dtype over fp32 master weights (fp32: none)
        "backend": ranks[0].get("backend"),  # gloo on CPU or when ranks share GPUs (P2P via host), else nccl
        "data": cfg.data or "stdlib",
        "freeze": cfg.freeze,
        "recompute": extra.get("policies"),
        "offload_activations": scenario.memory.offload_activations,
        "optimizer_tier": scenario.memory.optimizer,
        "memory_plan": scenario.memory.plan,
        "offload_share_per_chunk": extra.get("offload_shares"),
        "stash_offload_share_per_chunk": extra.get("stash_offload_shares"),
        "states_on_host_per_rank": extra.get("states_on_host"),
        "cpu_time_s": float(chosen["cpu_time_s"].median()),
        "clock": clock_summary(ranks, schedule, idx),
        "timeline_step": rep_step,
        "title": f"measured {schedule.name}: p={schedule.num_ranks} m={schedule.num_microbatches} "
                 f"v={schedule.virtual_stages} (step {rep_step})",
    }
    peaks_dev = [max((r["history"][i].trace.peak_device_bytes or 0) for i in idx) for r in ranks]
    if any(peaks_dev):
        summary["measured_peak_device_bytes"] = peaks_dev
    if cfg.freeze != "none":
        plan = extra.get("plan") or {}
        summary["freeze_cap"] = cfg.freeze_cap if cfg.freeze_cap is not None else scenario.freeze.cap
        summary["planned_mean_ratio"] = float(np.mean(list(plan.values()))) if plan else 0.0
        summary["realized_mean_ratio"] = float(chosen["freeze_ratio"].mean())
        summary["planned_makespan_s"] = extra.get("planned_makespan_s")
        summary["planned_unfrozen_makespan_s"] = extra.get("unfrozen_makespan_s")  # same monitoring, no freezing
    atomic_write_text(out / "metrics.csv", metrics.to_csv(index=False))
    atomic_write_text(out / "timeline.csv", timeline.to_csv(index=False))
    atomic_write_text(out / "timelines.csv", all_timelines.to_csv(index=False))
    atomic_write_text(out / "memory.csv", memory.to_csv(index=False))
    atomic_write_text(out / "schedule.csv", schedule.to_csv_text())
    atomic_write_json(out / "summary.json", summary)
    return summary


# ---- pipeplan profile -------------------------------------------------------------------------------
def write_profile(cfg: RunConfig, scenario: Scenario, schedule: Schedule, ranks: list[RankResult],
                  extra: dict[str, Any]) -> dict[str, Any]:
    """profile.json and scenario.toml: an explicit-costs scenario measured on this hardware."""
    assert cfg.out_dir is not None  # the worker writes outputs only when given a folder
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks = sorted(ranks, key=lambda r: r["rank"])
    pings = [r["p2p_s"] for r in ranks if r.get("p2p_s") is not None]
    costs = chunk_costs(ranks, schedule, float(statistics.median(pings)) if pings else None)
    static = [0.0] * schedule.num_stages
    for r in ranks:
        for stage, nbytes in r["static_bytes_per_stage"].items():
            static[stage] = float(nbytes)
    p = scenario.pipeline
    profile = {
        "scenario": cfg.scenario or "tiny-cpu",
        "schedule": schedule.name,
        "device": ranks[0].get("device", "cpu"),
        "backend": ranks[0].get("backend"),
        "dtype": scenario.training.dtype,
        "threads_per_rank": cfg.threads,
        "steps": cfg.steps,
        **costs,
        "static_bytes": static,
        "clock": clock_summary(ranks, schedule, list(range(len(ranks[0]["history"])))),
    }
    per_chunk = ("forward_s", "backward_input_s", "backward_weight_s", "activation_bytes")
    toml = [
        f"# Measured by `pipeplan profile` ({profile['device']}, {cfg.threads} thread(s) per rank, "
        f"schedule {schedule.name}, {cfg.steps} steps; means over the steady steps, per-action overhead "
        f"{costs['overhead_s'] * 1e3:.3f} ms included).",
        f"# Source scenario: {profile['scenario']}. Simulate it: `pipeplan simulate THIS_FILE --schedule NAME`.",
        "",
        "[pipeline]",
        f"stages = {p.stages}",
        f"microbatches = {p.microbatches}",
        f'schedule = "{p.schedule}"',
        f"virtual_stages = {p.virtual_stages}",
        "",
        "[costs]",
        *(f"{k} = [{', '.join(f'{v:.9g}' for v in costs[k])}]" for k in per_chunk),
        f"p2p_s = {costs['p2p_s']:.9g}",
        f"static_bytes = [{', '.join(f'{v:.9g}' for v in static)}]",
        "",
    ]
    text = "\n".join(toml)
    if cfg.validate:
        profile["validation"] = validate_profile(text, schedule, ranks)
    timelines = pd.concat([timeline_rows(ranks, i).assign(step=r.step, phase=r.phase)
                           for i, r in enumerate(ranks[0]["history"])])
    atomic_write_json(out / "profile.json", profile)
    atomic_write_text(out / "scenario.toml", text)
    atomic_write_text(out / "timelines.csv", timelines.to_csv(index=False))
    return profile


def validate_profile(scenario_text: str, schedule: Schedule, ranks: list[RankResult]) -> dict[str, Any]:
    """Simulate the step under the just-measured costs and compare with the plain steps of the same job."""
    import tomllib

    from pipeplan.sim.config import parse_scenario

    costs = build_cost_table(parse_scenario(tomllib.loads(scenario_text), "profile"))
    predicted = simulate(schedule, costs).makespan_s
    history = ranks[0]["history"]
    plain = [i for i, r in enumerate(history) if r.phase == "plain" and r.step != history[0].step]
    spans = [max(e for acts in aligned_actions(ranks, i) for _a, _s, e in acts) for i in plain]
    measured = float(statistics.median_low(spans))
    return {"measured_makespan_s": measured, "predicted_makespan_s": predicted,
            "makespan_rel_error": rel_error(predicted, measured), "plain_steps": [history[i].step for i in plain],
            "plain_makespans_s": spans}
