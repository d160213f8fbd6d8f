"""Compare two `.ci/regress` output trees: equal but for wall-clock fields, code-fingerprint keys and figures.

JSON and CSV are compared as data with those fields dropped; CSV rows and journal lines (JSONL) as sets, since
worker processes finish in any order. Prints each differing file and exits 1 if any differs."""

import csv
import io
import json
import re
import sys
from pathlib import Path

VOLATILE = re.compile(r"(wall|_s$|build_s|solve_s|elapsed|seconds|time_s|created|timestamp|^key$|version)")
SKIPPED = {".png", ".html"}  # figures and the page built from them: rendering, not results


def _norm(o: object) -> object:
    if isinstance(o, dict):
        return {k: _norm(v) for k, v in o.items() if not VOLATILE.search(k)}
    if isinstance(o, list):
        return [_norm(v) for v in o]
    return o


def _load(p: Path) -> object:
    if p.suffix not in (".json", ".jsonl", ".csv", ".md", ".txt"):
        return p.read_bytes()
    text = p.read_text(errors="replace")
    if p.suffix == ".json":
        return _norm(json.loads(text))
    if p.suffix == ".jsonl":
        return sorted(json.dumps(_norm(json.loads(line)), sort_keys=True) for line in text.splitlines() if line.strip())
    if p.suffix == ".csv":
        rows = list(csv.reader(io.StringIO(text)))
        keep = [i for i, h in enumerate(rows[0]) if not VOLATILE.search(h)] if rows else []
        body = sorted([r[i] for i in keep if i < len(r)] for r in rows[1:])  # a sweep writes rows as they finish
        return [[rows[0][i] for i in keep], *body] if rows else []
    return text


def main(before: Path, after: Path) -> int:
    bad = 0
    for a in sorted(p for p in before.rglob("*") if p.is_file()):
        b = after / a.relative_to(before)
        if a.suffix in SKIPPED or a.name == "pipeplan.json":
            continue
        if not b.is_file() or _load(a) != _load(b):
            print("differs:", a.relative_to(before))
            bad += 1
    print("differences:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
