"""Hardening: writes that never destroy, outputs that never mix, sizes checked before work, one-line errors.

Each test is one input from the hardening report (issue 15) with the behaviour promised for it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.analysis.cli import MAX_ERROR_CHARS, main
from pipeplan.analysis.sweep import parse_grid, run_sweep, validate_grid
from pipeplan.common.io import (
    OutputPathError,
    OutputValueError,
    atomic_write_json,
    atomic_write_text,
    staged_output,
)
from pipeplan.sim.errors import PipeplanError

UNIT = str(scenario_path("explicit-unit"))
EIGHT_B = str(scenario_path("llama3-8b-pp4-h100"))


def refused(argv: list[str], capsys) -> str:
    """Run the CLI, expect exit 2 with one line of at most MAX_ERROR_CHARS characters; return the line."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and len(err) <= MAX_ERROR_CHARS + 1 and "Traceback" not in err, err
    assert out == "", out  # nothing on stdout either, not even a progress bar's last line
    return err


def tree(root: Path) -> dict[str, bytes | str]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else "dir") for p in sorted(root.rglob("*"))}


# ---- writes that never destroy -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["symlink", "fifo", "folder"])
def test_atomic_write_refuses_what_is_not_a_regular_file(kind, tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("keep me")
    path = tmp_path / "out"
    {"symlink": lambda: path.symlink_to(target), "fifo": lambda: os.mkfifo(path), "folder": path.mkdir}[kind]()
    with pytest.raises(OutputPathError, match=f"is a {kind}"):
        atomic_write_text(path, "new")
    assert target.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "target.txt"]  # no temporary file left


def test_atomic_write_refuses_dev_and_proc(tmp_path):
    with pytest.raises(OutputPathError, match="is a device"):
        atomic_write_text("/dev/null", "x")
    with pytest.raises(OutputPathError, match="kernel or device"):
        atomic_write_text("/proc/self/pipeplan-test", "x")


def test_strict_json_refuses_infinity(tmp_path):
    with pytest.raises(OutputValueError, match=r"result a\.b is not a finite number"):
        atomic_write_json(tmp_path / "s.json", {"a": {"b": float("inf")}})
    assert not list(tmp_path.iterdir())


