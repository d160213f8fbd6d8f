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
    atomic_write_text,
    check_output_file,
    strict_json,
)
from pipeplan.sim.config import load_scenario

JOURNAL = "evaluations.jsonl"
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

    @property
    def path(self) -> Path:
        return self.folder / JOURNAL

    def __getstate__(self) -> dict[str, Any]:  # a worker process reads the file itself
        return {"folder": self.folder, "manifest": self.manifest, "live": self.live, "_entries": None,
                "damaged": 0}

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
                for line in self.path.read_bytes().splitlines():
                    if not line.strip():
                        continue
                    try:
                        d = json.loads(line)
                        key, ev = d["key"], d["evaluation"]
                        if not isinstance(key, str) or not isinstance(ev, dict) or type(ev["layers"]) is not int:
                            raise TypeError(line)
                        self._entries.setdefault(key, {})[ev["layers"]] = ev
                    except (ValueError, KeyError, TypeError):
                        self.damaged += 1
        return self._entries

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
