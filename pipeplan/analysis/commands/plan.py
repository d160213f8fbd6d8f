"""`pipeplan plan`: freeze ratios per action from the TimelyFreeze LP, verified by the simulator.

    pipeplan plan                                   # the built-in 8B scenario at its [freeze] cap (0.9)
    pipeplan plan scenarios/explicit-unit.toml --cap 0.5 --out out/plan-unit
    pipeplan plan --sweep-cap --out out/plan-sweep  # cap 0..0.9 x gpipe, 1f1b, interleaved-1f1b, zbv

Writes plan.json, freeze.csv, baselines.csv, freeze_heatmap.png, gantt_before.png, gantt_after.png and every
`simulate` output of the planned step; with --sweep-cap, sweep.csv and sweep.png.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.markup import escape
from rich.table import Table

from pipeplan.analysis.commands.simulate import (
    VIRTUAL_STAGES_HELP,
    add_scenario_argument,
    add_set_argument,
    scenario_overrides,
)
from pipeplan.analysis.console import busy, console, fit_line, gib, transient_bar
from pipeplan.analysis.freeze_plots import freeze_heatmap, sweep_plot
from pipeplan.analysis.outputs import add_force_argument, output_folder, scenario_title, write_simulation
from pipeplan.analysis.plots import gantt
from pipeplan.common.io import atomic_write_json, atomic_write_text
from pipeplan.sim.config import load_scenario
from pipeplan.sim.schedules import SCHEDULES, schedule_names, sweep_schedules
from pipeplan.sim.trace import fit_fields, hbm_fit, timeline_frame
from pipeplan.solver.freeze_lp import MAKESPAN_ABS_TOL, MAKESPAN_REL_TOL
from pipeplan.solver.plan import FreezePlan, plan_scenario, sweep_caps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_scenario_argument(parser)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--cap", type=float, help="override freeze.cap: the largest mean freeze ratio per stage"
    )
    mode.add_argument(
        "--sweep-cap",
        action="store_true",
        help=f"sweep cap 0..0.9 for {', '.join(sweep_schedules())} (or --schedule only)",
    )
    order = parser.add_mutually_exclusive_group()
    order.add_argument(
        "--schedule", help=f"override pipeline.schedule ({', '.join(schedule_names())})"
    )
    order.add_argument(
        "--schedule-csv", help="plan this action order (torch action-string CSV, one row per rank)"
    )
    parser.add_argument("--virtual-stages", type=int, help=VIRTUAL_STAGES_HELP)
    add_set_argument(parser)
    parser.add_argument("--out", default=None, help="output folder (default: out/plan, or out/plan-sweep)")
    add_force_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.sweep_cap:
        return _run_sweep(args)
    overrides: dict[str, Any] = scenario_overrides(args)
    if args.cap is not None:
        overrides["freeze.cap"] = args.cap
    scenario = load_scenario(args.scenario, overrides)
    with busy(f"planning {scenario.pipeline.schedule}: LP, simulation, baselines"):
        plan = plan_scenario(scenario, args.schedule_csv)
    out = args.out or "out/plan"
    with output_folder(args, out) as stage:
        summary = write_plan(plan, stage, scenario_name=str(args.scenario or "llama3-8b-pp4-h100 (default)"),
                             about=scenario_title(scenario, args.scenario))
    print_plan(summary)
    print(
        f"wrote {out}/: plan.json freeze.csv baselines.csv freeze_heatmap.png gantt_before.png "
        "gantt_after.png "
        "+ simulate outputs of the planned step"
    )
    return 0


def write_plan(plan: FreezePlan, folder: Path, scenario_name: str = "", about: str = "") -> dict[str, Any]:
    """Every output of one plan; returns plan.json's content. `about` names model and device in the titles."""
    sched, sol = plan.schedule, plan.solution
    size = f"p={sched.num_ranks} m={sched.num_microbatches} v={sched.virtual_stages}"
    title = f"{about + ' - ' if about else ''}{sched.name}: {size}, cap {plan.cap:g}"
    actions = plan.actions_table()
    summary: dict[str, Any] = {
        "scenario": scenario_name,
        "schedule": sched.name,
        "stages": sched.num_ranks,
        "virtual_stages": sched.virtual_stages,
        "microbatches": sched.num_microbatches,
        "cap": plan.cap,
        "max_ratio": plan.freeze.max_ratio,
        "time_model": "curve" if plan.dag.curves is not None else "linear",
        "baseline_makespan_s": plan.baseline.makespan_s,
        "planned_makespan_s": sol.makespan_s,
        "simulated_makespan_s": plan.planned.makespan_s,
        "speedup": plan.speedup,
        "throughput_gain": plan.speedup - 1,
        "solve_wall_s": sol.wall_s,
        "mean_freeze_ratio": plan.mean_ratio,
        "stage_mean_freeze_ratio": plan.stage_mean_ratio(),
        "gain_per_freeze": plan.gain_per_freeze,
        "bubble_ratio_before": plan.baseline.bubble_ratio,
        "bubble_ratio_after": plan.planned.bubble_ratio,
        "memory_policy": list(plan.memory.policy) if plan.memory is not None else None,
        **{k: v for k, v in plan.memory_summary.items() if k != "memory_plan"},
        "peak_hbm_bytes_before": float(plan.baseline.peak_hbm_bytes.max()),
        "peak_hbm_bytes_after": float(plan.planned.peak_hbm_bytes.max()),
        "fits_hbm_after": not plan.planned.oom_over_limit,
        "fits_before": hbm_fit(plan.baseline).fits,
        **fit_fields(plan.planned),
        "hbm_capacity_bytes": plan.costs.hbm_bytes if np.isfinite(plan.costs.hbm_bytes) else None,
        "lp": {
            "build_s": sol.build_s,
            "solve_s": sol.solve_s,
            "rows": sol.rows,
            "columns": sol.columns,
            "simplex_iterations": list(sol.iterations),
            "link_transfer_nodes": plan.dag.link_nodes,
            "copy_engine_nodes": plan.dag.copy_nodes,
            "copy_order_rounds": plan.order_rounds,
            "stage2_makespan_tolerance": {
                "relative": MAKESPAN_REL_TOL,
                "absolute_s": MAKESPAN_ABS_TOL * float(plan.dag.w_max.max()),
            },
        },
        "baselines": [
            {
                "name": b.name,
                "mean_freeze_ratio": b.mean_ratio,
                "makespan_s": b.makespan_s,
                "speedup": b.speedup,
                "gain_per_freeze": b.gain_per_freeze,
            }
            for b in plan.baselines
        ],
        "uniform_at_cap": None
        if plan.uniform_at_cap is None
        else {
            "mean_freeze_ratio": plan.uniform_at_cap.mean_ratio,
            "makespan_s": plan.uniform_at_cap.makespan_s,
            "speedup": plan.uniform_at_cap.speedup,
            "gain_per_freeze": plan.uniform_at_cap.gain_per_freeze,
        },
        "uniform_ratio_to_match": plan.uniform_ratio_to_match,
    }
    if plan.costs.post_validation:
        # the step as the simulator counts it under optimizer post-validation: the longest rank span, which the
        # freeze LP (it minimizes the makespan) does not optimize; its gain can differ from the makespan's
        summary["step_time_s_before"] = plan.baseline.step_time_s
        summary["step_time_s_after"] = plan.planned.step_time_s
    if plan.baseline.tokens_per_s is not None:
        summary["tokens_per_s_before"] = plan.baseline.tokens_per_s
        summary["tokens_per_s_after"] = plan.planned.tokens_per_s
    summary["actions"] = actions

    atomic_write_json(folder / "plan.json", summary)
    frame = pd.DataFrame(actions)
    frame.insert(0, "rank", [sched.stage_to_rank[s] for s in frame["stage"]])
    frame["unfrozen_s"] = plan.dag.w_max[: plan.dag.n_actions]
    frame["fully_frozen_s"] = plan.dag.w_min[: plan.dag.n_actions]
    atomic_write_text(folder / "freeze.csv", frame.to_csv(index=False))
    atomic_write_text(
        folder / "baselines.csv",
        pd.DataFrame(
            [
                {
                    "name": "lp-plan",
                    "mean_freeze_ratio": plan.mean_ratio,
                    "makespan_s": plan.planned.makespan_s,
                    "speedup": plan.speedup,
                    "gain_per_freeze": plan.gain_per_freeze,
                }
            ]
            + summary["baselines"]
        ).to_csv(index=False),
    )
    freeze_heatmap(ratio_matrix(plan), folder / "freeze_heatmap.png", f"freeze ratio - {title}")
    gantt(timeline_frame(plan.baseline), folder / "gantt_before.png", f"before freezing - {title}")
    extra = {
        "freeze_plan": "plan.json",
        "baseline_makespan_s": plan.baseline.makespan_s,
        "speedup": plan.speedup,
    }
    write_simulation(plan.planned, folder, f"planned - {title}", extra)
    os.replace(folder / "gantt.png", folder / "gantt_after.png")  # the planned step's Gantt, under one name
    return summary


