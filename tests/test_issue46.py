"""Hardening of the newer surfaces (issue 46): writes through links, report leaks, runaway ranks, hangs, trusted
state on resume. Each test is one reproducer of the issue with the behaviour promised for it."""

from __future__ import annotations

import contextlib
import csv
import io
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.analysis.cli import MAX_ERROR_CHARS, main
from pipeplan.analysis.sweep_plots import save_atomic
from pipeplan.common.io import InputError, atomic_file, csv_text, formula_safe, read_input_bytes

UNIT = str(scenario_path("explicit-unit"))
EIGHT_B = str(scenario_path("llama3-8b-pp4-h100"))


def refused(argv: list[str], capsys) -> str:
    """Run the CLI, expect exit 2 with one line of at most MAX_ERROR_CHARS characters; return the line."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out, out
    assert err.count("\n") == 1 and len(err) <= MAX_ERROR_CHARS + 1 and "Traceback" not in err, err
    return err


# ---- security: temporaries never followed through links ---------------------------------------------------
def test_save_atomic_never_writes_through_a_planted_link(tmp_path):
    target = tmp_path / "outside.txt"
    target.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    for name in (".pareto.png.tmp.png", ".pareto.png.tmp"):  # the old fixed name and a guess at a new one
        (out / name).symlink_to(target)
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    save_atomic(fig, out / "pareto.png")
    assert target.read_text() == "precious"
    assert (out / "pareto.png").read_bytes().startswith(b"\x89PNG")
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]  # no temporary left


def test_atomic_file_leaves_nothing_on_error(tmp_path):
    with pytest.raises(RuntimeError), atomic_file(tmp_path / "x.bin") as f:
        f.write(b"half")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


# ---- security: report reads only regular files inside its folder; escapes what it shows -------------------
@pytest.fixture(scope="module")
def sim_folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sim") / "o"
    assert main(["simulate", UNIT, "--out", str(out)]) == 0
    return out


def copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_report_refuses_a_symlink_out_of_its_folder(sim_folder, tmp_path, capsys):
    secret = tmp_path / "secret.json"
    secret.write_text('{"password": "hunter2"}')
    folder = copy_folder(sim_folder, tmp_path / "f")
    (folder / "leak.json").symlink_to(secret)
    err = refused(["report", str(folder)], capsys)
    assert "leak.json is a symlink" in err
    assert not (folder / "report.html").exists()


def test_report_refuses_a_fifo_before_opening_it(sim_folder, tmp_path, capsys):
    folder = copy_folder(sim_folder, tmp_path / "f")
    (folder / "summary.json").unlink()
    os.mkfifo(folder / "summary.json")
    assert "summary.json is not a regular file" in refused(["report", str(folder)], capsys)


def test_report_refuses_a_csv_a_million_columns_wide(sim_folder, tmp_path, capsys):
    folder = copy_folder(sim_folder, tmp_path / "f")
    (folder / "wide.csv").write_text(",".join(f"c{i}" for i in range(100_000)) + "\n" + "1," * 99_999 + "1\n")
    assert "wide.csv has 100,000 columns" in refused(["report", str(folder)], capsys)


def test_report_refuses_latin1_text_in_one_line(sim_folder, tmp_path, capsys):
    folder = copy_folder(sim_folder, tmp_path / "f")
    (folder / "extra.csv").write_bytes("name\ncaf\xe9\n".encode("latin-1"))
    assert "extra.csv is not UTF-8 text" in refused(["report", str(folder)], capsys)


def test_report_escapes_markup_in_user_strings(sim_folder, tmp_path):
    folder = copy_folder(sim_folder, tmp_path / "f")
    (folder / "names.csv").write_text('name\n<script>alert(1)</script>\n"[x](javascript:alert(1))"\n')
    assert main(["report", str(folder)]) == 0
    md = (folder / "report.md").read_text()
    page = (folder / "report.html").read_text()
    assert "<script>" not in md and "&lt;script>" in md
    assert "[x](javascript:" not in md and r"\[x\](javascript:" in md
    assert "<script>alert" not in page


# ---- security: spreadsheet formulas in CSV cells we write ------------------------------------------------
@pytest.mark.parametrize("cell", ["=cmd|' /C calc'!A0", "+1+cmd", "-2+3+cmd", "@SUM(A1)", "\tx", "\rx"])
def test_formula_cells_are_neutralised(cell):
    assert formula_safe(cell) == "'" + cell


def test_numbers_and_plain_text_stay_as_they_are():
    assert [formula_safe(v) for v in ("-1.5", "+3", "1f1b", 12, -3.0)] == ["-1.5", "+3", "1f1b", 12, -3.0]
    text = csv_text(pd.DataFrame({"name": ["=1+1", "ok"], "v": [-1.0, 2.0]}))
    assert list(csv.reader(io.StringIO(text))) == [["name", "v"], ["'=1+1", "-1.0"], ["ok", "2.0"]]


# ---- hangs: inputs that are not regular files are refused before opening ----------------------------------
def test_read_input_bytes_refuses_fifo_link_and_size(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(InputError, match="is a fifo, not a regular file"):
        read_input_bytes(tmp_path / "fifo", 100, "scenario")
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(InputError, match="larger than the limit of 100"):
        read_input_bytes(tmp_path / "big", 100, "scenario")
    (tmp_path / "link").symlink_to(tmp_path / "big")
    with pytest.raises(InputError, match="is a symlink"):
        read_input_bytes(tmp_path / "link", 1000, "report:", follow_links=False)
    with pytest.raises(InputError, match="NUL"):
        read_input_bytes("a\0b", 100, "model.config")


# ---- runaway processes: run checks every input before launching ranks -------------------------------------
@pytest.fixture
def run_inputs(tmp_path) -> Path:
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "one").write_bytes(b"a")
    with open(tmp_path / "huge", "wb") as f:  # sparse: 2 GiB that take no disk
        f.truncate(2 * 2**30)
    ck = tmp_path / "ck" / "step-000002"
    ck.mkdir(parents=True)
    (tmp_path / "ck" / "latest").write_text("2\n")
    import torch

    for rank in range(4):
        torch.save({"step": 2, "device": {}}, ck / f"rank-{rank}.pt")  # loads, but is not the runtime's state
    return tmp_path


@pytest.mark.parametrize("flags, expected", [
    (["--checkpoint-dir", "{tmp}/afile"], "--checkpoint-dir {tmp}/afile: is a file, not a folder"),
    (["--checkpoint-dir", "/proc/ck"], "--checkpoint-dir /proc/ck: lies on a kernel or device file system"),
    (["--data", "{tmp}/empty"], "0 bytes, need at least seq_len + 2"),
    (["--data", "{tmp}/one"], "1 bytes, need at least seq_len + 2"),
    (["--data", "{tmp}/huge"], "2,147,483,648 bytes, above the limit"),
    (["--timeout-s", "1e308"], "--timeout-s: 1e+308 is outside 1..604800 seconds"),
    (["--timeout-s", str(2**63)], "--timeout-s: 9.22337e+18 is outside"),
    (["--timeout-s", "1e-320"], "--timeout-s: 9.99989e-321 is outside"),
    (["--steps", str(2**63)], "--steps: 9223372036854775808 is above the limit 1,000,000"),
    (["--rdzv-endpoint", "node0", "--nnodes", "2", "--nproc-per-node", "2"], "--rdzv-endpoint node0: give HOST:PORT"),
    (["--rdzv-endpoint", "node0:99999", "--nnodes", "2", "--nproc-per-node", "2"], "give HOST:PORT with a port"),
    (["--node-rank", "5", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "h:29500"],
     "--node-rank: 5 is outside 0..1"),
    (["--resume", "--checkpoint-dir", "{tmp}/ck"], "rank-0.pt lacks device.chunks"),
    (["--costs", UNIT.replace("explicit-unit", "llama3-8b-pp4-h100")], "a [model] scenario; give an explicit-costs"),
])  # fmt: skip
def test_run_checks_every_input_before_launching(flags, expected, run_inputs, capsys, monkeypatch):
    import pipeplan.analysis.commands.run as run_command

    def never(*_a, **_k):  # a launch here is the bug: ranks started on input that could be checked
        raise AssertionError("launched")

    monkeypatch.setattr(run_command, "launch", never)
    argv = ["run", *[f.format(tmp=run_inputs) for f in flags], "--out", str(run_inputs / "o")]
    assert expected.format(tmp=run_inputs) in refused(argv, capsys)
    assert not (run_inputs / "o").exists()


def test_run_refuses_cuda_where_there_is_none(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--device cuda: CUDA is not available" in refused(["run", "--device", "cuda", "--out",
                                                              str(tmp_path / "o")], capsys)


# ---- runaway processes: no rank outlives the launcher; signals end in one line ----------------------------
def descendants(pid: int) -> set[int]:
    """Every process below `pid` now (children by PPID, recursively), read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def default_sigint() -> None:
    """A background job starts with SIGINT ignored (and Python then installs no Ctrl-C handler); a terminal's
    foreground job, which a Ctrl-C reaches, does not."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_run_and_wait_for_ranks(out: Path):
    """`pipeplan run` (4 ranks, endless steps) in a session of its own, once all its ranks are up: (proc, pids)."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "pipeplan.analysis.cli", "run", "--steps", "100000", "--data",
                             "synthetic", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, preexec_fn=default_sigint)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pids = descendants(proc.pid)
        if len(pids) >= 5:  # the agent and 4 ranks
            return proc, pids
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("the ranks did not start within 120 s")


