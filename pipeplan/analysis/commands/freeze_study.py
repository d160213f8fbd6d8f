"""`pipeplan freeze-study`: what TimelyFreeze costs in training quality, and what it buys in speed.

    pipeplan freeze-study                                         # freeze-study-cpu, caps 0,0.3,0.6,0.9
    pipeplan freeze-study SCEN.toml --caps 0,0.5 --tokens 65536 --out out/fs
    pipeplan freeze-study --methods timelyfreeze,autofreeze,none --caps 0.5,0.9 --seeds 3

The same model is trained once per (method, cap, seed), to the same number of tokens, on the same data:
`--corpus python` (default: the standard library's sources and Language Reference topics that ship with
CPython) or `--corpus pydoc` (the topics alone); a tenth of the documents is held out, and evaluation windows
are drawn only where their bytes occur nowhere in training (runtime/corpus.py). Methods: `timelyfreeze`
(`pipeplan run --freeze timelyfreeze --cap C`: warm-up, monitoring, the LP, a ramp of the cap; cap 0 has the
same phases with a plan that freezes nothing), `autofreeze` (runtime/autofreeze.py: converged blocks front to
back up to C of the parameters), `apf` (runtime/apf.py: stable scalars for adaptive periods, up to C of
them), `uniform` (every action at ratio C) and `none` (run once per seed). Seeds are
--seed, --seed + 1, ...: weights, data order and draws. After each run the final weights (from its end-of-run
checkpoint) are evaluated on held-out text.

    freeze_study.csv   one row per method, cap and seed: cap, tokens, final_loss, heldout_loss,
                       mean_step_time_s, predicted_step_time_s, wall_s, then median_step_time_s,
                       cpu_time_per_step_s, predicted_unfrozen_step_time_s, predicted_gain, planned_mean_ratio,
                       realized_mean_ratio, method, seed, measured_cpu_ratio, prediction_error
    loss_curves.png    training loss against tokens and against wall time, one line per method and cap, the
                       seeds' range as a band
    METHOD-cap-C-seed-S/  that run's `pipeplan run` outputs (metrics.csv, timelines, summary.json, ...)

final_loss is the mean training loss over the last tenth of the steps (one step's loss is one batch's);
mean_step_time_s the mean wall time of the steps after the full cap's first (the same steps for every
method; median and CPU time per step beside it: the CPU time is what other jobs on a shared machine do not
inflate); predicted_step_time_s the LP plan's simulated makespan at the cap, from the run's own monitoring,
and predicted_gain its ratio to the same simulation with nothing frozen (predicted_unfrozen_step_time_s);
measured_cpu_ratio the run's CPU time per step over the same seed's unfrozen run's (method none, else the
method's least cap), and prediction_error = predicted_gain / measured_cpu_ratio - 1; wall_s the whole job,
launch included. The printed report leads with the methods on the front: the (method, cap) points no other
beats on both mean held-out loss and mean CPU time per step.
"""

from __future__ import annotations

import argparse
import math
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipeplan.analysis.commands.run import JobFailed, add_launch_arguments, launch_job, overrides
from pipeplan.analysis.outputs import add_force_argument, output_folder
from pipeplan.common.io import atomic_write_text
from pipeplan.sim.errors import PipeplanError

if TYPE_CHECKING:
    import pandas as pd

    from pipeplan.runtime.config import RunConfig
    from pipeplan.sim.ir import Schedule

DEFAULT_SCENARIO = "freeze-study-cpu"
DEFAULT_CAPS = "0,0.3,0.6,0.9"
HELDOUT_MICROBATCHES = 32  # evaluation windows of the held-out split (x micro_batch_size sequences)
FINAL_SHARE = 0.1  # final_loss: the mean over this last share of the steps
COLUMNS = ("cap", "tokens", "final_loss", "heldout_loss", "mean_step_time_s", "predicted_step_time_s", "wall_s",
           "median_step_time_s", "cpu_time_per_step_s", "predicted_unfrozen_step_time_s", "predicted_gain",
           "planned_mean_ratio", "realized_mean_ratio", "method", "seed", "measured_cpu_ratio",
           "prediction_error")
