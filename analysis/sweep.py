"""What-if sweeps: every combination of a grid of scenario keys, simulated (and freeze-planned) in parallel.

Each configuration is a set of dotted-key overrides of one scenario; its id is a hash of them, so a rerun
skips what `sweep.csv` already holds. Rows are appended as they finish, each with one `write` on an
O_APPEND descriptor followed by fsync; a torn last line (a crash mid-write) is dropped on the next load.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import tomllib
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import pandas as pd

from sim.errors import PipeplanError

METRICS = ["status", "reason", "tokens_per_s", "step_time_s", "bubble_ratio", "max_peak_hbm_bytes", "fits",
           "mfu", "freeze_speedup", "sim_wall_s"]


def parse_grid(items: list[str]) -> dict[str, list[Any]]:
    """`["pipeline.stages=2,4,8", "pipeline.schedule=1f1b,zbv"]` -> {key: [values]} (TOML scalars)."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise PipeplanError(f"--grid {item!r}: expected KEY=V1,V2,... e.g. pipeline.stages=2,4,8")
        if key in grid:
            raise PipeplanError(f"--grid {key}: given twice; list all its values in one --grid")
        grid[key] = [parse_scalar(v.strip()) for v in values.split(",") if v.strip()]
    if not grid:
        raise PipeplanError("--grid: give at least one KEY=V1,V2,...")
    return grid


def parse_scalar(text: str) -> Any:
    """A TOML value (number, bool, string, list), or the bare word itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word such as 1f1b or zbv


def configurations(grid: dict[str, list[Any]]) -> Iterator[dict[str, Any]]:
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        yield dict(zip(keys, values, strict=True))


def config_id(overrides: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:16]


def evaluate(scenario: str | None, overrides: dict[str, Any], plan_freeze: bool) -> dict[str, Any]:
    """One configuration's row; bad combinations come back as status=invalid with the reason."""
    from sim.config import load_scenario
    from solver.step import simulate_with_memory_policy

    row: dict[str, Any] = {"config_id": config_id(overrides), **overrides}
    try:
        sc = load_scenario(scenario, overrides)
        res, _extra = simulate_with_memory_policy(sc)
        row |= {
            "status": "ok",
            "reason": "",
            "tokens_per_s": res.tokens_per_s,
            "step_time_s": res.makespan_s,
            "bubble_ratio": res.bubble_ratio,
            "max_peak_hbm_bytes": float(res.peak_hbm_bytes.max()),
            "fits": not res.oom_over_limit,
            "mfu": res.mfu,
            "sim_wall_s": res.sim_wall_s,
        }
        if plan_freeze:
            row["freeze_speedup"] = _freeze_speedup(sc, res.makespan_s)
    except PipeplanError as exc:
        row |= {"status": "invalid", "reason": str(exc)}
    return row


def _freeze_speedup(sc, makespan_s: float) -> float | None:
    """Step-time ratio unfrozen / freeze-planned at the scenario's cap, under the scenario's memory policy;
    None where the [freeze] settings are unusable (e.g. w_min > w_max)."""
    from solver.errors import FreezeInputError
    from solver.plan import plan_scenario

    try:
        plan = plan_scenario(sc, baselines=False)
    except FreezeInputError:
        return None
    return plan.baseline.makespan_s / plan.solution.makespan_s if plan.solution.makespan_s > 0 else 1.0


def load_rows(path: Path, columns: list[str]) -> pd.DataFrame:
    """The rows already in sweep.csv (torn last line dropped); an error if it was made with another grid."""
    if not path.exists():
        return pd.DataFrame(columns=columns)
    text = path.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    header = text.split("\n", 1)[0].split(",") if text else []
    if header and header != columns:
        raise PipeplanError(f"{path}: was written by a sweep with other grid keys ({', '.join(header[1:-10])}); "
                            "use another --out")
    if not text:
        return pd.DataFrame(columns=columns)
    from io import StringIO

    return pd.read_csv(StringIO(text), keep_default_na=False, na_values=[""]).drop_duplicates("config_id")


def _drop_torn_tail(path: Path) -> None:
    """Cut a partial last line (a crash mid-append) so the next append starts on a fresh line."""
    if path.exists():
        text = path.read_text()
        if text and not text.endswith("\n"):
            from common.io import atomic_write_text

            atomic_write_text(path, text[: text.rfind("\n") + 1])


def append_row(path: Path, row: dict[str, Any], columns: list[str]) -> None:
    line = pd.DataFrame([row], columns=columns).to_csv(index=False, header=False)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size == 0:
            line = ",".join(columns) + "\n" + line
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def run_sweep(
    scenario: str | None,
    grid: dict[str, list[Any]],
    out: Path,
    jobs: int,
    plan_freeze: bool,
    progress: Callable[[int, int], None] | None = None,
) -> pd.DataFrame:
    """Evaluate every configuration not yet in out/sweep.csv; returns all rows."""
    from sim.config import load_scenario

    load_scenario(scenario)  # a bad base scenario is one error, not a thousand invalid rows
    columns = ["config_id", *grid, *METRICS]
    path = out / "sweep.csv"
    out.mkdir(parents=True, exist_ok=True)
    done = load_rows(path, columns)
    _drop_torn_tail(path)
    seen = set(done["config_id"])
    todo = [c for c in configurations(grid) if config_id(c) not in seen]
    total = len(seen) + len(todo)
    if progress:
        progress(len(seen), total)
    if todo:
        with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
            pending = {pool.submit(evaluate, scenario, c, plan_freeze) for c in todo}
            finished = len(seen)
            while pending:
                ready, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in ready:
                    append_row(path, fut.result(), columns)
                    finished += 1
                if progress:
                    progress(finished, total)
    return load_rows(path, columns)


def pareto_front(df: pd.DataFrame) -> pd.DataFrame:
    """Fitting configurations not beaten on both tokens/s (higher) and peak HBM (lower)."""
    ok = df[(df["status"] == "ok") & (df["fits"].astype(str) == "True")].sort_values(
        ["max_peak_hbm_bytes", "tokens_per_s"], ascending=[True, False])
    best = -1.0
    keep = []
    for idx, r in ok.iterrows():
        if r["tokens_per_s"] > best:
            keep.append(idx)
            best = r["tokens_per_s"]
    return ok.loc[keep]