def gone_within(pids: set[int], seconds: float) -> set[int]:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(map(alive, pids)):
        time.sleep(0.2)
    return {p for p in pids if alive(p)}


@pytest.mark.parametrize("sig, code, line", [(15, 143, "terminated (SIGTERM)"), (2, 130, "interrupted")])
def test_a_signal_to_the_launcher_stops_every_rank_in_one_line(sig, code, line, tmp_path):
    proc, pids = start_run_and_wait_for_ranks(tmp_path / "o")
    os.kill(proc.pid, sig)
    try:
        _, err = proc.communicate(timeout=30)
    finally:  # a failed test must not leave its job running either
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, 9)
    assert proc.returncode == code
    assert err.strip().splitlines() == [f"pipeplan run: {line}; nothing was written"]
    assert gone_within(pids, 10) == set()
    assert not (tmp_path / "o").exists()


def test_sigkill_to_the_launchers_group_leaves_no_rank(tmp_path):
    proc, pids = start_run_and_wait_for_ranks(tmp_path / "o")
    os.killpg(proc.pid, 9)
    proc.wait(timeout=10)
    assert gone_within(pids, 10) == set()


# ---- hangs: fifos as inputs are refused before they are opened; sizes bounded before reading ---------------
def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def test_a_fifo_scenario_is_refused(tmp_path, capsys):
    err = refused(["simulate", str(fifo(tmp_path / "s.toml")), "--out", str(tmp_path / "o")], capsys)
    assert "s.toml: is a fifo, not a regular file" in err


