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
import shutil
import signal
import socket
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


HOSTILE_STRINGS = [
    "x[/]y", "[link=http://evil.example]click[/link]", "[bold red]loud", "\x1b[31mred\x1b[0m", "=cmd|' /C calc'!A0",
    "+1+1", "-2+3", "@SUM(A1)", "<script>alert(1)</script>", "[x](javascript:alert(1))", "naïve-模型-🚀", "a|b*c_d`e",
    "\u202eevil", "x" * 300,
]  # fmt: skip
"""Markup, ANSI, formulas, HTML, Markdown, right-to-left and non-ASCII, and an over-long name: every string field."""


def _toml_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is a TOML basic string (escapes included)


@st.composite
def hostile_string_line(draw: st.DrawFn) -> Case:
    """A user string with markup, ANSI, a formula or HTML in model.name or a grid value, into every writer."""
    text = draw(st.sampled_from(HOSTILE_STRINGS))
    command = draw(st.sampled_from(["simulate", "show", "plan", "sweep", "capacity"]))
    if command == "sweep":
        return Case(command="sweep", base="tiny", grid=[f"model.name={text.replace(',', ';')},plain"], jobs="1",
                    out=draw(st.sampled_from(["new", "new", "same"])))
    flags = ["--policies", "1f1b"] if command == "capacity" else []
    return Case(command=command, base="tiny", sets=[f"model.name={_toml_string(text)}"], flags=flags,
                out=draw(st.sampled_from(["new", "new", "same"])))


@st.composite
def report_line(draw: st.DrawFn) -> Case:
    """`pipeplan report` of a folder with traps: a link to a secret outside, a fifo, Latin-1, a very wide CSV,
    hostile names in cells."""
    trap = draw(st.sampled_from(["leak", "leak", "fifo", "latin1", "wide", "names", "names", "deep-json",
                                 "huge-int", "plain"]))
    return Case(command="report", base="unit", positional="{sandbox}/rep", setup=f"report-{trap}",
                force=draw(st.integers(0, 3)) == 0)


@st.composite
def fifo_input_line(draw: st.DrawFn) -> Case:
    """A fifo (or another non-file) where a command reads an input: each used to block forever."""
    where = draw(st.sampled_from(["scenario", "model-config", "published", "costs", "latest", "rank-file",
                                  "sweep-csv", "data", "schedule-csv"]))
    if where == "scenario":
        return Case(command=draw(st.sampled_from(["simulate", "plan", "show"])), base="unit",
                    positional="{sandbox}/fifo", out="new")
    if where == "model-config":
        return Case(command="simulate", base="tiny", sets=['model.config="{sandbox}/fifo"'], out="new")
    if where == "published":
        return Case(command="validate", base="unit", positional="", flags=["--published", "{sandbox}/fifo"],
                    out="new")
    if where == "costs":
        return Case(command="run", base="tiny", flags=["--costs", "{sandbox}/fifo"], out="new")
    if where in ("latest", "rank-file"):
        return Case(command="run", base="tiny", flags=["--resume", "--checkpoint-dir", "{sandbox}/fifo-checkpoint"],
                    out="new", setup=f"fifo-{where}")
    if where == "sweep-csv":
        return Case(command="sweep", base="unit", grid=["pipeline.microbatches=4,8"], jobs="1", out="same",
                    setup="fifo-sweep-csv")
    if where == "data":
        return Case(command="run", base="tiny", flags=["--data", "{sandbox}/fifo"], out="new")
    return Case(command="simulate", base="unit", flags=["--schedule-csv", "{sandbox}/fifo"], out="new")