def test_a_failed_swap_leaves_the_old_folder_exactly_as_it_was(tmp_path, monkeypatch):
    out = tmp_path / "out"
    with staged_output(out, {"command": "simulate"}) as stage:
        (stage / "summary.json").write_text("old")
        (stage / "trace.json").write_text("old trace")
    before = tree(out)
    real_rename = os.rename

    def failing_rename(src, dst):
        if ".staging-" in str(src):
            raise OSError(28, "No space left on device")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError), staged_output(out, {"command": "simulate"}) as stage:
        (stage / "summary.json").write_text("new")
    monkeypatch.undo()
    assert tree(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # staging and set-aside folders are gone


def test_a_rerun_replaces_the_folder_as_a_whole(tmp_path):
    out = tmp_path / "out"
    with staged_output(out, {"command": "simulate"}) as stage:
        (stage / "gantt.png").write_text("a")
        (stage / "only-in-the-old-run.csv").write_text("a")
    with staged_output(out, {"command": "simulate"}) as stage:
        (stage / "gantt.png").write_text("b")
    assert {p.name: p.read_text() for p in out.iterdir() if p.name != "pipeplan.json"} == {"gantt.png": "b"}


def test_stale_staging_of_a_dead_process_is_cleaned(tmp_path):
    dead = tmp_path / ".out.staging-999999999-abc"  # no such pid
    alive = tmp_path / f".out.staging-{os.getppid()}-abc"  # pytest's parent is alive
    dead.mkdir()
    alive.mkdir()
    with staged_output(tmp_path / "out", {"command": "simulate"}):
        pass
    assert not dead.exists() and alive.exists()


@pytest.mark.parametrize("out, expected", [
    ("", "--out: empty path"),
    ("a-file", "is a file, not a folder"),
    ("a-file/sub", "is a path under a file"),
    ("/proc/self/pipeplan", "kernel or device file system"),
])  # fmt: skip
def test_bad_out_paths_are_refused_before_any_work(out, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("a-file").write_text("precious")
    assert expected in refused(["simulate", UNIT, "--out", out], capsys)
    assert Path("a-file").read_text() == "precious"


# ---- outputs never mix -------------------------------------------------------------------------------
def test_a_folder_of_another_command_is_refused_unless_force(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["simulate", UNIT, "--out", str(out)]) == 0
    manifest = json.loads((out / "pipeplan.json").read_text())
    assert manifest["command"] == "simulate" and manifest["scenario"] == UNIT and manifest["pipeplan_version"]
    capsys.readouterr()
    assert "holds the outputs of `pipeplan simulate`" in refused(["plan", UNIT, "--out", str(out)], capsys)
    assert main(["plan", UNIT, "--out", str(out), "--force"]) == 0
    assert json.loads((out / "pipeplan.json").read_text())["command"] == "plan"
    assert (out / "plan.json").exists()


def test_a_folder_of_user_files_is_refused(tmp_path, capsys):
    (tmp_path / "thesis.tex").write_text("years of work")
    assert "pipeplan did not write" in refused(["simulate", UNIT, "--out", str(tmp_path)], capsys)
    assert (tmp_path / "thesis.tex").read_text() == "years of work"


# ---- sizes checked before any work ------------------------------------------------------------------
@pytest.mark.parametrize("setting, expected", [
    ("pipeline.microbatches=1000000000000000000", "pipeline.microbatches: stages * virtual_stages * microbatches"),
    ("pipeline.stages=1000000", "pipeline.stages * pipeline.virtual_stages: 1,000,000 chunks; the limit is 4,096"),
    ("pipeline.virtual_stages=1000000", "limit is 4,096"),
    ("costs.forward_s=1e308", "costs.forward_s: 1e+308 is above the limit 1e+06"),
    ("costs.activation_bytes=1e308", "costs.activation_bytes: 1e+308 is above the limit"),
    ("freeze.curve=[]", "freeze.curve: empty"),
])  # fmt: skip
def test_sizes_and_magnitudes_are_refused_naming_field_and_limit(setting, expected, tmp_path, capsys):
    assert expected in refused(["simulate", UNIT, "--set", setting, "--out", str(tmp_path / "o")], capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("setting, expected", [
    ("parallel.tp=1024", "parallel.tp: 1024 does not divide model.heads (32)"),
    ("model.layers=1000000000000000000", "model.layers: 1e+18 is above the limit 10,000"),
    ("device.peak_tflops=1e-300", "forward_s comes to"),
])  # fmt: skip
def test_model_scenarios_out_of_range_are_refused(setting, expected, tmp_path, capsys):
    assert expected in refused(["simulate", EIGHT_B, "--set", setting, "--out", str(tmp_path / "o")], capsys)


@pytest.mark.parametrize("content, expected", [
    (b"0F" + b"9" * 5000, "microbatch id 999999999999... has 5,000 digits; the limit is 9"),
    (b"\xff\xfe0F0", "not UTF-8 text"),
    (b"100000F0", "names stage 100,000; the limit is 4,096 stages"),
])  # fmt: skip
def test_bad_schedule_csv_files(content, expected, tmp_path, capsys):
    csv = tmp_path / "s.csv"
    csv.write_bytes(content)
    assert expected in refused(["simulate", UNIT, "--schedule-csv", str(csv), "--out", str(tmp_path / "o")], capsys)


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_schedule_csv_that_is_not_a_file_is_not_read(special, tmp_path, capsys):
    if special == "fifo":
        os.mkfifo(tmp_path / "fifo")  # opening it would block for a writer
        special = str(tmp_path / "fifo")
    assert "not a regular file" in refused(["simulate", UNIT, "--schedule-csv", special, "--out",
                                            str(tmp_path / "o")], capsys)


def test_deep_toml_and_huge_integers_are_one_line(tmp_path, capsys):
    deep = tmp_path / "deep.toml"
    deep.write_text("[pipeline]\nstages = 4\nmicrobatches = 8\n[freeze]\ncurve = " + "[" * 5000 + "]" * 5000)
    assert "nested too deeply" in refused(["simulate", str(deep), "--out", str(tmp_path / "o")], capsys)
    digits = tmp_path / "digits.toml"
    digits.write_text("[pipeline]\nstages = 4\nmicrobatches = " + "9" * 5000)
    assert "not valid TOML" in refused(["simulate", str(digits), "--out", str(tmp_path / "o")], capsys)


def test_long_echoes_are_cut(tmp_path, capsys):
    err = refused(["simulate", UNIT, "--set", "pipeline.schedule=" + "x" * 5_000_000, "--out",
                   str(tmp_path / "o")], capsys)
    assert err.rstrip().endswith("...")


def test_empty_schedule_is_refused(tmp_path, capsys):
    assert "--schedule: empty" in refused(["simulate", UNIT, "--schedule", "", "--out", str(tmp_path / "o")], capsys)


def test_plan_with_all_zero_costs_says_so(tmp_path, capsys):
    zero = [f"costs.{k}=0.0" for k in ("forward_s", "backward_input_s", "backward_weight_s")]
    argv = ["plan", UNIT, *[a for z in zero for a in ("--set", z)], "--out", str(tmp_path / "o")]
    assert "every forward and backward duration is 0" in refused(argv, capsys)


# ---- run validates before launching -----------------------------------------------------------------
@pytest.mark.parametrize("flags, expected", [
    (["--timeout-s", "nan"], "--timeout-s: nan is not a finite number"),
    (["--lr", "nan"], "--lr: nan is not a finite number"),
    (["--resume", "--checkpoint-dir", "{tmp}/none"], "no complete checkpoint"),
    (["--resume", "--checkpoint-dir", "{tmp}/broken"], "rank-0.pt cannot be loaded"),
])  # fmt: skip
def test_run_refuses_bad_flags_and_checkpoints_before_launching(flags, expected, tmp_path, capsys):
    broken = tmp_path / "broken" / "step-000002"
    broken.mkdir(parents=True)
    (tmp_path / "broken" / "latest").write_text("2\n")
    for rank in range(4):
        (broken / f"rank-{rank}.pt").write_bytes(b"PK\x03\x04 truncated")
    argv = ["run", *[f.format(tmp=tmp_path) for f in flags], "--out", str(tmp_path / "o")]
    assert expected in refused(argv, capsys)
    assert not (tmp_path / "o").exists()


# ---- sweeps ------------------------------------------------------------------------------------------
def test_duplicate_grid_values_give_one_row(tmp_path):
    grid = parse_grid(["pipeline.microbatches=4,4,8"])
    assert grid == {"pipeline.microbatches": [4, 8]}
    rows = run_sweep(UNIT, grid, tmp_path, jobs=1, plan_freeze=False)
    assert len(rows) == 2 and rows["config_id"].is_unique


@pytest.mark.parametrize("grid, expected", [
    ({"pipeline.microbatchs": [4]}, "pipeline has no key 'microbatchs'; allowed: stages, microbatches"),
    ({"pipeline.stages": ["four"]}, "--grid pipeline.stages: value 'four': input should be a valid integer"),
    ({"memory.recompute": ["some"]}, "input should be 'none', 'full', 'selective', 'selective-op' or 'chronos'"),
    ({"pipeline.stages.x": [1]}, "pipeline.stages is a value, not a table"),
])  # fmt: skip
def test_bad_grid_keys_and_values_are_refused_up_front(grid, expected):
    with pytest.raises(PipeplanError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        validate_grid(grid)


def test_resume_moves_damaged_lines_aside_and_recomputes_them(tmp_path, capsys):
    grid = {"pipeline.microbatches": [4, 8, 12], "parallel.sequence_parallel": [True]}
    rows = run_sweep(UNIT, grid, tmp_path, jobs=1, plan_freeze=False)
    csv = tmp_path / "sweep.csv"
    header, first, second, third = csv.read_bytes().splitlines()
    flipped = (b"0" if first[:1] != b"0" else b"1") + first[1:]  # a flipped id: its values no longer match
    csv.write_bytes(b"\n".join([header, flipped, b"garbage", b"\0" * 40, b"\xff\xfe", second]) + b"\n" + third[:9])
    again = run_sweep(UNIT, grid, tmp_path, jobs=1, plan_freeze=False)
    assert sorted(again["config_id"]) == sorted(rows["config_id"])
    assert "5 damaged line(s) (or rows of other --set values) moved to sweep.rejected.csv" in capsys.readouterr().err
    assert (tmp_path / "sweep.rejected.csv").read_bytes().count(b"\n") == 5
    assert len(csv.read_text().splitlines()) == 4  # header + three good rows, no garbage kept


# ---- flags and keys that were silently ignored or misnamed (review of the capacity/fit work) ---------
@pytest.mark.parametrize("flags, expected", [
    (["--max-dim", "0"], "--max-dim: must be >= 128 (got 0)"),  # 0 is a value, not "use the default"
    (["--threads", "0"], "--threads: must be > 0 (got 0)"),
    (["--threads", "-2"], "--threads: must be > 0 (got -2)"),
])  # fmt: skip
def test_profile_gemm_refuses_zero_sizes(flags, expected, tmp_path, capsys):
    argv = ["profile", "--gemm", "--device", "cpu", *flags, "--out", str(tmp_path / "o")]
    assert expected in refused(argv, capsys)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("key", ["admission_cap", "stash_limit"])
def test_schedule_csv_refuses_keys_that_shape_a_generated_order(key, tmp_path, capsys):
    from pipeplan.sim.config import load_scenario
    from pipeplan.sim.step import resolve_schedule

    csv = tmp_path / "order.csv"
    resolve_schedule(load_scenario(UNIT)).write_csv(csv)  # a valid order: only the key is wrong
    line = refused(["simulate", UNIT, "--schedule-csv", str(csv), "--set", f"pipeline.{key}=4", "--out",
                    str(tmp_path / "o")], capsys)
    assert f"pipeline.{key}: applies to a generated schedule, not to --schedule-csv" in line


def test_a_stash_limit_on_1f1b_is_named_as_such(tmp_path, capsys):
    line = refused(["simulate", UNIT, "--set", "pipeline.stash_limit=5", "--out", str(tmp_path / "o")], capsys)
    assert "pipeline.stash_limit: schedule '1f1b' has no W stash limit" in line


def test_order_timing_is_refused_where_no_order_is_generated_for_it(tmp_path, capsys):
    """pipeline.order_timing = "costs" times chronos' list scheduler: a fixed order (1f1b) or a given one
    (--schedule-csv) has nothing to time; one line each, exit 2."""
    from pipeplan.sim.config import load_scenario
    from pipeplan.sim.step import resolve_schedule

    line = refused(["simulate", UNIT, "--set", "pipeline.order_timing=costs", "--out", str(tmp_path / "o")], capsys)
    assert "pipeline.order_timing: schedule '1f1b' has no cost-timed order" in line
    csv = tmp_path / "order.csv"
    resolve_schedule(load_scenario(UNIT)).write_csv(csv)
    line = refused(["simulate", UNIT, "--schedule-csv", str(csv), "--set", "pipeline.order_timing=costs", "--out",
                    str(tmp_path / "o")], capsys)
    assert "pipeline.order_timing: times a generated schedule, not --schedule-csv's given order" in line


def test_a_bool_for_offload_weights_names_the_list_form(tmp_path, capsys):
    line = refused(["simulate", EIGHT_B, "--set", "memory.offload_weights=true", "--out", str(tmp_path / "o")],
                   capsys)
    assert "memory.offload_weights: input should be 'none', 'all' or 'auto' (got True); or a list, one bool per " \
           "chunk" in line