def test_a_fifo_model_config_is_refused(tmp_path, capsys):
    text = Path(EIGHT_B).read_text().replace('name = "llama3-8b"', 'name = "llama3-8b"\nconfig = "config.json"')
    (tmp_path / "s.toml").write_text(text)
    fifo(tmp_path / "config.json")
    err = refused(["show", str(tmp_path / "s.toml")], capsys)
    assert "model.config" in err and "config.json: is a fifo" in err


def test_a_huge_scenario_is_refused_before_it_is_read(tmp_path, capsys):
    with open(tmp_path / "big.toml", "wb") as f:
        f.truncate(2 * 2**30)  # sparse
    assert "larger than the limit of 16,777,216" in refused(["show", str(tmp_path / "big.toml")], capsys)


def test_a_bom_at_the_start_of_a_scenario_is_read(tmp_path, capsys):
    (tmp_path / "s.toml").write_bytes(b"\xef\xbb\xbf" + Path(UNIT).read_bytes())
    assert main(["show", str(tmp_path / "s.toml")]) == 0


def test_published_fifo_and_empty_path_are_refused(tmp_path, capsys):
    err = refused(["validate", "--published", str(fifo(tmp_path / "p.csv")), "--out", str(tmp_path / "o")], capsys)
    assert "p.csv: is a fifo" in err
    assert "--published: empty path" in refused(["validate", "--published", "", "--out", str(tmp_path / "o")],
                                                capsys)


def test_a_fifo_latest_or_rank_file_is_refused_on_resume(tmp_path, capsys):
    ck = tmp_path / "ck"
    (ck / "step-000002").mkdir(parents=True)
    fifo(ck / "latest")
    argv = ["run", "--resume", "--checkpoint-dir", str(ck), "--data", "synthetic", "--out", str(tmp_path / "o")]
    assert "latest: is a fifo" in refused(argv, capsys)
    (ck / "latest").unlink()
    (ck / "latest").write_text("2\n")
    for rank in range(4):
        fifo(ck / "step-000002" / f"rank-{rank}.pt")
    assert "rank-0.pt is not a regular file" in refused(argv, capsys)


