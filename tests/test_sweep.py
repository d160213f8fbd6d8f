"""`pipeplan sweep` and `pipeplan report`: grids, invalid rows, resuming, the page."""

from __future__ import annotations

import pandas as pd
import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.analysis.cli import main
from pipeplan.analysis.sweep import config_id, configurations, parse_grid, run_sweep
from pipeplan.sim.errors import PipeplanError

EIGHT_B = str(scenario_path("llama3-8b-pp4-h100"))
GRID = {"pipeline.stages": [2, 4], "pipeline.schedule": ["1f1b", "interleaved-1f1b"], "pipeline.microbatches": [8],
        "pipeline.virtual_stages": [1]}  # interleaved-1f1b at v = 1, given explicitly, is invalid


def test_parse_grid_types_values():
    grid = parse_grid(["pipeline.stages=2,4", "freeze.cap=0,0.5", "pipeline.schedule=1f1b,zbv",
                       "parallel.sequence_parallel=true,false"])
    assert grid == {"pipeline.stages": [2, 4], "freeze.cap": [0, 0.5], "pipeline.schedule": ["1f1b", "zbv"],
                    "parallel.sequence_parallel": [True, False]}
    assert len(list(configurations(grid))) == 16


@pytest.mark.parametrize("bad", [["pipeline.stages"], ["=1,2"], ["a=1", "a=2"], []])
def test_bad_grids(bad):
    with pytest.raises(PipeplanError, match="--grid"):
        parse_grid(bad)


def test_sweep_records_invalid_combinations_and_resumes(tmp_path):
    rows = run_sweep(EIGHT_B, GRID, tmp_path, jobs=2, plan_freeze=False)
    assert len(rows) == 4
    bad = rows[rows["pipeline.schedule"] == "interleaved-1f1b"]
    assert (bad["status"] == "invalid").all()
    assert bad["reason"].str.contains("virtual_stages").all()
    ok = rows[rows["status"] == "ok"]
    assert (ok["tokens_per_s"] > 0).all() and set(ok["pipeline.stages"]) == {2, 4}

    csv = tmp_path / "sweep.csv"
    before = csv.read_text()
    run_sweep(EIGHT_B, GRID, tmp_path, jobs=2, plan_freeze=False)
    assert csv.read_text() == before  # nothing recomputed, nothing duplicated

    # an interrupted sweep: a torn last line and a missing configuration
    lines = before.splitlines(keepends=True)
    csv.write_text("".join(lines[:-1]) + lines[-1][:10])
    again = run_sweep(EIGHT_B, GRID, tmp_path, jobs=1, plan_freeze=False)
    assert sorted(again["config_id"]) == sorted(rows["config_id"])
    assert len(pd.read_csv(csv)) == 4


def test_sweep_refuses_a_folder_of_another_grid(tmp_path):
    run_sweep(EIGHT_B, {"pipeline.microbatches": [8]}, tmp_path, jobs=1, plan_freeze=False)
    with pytest.raises(PipeplanError, match="other grid keys"):
        run_sweep(EIGHT_B, {"pipeline.stages": [4]}, tmp_path, jobs=1, plan_freeze=False)


def test_config_ids_are_stable():
    assert config_id({"a": 1, "b": "x"}) == config_id({"b": "x", "a": 1})


def test_sweep_cli_writes_table_plots_and_freeze_speedups(tmp_path, capsys):
    out = tmp_path / "sw"
    # with runtime memory and allocator fragmentation counted (docs/cost-model.md) the 8B setting needs the
    # 96 GB H100 (93.6 GiB usable) rather than the 80 GB one
    argv = ["sweep", EIGHT_B, "--grid", "pipeline.microbatches=4,8", "--grid", "freeze.cap=0,0.9",
            "--grid", "device.hbm_gib=93.6", "--jobs", "2", "--out", str(out)]
    assert main(argv) == 0
    assert {"sweep.csv", "pareto.png", "heatmap.png"} <= {p.name for p in out.iterdir()}
    df = pd.read_csv(out / "sweep.csv")
    assert df.loc[df["freeze.cap"] == 0, "freeze_speedup"].tolist() == pytest.approx([1.0, 1.0])
    assert (df.loc[df["freeze.cap"] == 0.9, "freeze_speedup"] > 1.0).all()
    assert "best 4 configurations that fit" in capsys.readouterr().out


