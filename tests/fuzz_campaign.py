"""A fuzz campaign: the oracle of tests/fuzzing.py over many cases, with a seed of its own, counted.

    python -m tests.fuzz_campaign --cases 1200 --seed 20261130 --out out/fuzz-campaign

Cases are `simulate`/`plan` with scenario mutations, flags and schedule CSVs (about half), `sweep` grids, `run`
with bad flags and `capacity` with scenario mutations and its own flags, and the families of issue 46: hostile
strings (markup, ANSI, formulas, HTML) in every string field, `report` of folders with links out, fifos, Latin-1
and wide CSVs, fifos on every input, damaged resumable state (sweep.csv cells, capacity journal values), a second
writer on one --out, silent and unsupported scheduler addresses, and `run` input checked before launching. Each
case must end within 60 s (else a hang) and leave no process behind (else an orphan). Counts (results, refusals,
tracebacks, lines too long, partial or destructive writes, refusals that took over 10 s of CPU, results over
10 s) go to stdout and OUT/campaign.json;
every failing case goes to OUT/failures.jsonl. Times are CPU seconds of this process (time.process_time):
the machine is shared, so wall time measures the neighbours more than pipeplan.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from tests.fuzzing import (
    Case,
    capacity_line,
    command_line,
    concurrency_line,
    fifo_input_line,
    hostile_string_line,
    network_line,
    report_line,
    resume_line,
    run_case,
    run_check_line,
    run_line,
    start_silent_port,
    sweep_line,
)

FAMILIES = [sweep_line, sweep_line, run_line, run_line, capacity_line, hostile_string_line, hostile_string_line,
            report_line, report_line, fifo_input_line, fifo_input_line, resume_line, concurrency_line, network_line,
            run_check_line, run_check_line]
"""Each case draws one family (issue 46 added all after capacity_line); the rest of 30 draws are command_line."""

SLOW_S = 10.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=1200)
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--out", default="out/fuzz-campaign")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts: collections.Counter[str] = collections.Counter()
    slow: list[dict] = []
    reasons: collections.Counter[str] = collections.Counter()
    cpu_max = {"refused": 0.0, "result": 0.0}
    failures = (out / "failures.jsonl").open("w")
    silent = start_silent_port()  # for network cases: a scheduler address that accepts and never answers
    start = time.perf_counter()

    @seed(args.seed)
    @settings(max_examples=args.cases, deadline=None, database=None, phases=("generate",),
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, 29).flatmap(lambda i: FAMILIES[i]() if i < len(FAMILIES) else command_line()))
    def one(case: Case) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            outcome = run_case(case, Path(tmp))
        counts["cases"] += 1
        counts[f"command {case.command}"] += 1
        counts["results (exit 0)" if outcome.code == 0 else "refused (exit 2)" if outcome.code == 2 else
               "other outcome"] += 1
        for problem in outcome.problems:
            counts[_kind(problem)] += 1
        if outcome.code == 2:
            reasons[_reason(outcome.stderr)] += 1
            cpu_max["refused"] = max(cpu_max["refused"], outcome.cpu_s)
        if outcome.code == 0:
            cpu_max["result"] = max(cpu_max["result"], outcome.cpu_s)
        if outcome.code == 2 and outcome.cpu_s > SLOW_S:
            counts["refused after > 10 s CPU"] += 1
        if outcome.code == 0 and outcome.cpu_s > SLOW_S:
            counts["results taking > 10 s CPU"] += 1
        if outcome.cpu_s > SLOW_S or outcome.problems:
            record = {"argv": case.argv(Path("SANDBOX")), "code": outcome.code, "cpu_s": round(outcome.cpu_s, 2),
                      "problems": outcome.problems, "stderr": outcome.stderr[-400:]}
            (failures if outcome.problems else _Sink(slow)).write(json.dumps(record, default=str) + "\n")
        if counts["cases"] % 50 == 0:
            print(f"{counts['cases']} cases, {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

    one()
    failures.close()
    silent.close()
    summary = {"seed": args.seed, "cases": counts["cases"], "wall_s": round(time.perf_counter() - start, 1),
               "counts": dict(sorted(counts.items())), "max_cpu_s": {k: round(v, 2) for k, v in cpu_max.items()},
               "refusals_by_reason": dict(reasons.most_common()), "slow": slow}
    (out / "campaign.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("counts", "max_cpu_s")}, indent=2))
    bad = sum(v for k, v in counts.items() if k.startswith("problem:")) + counts["refused after > 10 s CPU"]
    return 1 if bad else 0


def _reason(stderr: str) -> str:
    """What a refusal is about: its message with paths, numbers and quoted echoes blanked, cut short."""
    text = stderr.split("error: ", 1)[-1]
    text = re.sub(r"\S*/\S*", "PATH", text)
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", text)
    text = re.sub(r"[-+]?\d[\d,.e+]*", "N", text)
    return text.split(";")[0].strip()[:60]


def _kind(problem: str) -> str:
    return "problem: " + problem.split(" (")[0].split(":")[0]


class _Sink:
    def __init__(self, into: list[dict]):
        self.into = into

    def write(self, line: str) -> None:
        self.into.append(json.loads(line))


if __name__ == "__main__":
    sys.exit(main())