# ---- state trusted on resume: sweep.csv rows held to what a fresh run writes --------------------------------
def test_a_fifo_sweep_csv_is_refused_on_resume(tmp_path, capsys):
    (tmp_path / "o").mkdir()
    fifo(tmp_path / "o" / "sweep.csv")
    from pipeplan.analysis.sweep import run_sweep
    from pipeplan.sim.errors import PipeplanError

    with pytest.raises(PipeplanError, match=r"sweep\.csv: is a fifo"):
        run_sweep(UNIT, {"pipeline.microbatches": [4, 8]}, tmp_path / "o", jobs=1, plan_freeze=False)


@pytest.mark.parametrize("column, cell", [("tokens_per_s", "12x4.5"), ("step_time_s", "nan"),
                                          ("max_peak_hbm_bytes", "inf"), ("gpus", "-1"), ("fits", "maybe")])
def test_resumed_rows_with_bad_metric_cells_are_recomputed(column, cell, tmp_path, capsys):
    from pipeplan.analysis.sweep import run_sweep

    grid = {"pipeline.microbatches": [4, 8]}
    first = run_sweep(UNIT, grid, tmp_path, jobs=1, plan_freeze=False)
    path = tmp_path / "sweep.csv"
    rows = list(csv.reader(io.StringIO(path.read_text())))
    rows[1][rows[0].index(column)] = cell
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    path.write_text(buf.getvalue())
    again = run_sweep(UNIT, grid, tmp_path, jobs=1, plan_freeze=False)
    assert "1 damaged line(s)" in capsys.readouterr().err
    assert sorted(again["config_id"]) == sorted(first["config_id"])
    assert again.set_index("config_id")[column].astype(str).to_dict() == \
        first.set_index("config_id")[column].astype(str).to_dict()