def test_sweep_cli_bad_flags(tmp_path, capsys):
    assert main(["sweep", EIGHT_B, "--grid", "pipeline.stages=2", "--heatmap", "a,b", "--out", str(tmp_path)]) == 2
    assert "--heatmap" in capsys.readouterr().err
    assert main(["sweep", "missing.toml", "--grid", "pipeline.stages=2", "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x" / "sweep.csv").exists()


def test_report_renders_a_simulate_folder(tmp_path):
    out = tmp_path / "sim"
    assert main(["simulate", "--out", str(out)]) == 0
    assert main(["report", str(out)]) == 0
    page = (out / "report.html").read_text()
    md = (out / "report.md").read_text()
    assert page.count("data:image/png;base64,") == 2  # gantt and memory, inlined
    for name in ("summary.json", "timeline.csv", "schedule.csv", "gantt.png"):
        assert name in md
    assert "| makespan_s" in md and "peak_hbm (GiB)" in md


def test_report_bad_folders(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not a folder" in err and "holds no pipeplan outputs" in err


@pytest.fixture(scope="module")
def unit_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("unit") / "sw"
    grid = ["--grid", "pipeline.microbatches=4,8,16"]
    assert main(["sweep", str(scenario_path("explicit-unit")), *grid, "--jobs", "1", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("damage, message", [
    (lambda text: text[: text.index("\n") + 40], "is cut off (no newline at its end)"),  # a cut-off first row
    (lambda text: text[:60], "is cut off"),  # a cut-off header: pandas would read a table with no rows
    (lambda text: text + "0123,4,ok\n", "line 5 has 3 fields, its header 19"),
])
def test_report_refuses_a_damaged_csv_instead_of_answering_from_it(tmp_path, unit_sweep, capsys, damage, message):
    """A damaged sweep.csv would otherwise be read as blanks, and the page would lead with "nothing fits"."""
    import shutil

    folder = tmp_path / "sw"
    shutil.copytree(unit_sweep, folder)
    (folder / "sweep.csv").write_text(damage((folder / "sweep.csv").read_text()))
    assert main(["report", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "rerun the command that wrote it" in err
    assert not (folder / "report.md").exists()


def test_report_after_a_repaired_sweep_notes_the_rejected_lines(tmp_path, unit_sweep, capsys):
    """Resuming moves damaged lines to sweep.rejected.csv; the report says so and answers from sweep.csv."""
    import shutil

    folder = tmp_path / "sw"
    shutil.copytree(unit_sweep, folder)
    lines = (folder / "sweep.csv").read_text().splitlines(keepends=True)
    (folder / "sweep.csv").write_text("".join([*lines[:2], 'garbage,,1,"unterminated\n', *lines[3:]]))
    grid = ["--grid", "pipeline.microbatches=4,8,16"]
    assert main(["sweep", str(scenario_path("explicit-unit")), *grid, "--jobs", "1", "--out", str(folder)]) == 0
    assert (folder / "sweep.rejected.csv").exists()
    assert main(["report", str(folder)]) == 0
    md = (folder / "report.md").read_text()
    assert "1 damaged line(s) of sweep.csv" in md and "Configurations that fit (3)" in md


@pytest.mark.parametrize("schedule,zero", [("zb-2p", True), ("1f1b", False)])
def test_step_tail_share_under_post_validation(schedule, zero):
    """With optimizer post-validation the step is the longest rank span: ZB-2p's is shorter than its makespan
    (the share is clamped at 0), the default scenario's 1F1B rank 0 starts first and ends last, so its span is the
    makespan plus its own optimizer step (a share above 0, as docs/sweep.md says)."""
    from pipeplan.analysis.sweep import evaluate
    from pipeplan.sim.config import load_scenario
    from pipeplan.solver.step import simulate_with_memory_policy

    over = {"pipeline.schedule": schedule, "training.optimizer_post_validation": True}
    row = evaluate(str(scenario_path("llama3-8b-pp4-h100")), over, False)
    assert row["status"] == "ok"
    res, _ = simulate_with_memory_policy(load_scenario(scenario_path("llama3-8b-pp4-h100"), over))
    assert row["step_time_s"] == res.step_time_s
    if zero:
        assert res.step_time_s < res.makespan_s and row["step_tail_share"] == 0.0
    else:
        assert res.step_time_s > res.makespan_s
        assert row["step_tail_share"] == pytest.approx((res.step_time_s - res.makespan_s) / res.step_time_s)
        assert 0.0 < row["step_tail_share"] < 0.05


@pytest.mark.parametrize("makespan,step,share", [
    (10.0, 12.5, 0.2),  # 2.5 s of tails in a 12.5 s step
    (10.0, 10.0, 0.0),
    (10.0, 9.5, 0.0),  # post-validation's span under the makespan: no tail, not -5.3%
    (10.0, 0.0, 0.0),  # an empty step
])
def test_step_tail_share_is_the_step_past_the_makespan_and_never_negative(makespan, step, share):
    from pipeplan.analysis.sweep import step_tail_share

    assert step_tail_share(makespan, step) == pytest.approx(share)


def test_invalid_reasons_keep_their_brackets(tmp_path, capsys):
    """A reason names scenario tables ("[model]", "[costs]"): the console prints them, not as rich markup."""
    grid = ["--grid", "pipeline.p2p_buffers=per-exchange,per-microbatch"]
    assert main(["sweep", str(scenario_path("explicit-unit")), *grid, "--out", str(tmp_path / "s")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "needs a [model] scenario (explicit [costs] give" in out


def test_report_keeps_a_file_it_did_not_write_unless_force(tmp_path, capsys):
    """report.md of the user's own (or a symlink) in the folder is refused before either page is written."""
    out = tmp_path / "sim"
    assert main(["simulate", str(scenario_path("explicit-unit")), "--out", str(out)]) == 0
    (out / "report.md").write_text("my own notes\n")
    assert main(["report", str(out)]) == 2
    err = capsys.readouterr().err
    assert "report.md: exists and is not a pipeplan report" in err and "--force" in err
    assert (out / "report.md").read_text() == "my own notes\n" and not (out / "report.html").exists()
    assert main(["report", str(out), "--force"]) == 0 and main(["report", str(out)]) == 0  # then it is ours
    assert (out / "report.md").read_text().startswith("# pipeplan report: sim (simulated step)")
    (out / "report.html").unlink()
    (out / "report.html").symlink_to(tmp_path / "elsewhere.html")
    assert main(["report", str(out), "--force"]) == 2  # a symlink is never written, --force or not
    assert "report " in capsys.readouterr().err and not (tmp_path / "elsewhere.html").exists()
