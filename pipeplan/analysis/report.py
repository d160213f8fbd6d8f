"""Render any pipeplan output folder as one readable page: report.html (self-contained) and report.md.

The page leads with the answer to the folder's question (analysis/report_answers.py: for a sweep, the best
configuration that fits and what limits it); below, every file in a fixed order: JSON summaries as
key/value tables, CSV tables (long ones truncated, with their row count), then the remaining figures. Nothing
is simulated here, so it works for simulate, plan, capacity, sweep, run and lcp bench folders alike.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import os
import re
import stat
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pandas as pd

from pipeplan.common.units import GIB
from pipeplan.sim.errors import PipeplanError

MAX_ROWS = 30
MAX_FILE_BYTES = 64 * 2**20
"""The largest file a report reads (pipeplan's own CSVs of a 100,000-row sweep are ~30 MiB)."""
MAX_CSV_COLUMNS = 1000
"""The widest CSV a report reads; pipeplan writes at most a few hundred columns (a sweep's grid keys + metrics)."""
READ_SUFFIXES = (".json", ".csv", ".png")
LONG_TABLES = {"timeline.csv", "memory.csv"}  # per-action/per-change traces: summarised, not listed
PRIORITY = ["summary.json", "plan.json", "meta.json", "capacity.csv", "sweep.csv", "metrics.csv", "bench.csv",
            "freeze.csv"]
KINDS = {"plan.json": "freeze plan", "capacity.csv": "capacity", "sweep.csv": "sweep", "metrics.csv": "measured run",
         "bench.csv": "LCP benchmark", "bench_sim.csv": "simulator benchmark", "summary.json": "simulated step"}


def check_folder_files(folder: Path) -> None:
    """Refuse a folder whose json/csv/png entries are not all regular files of bounded size: a symlink may point
    outside the folder (its target would be embedded in the page), and a fifo would block the reader forever."""
    from pipeplan.common.io import short_path

    for entry in os.scandir(folder):
        if entry.name.startswith(".") or not entry.name.endswith(READ_SUFFIXES):
            continue
        info = entry.stat(follow_symlinks=False)
        if stat.S_ISLNK(info.st_mode):
            raise PipeplanError(f"report: {short_path(entry.path)} is a symlink; a report reads only the regular "
                                "files inside its folder (copy the file in)")
        if not stat.S_ISREG(info.st_mode) and entry.name in KINDS | {"frontier_answers.csv": "", "sweep.csv": ""}:
            raise PipeplanError(f"report: {short_path(entry.path)} is not a regular file; give an output folder")
        if stat.S_ISREG(info.st_mode) and info.st_size > MAX_FILE_BYTES:
            raise PipeplanError(f"report: {short_path(entry.path)} has {info.st_size:,} bytes; a report reads files "
                                f"of at most {MAX_FILE_BYTES:,}")


def read_text(p: Path) -> str:
    """A file of the folder as UTF-8 text: regular, not through a link, bounded; one line naming it otherwise."""
    from pipeplan.common.io import read_input_bytes, short_path

    data = read_input_bytes(p, MAX_FILE_BYTES, "report:", follow_links=False)
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise PipeplanError(f"report: {short_path(p)} is not UTF-8 text (byte {exc.start}); rerun the command "
                            "that wrote it") from None


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
    return round(v / GIB, 3) if isinstance(v, int | float) else v


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _read_schedule(text: str) -> pd.DataFrame:
    """torch's action-string CSV has no header: one row of actions per rank."""
    rows = [line.split(",") for line in text.splitlines()]
    return pd.DataFrame({"rank": range(len(rows)), "actions": [" ".join(r) for r in rows]})


def _check_complete(p: Path, text: str) -> None:
    """Refuse a damaged or cut-off CSV: pandas would read a short last row as blanks and a cut header as a
    table with no rows, and the answer would then be wrong ("nothing fits") rather than absent. pipeplan's
    CSVs end with a newline and give every row the header's number of fields (schedule.csv has no header)."""
    from pipeplan.common.io import short_path

    if text and not text.endswith("\n"):
        raise PipeplanError(f"report: {short_path(p)} is cut off (no newline at its end); rerun the command that "
                            "wrote it")
    if p.name == "schedule.csv":
        return
    rows = csv.reader(text.splitlines())
    width = len(next(rows, []))
    if width > MAX_CSV_COLUMNS:
        raise PipeplanError(f"report: {short_path(p)} has {width:,} columns; a report reads at most "
                            f"{MAX_CSV_COLUMNS:,}")
    for number, row in enumerate(rows, start=2):
        if len(row) != width:
            raise PipeplanError(f"report: {short_path(p)} line {number} has {len(row)} fields, its header "
                                f"{width}; rerun the command that wrote it")


def sections(folder: Path) -> list[tuple[str, str, Any]]:
    """(title, kind, payload) per file: kind is 'table' (DataFrame, note) or 'image' (path)."""
    from pipeplan.analysis.sweep import REJECTED

    out: list[tuple[str, str, Any]] = []
    files = [p for p in folder.iterdir()
             if p.is_file() and not p.name.startswith(".") and p.name not in ("report.html", "report.md")]
    rejected = [p for p in files if p.name == REJECTED]  # the damaged lines a resumed sweep set aside
    files = [p for p in files if p.name != REJECTED]
    for p in _ordered([f for f in files if f.suffix == ".json" and f.name != "trace.json"]):
        try:
            obj = json.loads(read_text(p))
        except (json.JSONDecodeError, RecursionError) as exc:
            raise PipeplanError(f"report: {p} is not valid JSON ({str(exc)[:80]})") from None
        except ValueError as exc:  # e.g. an integer of more than 4,300 digits
            raise PipeplanError(f"report: {p} is not valid JSON ({str(exc)[:80]})") from None
        if isinstance(obj, dict):
            out.append((p.name, "table", (_flatten(obj), "")))
    for p in _ordered([f for f in files if f.suffix == ".csv"]):
        text = read_text(p)
        _check_complete(p, text)
        try:
            df = _read_schedule(text) if p.name == "schedule.csv" else pd.read_csv(io.StringIO(text))
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
    if rejected:
        lines = len(read_text(rejected[0]).splitlines())
        out.append((REJECTED, "note", f"{lines} damaged line(s) of sweep.csv that resuming the sweep set aside "
                                      "and computed again; not part of the results above"))
    if "trace.json" in {f.name for f in files}:
        out.append(("trace.json", "note", "Chrome trace: open it in https://ui.perfetto.dev or chrome://tracing"))
    return out


STYLE = (
    "body{font-family:system-ui,-apple-system,sans-serif;max-width:1180px;margin:2em auto;padding:0 1em;color:#222;"
    "line-height:1.45}h1{font-size:1.5em;margin-bottom:.2em}h2{margin-top:1.6em;font-size:1.15em}"
    ".lead{font-size:1.2em;background:#f3f7fb;border-left:4px solid #4C78A8;padding:.7em 1em;margin:1em 0}"
    "table.t{border-collapse:collapse;font-size:13px;margin:.5em 0}"
    "table.t td,table.t th{border-bottom:1px solid #ddd;padding:3px 8px;text-align:right}"
    "table.t th{background:#fafafa}table.t td:first-child,table.t th:first-child{text-align:left}"
    "img{max-width:100%;border:1px solid #eee;margin:.5em 0}"
    "details{margin-top:2em}summary{cursor:pointer;font-weight:bold;font-size:1.1em}.muted{color:#666}"
)
NA = "—"


TITLE = "pipeplan report: "
PAGE_START = "<!doctype html><html><head><meta charset='utf-8'><title>"
OUTPUTS = {"report.html": PAGE_START + TITLE, "report.md": "# " + TITLE}
"""The two files `pipeplan report` writes, and how each begins: an existing file there that begins otherwise is
not pipeplan's and is kept unless --force (common.io.check_file_owner)."""


def render(folder: Path) -> tuple[str, str]:
    """(html, markdown) for the folder: the answer first (analysis/report_answers.py), then every file."""
    from pipeplan.analysis.report_answers import answer

    if not folder.is_dir():
        raise PipeplanError(f"report: {folder} is not a folder; give a pipeplan output folder")
    check_folder_files(folder)
    parts = sections(folder)
    if not parts:
        raise PipeplanError(f"report: {folder} holds no pipeplan outputs (json, csv or png files)")
    try:
        kind, blocks = answer(folder)
    except (KeyError, IndexError, TypeError, ValueError) as exc:  # a file without what its command writes
        raise PipeplanError(f"report: {folder}: a file lacks what its command writes ({type(exc).__name__}: "
                            f"{str(exc)[:60]}); rerun the command that wrote it") from None
    title = f"{TITLE}{folder.name} ({kind})"
    md = [f"# {TITLE}{md_escape(f'{folder.name} ({kind})')}", ""]
    body = [f"<h1>{html.escape(title)}</h1>"]
    shown = {b.payload.name for b in blocks if b.kind == "image"}
    for b in blocks:
        _block(b.kind, b.payload, md, body)
    md += ["## Files", ""]
    body.append(f"<details{' open' if not blocks else ''}><summary>Files in {html.escape(folder.name)}/</summary>")
    for name, kind_, payload in parts:
        if kind_ == "image" and name in shown:
            continue
        _block("h3", name, md, body)
        if kind_ == "table":
            df, note = payload
            if note:
                _block("note", note, md, body)
            _block("table", df, md, body)
        else:
            _block(kind_, payload, md, body)
    body.append("</details>")
    page = (f"{PAGE_START}{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>\n")
    return page, "\n".join(md) + "\n"


def _inline(text: str) -> str:
    """HTML for a sentence that may hold **bold** (the only Markdown the answers use)."""
    parts = html.escape(text).split("**")
    return "".join(f"<strong>{p}</strong>" if i % 2 else p for i, p in enumerate(parts))


MD_SPECIAL = re.compile(r"([\\`*\[\]!|~]|(?<!\w)_|_(?!\w))")
"""Characters that make Markdown of plain text: emphasis, code, links and images, table cells, strikethrough;
an underscore only at a word's edge (inside a word, as in `makespan_s`, CommonMark never reads it as emphasis)."""


MD_ENTITY = re.compile(r"&(?=#?\w+;)")


def md_escape(text: Any) -> str:
    """`text` as literal Markdown: its punctuation backslash-escaped, < and an entity's & as HTML entities (a name
    such as `<script>` or `[x](javascript:...)` from a user's scenario must show as written, never run or link)."""
    text = MD_ENTITY.sub("&amp;", str(text)).replace("<", "&lt;")  # no tag, no entity; `>=` stays as written
    return MD_SPECIAL.sub(r"\\\1", text).replace("\n", " ")


def _md_inline(text: str) -> str:
    """Markdown for a sentence that may hold **bold** (the only Markdown the answers use), the rest escaped."""
    return "**".join(md_escape(part) for part in text.split("**"))


def _block(kind: str, payload: Any, md: list[str], body: list[str]) -> None:
    """Append one block to both the Markdown and the HTML page."""
    if kind == "lead":
        md += [f"**{_md_inline(payload)}**", ""]
        body.append(f"<p class='lead'>{_inline(payload)}</p>")
    elif kind == "p":
        md += [_md_inline(payload), ""]
        body.append(f"<p>{_inline(payload)}</p>")
    elif kind == "note":
        md += [f"*{md_escape(payload)}*", ""]
        body.append(f"<p class='muted'><em>{html.escape(payload)}</em></p>")
    elif kind == "list":
        md += [f"- {_md_inline(x)}" for x in payload] + [""]
        body.append("<ul>" + "".join(f"<li>{_inline(x)}</li>" for x in payload) + "</ul>")
    elif kind in ("h2", "h3"):
        md += [f"{'#' * int(kind[1])} {md_escape(payload)}", ""]
        body.append(f"<{kind}>{html.escape(payload)}</{kind}>")
    elif kind == "table":
        df = payload
        cells = df.astype(object).where(pd.notna(df), NA)
        cells = cells.map(lambda v: md_escape(v) if isinstance(v, str) and v != NA else v)
        cells.columns = [md_escape(c) for c in cells.columns]
        md += [cells.to_markdown(index=False), ""]
        body.append(df.to_html(index=False, border=0, classes="t", na_rep=NA,
                               float_format=lambda x: f"{x:.6g}"))
    elif kind == "image":
        from pipeplan.common.io import read_input_bytes

        data = base64.b64encode(read_input_bytes(payload, MAX_FILE_BYTES, "report:", follow_links=False)).decode()
        md += [f"![{md_escape(payload.name)}]({quote(payload.name)})", ""]
        body.append(f'<img alt="{html.escape(payload.name)}" src="data:image/png;base64,{data}">')
    else:
        md += [md_escape(payload), ""]
        body.append(f"<p>{html.escape(str(payload))}</p>")
