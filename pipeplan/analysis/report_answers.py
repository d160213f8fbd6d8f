"""The top of a report: the answer to the question the folder's command was run to ask, before any raw file.

- validate: mean and max error against the published figures, per metric against its target, the worst;
- freeze-study: the fastest cap against cap 0, its held-out loss, the predicted against the measured step;
- search: per GPU count, the winner, the runner-ups, what limits each and the headroom;
- sweep: the fastest configuration that fits (overall and per GPU count), what limits it, a ranked table of
  those that fit, then those that do not, then invalid combinations by reason;
- plan: the speedup, and whether the planned step fits;
- plan --sweep-cap: the fastest planned step over schedules and caps, the largest speedup, the speedup table;
- simulate: step time, throughput, bubble, and whether it fits;
- capacity: the policy that fits the deepest model, and at what speed; with --frontier first the deepest
  model at the asked share of 1F1B's per-layer throughput, per policy;
- run: measured against predicted.

Everything shown is read from the folder's files; nothing is re-simulated. Cells with no value show "—".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd

from pipeplan.analysis.console import step_differs
from pipeplan.analysis.sweep import fitting, invalid_reasons, ranked, speed_column, with_speed
from pipeplan.common.units import GIB

MEMORY_TIGHT = 0.05
"""Headroom below this share of capacity counts as memory limiting the configuration."""
BUBBLE_HIGH = 0.10
"""Bubble ratio above this counts as bubbles limiting the configuration (idle rank-time over the step)."""
COMM_HIGH = 0.10
"""Exposed communication (transfer waits + the step's tail) above this share counts as limiting."""
SPEED_NAMES = {"tokens_per_s_per_gpu": "tokens/s per GPU", "tokens_per_s": "tokens/s", "steps_per_s": "steps/s",
               "samples_per_s_per_gpu": "sequences/s per GPU"}
TOP_FITTING = 20
TOP_NOT_FITTING = 10


class Block(NamedTuple):
    """One piece of the page: 'lead' (the headline answer, a sentence), 'p' (a sentence), 'h2' (a heading),
    'table' (DataFrame), 'image' (Path of a PNG) or 'list' (list of sentences)."""

    kind: str
    payload: Any


def answer(folder: Path) -> tuple[str, list[Block]]:
    """(kind of folder, blocks that answer its question); an empty list when the folder is of no known kind."""
    names = {p.name for p in folder.iterdir()}
    if "search.csv" in names:
        return "search", search_answer(folder)
    if "validation.csv" in names:
        return "validation", validate_answer(folder)
    if "freeze_study.csv" in names:
        return "freeze study", freeze_study_answer(folder)
    if "sweep.csv" in names and "plan.json" not in names:
        if "speedup" in _columns(folder / "sweep.csv"):
            return "freeze cap sweep", plan_sweep_answer(folder)
        return "sweep", sweep_answer(folder)
    if "plan.json" in names:
        return "freeze plan", plan_answer(folder)
    if "capacity.csv" in names:
        return "capacity", capacity_answer(folder)
    if "metrics.csv" in names and "summary.json" in names:
        return "measured run", run_answer(folder)
    if "summary.json" in names:
        return "simulated step", simulate_answer(folder)
    return "pipeplan output", []


def _columns(path: Path) -> list[str]:
    return path.read_text().split("\n", 1)[0].split(",")


def _gib(x: Any) -> str:
    return "—" if x is None or pd.isna(x) else f"{float(x) / GIB:.1f} GiB"


def _pct(x: Any) -> str:
    return "—" if x is None or pd.isna(x) else f"{float(x):.1%}"


def _num(x: Any, spec: str = ",.0f") -> str:
    return "—" if x is None or pd.isna(x) else format(float(x), spec)


# --- sweep -------------------------------------------------------------------------------------------------


def sweep_answer(folder: Path) -> list[Block]:
    from pipeplan.analysis.sweep import load_rows

    cols = _columns(folder / "sweep.csv")
    df = with_speed(load_rows(folder / "sweep.csv", cols))
    keys = [c for c in cols if "." in c]
    col = speed_column(df)
    fit = ranked(fitting(df))
    ok = df[df["status"] == "ok"]
    out: list[Block] = []
    if fit.empty:
        why = "every simulated configuration runs out of HBM" if len(ok) else "no configuration could be simulated"
        out.append(Block("lead", f"Nothing fits: {why} ({len(df)} configurations)."))
    else:
        best = fit.iloc[0]
        out.append(Block("lead", "Best that fits: " + _config(best, keys) + " — " + _speed(best)))
        out.append(Block("list", limits(best, df, keys)))
    if (folder / "pareto.png").exists():
        out.append(Block("image", folder / "pareto.png"))
    if "gpus" in fit and fit["gpus"].nunique() > 1:
        out.append(Block("h2", "Best that fits, per GPU count"))
        per = best_per_gpu_count(fit)
        out.append(Block("table", _sweep_table(per, keys)))
    out.append(Block("h2", f"Configurations that fit ({len(fit)}), fastest first by {SPEED_NAMES.get(col, col)}"))
    if len(fit) > TOP_FITTING:
        out.append(Block("p", f"The first {TOP_FITTING} of {len(fit)}; sweep.csv holds all."))
    out.append(Block("table", _sweep_table(fit.head(TOP_FITTING), keys)))
    if (folder / "heatmap.png").exists():
        out.append(Block("image", folder / "heatmap.png"))
    over = ranked(ok[ok["fits"].astype(str) != "True"])
    if len(over):
        out.append(Block("h2", f"Faster or not, these do not fit HBM ({len(over)})"))
        out.append(Block("table", _sweep_table(over.head(TOP_NOT_FITTING), keys, over=True)))
    reasons = invalid_reasons(df, keys)
    if reasons:
        out.append(Block("h2", f"Invalid combinations ({sum(r.count for r in reasons)}), not simulated"))
        out.append(Block("table", pd.DataFrame([{"count": r.count, "reason": r.reason, "for example": r.example}
                                                for r in reasons])))
    return out


def best_per_gpu_count(fit: pd.DataFrame) -> pd.DataFrame:
    """The first row of each GPU count in `fit` (ranked best first), by GPU count. The ranking decides which row:
    grouping keeps each group's rows in their order, and the final sort is stable (a plain sort_values is
    quicksort, which reorders equal keys and so threw the ranking away)."""
    return fit.groupby("gpus", sort=True).head(1).sort_values("gpus", kind="stable")


# --- search ------------------------------------------------------------------------------------------------

SEARCH_KEYS = ["parallel.tp", "pipeline.stages", "parallel.dp", "pipeline.schedule", "pipeline.virtual_stages",
               "training.micro_batch_size", "pipeline.microbatches", "memory.recompute",
               "memory.offload_activations", "memory.optimizer", "parallel.zero"]
TOP_RUNNERS_UP = 5


def search_answer(folder: Path) -> list[Block]:
    """Per GPU count searched: the winner, the runner-ups, what limits each, and the headroom."""
    df = pd.read_csv(folder / "search.csv") if (folder / "search.csv").stat().st_size > 1 else pd.DataFrame()
    out: list[Block] = []
    if not len(df):
        return [Block("lead", "Nothing was simulated: every candidate was pruned (pruned.csv says why).")]
    df = df.assign(status="ok")
    keys = [k for k in SEARCH_KEYS if k in df]
    for n, group in df.groupby("gpus", sort=True):
        fit = ranked(fitting(group))
        batch = int(group["global_batch"].iloc[0])
        if fit.empty:
            out.append(Block("lead", f"{n} GPUs, global batch {batch}: nothing fits — every candidate that could "
                                     "win runs out of HBM (the closest is "
                                     f"{_gib(group['over_capacity_bytes'].min())} over)."))
            continue
        best = fit.iloc[0]
        head = f"{n} GPUs, global batch {batch}: run " + _config(best, keys).removesuffix(f", on {n} GPUs")
        out.append(Block("lead", head + " — " + _speed(best) + f" Headroom {float(best['headroom_gib']):.1f} GiB."))
        out.append(Block("list", limits(best, group, keys)))
        if len(fit) > 1:
            out.append(Block("h2", f"Runner-ups on {n} GPUs"))
            table = _sweep_table(fit.iloc[1:1 + TOP_RUNNERS_UP], keys)
            table["headroom"] = [f"{v:.1f} GiB" for v in fit["headroom_gib"].iloc[1:1 + TOP_RUNNERS_UP]]
            table["limited by"] = [_limited_by(r) for _, r in fit.iloc[1:1 + TOP_RUNNERS_UP].iterrows()]
            out.append(Block("table", table))
    if (folder / "pruned.csv").exists():
        out.append(Block("h2", "How the rest was ruled out"))
        out.append(Block("p", "A candidate is pruned only when a lower bound proves it cannot fit or cannot beat a "
                              "step already simulated (docs/search.md)."))
        out.append(Block("table", pd.read_csv(folder / "pruned.csv")))
    return out


def validate_answer(folder: Path) -> list[Block]:
    """How close the predictions come to the published figures: overall, per metric against its target, and
    the worst case."""
    from pipeplan.analysis.validation import TARGETS

    df = pd.read_csv(folder / "validation.csv")
    err = pd.to_numeric(df["rel_error"], errors="coerce").abs()
    df = df.assign(abs_error=err)
    if not err.notna().any():
        return [Block("lead", f"No published figure could be predicted ({len(df)} rows).")]
    worst = df.loc[err.idxmax()]
    out = [Block("lead", f"{int(err.notna().sum())} published figures predicted: mean |error| {err.mean():.1%}, "
                         f"max {err.max():.1%} ({worst['source']}, {worst['case']}).")]
    lines = []
    for metric, g in df.groupby("metric", sort=True):
        mean, top = g["abs_error"].mean(), g["abs_error"].max()
        target = TARGETS.get(str(metric))
        verdict = ""
        if target is not None:
            ok = mean <= target[0] and (target[1] is None or top <= target[1])
            verdict = f" — target mean {target[0]:.0%}" + (f" / max {target[1]:.0%}" if target[1] else "") + \
                (": met" if ok else ": **not met**")
        lines.append(f"{metric}: {len(g)} figures, mean |error| {mean:.1%}, max {top:.1%}{verdict}.")
    out.append(Block("list", lines))
    out.append(Block("h2", "Largest errors"))
    out.append(Block("table", df.sort_values("abs_error", ascending=False, kind="stable").head(10)[
        ["source", "case", "metric", "published", "predicted", "rel_error"]].reset_index(drop=True)))
    return out


def freeze_study_answer(folder: Path) -> list[Block]:
    """What freezing bought: the fastest cap's step against cap 0, what it cost in held-out loss, and how well the
    simulator predicted each step."""
    df = pd.read_csv(folder / "freeze_study.csv").sort_values("cap", kind="stable")
    if not len(df):
        return [Block("lead", "The study holds no run.")]
    base = df.iloc[0]
    fast = df.loc[pd.to_numeric(df["mean_step_time_s"], errors="coerce").idxmin()]
    speed = float(base["mean_step_time_s"]) / float(fast["mean_step_time_s"])
    loss = float(fast["heldout_loss"]) - float(base["heldout_loss"])
    out = [Block("lead", f"Cap {fast['cap']:g} is fastest: mean step {float(fast['mean_step_time_s']):.3g} s, "
                         f"{speed:.2f}x cap {base['cap']:g}'s, at a held-out loss of {float(fast['heldout_loss']):.3f}"
                         f" ({loss:+.3f} against cap {base['cap']:g}).")]
    pred = pd.to_numeric(df["predicted_step_time_s"], errors="coerce")
    err = pred / pd.to_numeric(df["mean_step_time_s"], errors="coerce") - 1
    out.append(Block("list", [f"Cap {c:g}: measured {float(m):.3g} s per step, predicted {float(p):.3g} s "
                              f"({e:+.1%}); held-out loss {float(h):.3f}."
                              for c, m, p, e, h in zip(df["cap"], df["mean_step_time_s"], pred, err,
                                                       df["heldout_loss"], strict=True)]))
    return out


def _limited_by(r: pd.Series) -> str:
    """One word on what most holds a configuration back: memory, bubbles, communication, or compute."""
    if float(r.get("headroom_gib", 1e9)) * GIB < MEMORY_TIGHT * float(r["max_peak_hbm_bytes"]):
        return "memory"
    comm = float(r.get("p2p_wait_share", 0) or 0) + float(r.get("step_tail_share", 0) or 0)
    if comm > COMM_HIGH:
        return "communication"
    return "bubbles" if float(r["bubble_ratio"]) > BUBBLE_HIGH else "compute"


def _config(r: pd.Series, keys: list[str]) -> str:
    parts = [f"{k.split('.')[-1]} = {r[k]}" for k in keys]
    if "gpus" in r and not pd.isna(r["gpus"]):
        parts.append(f"on {int(r['gpus'])} GPUs")
    return ", ".join(parts)


def _speed(r: pd.Series) -> str:
    bits = []
    if "tokens_per_s" in r and not pd.isna(r["tokens_per_s"]):
        per = r.get("tokens_per_s_per_gpu")
        bits.append(f"{_num(r['tokens_per_s'])} tokens/s" + ("" if per is None or pd.isna(per)
                                                               else f" ({_num(per)} per GPU)"))
    if "samples_per_s_per_gpu" in r and not pd.isna(r["samples_per_s_per_gpu"]):
        bits.append(f"{_num(r['samples_per_s_per_gpu'], '.4g')} sequences/s per GPU")
    bits.append(f"step {_num(r['step_time_s'], '.4g')} s")
    bits.append(f"peak HBM {_gib(r['max_peak_hbm_bytes'])}")
    if "mfu" in r and not pd.isna(r["mfu"]):
        bits.append(f"MFU {_pct(r['mfu'])}")
    return ", ".join(bits) + "."


def limits(best: pd.Series, df: pd.DataFrame, keys: list[str]) -> list[str]:
    """What stops the best fitting configuration from being faster: memory, bubbles, communication, or neither."""
    out = []
    col = speed_column(df)
    ok = df[df["status"] == "ok"]
    faster = ok[(ok[col] > best[col]) & (ok["fits"].astype(str) != "True")]
    if "gpus" in ok and not pd.isna(best.get("gpus")):
        faster = faster[faster["gpus"] == best["gpus"]]
    cap = _limit_bytes(best, ok)
    if cap:
        headroom = cap - float(best["max_peak_hbm_bytes"])
        line = f"Memory: peak HBM {_gib(best['max_peak_hbm_bytes'])} of {_gib(cap)} ({_gib(headroom)} free)"
        if len(faster):
            top = ranked(faster).iloc[0]
            line += (f"; {len(faster)} faster configuration(s) on as many GPUs do not fit — the fastest, "
                     f"{_config(top, keys)}, needs {_gib(top['max_peak_hbm_bytes'])} ({_num(top[col])} "
                     f"{SPEED_NAMES.get(col, col)})")
        out.append(("**Limited by memory.** " if len(faster) or headroom < MEMORY_TIGHT * cap else "") + line + ".")
    bubble = float(best["bubble_ratio"])
    prefix = "**Limited by bubbles.** " if bubble > BUBBLE_HIGH else ""
    out.append(f"{prefix}Bubbles: ranks idle {_pct(bubble)} of the step (pipeline fill and drain, waits on "
               "neighbours and on transfers); more microbatches or a zero-bubble schedule shrink it.")
    comm = [float(best.get(c, float("nan"))) for c in ("p2p_wait_share", "step_tail_share")]
    if not any(pd.isna(x) for x in comm):
        p2p, tail = comm
        prefix = "**Limited by communication.** " if p2p + tail > COMM_HIGH else ""
        out.append(f"{prefix}Communication: ranks wait {_pct(p2p)} of the step only for activations or gradients "
                   f"in transit between stages (inside the bubble above); the data-parallel gradient reduction and "
                   f"optimizer step after the pipeline take {_pct(tail)} of the step.")
    if not pd.isna(best.get("mfu", float("nan"))):
        out.append(f"Compute: MFU {_pct(best['mfu'])} (busy GPUs at the device's sustained efficiency; the rest is "
                   "bubbles and recomputation).")
    if "global_batch" in df and df.loc[df["status"] == "ok", "global_batch"].nunique() > 1:
        out.append(f"Global batch {int(best['global_batch'])} sequences: the sweep varies it, and a larger batch "
                   "changes training, not only speed — compare rows of the same global batch.")
    return out


def _limit_bytes(best: pd.Series, ok: pd.DataFrame) -> float | None:
    """capacity - margin of the sweep's device: read back from any row that does not fit (peak - over)."""
    if "over_capacity_bytes" not in ok:
        return None
    over = ok[pd.to_numeric(ok["over_capacity_bytes"], errors="coerce") > 0]
    if not len(over):
        return None
    r = over.iloc[0]
    return float(r["max_peak_hbm_bytes"]) - float(r["over_capacity_bytes"])


def _sweep_table(rows: pd.DataFrame, keys: list[str], over: bool = False) -> pd.DataFrame:
    table = pd.DataFrame({k.split(".")[-1]: rows[k] for k in keys})
    for src, name, fmt in [
        ("gpus", "GPUs", lambda v: _num(v, ".0f")),
        ("global_batch", "global batch", lambda v: _num(v, ".0f")),
        ("tokens_per_s_per_gpu", "tokens/s per GPU", _num),
        ("tokens_per_s", "tokens/s", _num),
        ("step_time_s", "step (s)", lambda v: _num(v, ".4g")),
        ("bubble_ratio", "bubble", _pct),
        ("max_peak_hbm_bytes", "peak HBM", _gib),
        ("mfu", "MFU", _pct),
        ("freeze_speedup", "freeze speedup", lambda v: _num(v, ".3f")),
    ]:
        if src in rows and rows[src].notna().any():
            table[name] = [fmt(v) for v in rows[src]]
    if over and "over_capacity_bytes" in rows:
        table["over capacity"] = [_gib(v) for v in rows["over_capacity_bytes"]]
        if "tightest_rank" in rows:
            table["on rank"] = [_num(v, ".0f") for v in rows["tightest_rank"]]
    return table.reset_index(drop=True)


# --- simulate, plan, capacity, run --------------------------------------------------------------------------


def _fits_sentence(s: dict[str, Any], peak: float) -> str:
    limit = s.get("hbm_limit_bytes")
    if limit is None:
        return "No HBM capacity is set, so nothing is checked against it."
    if s.get("fits", True):
        return f"Fits: the tightest rank ({s.get('tightest_rank')}) peaks at {_gib(peak)} of {_gib(limit)}."
    return (f"**Does not fit**: rank {s.get('tightest_rank')} needs {_gib(peak)} of {_gib(limit)} — "
            f"{_gib(s.get('over_capacity_bytes'))} over.")


def simulate_answer(folder: Path) -> list[Block]:
    s = json.loads((folder / "summary.json").read_text())
    what = f"{s['schedule']}, {s['stages']} stages × {s['virtual_stages']} chunks, {s['microbatches']} microbatches"
    step, makespan = s.get("step_time_s", s["makespan_s"]), s["makespan_s"]
    lead = f"{what}: one step takes {_num(step, '.4g')} s"
    if "tokens_per_s" in s:
        lead += f", {_num(s['tokens_per_s'])} tokens/s at MFU {_pct(s.get('mfu'))}"
    if not step_differs(s, ".4g"):
        lead += f"; ranks are idle {_pct(s['bubble_ratio'])} of it."
    else:
        lead += (f"; the pipeline's makespan is {_num(makespan, '.4g')} s and ranks are idle "
                 f"{_pct(s['bubble_ratio'])} of that.")
    out = [Block("lead", lead), Block("p", _fits_sentence(s, max(s["peak_hbm_bytes"])))]
    ranks = pd.DataFrame({"rank": range(len(s["peak_hbm_bytes"])),
                          "peak activations": [_gib(x) for x in s["peak_activation_bytes"]],
                          "static (weights, grads, optimizer)": [_gib(x) for x in s["static_bytes"]],
                          "peak HBM": [_gib(x) for x in s["peak_hbm_bytes"]]})
    out += [Block("h2", "Memory per rank"), Block("table", ranks)]
    out += [Block("image", folder / n) for n in ("gantt.png", "memory.png") if (folder / n).exists()]
    return out


def plan_answer(folder: Path) -> list[Block]:
    s = json.loads((folder / "plan.json").read_text())
    lead = (f"Freezing at cap {s['cap']:g} makes the {s['schedule']} step {s['speedup']:.3f}× faster "
            f"({_num(s['baseline_makespan_s'], '.4g')} s → {_num(s['simulated_makespan_s'], '.4g')} s, "
            f"mean freeze ratio {s['mean_freeze_ratio']:.3f}).")
    out = [Block("lead", lead)]
    if "step_time_s_after" in s:  # optimizer post-validation: the step is not the makespan the LP minimizes
        before, after = s["step_time_s_before"], s["step_time_s_after"]
        out.append(Block("p", f"With optimizer post-validation the step is the longest rank span: "
                              f"{_num(before, '.4g')} s → {_num(after, '.4g')} s ({before / after:.3f}× faster); "
                              "the LP minimizes the makespan, not the spans."))
    if "fits" in s:
        out.append(Block("p", _fits_sentence(s, s["peak_hbm_bytes_after"])
                         + ("" if s["fits"] else " The speedup cannot be had on this device as configured.")))
    rows = [{"policy": "LP plan", "mean freeze ratio": s["mean_freeze_ratio"],
             "makespan (s)": s["simulated_makespan_s"], "speedup": s["speedup"]}]
    rows += [{"policy": b["name"], "mean freeze ratio": b["mean_freeze_ratio"], "makespan (s)": b["makespan_s"],
              "speedup": b["speedup"]} for b in s.get("baselines", [])]
    table = pd.DataFrame(rows)
    for c in ("mean freeze ratio", "speedup"):
        table[c] = [_num(v, ".3f") for v in table[c]]
    table["makespan (s)"] = [_num(v, ".4g") for v in table["makespan (s)"]]
    out += [Block("h2", "Against the baselines (same mean freeze ratio)"), Block("table", table)]
    out += [Block("image", folder / n) for n in ("freeze_heatmap.png", "gantt_before.png", "gantt_after.png",
                                                 "memory.png") if (folder / n).exists()]
    return out


def plan_sweep_answer(folder: Path) -> list[Block]:
    """`plan --sweep-cap`: one row per (schedule, cap), each an LP plan verified by simulation."""
    df = pd.read_csv(folder / "sweep.csv")
    if df.empty:
        return [Block("lead", "The cap sweep planned no (schedule, cap) pair.")]
    fast = df.loc[df["simulated_makespan_s"].idxmin()]
    lead = (f"Fastest planned step: {fast['schedule']} at cap {fast['cap']:g}, "
            f"{_num(fast['simulated_makespan_s'], '.4g')} s ({fast['speedup']:.3f}× faster than its unfrozen "
            f"{_num(fast['baseline_makespan_s'], '.4g')} s; {len(df)} schedule × cap plans).")
    out = [Block("lead", lead)]
    most = df.loc[df["speedup"].idxmax()]
    if most.name != fast.name:
        out.append(Block("p", f"Largest speedup: {most['schedule']} at cap {most['cap']:g}, {most['speedup']:.3f}× "
                              f"({_num(most['baseline_makespan_s'], '.4g')} s → "
                              f"{_num(most['simulated_makespan_s'], '.4g')} s)."))
    label = df["schedule"].astype(str)
    if df.groupby("schedule")["virtual_stages"].nunique().max() > 1:
        label = label + " (v = " + df["virtual_stages"].astype(str) + ")"
    table = df.assign(schedule=label).pivot_table(index="schedule", columns="cap", values="speedup", sort=False)
    table.columns = [f"{c:g}" for c in table.columns]
    table = table.map(lambda v: _num(v, ".3f")).reset_index()
    out += [Block("h2", "Speedup per schedule and cap (LP plan, verified by simulation)"), Block("table", table)]
    out += [Block("image", folder / "sweep.png")] if (folder / "sweep.png").exists() else []
    return out


def capacity_answer(folder: Path) -> list[Block]:
    df = pd.read_csv(folder / "capacity.csv")
    out: list[Block] = frontier_answer(folder) if (folder / "frontier_answers.csv").exists() else []
    if len(df) and df["max_layers"].max() > 0:
        deep = df.sort_values("max_layers", ascending=False).iloc[0]
        lead = f"Deepest model that fits: {int(deep['max_layers'])} layers under {deep['policy']}"
        if "params" in deep and not pd.isna(deep["params"]):
            lead += f" ({deep['params'] / 1e9:.1f} B parameters)"
        if "layer_tokens_per_s" in df and df["layer_tokens_per_s"].notna().any():
            fast = df.sort_values("layer_tokens_per_s", ascending=False).iloc[0]
            lead += f"; most throughput per unit of depth: {fast['policy']}"
        out.append(Block("p" if out else "lead", lead + "."))
    else:
        out.append(Block("p" if out else "lead", "No policy fits even the shallowest model of this width."))
    table = pd.DataFrame({"policy": df["policy"], "max layers": df["max_layers"]})
    for src, name, fmt in [("params", "parameters (B)", lambda v: _num(v / 1e9, ".1f")),
                           ("tokens_per_s", "tokens/s there", _num),
                           ("layers_vs_1f1b", "layers vs 1F1B", lambda v: _num(v, ".2f")),
                           ("layer_throughput_vs_1f1b", "throughput x layers vs 1F1B", lambda v: _num(v, ".2f")),
                           ("fits_scenario_layers", "scenario's depth fits", lambda v: "—" if pd.isna(v) else str(v))]:
        if src in df:
            table[name] = [fmt(v) for v in df[src]]
    out += [Block("h2", "Per memory policy"), Block("table", table)]
    out += [Block("image", folder / "capacity.png")] if (folder / "capacity.png").exists() else []
    return out


def frontier_answer(folder: Path) -> list[Block]:
    """`capacity --frontier`: the deepest model at >= the asked share of plain 1F1B's per-layer throughput,
    per policy (frontier_answers.csv), then the frontier figure; the blocks lead the capacity page."""
    ans = pd.read_csv(folder / "frontier_answers.csv")
    share = f"{ans['min_throughput'].iloc[0]:.0%}" if len(ans) else "the asked share"
    found = ans[ans["layers"].notna()]
    if len(found):
        best = found.sort_values(["layers", "layer_throughput_vs_1f1b"], ascending=False).iloc[0]
        lead = (f"Deepest model at >= {share} of plain 1F1B's per-layer throughput: {int(best['layers'])} layers "
                f"({best['layers_vs_1f1b']:.2f}x 1F1B's deepest fit) under {best['policy']}, at "
                f"{best['layer_throughput_vs_1f1b']:.2f}x 1F1B's per-layer throughput.")
    else:
        lead = f"No policy keeps {share} of plain 1F1B's per-layer throughput at any depth."
    table = pd.DataFrame({"policy": ans["policy"],
                          "layers": [_num(v, ".0f") for v in ans["layers"]],
                          "x 1F1B's depth": [_num(v, ".2f") for v in ans["layers_vs_1f1b"]],
                          "throughput x layers vs 1F1B": [_num(v, ".3f") for v in ans["layer_throughput_vs_1f1b"]],
                          "tokens/s": [_num(v) for v in ans["tokens_per_s"]],
                          "chosen": [v if isinstance(v, str) and v else "—" for v in ans["variant"]]})
    out = [Block("lead", lead), Block("h2", f"Deepest model at >= {share} of plain 1F1B's per-layer throughput"),
           Block("table", table)]
    return out + ([Block("image", folder / "frontier.png")] if (folder / "frontier.png").exists() else [])


def run_answer(folder: Path) -> list[Block]:
    s = json.loads((folder / "summary.json").read_text())
    if "measured_makespan_s" not in s:
        return simulate_answer(folder)
    err = s.get("makespan_rel_error")
    lead = (f"Measured step {_num(s['measured_makespan_s'] * 1e3, '.2f')} ms against "
            f"{_num(s['predicted_makespan_s'] * 1e3, '.2f')} ms predicted"
            + ("" if err is None else f" ({err:+.1%})") + f"; {_num(s.get('tokens_per_s'))} tokens/s on "
            f"{s.get('device', '—')}, final loss {_num(s.get('final_loss'), '.4f')}.")
    out = [Block("lead", lead)]
    out += [Block("image", folder / n) for n in ("gantt.png", "memory.png", "loss.png") if (folder / n).exists()]
    return out