METHODS = ("timelyfreeze", "apf", "autofreeze", "uniform", "none")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser)
    for action in parser._actions:
        if action.dest == "scenario":
            action.help = f"scenario TOML with a [model] table (default: scenarios/{DEFAULT_SCENARIO}.toml)"
    parser.set_defaults(default_scenario=DEFAULT_SCENARIO)
    parser.add_argument("--caps", default=DEFAULT_CAPS, help=f"freeze caps, one run each (default {DEFAULT_CAPS})")
    parser.add_argument("--methods", default="timelyfreeze",
                        help=f"comma-separated, of {', '.join(METHODS)} (default timelyfreeze; none runs once, cap 0)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="seeds per method and cap: --seed, --seed + 1, ... (default 1)")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens each run trains on (default 65536)")
    parser.add_argument("--corpus", default="python", choices=("python", "pydoc"),
                        help="text to train and evaluate on (default python: stdlib sources and docs)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument("--freeze-warmup", type=int, default=2, help="steps before freezing (default 2)")
    parser.add_argument("--freeze-monitor", type=int, default=8,
                        help="monitoring steps, half of each action's samples frozen (default 8)")
    parser.add_argument("--freeze-ramp", type=int, default=4, help="steps to ramp the cap up (default 4)")
    parser.add_argument("--freeze-redraw", type=int, default=5, help="re-draw frozen sets every K steps (default 5)")
    parser.add_argument("--out", default="out/freeze-study", help="output folder (default: out/freeze-study)")
    add_force_argument(parser)


def parse_caps(text: str) -> list[float]:
    try:
        caps = [float(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise PipeplanError(f"--caps {text}: give comma-separated numbers in [0, 1], e.g. 0,0.3,0.6,0.9") from None
    if not caps or any(not 0 <= c <= 1 for c in caps) or len(set(caps)) != len(caps):
        raise PipeplanError(f"--caps {text}: give distinct numbers in [0, 1], e.g. 0,0.3,0.6,0.9")
    return caps


def run(args: argparse.Namespace) -> int:
    from pipeplan.analysis.console import console
    from pipeplan.runtime.config import RunConfig
    from pipeplan.runtime.train import load_run_scenario
    from pipeplan.scenarios import scenario_path

    caps = parse_caps(args.caps)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods or any(m not in METHODS for m in methods) or len(set(methods)) != len(methods):
        raise PipeplanError(f"--methods {args.methods}: give distinct names of {', '.join(METHODS)}")
    if args.seeds < 1:
        raise PipeplanError(f"--seeds: must be >= 1 (got {args.seeds})")
    # seed-major, so that each seed's runs follow each other: a machine's load drifts over a long study, and a
    # run is compared with its own seed's unfrozen run (measured_cpu_ratio)
    runs = [(m, c, args.seed + k) for k in range(args.seeds) for m in methods for c in ([0.0] if m == "none" else caps)]
    if args.tokens < 1:
        raise PipeplanError(f"--tokens: must be >= 1 (got {args.tokens})")
    scenario = args.scenario or str(scenario_path(DEFAULT_SCENARIO))
    base = RunConfig(scenario=scenario, overrides=overrides(args), schedule_csv=args.schedule_csv, data=args.corpus,
                     seed=args.seed, lr=args.lr, freeze="timelyfreeze", freeze_warmup=args.freeze_warmup,
                     freeze_monitor=args.freeze_monitor, freeze_ramp=args.freeze_ramp,
                     freeze_redraw=args.freeze_redraw, device=args.device, timeout_s=args.timeout_s,
                     threads=args.threads)
    sc, sched = load_run_scenario(base)
    tokens_per_step = sc.training.micro_batch_size * sc.model.seq_len * sched.num_microbatches
    steps = math.ceil(args.tokens / tokens_per_step)
    from pipeplan.analysis.commands.run import MAX_STEPS

    if steps > MAX_STEPS:
        raise PipeplanError(f"--tokens {args.tokens}: {steps:,} steps of {tokens_per_step} tokens, above the limit "
                            f"of {MAX_STEPS:,} steps per run")
    first_steady = args.freeze_warmup + args.freeze_monitor + args.freeze_ramp
    if steps <= first_steady + 1:
        raise PipeplanError(f"--tokens {args.tokens}: {steps} steps of {tokens_per_step} tokens leave no steady "
                            f"steps after warm-up, monitoring and ramp ({first_steady}); give more tokens")
    console.print(f"{len(runs)} runs of {steps} steps x {tokens_per_step} tokens ({steps * tokens_per_step:,} "
                  f"tokens) on {args.corpus} text; {sched.name} p={sched.num_ranks} m={sched.num_microbatches}")
    try:
        study = run_study(args, runs, base, steps, tokens_per_step, sched)
    except JobFailed as exc:
        return exc.code
    print_study(study)
    print(f"wrote {args.out}/: freeze_study.csv loss_curves.png METHOD-cap-C-seed-S/")
    return 0


def run_name(method: str, cap: float, seed: int) -> str:
    return f"{method}-cap-{cap:g}-seed-{seed}"


def run_study(args: argparse.Namespace, runs: list[tuple[str, float, int]], base: RunConfig, steps: int,
              tokens_per_step: int, sched: Schedule) -> pd.DataFrame:
    """One run per (method, cap, seed) into a staged folder that replaces --out as a whole when every run
    succeeded."""
    import pandas as pd
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from pipeplan.analysis.console import console
    from pipeplan.runtime.config import RunConfig

    out = args.out
    with output_folder(args) as stage:  # the whole study lands at once, with its manifest
        rows = []
        columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
                   TimeElapsedColumn())
        with Progress(*columns, console=console) as bar:
            for method, cap, seed in runs:
                name = run_name(method, cap, seed)
                task = bar.add_task(name, total=steps)
                run_dir, ckpt = stage / name, stage / "checkpoints" / name
                progress = stage / f".progress-{name}"
                shutil.rmtree(ckpt, ignore_errors=True)
                cfg = RunConfig(**{**base.__dict__, "steps": steps, "freeze": method, "freeze_cap": cap,
                                   "seed": seed, "checkpoint_dir": str(ckpt), "progress_file": str(progress)})

                def poll(task=task, progress=progress) -> None:
                    if progress.exists():
                        bar.update(task, completed=int(progress.read_text().strip() or 0))

                start = time.perf_counter()
                try:
                    summary = launch_job(cfg, args, str(run_dir), poll=poll)
                except JobFailed as exc:  # leaves the with: the staged study is discarded, --out untouched
                    console.print(f"pipeplan freeze-study: {name}: {exc}; nothing was written to {out}")
                    raise
                wall = time.perf_counter() - start
                bar.update(task, completed=steps)
                progress.unlink(missing_ok=True)
                row = study_row(cap, steps * tokens_per_step, run_dir, summary or {}, wall,
                                heldout_loss(cfg, ckpt, sched.num_ranks), first_steady(args))
                rows.append({**row, "method": method, "seed": seed})
                shutil.rmtree(ckpt, ignore_errors=True)  # weights evaluated; the run's measurements stay
        shutil.rmtree(stage / "checkpoints", ignore_errors=True)
        table = with_measured_ratios(pd.DataFrame(rows, columns=COLUMNS))
        atomic_write_text(stage / "freeze_study.csv", table.to_csv(index=False))
        from pipeplan.analysis.freeze_study_plots import loss_curves

        metrics = {(m, c, s): pd.read_csv(stage / run_name(m, c, s) / "metrics.csv") for m, c, s in runs}
        loss_curves(metrics, tokens_per_step, stage / "loss_curves.png",
                    f"{sched.name} p={sched.num_ranks}: freezing methods and caps, {base.data} text")
    return table


def first_steady(args: argparse.Namespace) -> int:
    return args.freeze_warmup + args.freeze_monitor + args.freeze_ramp


def with_measured_ratios(table: pd.DataFrame) -> pd.DataFrame:
    """measured_cpu_ratio: CPU time per step against the same seed's unfrozen run (method none, else the
    same method at cap 0, else that method's least cap); prediction_error: predicted_gain over it, minus 1."""
    out = table.copy()
    out["realized_mean_ratio"] = out["realized_mean_ratio"].fillna(0.0)  # method none reports no draws
    for i, r in table.iterrows():
        same = table[table["seed"] == r["seed"]]
        base = same[same["method"] == "none"]
        if base.empty:
            mine = same[same["method"] == r["method"]]
            base = mine[mine["cap"] == mine["cap"].min()]
        ratio = r["cpu_time_per_step_s"] / float(base["cpu_time_per_step_s"].iloc[0])
        out.loc[i, "measured_cpu_ratio"] = ratio
        gain = r["predicted_gain"]
        out.loc[i, "prediction_error"] = gain / ratio - 1 if gain == gain and gain is not None else None
    return out


def study_row(cap: float, tokens: int, run_dir: Path, summary: dict, wall_s: float, heldout: float,
              steady_from: int) -> dict:
    import pandas as pd

    metrics = pd.read_csv(run_dir / "metrics.csv")
    tail = metrics.tail(max(1, round(FINAL_SHARE * len(metrics))))
    steady = metrics[metrics["step"] > steady_from]  # the same steps for every method: after the full cap's first
    return {
        "cap": cap,
        "tokens": tokens,
        "final_loss": float(tail["loss"].mean()),
        "heldout_loss": heldout,
        "mean_step_time_s": float(steady["step_time_s"].mean()),
        "predicted_step_time_s": summary.get("planned_makespan_s"),
        "wall_s": wall_s,
        "median_step_time_s": float(steady["step_time_s"].median()),
        "cpu_time_per_step_s": float(steady["cpu_time_s"].mean()),
        "predicted_unfrozen_step_time_s": summary.get("planned_unfrozen_makespan_s"),
        "predicted_gain": (summary["planned_makespan_s"] / summary["planned_unfrozen_makespan_s"]
                           if summary.get("planned_unfrozen_makespan_s") else None),
        "planned_mean_ratio": summary.get("planned_mean_ratio"),
        "realized_mean_ratio": summary.get("realized_mean_ratio"),
    }


def heldout_loss(cfg, ckpt: Path, ranks: int) -> float:
    """Mean loss of the run's final weights (every rank's end-of-run checkpoint, merged: chunks carry the
    full model's parameter names) on HELDOUT_MICROBATCHES windows of the held-out split."""
    import torch

    from pipeplan.runtime import checkpoint
    from pipeplan.runtime.data import heldout_batches
    from pipeplan.runtime.executor import autocast
    from pipeplan.runtime.model import ModelArgs, cross_entropy
    from pipeplan.runtime.stages import build_model
    from pipeplan.runtime.train import AUTOCAST, load_run_scenario

    sc, _ = load_run_scenario(cfg)
    weights: dict = {}
    for rank in range(ranks):
        for chunk in checkpoint.load(ckpt, rank, "cpu")["device"]["chunks"].values():
            weights.update(chunk)
    model = build_model(ModelArgs.from_scenario(sc.model), "cpu", cfg.seed)
    model.load_state_dict(weights)
    batches = heldout_batches(sc.model.vocab, sc.model.seq_len, sc.training.micro_batch_size,
                              HELDOUT_MICROBATCHES, cfg.seed, corpus=cfg.data)
    cpu = torch.device("cpu")
    with torch.no_grad(), autocast(cpu, AUTOCAST[sc.training.dtype]):
        return float(sum(cross_entropy(model(x), y) for x, y in batches) / len(batches))


def summarise(table: pd.DataFrame) -> pd.DataFrame:
    """Per (method, cap): the mean over seeds and the spread (max - min) of the loss, speed and prediction
    columns, and whether the point is on the front (no other has both a lower mean held-out loss and a lower
    mean CPU time per step)."""
    import pandas as pd

    cols = ["heldout_loss", "final_loss", "cpu_time_per_step_s", "measured_cpu_ratio", "predicted_gain",
            "prediction_error", "realized_mean_ratio"]
    g = table.groupby(["method", "cap"], sort=False)[cols]
    spread = (g.max() - g.min()).add_suffix("_spread")
    out = pd.concat([g.mean(), spread, g.size().rename("seeds")], axis=1).reset_index()
    loss, cpu = out["heldout_loss"].to_numpy(), out["cpu_time_per_step_s"].to_numpy()
    out["on_front"] = [not ((loss < loss[k]) & (cpu < cpu[k])).any() for k in range(len(out))]
    return out


def front_line(summary: pd.DataFrame) -> str:
    front = summary[summary["on_front"]].sort_values("cpu_time_per_step_s")
    points = ", ".join(f"{r['method']} cap {r['cap']:g} ({r['heldout_loss']:.3f} at {r['cpu_time_per_step_s']:.3f} "
                       f"CPU-s/step)" for _, r in front.iterrows())
    methods = sorted(set(front["method"]))
    return f"on the front (held-out loss vs CPU time per step, mean over seeds): {', '.join(methods)} — {points}"


def print_study(table) -> None:
    import pandas as pd
    from rich.table import Table

    from pipeplan.analysis.console import console

    summary = summarise(table)
    console.print(front_line(summary))
    t = Table(title="freeze study (mean over seeds, ± half the spread)", header_style="bold")
    for col in ("method", "cap", "seeds", "held-out loss", "CPU s/step", "measured ratio", "predicted ratio",
                "pred. error", "frozen share", "front"):
        t.add_column(col, justify="right")
    def pm(r, col: str, fmt: str) -> str:
        v, d = r[col], r[f"{col}_spread"]
        return "n/a" if pd.isna(v) else f"{v:{fmt}} ± {d / 2:{fmt}}"

    for _, r in summary.iterrows():
        t.add_row(r["method"], f"{r['cap']:g}", str(r["seeds"]), pm(r, "heldout_loss", ".3f"),
                  pm(r, "cpu_time_per_step_s", ".3f"), pm(r, "measured_cpu_ratio", ".3f"),
                  pm(r, "predicted_gain", ".3f"), pm(r, "prediction_error", "+.3f"),
                  f"{r['realized_mean_ratio']:.2f}", "*" if r["on_front"] else "")
    console.print(t)