def ratio_matrix(plan: FreezePlan) -> np.ndarray:
    """(stages, microbatches) ratio of each stage's freezable action (B, or W when backward is split)."""
    out = np.zeros((plan.schedule.num_stages, plan.schedule.num_microbatches))
    for i, r in zip(plan.dag.freezable, plan.solution.ratio, strict=True):
        a = plan.dag.actions[i]
        out[a.stage, a.microbatch] = r
    return out


def print_plan(s: dict[str, Any]) -> None:
    title = (
        f"{s['schedule']}: p={s['stages']} m={s['microbatches']} v={s['virtual_stages']}, cap {s['cap']:g}"
    )
    console.print(fit_line(s, peak_key="peak_hbm_bytes_after"))
    cap = s.get("hbm_capacity_bytes")
    t = Table(title=f"freeze plan - {escape(title)}", header_style="bold")  # the title holds model.name
    mem_col = "peak HBM (GiB)" + (f" of {gib(cap)}" if cap else "")
    for col in ("policy", "mean freeze ratio", "makespan (s)", "speedup", "gain per unit freeze", mem_col):
        t.add_column(col, justify="right")
    gain = s["gain_per_freeze"]

    def mem(x: float, fits: bool) -> str:
        return gib(x) if fits else f"[red]{gib(x)}[/]"

    t.add_row("none", "0", f"{s['baseline_makespan_s']:.6g}", "1.000", "-",
              mem(s["peak_hbm_bytes_before"], s["fits_before"]))
    t.add_row(
        "[bold]LP plan[/]",
        f"{s['mean_freeze_ratio']:.3f}",
        f"{s['simulated_makespan_s']:.6g}",
        f"{s['speedup']:.3f}",
        "-" if gain is None else f"{gain:.3f}",
        mem(s["peak_hbm_bytes_after"], s["fits"]),
    )
    rows = [
        *s["baselines"],
        *([{"name": "uniform at cap", **s["uniform_at_cap"]}] if s["uniform_at_cap"] else []),
    ]
    for b in rows:
        g = b["gain_per_freeze"]
        t.add_row(
            b["name"],
            f"{b['mean_freeze_ratio']:.3f}",
            f"{b['makespan_s']:.6g}",
            f"{b['speedup']:.3f}",
            "-" if g is None else f"{g:.3f}",
            "",
        )
    console.print(t)
    match = s["uniform_ratio_to_match"]
    console.print(
        f"LP {s['planned_makespan_s']:.9g} s = simulated {s['simulated_makespan_s']:.9g} s · "
        f"throughput +{s['throughput_gain']:.1%} · LP build+solve {s['solve_wall_s'] * 1e3:.0f} ms · "
        "uniform freezing "
        + (
            "cannot match the plan within the cap"
            if match is None
            else f"needs r = {match:.3f} to match the plan"
        )
    )
    if "step_time_s_after" in s:
        before, after = s["step_time_s_before"], s["step_time_s_after"]
        console.print(
            f"optimizer post-validation: step (longest rank span) {before:.6g} s -> {after:.6g} s, throughput "
            f"{before / after - 1:+.1%}; the LP minimizes the makespan, not the spans"
        )
    if s["lp"]["copy_engine_nodes"]:
        console.print(
            f"copy engines in the LP: {s['lp']['copy_engine_nodes']} copies, order settled after "
            f"{s['lp']['copy_order_rounds']} solve(s)"
        )
    console.print(
        f"peak HBM {gib(s['peak_hbm_bytes_before'])} GiB before -> {gib(s['peak_hbm_bytes_after'])} GiB after"
        + (f", capacity {gib(cap)} GiB" if cap else "")
    )
    if not s["fits"]:
        console.print(
            f"[bold red]The plan does not fit[/]: rank {s['tightest_rank']} needs "
            f"{gib(s['over_capacity_bytes'])} GiB more than it has; its speedup cannot be had on this device. "
            "Try --set memory.recompute=full, --set memory.plan=true, fewer microbatches in flight (another "
            "--schedule) or a smaller training.micro_batch_size."
        )