# ---- hangs: a Dask scheduler that never answers, schemes pipeplan cannot use -------------------------------
@pytest.fixture
def silent_port():
    """A TCP port that accepts connections and never says a word."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


def test_a_silent_scheduler_is_refused_in_bounded_time_before_the_folder_is_claimed(silent_port, tmp_path, capfd):
    import time

    out = tmp_path / "sw"
    start = time.monotonic()
    assert main(["sweep", EIGHT_B, "--grid", "pipeline.microbatches=8,16", "--scheduler",
                 f"tcp://127.0.0.1:{silent_port}", "--out", str(out)]) == 2
    assert time.monotonic() - start < 30  # 5 s of probe, the rest loading the scenario on a busy machine
    err = capfd.readouterr().err
    assert "no Dask scheduler answered within 5 s" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("address", ["tls://127.0.0.1:8786", "ucx://127.0.0.1:8786", "inproc://x"])
def test_unsupported_scheduler_schemes_are_one_line(address, tmp_path, capfd):
    out = tmp_path / "sw"
    assert main(["sweep", EIGHT_B, "--grid", "pipeline.microbatches=8,16", "--scheduler", address,
                 "--out", str(out)]) == 2
    err = capfd.readouterr().err
    assert err.strip().splitlines() == [f"pipeplan sweep: error: --scheduler {address}: scheme "
                                        f"{address.split(':')[0]}:// is not supported; give tcp://HOST:PORT"], err
    assert not out.exists()


# ---- unbounded work: sizes refused before work -----------------------------------------------------------
def test_a_huge_model_name_is_refused(tmp_path, capsys):
    err = refused(["show", EIGHT_B, "--set", f"model.name={'x' * 100_000}"], capsys)
    assert "model.name" in err and "200" in err


@pytest.mark.parametrize("flags, expected", [
    (["--max-dim", "1000000000"], "--max-dim: 1000000000 is above the limit 65,536"),
    (["--repeats", str(2**63)], "--repeats: 9223372036854775808 is above the limit 1,000"),
    (["--max-dim", "64"], "--max-dim: must be >= 128 (got 64)"),
])  # fmt: skip
def test_profile_gemm_sizes_are_bounded(flags, expected, tmp_path, capsys):
    assert expected in refused(["profile", "--gemm", "--device", "cpu", *flags, "--out", str(tmp_path / "o")], capsys)
    assert not (tmp_path / "o").exists()


def test_freeze_study_tokens_are_bounded(tmp_path, capsys):
    err = refused(["freeze-study", "--tokens", str(10**12), "--out", str(tmp_path / "o")], capsys)
    assert "above the limit of 1,000,000 steps per run" in err


# ---- one writer per output folder; output preconditions checked before any work ---------------------------
def test_a_second_writer_on_one_folder_is_refused(tmp_path, capsys):
    from pipeplan.common.io import output_lock

    out = tmp_path / "sw"
    argv = ["sweep", UNIT, "--grid", "pipeline.microbatches=4,8", "--out", str(out)]
    with output_lock(out, "sweep"):
        err = refused(argv, capsys)
    assert f"in use by pipeplan sweep (pid {os.getpid()} on " in err
    assert not out.exists()
    assert main(argv) == 0  # released: the folder is free again, and no lock file is left
    assert len(pd.read_csv(out / "sweep.csv")) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sw"]


def test_a_lock_of_a_killed_holder_is_free(tmp_path):
    import subprocess
    import sys

    from pipeplan.common.io import output_lock

    out = tmp_path / "o"
    code = (f"from pipeplan.common.io import output_lock\nimport os\n"
            f"with output_lock({str(out)!r}, 'x'):\n    os._exit(9)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9  # died holding it, its file left behind
    with output_lock(out, "sweep"):
        pass


def test_the_current_folder_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "is the current folder or a root" in refused(["simulate", UNIT, "--out", "."], capsys)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_that_cannot_be_written_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)  # as chattr +i or a read-only mount
    assert "cannot be written here (read-only or immutable)" in refused(["simulate", UNIT, "--out",
                                                                          str(tmp_path / "o")], capsys)


# ---- masked crashes: Rich markup in user strings is shown as written ---------------------------------------
MARKUP = "x[/]y[link=http://evil.example]z"


def test_markup_in_a_model_name_is_printed_as_written(capsys):
    assert main(["show", UNIT.replace("explicit-unit", "tiny-cpu"), "--set", f"model.name={MARKUP}"]) == 0
    assert f"model: {MARKUP}," in capsys.readouterr().out


def test_markup_in_grid_values_is_printed_as_written(tmp_path, capsys):
    argv = ["sweep", EIGHT_B, "--grid", f"model.name={MARKUP},plain", "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert MARKUP in out and "unexpected" not in out


def test_a_user_file_replaced_with_its_folder_is_named(tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["simulate", UNIT, "--out", str(out)]) == 0
    (out / "my-notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(["simulate", UNIT, "--out", str(out)]) == 0
    assert "1 file(s) this run did not write are gone: my-notes.txt" in capsys.readouterr().err


# ---- masked crashes and last campaign's items ----------------------------------------------------------------
def test_toml_dates_as_grid_values_are_one_line(tmp_path, capsys):
    argv = ["sweep", UNIT, "--grid", "pipeline.microbatches=1979-05-27", "--out", str(tmp_path / "o")]
    assert "a TOML date or time" in refused(argv, capsys)


def test_a_set_value_with_a_line_break_is_refused(capsys):
    assert "holds a line break" in refused(["show", UNIT, "--set", "pipeline.stages=4\nfoo=1"], capsys)


def test_report_of_a_sweep_csv_without_metrics_is_one_line(tmp_path, capsys):
    (tmp_path / "sweep.csv").write_text("config_id,a\nx,1\n")
    assert "a file lacks what its command writes" in refused(["report", str(tmp_path)], capsys)


def test_a_target_ratio_past_the_layer_limit_names_the_ratio(tmp_path, capsys):
    argv = ["capacity", "tiny-cpu", "--policies", "1f1b", "--target-ratio", "100", "--out", str(tmp_path / "o")]
    err = refused(argv, capsys)
    assert err.startswith("pipeplan capacity: error: --target-ratio 100: 100 x 1F1B's deepest fit") and \
        "model.layers" not in err


def test_an_old_folder_that_cannot_be_deleted_is_named(tmp_path, capsys, monkeypatch):
    import shutil

    out = tmp_path / "o"
    assert main(["simulate", UNIT, "--out", str(out)]) == 0
    capsys.readouterr()
    real = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda p, ignore_errors=False: None if ".old-" in str(p) else
                        real(p, ignore_errors=ignore_errors))  # as an immutable file in the old folder would
    assert main(["simulate", UNIT, "--out", str(out)]) == 0
    assert "could not be deleted completely; what is left is in" in capsys.readouterr().err
