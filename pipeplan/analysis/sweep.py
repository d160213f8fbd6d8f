"""What-if sweeps: every combination of a grid of scenario keys, simulated (and freeze-planned) in parallel.

Each configuration is a set of dotted-key overrides of one scenario; its id is a hash of them, so a rerun
skips what `sweep.csv` already holds. Rows are appended as they finish, each with one `write` on an
O_APPEND descriptor followed by fsync; a torn last line (a crash mid-write) is dropped on the next load.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
import tomllib
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Annotated, Any, NamedTuple, get_args

import pandas as pd

from pipeplan.common.io import append_fsynced
from pipeplan.sim.errors import PipeplanError

METRICS = ["status", "reason", "gpus", "global_batch", "tokens_per_s", "tokens_per_s_per_gpu", "step_time_s",
           "bubble_ratio", "p2p_wait_share", "step_tail_share",
           "max_peak_hbm_bytes", "fits", "tightest_rank", "over_capacity_bytes", "mfu",
           "freeze_speedup", "sim_wall_s"]
"""sweep.csv's columns after config_id and the grid keys. gpus = stages x tp x dp; global_batch = sequences per
step (microbatches x micro_batch_size x dp); tokens_per_s_per_gpu makes configurations of different sizes
comparable. p2p_wait_share: rank-time idle only because an input was on a link (part of the bubble);
step_tail_share: the step after the pipeline's last action (data-parallel gradient reduction, optimizer step), 0
where the step is shorter than the makespan (step_tail_share)."""


def step_tail_share(makespan_s: float, step_time_s: float) -> float:
    """The share of the step after the pipeline's makespan: its tails (data-parallel gradient reduction,
    optimizer step). Never below 0: with training.optimizer_post_validation the step is the longest rank span
    (from the rank's first action to its optimizer step's end), which can be shorter than the makespan (from
    the first rank's start to the last rank's end); no part of that step runs after the pipeline, and a
    negative share would read as time saved and lower the communication total the report judges
    (p2p_wait_share + this)."""
    return max(0.0, 1.0 - makespan_s / step_time_s) if step_time_s > 0 else 0.0


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
        parsed = [parse_scalar(v.strip()) for v in values.split(",") if v.strip()]
        grid[key] = list({_value_key(v): v for v in reversed(parsed)}.values())[::-1]  # once each, first kept
    if not grid:
        raise PipeplanError("--grid: give at least one KEY=V1,V2,...")
    return grid


def _value_key(value: Any) -> str:
    """Values equal as config_id sees them (4 and 4 are one value; 4, 4.0 and true are three)."""
    return json.dumps(value, sort_keys=True)


def validate_grid(grid: dict[str, list[Any]]) -> None:
    """Refuse, before any work, a grid key the scenario does not have, a value of the wrong type or out of its
    field's range, and a grid of more than MAX_SWEEP_CONFIGS combinations. What depends on other keys
    (layers divisible by stages, a schedule's virtual stages) stays a per-row `invalid` with its reason."""
    import math

    from pydantic import ConfigDict, TypeAdapter, ValidationError

    from pipeplan.sim.limits import MAX_SWEEP_CONFIGS

    total = math.prod(len(v) for v in grid.values())
    if total > MAX_SWEEP_CONFIGS:
        raise PipeplanError(f"--grid: {total:,} combinations; the limit is {MAX_SWEEP_CONFIGS:,}")
    for key, values in grid.items():
        field = _scenario_field(key)
        ann = field.annotation if not field.metadata else Annotated[field.annotation, *field.metadata]
        check = TypeAdapter(ann, config=ConfigDict(strict=True))
        for value in values:
            try:
                check.validate_python(value)
            except ValidationError as exc:
                msg = exc.errors(include_url=False)[0]["msg"]
                raise PipeplanError(f"--grid {key}: value {str(value)[:40]!r}: {msg.lower()}") from None


def _scenario_field(key: str) -> Any:
    """The pydantic field of a dotted scenario key; PipeplanError listing the allowed keys if none."""
    from pydantic import BaseModel

    from pipeplan.sim.config import Scenario

    model: type[BaseModel] = Scenario
    parts = key.split(".")
    for depth, part in enumerate(parts):
        field = model.model_fields.get(part)
        where = ".".join(parts[:depth]) or "scenario"
        if field is None:
            raise PipeplanError(f"--grid {key[:60]}: {where} has no key {part[:40]!r}; allowed: "
                                f"{', '.join(model.model_fields)}")
        if depth == len(parts) - 1:
            return field
        options = get_args(field.annotation) or (field.annotation,)
        inner = next((a for a in options if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if inner is None:
            raise PipeplanError(f"--grid {key[:60]}: {'.'.join(parts[: depth + 1])} is a value, not a table")
        model = inner
    raise PipeplanError(f"--grid {key[:60]}: not a scenario key")


def parse_scalar(text: str) -> Any:
    """A TOML value (number, bool, string, list), or the bare word itself; one value only (a newline would let
    `4\nfoo=1` set a second key), and no TOML date or time (no scenario key takes one; JSON has none)."""
    if "\n" in text or "\r" in text:
        raise PipeplanError(f"value {text[:40]!r}: holds a line break; give one value")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word such as 1f1b or zbv
    except (RecursionError, ValueError):  # arrays nested thousands deep; integers of 4,300+ digits
        raise PipeplanError(f"value {text[:40]!r}...: nested too deeply or too long to be a TOML value") from None
    if _has_datetime(value):
        raise PipeplanError(f"value {text[:40]!r}: a TOML date or time; give a number, string or boolean")
    return value


def _has_datetime(value: Any) -> bool:
    import datetime

    if isinstance(value, datetime.date | datetime.time):
        return True
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return any(_has_datetime(v) for v in items)


def configurations(grid: dict[str, list[Any]]) -> Iterator[dict[str, Any]]:
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        yield dict(zip(keys, values, strict=True))


def config_id(overrides: dict[str, Any], base: dict[str, Any] | None = None) -> str:
    """Hash of one configuration: the grid's values plus the sweep's --set overrides (none: as before)."""
    return hashlib.sha1(json.dumps({**(base or {}), **overrides}, sort_keys=True).encode()).hexdigest()[:16]


def evaluate(
    scenario: str | None, overrides: dict[str, Any], plan_freeze: bool, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One configuration's row; bad combinations come back as status=invalid with the reason."""
    from pipeplan.sim.config import load_scenario
    from pipeplan.sim.trace import hbm_fit
    from pipeplan.solver.step import simulate_with_memory_policy

    row: dict[str, Any] = {"config_id": config_id(overrides, base), **overrides}
    try:
        sc = load_scenario(scenario, {**(base or {}), **overrides})
        res, _extra = simulate_with_memory_policy(sc)
        fit = hbm_fit(res)
        gpus = sc.pipeline.stages * sc.parallel.tp * sc.parallel.dp
        row |= {
            "status": "ok",
            "reason": "",
            "gpus": gpus,
            "global_batch": sc.pipeline.microbatches * sc.training.micro_batch_size * sc.parallel.dp,
            "tokens_per_s": res.tokens_per_s,
            "tokens_per_s_per_gpu": None if res.tokens_per_s is None else res.tokens_per_s / gpus,
            "step_time_s": res.step_time_s,
            "bubble_ratio": res.bubble_ratio,
            "p2p_wait_share": res.p2p_wait_share,
            "step_tail_share": step_tail_share(res.makespan_s, res.step_time_s),
            "max_peak_hbm_bytes": float(res.peak_hbm_bytes.max()),
            "fits": fit.fits,
            "tightest_rank": fit.rank,
            "over_capacity_bytes": fit.over_bytes,
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
    from pipeplan.solver.errors import FreezeInputError
    from pipeplan.solver.plan import plan_scenario

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


MAX_SWEEP_CSV_BYTES = 1 * 2**30
"""sweep.csv of MAX_SWEEP_CONFIGS rows is ~50 MB; a larger file is not one this sweep wrote."""
REJECTED = "sweep.rejected.csv"
"""Lines of sweep.csv that are not rows this sweep wrote (garbage, a flipped id, NULs, a torn end)."""


def repair_sweep_csv(path: Path, columns: list[str], base: dict[str, Any] | None = None) -> int:
    """Move every line of `path` that is not a well-formed row of this grid to sweep.rejected.csv (so its
    configuration is computed again) and cut a torn last line; returns the number of lines moved.

    A row is kept when it has one field per column, a status of ok or invalid, no NUL, valid UTF-8, and a
    config_id equal to the hash of its own grid values (with the sweep's --set `base`): a line damaged
    anywhere in its id or its values is caught, and so is a row made under other --set values. A header of
    another grid is an error (another sweep's folder), as before.
    """
    if not path.exists() and not path.is_symlink():
        return 0
    from pipeplan.common.io import InputError, read_input_bytes

    try:  # a fifo is refused before it is opened (it would block forever), a symlink before it is followed
        data = read_input_bytes(path, MAX_SWEEP_CSV_BYTES, "resume:", follow_links=False)
    except InputError as exc:
        raise PipeplanError(f"{exc}; use another --out") from None
    *lines, tail = data.split(b"\n")  # tail: b"" when the file ends with a newline, else a torn line
    header = ",".join(columns).encode()
    if not lines:  # nothing complete yet: at most a torn header
        if tail and not header.startswith(tail):
            raise PipeplanError(f"{path}: does not start with this sweep's header; use another --out")
        if tail:
            _rewrite(path, [])
        return 0
    if lines[0] != header:
        shown = lines[0][:80].decode(errors="replace")
        raise PipeplanError(f"{path}: was written by a sweep with other grid keys ({shown}); use another --out")
    grid_keys = [c for c in columns[1:] if c not in METRICS]
    good: list[bytes] = []
    bad: list[bytes] = []
    seen: set[str] = set()
    for line in lines[1:]:
        cid = _row_id(line, columns, grid_keys, base)
        (good if cid is not None and cid not in seen else bad).append(line)
        seen.add(cid or "")
    if tail:
        bad.append(tail)
    if bad:
        append_fsynced(path.parent / REJECTED, b"".join(line + b"\n" for line in bad))
        _rewrite(path, [header, *good])
    return len(bad)


def _rewrite(path: Path, lines: list[bytes]) -> None:
    from pipeplan.common.io import atomic_write_bytes

    atomic_write_bytes(path, b"".join(line + b"\n" for line in lines))


def _row_id(line: bytes, columns: list[str], grid_keys: list[str], base: dict[str, Any] | None) -> str | None:
    """The config_id of a well-formed row of this grid, or None for anything else."""
    import csv

    if b"\0" in line:
        return None
    try:
        fields = next(csv.reader([line.decode("utf-8")]), [])
    except (UnicodeDecodeError, csv.Error):
        return None
    if len(fields) != len(columns) or fields[columns.index("status")] not in ("ok", "invalid"):
        return None
    try:
        overrides = {k: _cell_value(fields[1 + i]) for i, k in enumerate(grid_keys)}
    except PipeplanError:
        return None
    if config_id(overrides, base) != fields[0] or not metrics_valid(dict(zip(columns, fields, strict=True))):
        return None
    return fields[0]


INTEGER_METRICS = ("gpus", "global_batch")
OPTIONAL_INTEGER_METRICS = ("tightest_rank",)
NUMBER_METRICS = ("tokens_per_s", "tokens_per_s_per_gpu", "step_time_s", "bubble_ratio", "p2p_wait_share",
                  "step_tail_share", "max_peak_hbm_bytes", "over_capacity_bytes", "mfu", "freeze_speedup",
                  "sim_wall_s")
"""How evaluate() fills a row of status ok: counts, an optional rank, finite numbers (or empty where the
simulator gives none), and fits as True/False; a resumed row is held to the same."""


def metrics_valid(cells: dict[str, str]) -> bool:
    """Whether the metric cells of one sweep.csv row are what evaluate() writes: a resumed row whose cell does
    not parse (`12x4.5`, `nan`) would otherwise pass into every later ranking and plot."""
    import math

    if cells["status"] == "invalid":
        return bool(cells["reason"]) and all(cells[k] == "" for k in METRICS if k not in ("status", "reason"))
    if cells["fits"] not in ("True", "False"):
        return False
    for key in INTEGER_METRICS + OPTIONAL_INTEGER_METRICS:
        text = cells[key]
        if text == "" and key in OPTIONAL_INTEGER_METRICS:
            continue
        if not (text.isdigit() or (text.endswith(".0") and text[:-2].isdigit())) or len(text) > 20:
            return False
    for key in NUMBER_METRICS:
        if cells[key] == "":
            continue
        try:
            if not math.isfinite(float(cells[key])):
                return False
        except ValueError:
            return False
    return True


def _cell_value(text: str) -> Any:
    """A grid value back from its CSV cell (pandas writes booleans as True/False, TOML as true/false)."""
    return {"True": True, "False": False}.get(text, parse_scalar(text) if text else text)


def append_row(path: Path, row: dict[str, Any], columns: list[str]) -> None:
    row = {k: " ".join(v.split()) if isinstance(v, str) else v for k, v in row.items()}  # one line per row
    line = pd.DataFrame([row], columns=columns).to_csv(index=False, header=False)
    append_fsynced(path, line.encode(), first=(",".join(columns) + "\n").encode())


def run_sweep(
    scenario: str | None,
    grid: dict[str, list[Any]],
    out: Path,
    jobs: int,
    plan_freeze: bool,
    progress: Callable[[int, int], None] | None = None,
    base: dict[str, Any] | None = None,
    scheduler: str | None = None,
    gpus: set[int] | None = None,
    global_batch: int | None = None,
) -> pd.DataFrame:
    """Evaluate every configuration not yet in out/sweep.csv; returns all rows.

    `gpus` and `global_batch` keep only the configurations of that many GPUs (stages x tp x dp) and that many
    sequences per step (microbatches x micro_batch_size x dp): the question "N GPUs, batch B" held fixed while
    the grid varies the rest. Combinations that do not load stay in, as invalid rows.

    `base` holds --set overrides applied under every configuration. The work runs in `jobs` local processes,
    or, with `scheduler` (a Dask distributed address such as tcp://host:8786), on that cluster's workers;
    either way rows are appended here, as they finish, so both resume the same way.
    """
    from pipeplan.sim.config import load_scenario

    load_scenario(scenario, base)  # a bad base scenario is one error, not a thousand invalid rows
    validate_grid(grid)  # so is a misspelt key or a value of the wrong type
    columns = ["config_id", *grid, *METRICS]
    path = out / "sweep.csv"
    out.mkdir(parents=True, exist_ok=True)
    moved = repair_sweep_csv(path, columns, base)
    if moved:
        print(f"warning: {path}: {moved} damaged line(s) (or rows of other --set values) moved to {REJECTED}; "
              "computing them again", file=sys.stderr)
    done = load_rows(path, columns)
    seen = set(done["config_id"])
    todo = [c for c in configurations(grid) if config_id(c, base) not in seen]
    if gpus is not None or global_batch is not None:
        todo = [c for c in todo if within(scenario, {**(base or {}), **c}, gpus, global_batch)]
    total = len(seen) + len(todo)
    if progress:
        progress(len(seen), total)
    if todo:
        run = _run_on_cluster if scheduler else _run_locally
        finished = len(seen)
        for row in run(scenario, todo, plan_freeze, base, jobs=jobs, scheduler=scheduler):
            append_row(path, row, columns)
            finished += 1
            if progress:
                progress(finished, total)
    return load_rows(path, columns)


def within(scenario: str | None, overrides: dict[str, Any], gpus: set[int] | None, global_batch: int | None) -> bool:
    """Whether a configuration has one of `gpus` and the `global_batch` (True where it does not load: it is then
    an invalid row with its reason)."""
    from pipeplan.sim.config import load_scenario

    try:
        sc = load_scenario(scenario, overrides)
    except PipeplanError:
        return True
    n = sc.pipeline.stages * sc.parallel.tp * sc.parallel.dp
    batch = sc.pipeline.microbatches * sc.training.micro_batch_size * sc.parallel.dp
    return (gpus is None or n in gpus) and (global_batch is None or batch == global_batch)


def _run_locally(
    scenario: str | None, todo: list[dict[str, Any]], plan_freeze: bool, base: dict[str, Any] | None, *,
    jobs: int, scheduler: str | None = None,
) -> Iterator[dict[str, Any]]:
    """Rows as they finish, from `jobs` worker processes on this machine."""
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        pending = {pool.submit(evaluate, scenario, c, plan_freeze, base) for c in todo}
        while pending:
            ready, pending = wait(pending, return_when=FIRST_COMPLETED)
            for fut in ready:
                yield fut.result()


def _run_on_cluster(
    scenario: str | None, todo: list[dict[str, Any]], plan_freeze: bool, base: dict[str, Any] | None, *,
    jobs: int = 0, scheduler: str | None = None,
) -> Iterator[dict[str, Any]]:
    """Rows as they finish, from the workers of the Dask scheduler at `scheduler`. The workers need pipeplan
    installed (they import analysis.sweep); the scenario path must be readable where they run."""
    try:
        from distributed import Client, as_completed
    except ImportError:
        raise PipeplanError("--scheduler: needs Dask distributed; install pipeplan[cluster]") from None
    probe_scheduler(str(scheduler))
    try:
        client = Client(scheduler, timeout=f"{SCHEDULER_TIMEOUT_S:g}s", set_as_default=False)
    except Exception as exc:
        raise PipeplanError(f"--scheduler {scheduler}: cannot reach a Dask scheduler there ({exc})") from None
    with client:
        if scenario is not None:  # workers may run elsewhere: give them an absolute path, not a name
            from pipeplan.sim.config import resolve_scenario_path

            scenario = str(resolve_scenario_path(scenario).resolve())
        futures = [client.submit(evaluate, scenario, c, plan_freeze, base, pure=False) for c in todo]
        try:
            for fut in as_completed(futures, loop=client.loop):
                yield fut.result()
        finally:
            client.cancel(futures)


SCHEDULER_SCHEMES = ("tcp", "inproc")
"""--scheduler schemes a sweep connects with: tls:// needs certificates (a Security object) pipeplan does not take,
ucx:// a package it does not install; inproc:// is a cluster inside this process (tests)."""
SCHEDULER_TIMEOUT_S = 5.0
"""A Dask scheduler that has not answered its identity call by then is taken as unreachable."""


def probe_scheduler(address: str, timeout_s: float = SCHEDULER_TIMEOUT_S, in_process: bool = True) -> None:
    """Ask the scheduler at `address` who it is, within `timeout_s`; PipeplanError if it does not answer. Dask's
    Client(timeout=...) bounds the TCP connect only: a port that accepts and never speaks holds it forever.
    `in_process=False` (the CLI) refuses inproc://, which names a cluster only the process that made it has."""
    import asyncio

    scheme = address.split("://", 1)[0] if "://" in address else "tcp"
    if scheme not in SCHEDULER_SCHEMES or (scheme == "inproc" and not in_process):
        raise PipeplanError(f"--scheduler {address[:80]}: scheme {scheme[:20]}:// is not supported; give "
                            "tcp://HOST:PORT")
    if scheme == "inproc":  # a cluster in this process: nothing can be silent there
        return
    from distributed.core import rpc

    async def identity() -> object:
        remote = rpc(address, timeout=timeout_s)
        try:
            return await remote.identity()
        finally:
            await remote.close_rpc()

    try:
        asyncio.run(asyncio.wait_for(identity(), timeout_s))
    except TimeoutError:
        raise PipeplanError(f"--scheduler {address[:80]}: no Dask scheduler answered within {timeout_s:g} s") \
            from None
    except Exception as exc:  # refused, unreachable, or something that is not a Dask scheduler answering
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:80]
        raise PipeplanError(f"--scheduler {address[:80]}: cannot reach a Dask scheduler there ({first})") from None


def speed_column(df: pd.DataFrame) -> str:
    """What sweeps rank by: tokens/s per GPU, so configurations of different sizes compare; for explicit-cost
    scenarios (no tokens), sequences/s per GPU (global_batch / step time / gpus); for sweeps written before
    those columns, tokens/s, else steps/s."""
    for col in ("tokens_per_s_per_gpu", "tokens_per_s"):
        if col in df and pd.to_numeric(df[col], errors="coerce").notna().any():
            return col
    return "samples_per_s_per_gpu" if {"global_batch", "gpus"} <= set(df.columns) else "steps_per_s"


def with_speed(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with the speed_column added when it is derived (explicit-cost sweeps)."""
    col = speed_column(df)
    if col in df:
        return df
    step = pd.to_numeric(df["step_time_s"], errors="coerce")
    if col == "samples_per_s_per_gpu":
        batch, gpus = (pd.to_numeric(df[c], errors="coerce") for c in ("global_batch", "gpus"))
        return df.assign(samples_per_s_per_gpu=batch / step / gpus)
    return df.assign(steps_per_s=1.0 / step)


def fitting(df: pd.DataFrame) -> pd.DataFrame:
    """Simulated configurations whose every rank fits HBM (capacity - margin)."""
    return df[(df["status"] == "ok") & (df["fits"].astype(str) == "True")]


def ranked(df: pd.DataFrame) -> pd.DataFrame:
    """Best first by speed_column; ties by lower peak HBM."""
    df = with_speed(df)
    return df.sort_values([speed_column(df), "max_peak_hbm_bytes"], ascending=[False, True], kind="stable")


class InvalidReason(NamedTuple):
    reason: str
    count: int
    example: str
    """One configuration with that reason, as KEY=VALUE pairs."""


def invalid_reasons(df: pd.DataFrame, keys: list[str] | None = None) -> list[InvalidReason]:
    """Invalid rows grouped by their reason, most frequent first."""
    bad = df[df["status"] == "invalid"]
    if keys is None:
        keys = [c for c in df.columns if "." in c]
    out = []
    for reason, g in bad.groupby("reason", sort=False):
        first = g.iloc[0]
        example = " ".join(f"{k.split('.')[-1]}={first[k]}" for k in keys if k in g)
        out.append(InvalidReason(str(reason), len(g), example))
    return sorted(out, key=lambda r: -r.count)


def pareto_front(df: pd.DataFrame) -> pd.DataFrame:
    """Fitting configurations not beaten on both speed (higher; speed_column) and peak HBM (lower)."""
    df = with_speed(df)
    col = speed_column(df)
    ok = fitting(df)
    ok = ok[ok[col].notna()].sort_values(["max_peak_hbm_bytes", col], ascending=[True, False])
    best = -1.0
    keep = []
    for idx, r in ok.iterrows():
        if r[col] > best:
            keep.append(idx)
            best = r[col]
    return ok.loc[keep]
