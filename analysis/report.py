"""Render any pipeplan output folder as one readable page: report.html (self-contained) and report.md.

Whatever the folder holds is shown in a fixed order: JSON summaries as key/value tables, CSV tables (long
ones truncated, with their row count), then every figure. Nothing is computed here; the page shows the
files as they are, so it works for simulate, plan, capacity, sweep, run and lcp bench folders alike.
"""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any

import pandas as pd

from sim.errors import PipeplanError

MAX_ROWS = 30
LONG_TABLES = {"timeline.csv", "memory.csv"}  # per-action/per-change traces: summarised, not listed
PRIORITY = ["summary.json", "plan.json", "meta.json", "capacity.csv", "sweep.csv", "metrics.csv", "bench.csv",
            "freeze.csv"]
KINDS = {"plan.json": "freeze plan", "capacity.csv": "capacity", "sweep.csv": "sweep", "metrics.csv": "measured run",
         "bench.csv": "LCP benchmark", "bench_sim.csv": "simulator benchmark", "summary.json": "simulated step"}


def describe(folder: Path) -> str:
    names = {p.name for p in folder.iterdir()}
    return next((kind for name, kind in KINDS.items() if name in names), "pipeplan output")


def _ordered(files: list[Path]) -> list[Path]:
    rank = {name: i for i, name in enumerate(PRIORITY)}
    return sorted(files, key=lambda p: (rank.get(p.name, len(PRIORITY)), p.name))


def _flatten(obj: dict[str, Any]) -> pd.DataFrame:
    rows = []
    for key, value in obj.items():
        if key.endswith("_bytes") and value is not None:
            value = [_gib(v) for v in value] if isinstance(value, list) else _gib(value)
            key = key.removesuffix("_bytes") + " (GiB)"
        if isinstance(value, list) and value and isinstance(value[0], dict):
            rows.append((key, f"{len(value)} entries (see the CSV files)"))
        elif isinstance(value, list):
            shown = ", ".join(_fmt(v) for v in value[:16]) + (" ..." if len(value) > 16 else "")
            rows.append((key, shown))
        elif isinstance(value, dict):
            rows.append((key, ", ".join(f"{k}={_fmt(v)}" for k, v in value.items())))
        else:
            rows.append((key, _fmt(value)))
    return pd.DataFrame(rows, columns=["key", "value"])


def _gib(v: Any) -> Any:
    return round(v / 2**30, 3) if isinstance(v, int | float) else v


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _read_schedule(p: Path) -> pd.DataFrame:
    """torch's action-string CSV has no header: one row of actions per rank."""
    rows = [line.split(",") for line in p.read_text().splitlines()]
    return pd.DataFrame({"rank": range(len(rows)), "actions": [" ".join(r) for r in rows]})


def sections(folder: Path) -> list[tuple[str, str, Any]]:
    """(title, kind, payload) per file: kind is 'table' (DataFrame, note) or 'image' (path)."""
    out: list[tuple[str, str, Any]] = []
    files = [p for p in folder.iterdir()
             if p.is_file() and not p.name.startswith(".") and p.name not in ("report.html", "report.md")]
    for p in _ordered([f for f in files if f.suffix == ".json" and f.name != "trace.json"]):
        try:
            obj = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise PipeplanError(f"report: {p} is not valid JSON ({exc})") from None
        if isinstance(obj, dict):
            out.append((p.name, "table", (_flatten(obj), "")))
    for p in _ordered([f for f in files if f.suffix == ".csv"]):
        try:
            df = _read_schedule(p) if p.name == "schedule.csv" else pd.read_csv(p)
        except (pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
            raise PipeplanError(f"report: {p} is not a readable CSV ({exc})") from None
        if p.name in LONG_TABLES:
            out.append((p.name, "table", (df.describe().T.reset_index().round(6).head(MAX_ROWS),
                                          f"{len(df)} rows; column statistics shown")))
        else:
            note = f"first {MAX_ROWS} of {len(df)} rows" if len(df) > MAX_ROWS else f"{len(df)} rows"
            out.append((p.name, "table", (df.head(MAX_ROWS), note)))
    for p in sorted(f for f in files if f.suffix == ".png"):
        out.append((p.name, "image", p))
    if "trace.json" in {f.name for f in files}:
        out.append(("trace.json", "note", "Chrome trace: open it in https://ui.perfetto.dev or chrome://tracing"))
    return out


def render(folder: Path) -> tuple[str, str]:
    """(html, markdown) for the folder."""
    if not folder.is_dir():
        raise PipeplanError(f"report: {folder} is not a folder; give a pipeplan output folder")
    parts = sections(folder)
    if not parts:
        raise PipeplanError(f"report: {folder} holds no pipeplan outputs (json, csv or png files)")
    title = f"pipeplan report: {folder.name} ({describe(folder)})"
    md = [f"# {title}", ""]
    body = [f"<h1>{html.escape(title)}</h1>"]
    for name, kind, payload in parts:
        md += [f"## {name}", ""]
        body.append(f"<h2>{html.escape(name)}</h2>")
        if kind == "table":
            df, note = payload
            if note:
                md += [f"*{note}*", ""]
                body.append(f"<p><em>{html.escape(note)}</em></p>")
            md += [df.to_markdown(index=False), ""]
            body.append(df.to_html(index=False, border=0, classes="t", float_format=lambda x: f"{x:.6g}"))
        elif kind == "image":
            data = base64.b64encode(payload.read_bytes()).decode()
            md += [f"![{name}]({name})", ""]
            body.append(f'<img alt="{html.escape(name)}" src="data:image/png;base64,{data}">')
        else:
            md += [payload, ""]
            body.append(f"<p>{html.escape(payload)}</p>")
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}"
             "table.t{border-collapse:collapse;font-size:13px;margin:.5em 0}"
             "table.t td,table.t th{border-bottom:1px solid #ddd;padding:3px 8px;text-align:right}"
             "img{max-width:100%;border:1px solid #eee}h2{margin-top:1.6em}")
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>\n")
    return page, "\n".join(md) + "\n"
