"""The evaluations journal of `pipeplan capacity`: each depth evaluated is appended to `<out>/evaluations.jsonl`
as soon as it is known (one JSON line, one `write`, fsynced), so a run stopped part-way (Ctrl-C, a crash, a lost
machine) resumes where it stopped, and a re-run with other `--points`, `--min-throughput` or `--policies`
evaluates only the depths it has not seen.

A line is used only under the inputs that made it: its key hashes the resolved scenario (with `--set`), the
policy's definition, the micro-batch sizes and the code that evaluates (pipeplan's version, the sources of sim/,
solver/ (the capacity search, solver/capacity.py, included), common/ and analysis/capacity.py, highspy's
version). A changed scenario or planner never returns a
stale answer; it evaluates again. Floats are written with `repr` precision, so a resumed run's outputs are
byte-identical to an uninterrupted one's. What an evaluation holds is solver.capacity's business
(`Evaluation.to_json`); this module keeps JSON records by key and depth.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from pipeplan.analysis.version import pipeplan_version
from pipeplan.common.io import (
    MANIFEST,
    OutputPathError,
    append_fsynced,
    atomic_write_bytes,
    atomic_write_text,
    check_output_file,
    strict_json,
)
from pipeplan.sim.config import load_scenario
from pipeplan.sim.limits import MAX_MODEL_DIM

JOURNAL = "evaluations.jsonl"
REJECTED_JOURNAL = "evaluations.rejected.jsonl"
"""The journal lines a resumed run set aside (not what capacity writes) and evaluated again."""
MAX_JOURNAL_BYTES = 256 * 2**20
"""The default --frontier run of the 70B scenario wrote 71 lines, 29.6 kB (measured, docs/memory.md): a journal
past this, ~9,000 times that, was not written by capacity, and is refused before any work, not read into memory."""


@cache
def code_fingerprint() -> str:
    """A hash of everything an evaluation's answer depends on besides its inputs."""
    import importlib.metadata

    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(f"{pipeplan_version()} highspy {importlib.metadata.version('highspy')}".encode())
    files = [p for pkg in ("sim", "solver", "common") for p in (root / pkg).rglob("*") if p.suffix in (".py", ".toml")]
    for p in sorted([*files, root / "analysis" / "capacity.py"]):
        digest.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return digest.hexdigest()


def depth_key(sc_path: str | None, overrides: dict[str, Any], policy: dict[str, Any], sizes: tuple[int, ...]) -> str:
    """The key of one policy's evaluations (`policy`: its definition as plain data): same key, same answers."""
    scenario = load_scenario(sc_path, overrides).model_dump_json()
    what = json.dumps({"scenario": scenario, "policy": policy, "sizes": list(sizes), "code": code_fingerprint()},
                      sort_keys=True, default=str)
    return hashlib.sha256(what.encode()).hexdigest()[:32]


