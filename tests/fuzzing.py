"""Fuzzing pipeplan's CLI: generators of bad and edge inputs, and the oracle every outcome must satisfy.

Shared by the property test (tests/test_fuzz.py, a few dozen cases per run) and the campaign
(tests/fuzz_campaign.py, a thousand or more with another seed). A case is one `pipeplan` command line run
in-process through `analysis.cli.main` inside a sandbox folder that holds the traps an output may hit: a
file, a symlink to a file, a fifo, a folder of another command's outputs and one of a user's own files.

The oracle (`check`):
- the exit code is 0 (a result) or 2 (refused); anything else, or an exception escaping `main`, fails;
- refused: stderr is exactly one line of at most 200 characters, without "Traceback";
- refused: the sandbox is exactly as it was (no partial output, no staging folder left, no trap replaced);
- a result: its folder holds pipeplan.json and strict JSON (no NaN/Infinity); the traps are untouched.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st
from pipeplan.scenarios import scenario_path

from pipeplan.analysis.cli import MAX_ERROR_CHARS, main
from pipeplan.sim.schedules import schedule_names

MAX_LINE = MAX_ERROR_CHARS
SCHEDULES = schedule_names()  # every registered one, zb-2p included
BASES = {"unit": str(scenario_path("explicit-unit")), "tiny": str(scenario_path("tiny-cpu"))}

# real keys of both scenario forms, and near misses
KEYS = [
    "pipeline.stages", "pipeline.microbatches", "pipeline.schedule", "pipeline.virtual_stages",
    "costs.forward_s", "costs.backward_input_s", "costs.backward_weight_s", "costs.activation_bytes",
    "costs.p2p_s", "costs.static_bytes", "costs.checkpoint_bytes", "costs.hbm_gib",
    "model.layers", "model.hidden", "model.ffn_hidden", "model.heads", "model.kv_heads", "model.vocab",
    "model.seq_len", "training.micro_batch_size", "training.dtype", "parallel.tp", "parallel.dp",
    "parallel.sequence_parallel", "device.preset", "device.peak_tflops", "device.efficiency", "device.hbm_gib",
    "interconnect.p2p_gbps", "interconnect.p2p_latency_us", "freeze.cap", "freeze.max_ratio", "freeze.curve",
    "freeze.backward_min_s", "freeze.weight_min_s", "memory.recompute", "memory.offload_activations",
    "memory.optimizer", "memory.hbm_margin_gib", "memory.prefetch_lookahead", "memory.plan", "memory.recompute_norms",
    "pipeline.stagez", "pipeline", "costs.forward_s.x", "nope.key", "model",
]  # fmt: skip

SPECIAL_NUMBERS = [
    "0", "-1", "1", "2", "3", "4", "8", "1e308", "-1e308", "5e-324", "nan", "inf", "-inf", "-0.0", "1e18",
    "1000000000000000000", "9223372036854775807", "1e6", "1024", "0.5", "1.0", "1e-300", "9" * 5000,
]  # fmt: skip


def toml_value() -> st.SearchStrategy[str]:
    """TOML text for one value: numbers (extreme ones too), strings, lists, deep nesting, junk."""
    number = st.one_of(
        st.sampled_from(SPECIAL_NUMBERS),
        st.integers(-10, 10**7).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(_toml_float),
    )
    string = st.one_of(st.sampled_from([*SCHEDULES, "H100-SXM-80GB", "bf16", "full", "dram", ""]),
                       st.text(max_size=20)).map(lambda s: json.dumps(s))
    flat = st.lists(st.one_of(number, string), max_size=9).map(lambda xs: "[" + ", ".join(xs) + "]")
    nested = st.sampled_from([10, 200, 3000]).map(lambda n: "[" * n + "]" * n)
    curve = st.sampled_from(["[]", "[[0, 1], [1, 0]]", "[[0, 1], [0.5, 0.9], [1, 0]]", "[[1, 0], [0, 1]]",
                             "[[[0, 1], [1, 0]]]", "[[0, 1]]"])
    junk = st.text(min_size=0, max_size=30)
    return st.one_of(number, number, string, flat, nested, curve, st.booleans().map(str).map(str.lower), junk)


def _toml_float(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(x)


def schedule_csv() -> st.SearchStrategy[bytes]:
    """Schedule CSVs: valid-looking orders, damaged ones, huge ids, binary junk."""
    action = st.tuples(st.sampled_from(["0", "1", "2", "3", "4", "1" + "0" * 12, "9" * 5000]), st.sampled_from("FBIWX"),
                       st.integers(0, 9)).map(lambda t: f"{t[0]}{t[1]}{t[2]}")
    row = st.lists(st.one_of(action, st.sampled_from(["", " ", "0F0", "3B7", "x"])), max_size=24)
    table = st.lists(row, min_size=0, max_size=6).map(lambda rows: "\n".join(",".join(r) for r in rows).encode())
    one_f_one_b = _one_f_one_b_csv(4, 8)
    damaged = st.tuples(st.integers(0, len(one_f_one_b) - 1), st.binary(min_size=1, max_size=4)).map(
        lambda t: one_f_one_b[: t[0]] + t[1] + one_f_one_b[t[0] + len(t[1]):])
    return st.one_of(table, damaged, st.just(one_f_one_b), st.binary(max_size=64),
                     st.just(b"0F" + b"9" * 5000), st.just(b'"0F0,0B0\n'))


def _one_f_one_b_csv(p: int, m: int) -> bytes:
    from pipeplan.sim.schedules import build_schedule

    return build_schedule("1f1b", p, m, 1).to_csv_text().encode()


OUT_KINDS = ["new"] * 12 + ["same", "other", "foreign", "file", "symlink", "fifo", "empty", "proc", "under_file"]
"""Mostly a new folder, so that the scenario and flag mutations are what gets judged; each trap now and then."""


@st.composite
def command_line(draw: st.DrawFn) -> Case:
    """One command line: simulate or plan on a base scenario with --set mutations, flags and files."""
    command = draw(st.sampled_from(["simulate", "simulate", "simulate", "plan"]))
    base = draw(st.sampled_from(list(BASES)))
    sets = draw(st.lists(st.tuples(st.sampled_from(KEYS), toml_value()), max_size=3))
    case = Case(command=command, base=base, sets=[f"{k}={v}" for k, v in sets])
    if draw(st.integers(0, 3)) == 0:
        case.schedule = draw(st.one_of(st.sampled_from([*SCHEDULES, "", " ", "bogus"]), st.text(max_size=12)))
    if draw(st.integers(0, 5)) == 0:
        case.virtual_stages = draw(st.sampled_from(["0", "-1", "2", "1000000", "abc", "1e3"]))
    elif case.schedule is None and draw(st.integers(0, 4)) == 0:
        case.csv = draw(schedule_csv())
    if command == "plan" and draw(st.booleans()):
        case.cap = draw(st.sampled_from(["nan", "inf", "-1", "0", "0.5", "1", "2", "x"]))
    case.out = draw(st.sampled_from(OUT_KINDS))
    case.force = draw(st.integers(0, 5)) == 0
    return case


@st.composite
def sweep_line(draw: st.DrawFn) -> Case:
    """A sweep over one or two grid keys of the explicit-unit scenario: typos, wrong types, duplicates."""
    keys = draw(st.lists(st.sampled_from(["pipeline.microbatches", "pipeline.schedule", "freeze.cap",
                                          "pipeline.stagez", "costs.p2p_s", "memory.recompute"]),
                         min_size=1, max_size=2, unique=True))
    values = st.sampled_from(["4", "8", "4", "1f1b", "gpipe", "0.5", "x", "-1", "nan", "[1]", "true", ""])
    grid = [f"{k}={','.join(draw(st.lists(values, min_size=1, max_size=3)))}" for k in keys]
    jobs = draw(st.sampled_from(["1", "1", "0", "100000"]))
    return Case(command="sweep", base="unit", grid=grid, jobs=jobs, out=draw(st.sampled_from(OUT_KINDS)),
                force=draw(st.integers(0, 5)) == 0)


@st.composite
def run_line(draw: st.DrawFn) -> Case:
    """`pipeplan run` with at least one bad flag: refused before any rank is launched."""
    bad = draw(st.sampled_from([["--timeout-s", "nan"], ["--lr", "nan"], ["--lr", "inf"], ["--steps", "0"],
                                ["--resume", "--checkpoint-dir", "{sandbox}/no-checkpoint"],
                                ["--resume", "--checkpoint-dir", "{sandbox}/broken-checkpoint"],
                                ["--resume"], ["--data", "/dev/zero"], ["--data", "{sandbox}/fifo"],
                                ["--threads", "100000"], ["--seed", "-1"], ["--timeout-s", "-inf"]]))
    return Case(command="run", base="tiny", flags=bad, out=draw(st.sampled_from(OUT_KINDS)))


CAPACITY_KEYS = [
    "model.layers", "model.hidden", "model.heads", "model.vocab", "model.seq_len", "training.micro_batch_size",
    "pipeline.stages", "pipeline.microbatches", "device.hbm_gib", "memory.hbm_margin_gib", "memory.recompute",
    "parallel.tp", "pipeline.stagez", "memory.recompute_norms",
]  # fmt: skip


@st.composite
def capacity_line(draw: st.DrawFn) -> Case:
    """`pipeplan capacity` on the small model with its own flags: fast policies (no MILP), typos, bad numbers,
    the frontier now and then; the explicit-costs base, which it refuses, now and then."""
    base = draw(st.sampled_from(["tiny", "tiny", "tiny", "unit"]))
    sets = draw(st.lists(st.tuples(st.sampled_from(CAPACITY_KEYS), toml_value()), max_size=2))
    policies = draw(st.lists(st.sampled_from(["1f1b", "1f1b+recompute", "zbv", "v-half", "chronos"] * 4
                                             + ["chronos+", "", " zbv", "1F1B"]), min_size=1, max_size=3))
    flags = ["--policies", ",".join(policies), "--jobs", draw(st.sampled_from(["1"] * 8 + ["0", "2000"]))]
    if draw(st.booleans()):
        flags += ["--frontier", "--points", draw(st.sampled_from(["2", "3", "4"] * 3 + ["1", "257", "x"]))]
        if draw(st.integers(0, 3)) == 0:
            flags += ["--min-throughput", draw(st.sampled_from(["0.95", "0.5", "0", "nan", "11", "-1"]))]
    if draw(st.integers(0, 3)) == 0:
        flags += ["--micro-batch-sizes", draw(st.sampled_from(["1", "2,1", "3", "0", "1,1", "a", "", "99999"]))]
    if draw(st.integers(0, 4)) == 0:
        flags += ["--target-ratio", draw(st.sampled_from(["2.4", "1", "0", "nan", "1e9", "-2"]))]
    if draw(st.integers(0, 4)) == 0:
        flags += ["--interleaved-v", draw(st.sampled_from(["2,3,4", "2", "", "2,6", "1", "33", "x", "3,3"]))]
    return Case(command="capacity", base=base, sets=[f"{k}={v}" for k, v in sets], flags=flags,
                out=draw(st.sampled_from(OUT_KINDS)), force=draw(st.integers(0, 5)) == 0)


@dataclass
class Case:
    command: str
    base: str
    sets: list[str] = field(default_factory=list)
    schedule: str | None = None
    virtual_stages: str | None = None
    csv: bytes | None = None
    cap: str | None = None
    out: str = "new"
    force: bool = False
    grid: list[str] = field(default_factory=list)
    jobs: str | None = None
    flags: list[str] = field(default_factory=list)

    def argv(self, sandbox: Path) -> list[str]:
        argv = [self.command, BASES[self.base]]
        for g in self.grid:
            argv += ["--grid", g]
        if self.jobs is not None:
            argv += ["--jobs", self.jobs]
        argv += [f.format(sandbox=sandbox) for f in self.flags]
        for s in self.sets:
            argv += ["--set", s]
        if self.schedule is not None:
            argv += ["--schedule", self.schedule]
        if self.virtual_stages is not None:
            argv += ["--virtual-stages", self.virtual_stages]
        if self.csv is not None:
            argv += ["--schedule-csv", str(sandbox / "schedule.csv")]
        if self.cap is not None:
            argv += ["--cap", self.cap]
        argv += ["--out", out_path(sandbox, self.out)]
        return argv + (["--force"] if self.force else [])


def out_path(sandbox: Path, kind: str) -> str:
    return {"new": str(sandbox / "out" / "new"), "same": str(sandbox / "same"), "other": str(sandbox / "other"),
            "foreign": str(sandbox / "foreign"), "file": str(sandbox / "a-file"), "symlink": str(sandbox / "link"),
            "fifo": str(sandbox / "fifo"), "empty": "", "proc": "/proc/self/pipeplan-fuzz",
            "under_file": str(sandbox / "a-file" / "sub")}[kind]


def make_sandbox(sandbox: Path, case: Case) -> None:
    """The traps: a file, a symlink to it, a fifo, another command's folder, a user's folder, a previous
    output of the same command."""
    (sandbox / "a-file").write_text("precious\n")
    (sandbox / "link").symlink_to(sandbox / "a-file")
    os.mkfifo(sandbox / "fifo")
    for name, command in (("other", "capacity"), ("same", case.command)):
        (sandbox / name).mkdir()
        (sandbox / name / "pipeplan.json").write_text(json.dumps({"command": command}))
        (sandbox / name / "old.txt").write_text("old output\n")
    (sandbox / "foreign").mkdir()
    (sandbox / "foreign" / "thesis.tex").write_text("years of work\n")
    if case.csv is not None:
        (sandbox / "schedule.csv").write_bytes(case.csv)
    broken = sandbox / "broken-checkpoint"
    (broken / "step-000002").mkdir(parents=True)
    (broken / "latest").write_text("2\n")
    for rank in range(4):
        (broken / "step-000002" / f"rank-{rank}.pt").write_bytes(b"PK\x03\x04 not a zip")


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under root: its kind and content hash (files), target (links); never opens a fifo."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            mode = p.lstat().st_mode
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(mode):
                out[rel] = "link:" + os.readlink(p)
            elif stat.S_ISREG(mode):
                out[rel] = "file:" + hashlib.sha1(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir" if stat.S_ISDIR(mode) else f"mode:{stat.S_IFMT(mode)}"
    return out


@dataclass
class Outcome:
    code: int | None
    stderr: str
    cpu_s: float
    wall_s: float
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def run_case(case: Case, sandbox: Path) -> Outcome:
    """Run one case in `sandbox` (an empty folder) and judge it."""
    make_sandbox(sandbox, case)
    before = snapshot(sandbox)
    argv = case.argv(sandbox)
    err, problems = io.StringIO(), []
    t0, c0 = time.perf_counter(), time.process_time()
    code: int | None
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(argv)
    except SystemExit as exc:  # argparse: a bad flag
        code = exc.code if isinstance(exc.code, int) else 2
    except BaseException as exc:
        code = None
        problems.append(f"escaped main: {type(exc).__name__}: {str(exc)[:120]}")
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    text = err.getvalue()
    after = snapshot(sandbox)
    if code not in (0, 2, None):
        problems.append(f"exit code {code}")
    if code == 2:
        lines = text.rstrip("\n").split("\n")
        if not text.strip():
            problems.append("refused without a message")
        elif len(lines) != 1 or len(lines[0]) > MAX_LINE:
            problems.append(f"not one line of <= {MAX_LINE} chars ({len(lines)} lines, {len(lines[-1])} chars)")
        if "Traceback" in text:
            problems.append("traceback")
        if after != before:
            changed = sorted(set(after.items()) ^ set(before.items()))[:3]
            problems.append(f"refused but wrote: {changed}")
    if code == 0:
        problems += _check_result(sandbox, case, before, after)
    return Outcome(code, text, cpu, wall, problems)


def _check_result(sandbox: Path, case: Case, before: dict[str, str], after: dict[str, str]) -> list[str]:
    out = Path(out_path(sandbox, case.out))
    if not out.is_relative_to(sandbox):
        return [f"wrote a result to {out}"]
    rel = str(out.relative_to(sandbox))
    problems = []
    kept = {k: v for k, v in before.items() if not (k == rel or k.startswith(rel + "/"))}
    if any(after.get(k) != v for k, v in kept.items()):
        problems.append("a result changed something outside its --out folder")
    if any(".staging-" in k or ".old-" in k for k in after):
        problems.append("a staging folder was left behind")
    if not out.is_dir() or not (out / "pipeplan.json").is_file():
        return [*problems, "result folder without pipeplan.json"]
    if json.loads((out / "pipeplan.json").read_text()).get("command") != case.command:
        problems.append("manifest names another command")
    if (out / "old.txt").exists() and case.command != "sweep":  # a sweep resumes in its own folder
        problems.append("old outputs mixed with new ones")
    for name in ("summary.json", "plan.json"):
        if (out / name).exists():
            try:
                json.loads((out / name).read_text(), parse_constant=_refuse_constant)
            except ValueError as exc:
                problems.append(f"{name}: not strict JSON ({exc})")
    return problems


def _refuse_constant(name: str) -> float:
    raise ValueError(f"non-standard constant {name}")