def _run_sweep(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in scenario_overrides(args).items() if k != "pipeline.schedule"}
    schedules = sweep_schedules()
    if args.schedule:
        spec = SCHEDULES.get(args.schedule)
        schedules = {args.schedule: args.virtual_stages or (spec.virtual_stages if spec else 1)}
    overrides.pop("pipeline.virtual_stages", None)
    caps = [round(0.1 * k, 1) for k in range(10)]
    with transient_bar() as progress:
        task = progress.add_task("plan --sweep-cap", total=len(schedules) * len(caps))
        rows = sweep_caps(
            args.scenario,
            overrides,
            schedules,
            caps,
            on_step=lambda name, cap: progress.update(task, advance=1, description=f"{name} cap {cap}"),
        )
    sweep = pd.DataFrame(rows)
    out = args.out or "out/plan-sweep"
    with output_folder(args, out) as stage:
        atomic_write_text(stage / "sweep.csv", sweep.to_csv(index=False))
        sweep_plot(
            sweep, stage / "sweep.png", f"LP-planned speedup vs cap - {args.scenario or 'llama3-8b-pp4-h100'}"
        )
    t = Table(title="speedup per schedule and cap (LP plan, verified by simulation)", header_style="bold")
    t.add_column("schedule")
    for cap in caps:
        t.add_column(f"{cap:g}", justify="right")
    for name, g in sweep.groupby("schedule", sort=False):
        t.add_row(name, *(f"{x:.3f}" for x in g["speedup"]))
    console.print(t)
    print(f"wrote {out}/: sweep.csv sweep.png")
    return 0