@dataclass
class Journal:
    """`<folder>/evaluations.jsonl`; `live` = False keeps it in memory until `write_to` (an --out folder that
    holds another command's outputs, replaced only at the end with --force)."""

    folder: Path
    manifest: dict[str, Any]  # the folder's pipeplan.json (analysis.outputs.manifest), if the journal makes it
    live: bool = True
    _entries: dict[str, dict[int, dict[str, Any]]] | None = field(default=None, repr=False)
    damaged: int = 0  # lines that could not be read (a torn last line, garbage): evaluated again
    rejected: list[tuple[int, str, bytes]] = field(default_factory=list, repr=False)  # (line, why, text)

    @property
    def path(self) -> Path:
        return self.folder / JOURNAL

    def __getstate__(self) -> dict[str, Any]:  # a worker process reads the file itself
        return {"folder": self.folder, "manifest": self.manifest, "live": self.live, "_entries": None,
                "damaged": 0, "rejected": []}

    def check(self) -> Journal:
        """Refuse, before any work, a journal that is not a regular file or is larger than any run writes."""
        if self.live and os.path.lexists(self.path):
            check_output_file(self.path)
            size = self.path.stat().st_size
            if size > MAX_JOURNAL_BYTES:
                raise OutputPathError(f"--out {self.folder}: {JOURNAL} is {size / 2**20:.0f} MiB, more than capacity "
                                      f"writes (at most {MAX_JOURNAL_BYTES // 2**20} MiB); move it away to start "
                                      "afresh")
        return self

    def key(self, sc_path: str | None, overrides: dict[str, Any], policy: dict[str, Any],
            sizes: tuple[int, ...]) -> str:
        """The key of one policy's evaluations (depth_key; solver.capacity.EvaluationJournal)."""
        return depth_key(sc_path, overrides, policy, sizes)

    def entries(self, key: str) -> dict[int, dict[str, Any]]:
        """Every evaluation journaled under `key` (as written: JSON data with its "layers"), by depth."""
        return dict(self._load().get(key, {}))

    def _load(self) -> dict[str, dict[int, dict[str, Any]]]:
        if self._entries is None:
            self._entries = {}
            if self.live and self.path.is_file():
                for number, line in enumerate(self.path.read_bytes().splitlines(), start=1):
                    if not line.strip():
                        continue
                    try:
                        d = json.loads(line, parse_constant=_no_constant)
                        problem = line_problem(d)
                    except (ValueError, RecursionError) as exc:
                        problem = f"not JSON ({str(exc)[:40]})"
                    if problem is None:
                        self._entries.setdefault(d["key"], {})[d["evaluation"]["layers"]] = d["evaluation"]
                    else:
                        self.damaged += 1
                        self.rejected.append((number, problem, line))
        return self._entries

    def damage_report(self) -> str:
        """One line saying which journal lines were set aside and why (the first reason), for a warning."""
        numbers = ", ".join(str(n) for n, _, _ in self.rejected[:5]) + (" ..." if len(self.rejected) > 5 else "")
        why = f" (line {numbers}: {self.rejected[0][1]})" if self.rejected else ""
        return (f"{self.path}: {self.damaged} damaged line(s){why} set aside in {REJECTED_JOURNAL}; those depths "
                "were evaluated again")

    def remember(self, key: str, ev: dict[str, Any]) -> None:
        """Record an evaluation journaled elsewhere (a worker process) in memory only."""
        self._load().setdefault(key, {})[ev["layers"]] = ev

    def append(self, key: str, ev: dict[str, Any]) -> None:
        """Record an evaluation (JSON data with its "layers"), in memory and, when live, on disk."""
        self.remember(key, ev)
        if not self.live:
            return
        if not (self.folder / MANIFEST).exists():  # the first evaluation makes the folder ours (it was absent or
            # empty: open_journal checked), so the end of the run, and a run resumed, may write there
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.folder / MANIFEST, strict_json(self.manifest))
        append_fsynced(self.path, (json.dumps({"key": key, "evaluation": ev}, allow_nan=False) + "\n").encode())

    def write_to(self, folder: Path) -> None:
        """Every evaluation known (journaled and new; damaged lines left out), as one journal in `folder`."""
        lines = [json.dumps({"key": key, "evaluation": ev}, allow_nan=False)
                 for key, evs in self._load().items() for _, ev in sorted(evs.items())]
        atomic_write_text(folder / JOURNAL, "".join(f"{line}\n" for line in lines))
        if self.rejected:  # kept for the user to inspect, out of the journal that resumes
            atomic_write_bytes(folder / REJECTED_JOURNAL, b"".join(text + b"\n" for _, _, text in self.rejected))


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _number(value: Any, optional: bool = False) -> bool:
    """A finite number >= 0 (None too, if `optional`): what a fresh evaluation holds."""
    if value is None:
        return optional
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _count(value: Any, optional: bool = False) -> bool:
    """A layer count or a micro-batch size: an int in 1..MAX_MODEL_DIM (None too, if `optional`)."""
    if value is None:
        return optional
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_MODEL_DIM


def line_problem(d: Any) -> str | None:
    """What makes a parsed journal line other than what `append` writes (a key and analysis.capacity's
    Evaluation.to_json), or None: a resumed answer is held to what a fresh evaluation would give."""
    if not isinstance(d, dict) or not isinstance(d.get("key"), str) or not isinstance(d.get("evaluation"), dict):
        return "not a {key, evaluation} record"
    ev = d["evaluation"]
    checks = {"layers": _count(ev.get("layers")), "fits": isinstance(ev.get("fits"), bool),
              "variant": isinstance(ev.get("variant"), str), "note": isinstance(ev.get("note"), str),
              "micro_batch_size": _count(ev.get("micro_batch_size"), optional=True),
              "result": ev.get("result") is None or isinstance(ev.get("result"), dict)}
    bad = [k for k, ok in checks.items() if not ok or k not in ev]
    if bad:
        return f"evaluation.{bad[0]} is missing or of the wrong type"
    r = ev["result"]
    if r is None:
        return None
    peak = r.get("peak_hbm_bytes")
    checks = {"tokens_per_s": _number(r.get("tokens_per_s"), optional=True), "makespan_s": _number(r.get("makespan_s")),
              "mfu": _number(r.get("mfu"), optional=True), "oom_over_limit": isinstance(r.get("oom_over_limit"), bool),
              "peak_hbm_bytes": isinstance(peak, list) and bool(peak) and all(map(_number, peak))}
    bad = [k for k, ok in checks.items() if not ok or k not in r]
    return f"result.{bad[0]} is not a finite number >= 0 (or of the wrong type)" if bad else None
