"""The `pipeplan` CLI: every subcommand's --help, simulate on shipped scenarios, and bad input -> exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from pipeplan.scenarios import scenario_names, scenario_path

from pipeplan.analysis.cli import COMMANDS, main

SIM_FILES = {"summary.json", "timeline.csv", "memory.csv", "schedule.csv", "trace.json", "gantt.png", "memory.png",
             "pipeplan.json"}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert "usage: pipeplan " + command in capsys.readouterr().out


@pytest.mark.parametrize("bench", ["sim", "plan", "sweep"])
def test_every_bench_help_ends_with_its_example(bench, capsys):
    with pytest.raises(SystemExit):
        main(["bench", bench, "--help"])
    assert f"examples:\n  pipeplan bench {bench} " in capsys.readouterr().out


def test_bench_plan_says_which_files_it_wrote(tmp_path, capsys):
    pytest.importorskip("scipy")  # the TimelyFreeze formulation it is timed against
    out = tmp_path / "b"
    assert main(["bench", "plan", "--sizes", "4x16", "--out", str(out)]) == 0
    wrote = capsys.readouterr().out.strip().splitlines()[-1]
    assert wrote == f"wrote {out}/: bench_plan.csv bench_plan.png"
    assert {p.name for p in out.iterdir()} == {"bench_plan.csv", "bench_plan.png", "pipeplan.json"}


def test_simulate_default_writes_everything(tmp_path):
    out = tmp_path / "sim"
    assert main(["simulate", "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == SIM_FILES
    assert json.loads((out / "pipeplan.json").read_text())["scenario"] == "llama3-8b-pp4-h100"  # not null
    summary = json.loads((out / "summary.json").read_text())
    for key in ("makespan_s", "bubble_ratio", "peak_activation_bytes", "peak_hbm_bytes", "oom", "sim_wall_s",
                "tokens_per_s", "mfu", "schedule", "stages", "microbatches"):
        assert key in summary
    timeline = pd.read_csv(out / "timeline.csv")
    assert list(timeline.columns) == ["rank", "stage", "microbatch", "kind", "start_s", "end_s"]
    assert timeline["end_s"].max() == pytest.approx(summary["makespan_s"])
    # the step ends when the last rank's data-parallel reduction and optimizer step (after its last action) do
    ends = timeline.groupby("rank")["end_s"].max().to_numpy() + np.asarray(summary["step_tail_s"])
    assert ends.max() == pytest.approx(summary["step_time_s"])
    trace = json.loads((out / "trace.json").read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e.get("tid") == 0]
    assert len(slices) == len(timeline)
    assert any(e["ph"] == "C" and e["name"] == "HBM" for e in trace["traceEvents"])
    mem = pd.read_csv(out / "memory.csv")
    assert list(mem.columns) == ["rank", "time_s", "hbm_bytes", "static_hbm_bytes", "activation_hbm_bytes",
                                 "dram_bytes", "nvme_bytes"]
    assert (mem["hbm_bytes"] == mem["static_hbm_bytes"] + mem["activation_hbm_bytes"]).all()


@pytest.mark.parametrize("name", scenario_names())
def test_simulate_every_shipped_scenario(name, tmp_path):
    assert main(["simulate", str(scenario_path(name)), "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["makespan_s"] > 0


def test_schedule_csv_round_trip(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    scen = str(scenario_path("explicit-unit"))
    assert main(["simulate", scen, "--schedule", "zb-h1", "--out", str(a)]) == 0
    assert main(["simulate", scen, "--schedule-csv", str(a / "schedule.csv"), "--out", str(b)]) == 0
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sa["makespan_s"] == sb["makespan_s"]
    assert (a / "schedule.csv").read_text() == (b / "schedule.csv").read_text()


def test_oom_is_reported_in_summary(tmp_path):
    scen = str(scenario_path("llama2-70b-48l-pp8-tp8-a100"))
    assert main(["simulate", scen, "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["oom"] is (max(summary["peak_hbm_bytes"]) > summary["hbm_capacity_bytes"])


def _bad_csv(tmp_path, text: str) -> str:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["simulate", "missing.toml"], "file not found"),
        (["simulate", "--schedule", "nope"], "pipeline.schedule: unknown schedule 'nope'"),
        (["simulate", "--schedule", "zbv", "--virtual-stages", "1"], "virtual_stages"),  # given, and wrong
        (["simulate", "--schedule", "1f1b", "--schedule-csv", "x.csv"], "not allowed with argument"),
        (["simulate", "--bogus"], "unrecognized arguments"),
        (["nope"], "invalid choice"),
        (["plan", "--sweep-cap", "--set", "pipeline.microbatches=100000"], "the limit is 524,288"),  # behind a bar
        (["validate", "--published", "missing.csv"], "missing.csv"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, expected, tmp_path, capsys):
    out = tmp_path / "out"
    try:
        code = main([*argv, "--out", str(out)] if argv[0] != "nope" and "--bogus" not in argv else argv)
    except SystemExit as exc:
        code = exc.code
    stdout, err = capsys.readouterr()
    assert code == 2
    assert stdout == ""  # not even the empty line a progress bar leaves in a log
    assert expected in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()
    assert not list(tmp_path.glob(".out.staging-*"))


@pytest.mark.parametrize(
    "csv,expected",
    [
        ("0F0,0X1\n", "expected <stage><F|B|I|W><microbatch>"),
        ("0F0,0B0\n2F0,2B0\n", "stages [1] have no actions"),
        ("0F0,0F0,0B0\n1F0,1B0\n", "appears more than once"),
        ("", "no rows"),
        ("0F0,0B0\n1F0,1B0\n", "the scenario says 8"),
    ],
)
def test_bad_schedule_csv(csv, expected, tmp_path, capsys):
    out = tmp_path / "out"
    scen = str(scenario_path("explicit-unit"))
    assert main(["simulate", scen, "--schedule-csv", _bad_csv(tmp_path, csv), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1
    assert not out.exists()


def test_console_script_end_to_end(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[pipeline]\nstages = 2\nmicrobatches = 0\n")
    proc = subprocess.run([sys.executable, "-m", "pipeplan.analysis.cli", "simulate", str(bad),
                           "--out", str(tmp_path / "o")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"pipeplan simulate: error: {bad}: pipeline.microbatches: input should be greater than 0 (got 0)"
    )


def test_simulate_with_offload_puts_copies_on_their_own_tracks(tmp_path):
    out = tmp_path / "sim"
    assert main(["simulate", "--set", "memory.offload_activations=0.5", "--set", "memory.optimizer=dram",
                 "--set", "memory.master_weights=dram", "--out", str(out)]) == 0
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    d2h = [e for e in events if e["ph"] == "X" and e.get("tid") == 2]
    h2d = [e for e in events if e["ph"] == "X" and e.get("tid") == 3]
    timeline = pd.read_csv(out / "timeline.csv")
    forwards, backwards = (timeline["kind"] == "F").sum(), (timeline["kind"] == "B").sum()
    # one offload per F and one prefetch per B, plus each chunk's optimizer-step copy on both streams
    assert len(d2h) == forwards + 4 and len(h2d) == backwards + 4
    assert {e["cat"] for e in d2h} == {"offload", "step"} and {e["cat"] for e in h2d} == {"prefetch", "step"}
    assert all(e["dur"] > 0 for e in d2h + h2d)