@st.composite
def resume_line(draw: st.DrawFn) -> Case:
    """A resumed sweep or capacity run whose state was damaged: a metric cell or a journal value replaced."""
    token = draw(st.sampled_from(["nan", "inf", "12x4.5", "", "-1", "True", "[]", "null", "NaN", "Infinity", "1e999",
                                  '"x"', "{}", "\x00"]))
    if draw(st.booleans()):
        column = draw(st.sampled_from(["tokens_per_s", "step_time_s", "gpus", "fits", "max_peak_hbm_bytes",
                                       "status", "mfu"]))
        return Case(command="sweep", base="unit", grid=["pipeline.microbatches=4,8"], jobs="1", out="same",
                    setup=f"sweep-csv:{column}:{token}")
    key = draw(st.sampled_from(["tokens_per_s", "makespan_s", "mfu", "peak_hbm_bytes", "layers", "fits"]))
    return Case(command="capacity", base="tiny", flags=["--policies", "1f1b"], out="same",
                setup=f"journal:{key}:{token}")


@st.composite
def concurrency_line(draw: st.DrawFn) -> Case:
    """A command whose --out another writer holds: refused, nothing written."""
    command = draw(st.sampled_from(["simulate", "sweep", "capacity", "plan"]))
    extra: dict = {"grid": ["pipeline.microbatches=4,8"], "jobs": "1"} if command == "sweep" else {}
    flags = ["--policies", "1f1b"] if command == "capacity" else []
    return Case(command=command, base="tiny" if command == "capacity" else "unit", flags=flags,
                out=draw(st.sampled_from(["new", "same"])), hold_lock=True, **extra)


@st.composite
def network_line(draw: st.DrawFn) -> Case:
    """sweep --scheduler at a silent port, a refused port, a malformed or unsupported address."""
    address = draw(st.sampled_from(["silent", "tcp://127.0.0.1:1", "tls://127.0.0.1:8786", "ucx://127.0.0.1:8786",
                                    "tcp://host", "nonsense", "inproc://x", "tcp://[::1]:1", "tcp://256.1.1.1:1"]))
    flags = ["--scheduler", "{silent}" if address == "silent" else address]
    return Case(command="sweep", base="unit", grid=["pipeline.microbatches=4,8"], jobs="1", flags=flags,
                out="new", setup="silent-port" if address == "silent" else None)


@st.composite
def run_check_line(draw: st.DrawFn) -> Case:
    """`pipeplan run` input the launcher can check: each once launched ranks that failed with tracebacks."""
    bad = draw(st.sampled_from([
        ["--checkpoint-dir", "{sandbox}/a-file"], ["--checkpoint-dir", "/proc/self/ck"], ["--device", "cuda"],
        ["--data", "{sandbox}/empty"], ["--data", "{sandbox}/one-byte"], ["--timeout-s", "1e308"],
        ["--timeout-s", str(2**63)], ["--timeout-s", "1e-320"], ["--steps", str(2**63)],
        ["--rdzv-endpoint", "node0", "--nnodes", "2", "--nproc-per-node", "2"],
        ["--node-rank", "5", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "h:29500"],
        ["--resume", "--checkpoint-dir", "{sandbox}/keyless-checkpoint"],
        ["--costs", BASES["tiny"]], ["--checkpoint-every", str(2**63)],
    ]))  # fmt: skip
    return Case(command="run", base="tiny", flags=bad, out=draw(st.sampled_from(OUT_KINDS)), setup="run-inputs")


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
    setup: str | None = None  # a trap of SETUPS built in the sandbox before the run
    hold_lock: bool = False  # another writer holds --out while the command runs
    positional: str | None = None  # instead of the base scenario (a report folder, a fifo)

    def argv(self, sandbox: Path) -> list[str]:
        first = self.positional.format(sandbox=sandbox) if self.positional is not None else BASES[self.base]
        argv = [self.command, first] if first else [self.command]
        for g in self.grid:
            argv += ["--grid", g]
        if self.jobs is not None:
            argv += ["--jobs", self.jobs]
        argv += [f.format(sandbox=sandbox, silent=SILENT_ADDRESS[0]) for f in self.flags]
        for s in self.sets:
            argv += ["--set", s.replace("{sandbox}", str(sandbox))]
        if self.schedule is not None:
            argv += ["--schedule", self.schedule]
        if self.virtual_stages is not None:
            argv += ["--virtual-stages", self.virtual_stages]
        if self.csv is not None:
            argv += ["--schedule-csv", str(sandbox / "schedule.csv")]
        if self.cap is not None:
            argv += ["--cap", self.cap]
        if self.command not in ("report", "show"):  # neither writes an output folder
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
    if case.setup:
        build_setup(sandbox, case)
    broken = sandbox / "broken-checkpoint"
    (broken / "step-000002").mkdir(parents=True)
    (broken / "latest").write_text("2\n")
    for rank in range(4):
        (broken / "step-000002" / f"rank-{rank}.pt").write_bytes(b"PK\x03\x04 not a zip")


