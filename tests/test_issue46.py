"""Hardening of the newer surfaces (issue 46): writes through links, report leaks, runaway ranks, hangs, trusted
state on resume. Each test is one reproducer of the issue with the behaviour promised for it."""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from pipeplan.scenarios import scenario_path  # noqa: E402

from pipeplan.analysis.cli import MAX_ERROR_CHARS, main  # noqa: E402
from pipeplan.analysis.sweep_plots import save_atomic  # noqa: E402
from pipeplan.common.io import InputError, atomic_file, csv_text, formula_safe, read_input_bytes  # noqa: E402

UNIT = str(scenario_path("explicit-unit"))


def refused(argv: list[str], capsys) -> str:
    """Run the CLI, expect exit 2 with one line of at most MAX_ERROR_CHARS characters; return the line."""
    assert main(argv) == 2
    out, err = capsys.readouterr()
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
    assert "<script>" not in md and "&lt;script&gt;" in md
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
