"""`pipeplan capacity` resumes: every evaluation is journaled as it is made, and a re-run with the same inputs
evaluates only what is missing, with the answer of an uninterrupted run."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from pipeplan.scenarios import scenario_path

import pipeplan.solver.capacity as capacity
from pipeplan.analysis.capacity import capacity_table, frontier_table
from pipeplan.analysis.capacity_journal import JOURNAL, Journal
from pipeplan.analysis.cli import main

SEVENTY = str(scenario_path("llama2-70b-48l-pp8-tp8-a100"))
POLICIES = ["1f1b", "v-half"]


def _run(folder, overrides=None, jobs=1):
    """capacity and a 3-point frontier with a journal in `folder`: (rows, frontier, journal)."""
    journal = Journal(folder, {"command": "capacity", "scenario": SEVENTY, "pipeplan_version": "test"})
    depths: dict = {}
    rows = capacity_table(SEVENTY, POLICIES, depths=depths, overrides=overrides, jobs=jobs, journal=journal)
    return rows, frontier_table(rows, depths, 3, jobs=jobs), journal


@pytest.fixture
def counted(monkeypatch):
    """The depths evaluated in this process, in order."""
    calls: list[tuple[str, int]] = []
    real = capacity.evaluate_sizes

    def counting(sc_path, overrides, policy, layers, *args):
        calls.append((policy.name, layers))
        return real(sc_path, overrides, policy, layers, *args)

    monkeypatch.setattr(capacity, "evaluate_sizes", counting)
    return calls


def test_a_resumed_run_evaluates_only_what_is_missing_and_gives_the_same_answer(tmp_path, counted):
    whole = _run(tmp_path / "a")
    lines = (tmp_path / "a" / JOURNAL).read_bytes().splitlines(keepends=True)
    assert len(lines) == len(counted) == len(set(counted))  # one line per evaluation, each made once
    # a run stopped after 5 evaluations, its last line torn by the crash
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / JOURNAL).write_bytes(b"".join(lines[:5]) + lines[5][:40])
    counted.clear()
    resumed = _run(tmp_path / "b")
    assert resumed[:2] == whole[:2]  # every row, floats included
    assert len(counted) == len(lines) - 5
    assert resumed[2].damaged == 1
    counted.clear()
    assert _run(tmp_path / "b")[:2] == whole[:2] and counted == []  # complete: nothing to evaluate


def test_other_inputs_never_take_a_journaled_answer(tmp_path, counted):
    before = _run(tmp_path / "a")
    other = {"pipeline.microbatches": 16}  # a --set that changes the step
    counted.clear()
    rows = _run(tmp_path / "a", other)[0]
    in_a = list(counted)
    counted.clear()
    assert _run(tmp_path / "fresh", other)[0] == rows
    assert sorted(in_a) == sorted(counted)  # in the old folder, every depth was evaluated as in a new one
    assert rows != before[0]  # and a journaled answer would have been wrong


def test_lines_it_did_not_write_are_evaluated_again(tmp_path, counted):
    whole = _run(tmp_path / "a")
    path = tmp_path / "a" / JOURNAL
    lines = path.read_bytes().splitlines(keepends=True)
    good = json.loads(lines[0])
    wrong_type = {**good, "evaluation": {**good["evaluation"], "fits": True, "result": {"tokens_per_s": "fast"}}}
    path.write_bytes(json.dumps(wrong_type).encode() + b"\n" + b"\x00garbage\n" + b"[1, 2]\n" + b"".join(lines[1:]))
    counted.clear()
    again = _run(tmp_path / "a")
    assert again[:2] == whole[:2]
    assert again[2].damaged == 3 and len(counted) == 1  # the depth of the first line, evaluated again


def test_worker_processes_journal_their_evaluations_as_they_go(tmp_path):
    serial = _run(tmp_path / "one")
    parallel = _run(tmp_path / "two", jobs=2)
    assert parallel[:2] == serial[:2]

    def depths_of(folder):
        return sorted((d["key"], d["evaluation"]["layers"]) for d in
                      map(json.loads, (folder / JOURNAL).read_bytes().splitlines()))

    assert depths_of(tmp_path / "two") == depths_of(tmp_path / "one")  # every line whole, none twice


def test_the_cli_resumes_after_ctrl_c_and_writes_what_an_uninterrupted_run_does(tmp_path, capsys, monkeypatch,
                                                                                counted):
    # chronos' answer at >= 95% (48 layers) lies between its two grid depths (32, 64): found by bisection
    args = ["capacity", SEVENTY, "--policies", "chronos", "--frontier", "--points", "2", "--jobs", "1"]
    assert main([*args, "--out", str(tmp_path / "whole")]) == 0
    assert ("chronos", 48) in counted and 48 not in set(pd.read_csv(tmp_path / "whole" / "frontier.csv")["layers"])
    # every evaluation is in the folder's journal, the bisection's included
    assert len((tmp_path / "whole" / JOURNAL).read_bytes().splitlines()) == len(counted) > 4
    real = capacity.evaluate_sizes
    made = []

    def interrupted(*a):
        if len(made) == 4:
            raise KeyboardInterrupt
        made.append(a[3])
        return real(*a)

    monkeypatch.setattr(capacity, "evaluate_sizes", interrupted)
    out = tmp_path / "cut"
    assert main([*args, "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert f"interrupted; the depths evaluated are kept in {out / JOURNAL}; run the same command again" in err
    assert len((out / JOURNAL).read_bytes().splitlines()) == 4 and not (out / "capacity.csv").exists()
    monkeypatch.setattr(capacity, "evaluate_sizes", real)
    assert main([*args, "--out", str(out)]) == 0
    assert f"resumed 4 evaluation(s) from {out / JOURNAL}" in capsys.readouterr().out
    for name in ("capacity.csv", "frontier.csv"):
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes()
    assert sorted((out / JOURNAL).read_bytes().splitlines()) == sorted(
        (tmp_path / "whole" / JOURNAL).read_bytes().splitlines())


def test_replacing_another_command_s_folder_journals_only_at_the_end(tmp_path, capsys):
    out = tmp_path / "sim"
    assert main(["simulate", "tiny-cpu", "--out", str(out)]) == 0
    args = ["capacity", SEVENTY, "--policies", "1f1b", "--jobs", "1", "--out", str(out)]
    assert main(args) == 2  # not ours: refused before any work
    assert "holds the outputs of `pipeplan simulate`" in capsys.readouterr().err
    assert main([*args, "--force"]) == 0
    assert json.loads((out / "pipeplan.json").read_text())["command"] == "capacity"
    assert (out / JOURNAL).is_file() and not (out / "summary.json").exists()
    assert main(args) == 0 and "resumed" in capsys.readouterr().out


def test_an_empty_folder_made_beforehand_takes_the_outputs(tmp_path, capsys):
    """An --out folder made empty before the run (mkdir -p): the journal made it capacity's own with its first
    line, so the run writes its outputs there. Before, the journal wrote no pipeplan.json into a folder that
    already existed, and a 64-minute --frontier run ended refusing its own folder (2026-12-06)."""
    out = tmp_path / "made"
    out.mkdir()
    args = ["capacity", SEVENTY, "--policies", "1f1b", "--jobs", "1", "--out", str(out)]
    assert main(args) == 0
    assert json.loads((out / "pipeplan.json").read_text())["command"] == "capacity"
    assert (out / "capacity.csv").is_file() and (out / JOURNAL).is_file()
    assert main(args) == 0 and "resumed" in capsys.readouterr().out


def test_a_journal_that_capacity_did_not_write_is_refused_before_any_work(tmp_path, capsys, counted):
    for name in ("link", "huge"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "pipeplan.json").write_text('{"command": "capacity"}')
    (tmp_path / "link" / JOURNAL).symlink_to(tmp_path / "elsewhere.txt")
    with (tmp_path / "huge" / JOURNAL).open("wb") as f:
        f.truncate(300 * 2**20)  # sparse: no disk used
    for name in ("link", "huge"):
        assert main(["capacity", SEVENTY, "--policies", "1f1b", "--out", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert f"{JOURNAL}: is a symlink, not a regular file" in err
    assert f"{JOURNAL} is 300 MiB, more than capacity writes (at most 256 MiB); move it away" in err
    assert counted == [] and not (tmp_path / "elsewhere.txt").exists() and "Traceback" not in err


@pytest.mark.parametrize("field, value", [("tokens_per_s", "NaN"), ("tokens_per_s", "Infinity"),
                                          ("makespan_s", "null"), ("peak_hbm_bytes", "[]"),
                                          ("peak_hbm_bytes", "[1.0, -Infinity]")])
def test_resumed_lines_are_held_to_what_a_fresh_evaluation_gives(field, value, tmp_path, counted):
    """Issue 46: a journal line with a non-finite number or an empty peak made every later run fail with an
    unexpected error naming neither the journal nor the line; now it is set aside, named, and evaluated again."""
    whole = _run(tmp_path / "a")
    path = tmp_path / "a" / JOURNAL
    lines = path.read_text().splitlines(keepends=True)
    i = next(i for i, line in enumerate(lines) if json.loads(line)["evaluation"]["result"] is not None)
    text = json.dumps(json.loads(lines[i])).replace(f'"{field}": ', f'"{field}": {value}, "was": ', 1)
    lines[i] = text + "\n"
    path.write_text("".join(lines))
    counted.clear()
    again = _run(tmp_path / "a")
    assert again[:2] == whole[:2] and len(counted) == 1  # that depth only, evaluated again
    assert again[2].damaged == 1
    report = again[2].damage_report()
    assert f"line {i + 1}: " in report and (f"result.{field}" in report or "is not a JSON number" in report)