SECRET = "pipeplan-fuzz-secret-7f3a"


def build_setup(sandbox: Path, case: Case) -> None:
    """The trap a case names (Case.setup): report folders, fifos in checkpoints, damaged resumable state."""
    name = case.setup or ""
    if name.startswith("report-"):
        rep = sandbox / "rep"
        rep.mkdir()
        (sandbox / "secret.json").write_text(json.dumps({"password": SECRET}))
        (rep / "data.csv").write_text("name,value\nplain,1\n")
        trap = name.removeprefix("report-")
        if trap == "leak":
            (rep / "leak.json").symlink_to(sandbox / "secret.json")
        elif trap == "fifo":
            os.mkfifo(rep / "pipe.csv")
        elif trap == "latin1":
            (rep / "extra.csv").write_bytes("name\ncaf\xe9\n".encode("latin-1"))
        elif trap == "wide":
            (rep / "wide.csv").write_text(",".join(f"c{i}" for i in range(20_000)) + "\n" + "1," * 19_999 + "1\n")
        elif trap == "names":
            import csv as csv_module

            buf = io.StringIO()
            csv_module.writer(buf, lineterminator="\n").writerows([["name"], *([t] for t in HOSTILE_STRINGS)])
            (rep / "names.csv").write_text(buf.getvalue())
        elif trap == "deep-json":
            (rep / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
        elif trap == "huge-int":
            (rep / "big.json").write_text('{"n": ' + "9" * 5000 + "}")
    elif name in ("fifo-latest", "fifo-rank-file"):
        ck = sandbox / "fifo-checkpoint"
        (ck / "step-000002").mkdir(parents=True)
        if name == "fifo-latest":
            os.mkfifo(ck / "latest")
        else:
            (ck / "latest").write_text("2\n")
            for rank in range(4):
                os.mkfifo(ck / "step-000002" / f"rank-{rank}.pt")
    elif name == "fifo-sweep-csv":
        (sandbox / "same" / "old.txt").unlink()
        os.mkfifo(sandbox / "same" / "sweep.csv")
    elif name.startswith(("sweep-csv:", "journal:")):
        _damage_state(sandbox, case)
    elif name == "run-inputs":
        (sandbox / "empty").write_bytes(b"")
        (sandbox / "one-byte").write_bytes(b"a")
        keyless = sandbox / "keyless-checkpoint" / "step-000002"
        keyless.mkdir(parents=True)
        (keyless.parent / "latest").write_text("2\n")
        import torch

        for rank in range(4):
            torch.save({"step": 2}, keyless / f"rank-{rank}.pt")


def _damage_state(sandbox: Path, case: Case) -> None:
    """Run the command once into `same`, then replace one value of its resumable state with a bad token."""
    kind, key, token = (case.setup or "").split(":", 2)
    same = sandbox / "same"
    shutil.rmtree(same)
    first = Case(**{**case.__dict__, "setup": None, "out": "same"})
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(first.argv(sandbox)) == 0, first
    if kind == "sweep-csv":
        import csv as csv_module

        path = same / "sweep.csv"
        rows = list(csv_module.reader(io.StringIO(path.read_text())))
        rows[1][rows[0].index(key)] = token
        buf = io.StringIO()
        csv_module.writer(buf, lineterminator="\n").writerows(rows)
        path.write_text(buf.getvalue())
    else:
        path = same / "evaluations.jsonl"
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            d = json.loads(line)
            ev = d["evaluation"]
            target = ev if key in ev else ev.get("result") or {}
            if key in target:
                lines[i] = line.replace(f'"{key}": {json.dumps(target[key])}', f'"{key}": {token}', 1)
                break
        path.write_text("\n".join(lines) + "\n")


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
    children_before = _children()
    previous = signal.signal(signal.SIGALRM, _hang)
    signal.alarm(HANG_S)
    try:
        with contextlib.ExitStack() as stack:
            if case.hold_lock:
                from pipeplan.common.io import output_lock

                stack.enter_context(output_lock(out_path(sandbox, case.out), "fuzz-holder"))
            stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            stack.enter_context(contextlib.redirect_stderr(err))
            code = main(argv)
    except SystemExit as exc:  # argparse: a bad flag
        code = exc.code if isinstance(exc.code, int) else 2
    except Hang:
        code = None
        problems.append(f"hang: no outcome within {HANG_S} s")
    except BaseException as exc:
        code = None
        problems.append(f"escaped main: {type(exc).__name__}: {str(exc)[:120]}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    orphans = _children() - children_before
    if orphans:
        problems.append(f"orphan processes: {len(orphans)} left running")
        for pid in orphans:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
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
    if code == 0 and case.command == "report":
        problems += _check_report(sandbox, before, after)
    elif code == 0 and case.command == "show":  # prints only: nothing may have changed
        problems += ["show changed the sandbox"] if after != before else []
    elif code == 0:
        problems += _check_result(sandbox, case, before, after)
    if code == 2 and case.hold_lock and "in use by" not in text:
        problems.append("a second writer was not refused as such")
    return Outcome(code, text, cpu, wall, problems)


HANG_S = 60
"""A case with no outcome by then is a hang (a blocked open of a fifo, a silent peer): counted, then abandoned."""
SILENT_ADDRESS = [""]
"""tcp://127.0.0.1:PORT of a socket that accepts and never speaks (start_silent_port), for network cases."""


class Hang(BaseException):
    pass


def _hang(signum: int, frame: object) -> None:
    raise Hang


def start_silent_port() -> socket.socket:
    """A listening socket nobody answers on: a Dask scheduler that never speaks."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    SILENT_ADDRESS[0] = f"tcp://127.0.0.1:{server.getsockname()[1]}"
    return server


def _children() -> set[int]:
    """This process's live descendants (by PPID, recursively), from /proc: a case must leave none behind."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":
                parents.setdefault(int(fields[1]), []).append(int(entry))
    found: set[int] = set()
    todo = [os.getpid()]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _check_report(sandbox: Path, before: dict[str, str], after: dict[str, str]) -> list[str]:
    """A report: nothing outside its folder changed, no secret from outside it embedded, names escaped."""
    problems = []
    rep = sandbox / "rep"
    if any(after.get(k) != v for k, v in before.items() if not k.startswith("rep/")):
        problems.append("a report changed something outside its folder")
    for name in ("report.html", "report.md"):
        text = (rep / name).read_text(errors="replace") if (rep / name).is_file() else ""
        if SECRET in text:
            problems.append(f"leak: {name} holds a file from outside the folder")
        if "<script>alert" in text:
            problems.append(f"unescaped HTML in {name}")
    return problems


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
    if (out / "sweep.csv").is_file():
        ids = [line.split(",", 1)[0] for line in (out / "sweep.csv").read_text().splitlines()[1:]]
        if len(ids) != len(set(ids)):
            problems.append("duplicate rows in sweep.csv")
    for name in ("summary.json", "plan.json"):
        if (out / name).exists():
            try:
                json.loads((out / name).read_text(), parse_constant=_refuse_constant)
            except ValueError as exc:
                problems.append(f"{name}: not strict JSON ({exc})")
    return problems


def _refuse_constant(name: str) -> float:
    raise ValueError(f"non-standard constant {name}")
