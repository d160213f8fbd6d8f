"""`pipeplan lcp build | query | bench` end to end, and bad input -> one line on stderr, exit 2, nothing lost."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from pipeplan.analysis.cli import main
from pipeplan.lcp import LCPIndex
from pipeplan.lcp.bench import COLUMNS

pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture
def rows_npy(tmp_path):
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 4, (500, 12), generator=g).to(torch.uint8)
    path = tmp_path / "rows.npy"
    np.save(path, rows.numpy())
    return path, rows


def test_help_lists_the_three_commands(capsys):
    with pytest.raises(SystemExit) as info:
        main(["lcp", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert all(word in out for word in ("build", "query", "bench"))


def test_build_then_query_matches_the_library(tmp_path, rows_npy, capsys):
    path, rows = rows_npy
    index_path = tmp_path / "rows.lcp"
    assert main(["lcp", "build", "--input", str(path), "--out", str(index_path)]) == 0
    assert "indexed 500 rows" in capsys.readouterr().out
    queries = rows[:7].clone()
    queries[:, 6:] = 3
    np.save(tmp_path / "q.npy", queries.numpy())
    hits = tmp_path / "hits.csv"
    assert main(["lcp", "query", str(index_path), "--queries", str(tmp_path / "q.npy"), "-k", "5",
                 "--out", str(hits)]) == 0  # fmt: skip
    got = pd.read_csv(hits)
    assert list(got.columns) == ["query", "rank", "id", "lcp"]
    top = LCPIndex.build(rows).topk(queries, 5)
    ids, lcps = top.ids, top.lcps
    assert got["id"].tolist() == ids.flatten().tolist()
    assert got["lcp"].tolist() == lcps.flatten().tolist()
    assert got["rank"].tolist() == [1, 2, 3, 4, 5] * 7


def test_text_input_has_variable_lengths(tmp_path, capsys):
    (tmp_path / "words.txt").write_text("banana\nband\nban\nbandana\napple\n")
    (tmp_path / "q.txt").write_text("bandit\nb\n")
    assert main(["lcp", "build", "--input", str(tmp_path / "words.txt"), "--out", str(tmp_path / "w.lcp")]) == 0
    capsys.readouterr()
    assert main(["lcp", "query", str(tmp_path / "w.lcp"), "--queries", str(tmp_path / "q.txt"), "-k", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    # bandit: band (4), bandana (4), then banana/ban (3) -> smallest id banana; b: everything at 1
    assert lines == ["query,rank,id,lcp", "0,1,1,4", "0,2,3,4", "0,3,0,3", "1,1,0,1", "1,2,1,1", "1,3,2,1"]


def test_bench_writes_csv_plots_and_refuses_pairwise(tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["lcp", "bench", "--n", "300,2000", "--length", "16", "--batch", "64", "--scan-batch", "4",
            "--repeats", "2", "--scan-repeats", "1", "--pairwise-budget-gib", "0.0001", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert {p.name for p in out.iterdir()} == {"bench.csv", "latency.png", "memory.png", "meta.json", "pipeplan.json"}
    assert (out / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    df = pd.read_csv(out / "bench.csv")
    assert list(df.columns) == COLUMNS
    assert sorted(zip(df["method"], df["n"], strict=True)) == sorted(
        (m, n) for m in ("index", "numpy", "scan", "trie", "pairwise") for n in (300, 2000)
    )
    ran = df[df["method"] != "pairwise"]
    assert (ran["p50_ms"] > 0).all() and (ran["p95_ms"] >= ran["p50_ms"]).all() and (ran["build_s"] > 0).all()
    batch = df.groupby("method")["batch"].unique()
    assert list(batch["scan"]) == [4] and list(batch["index"]) == [64]  # the scan is timed on fewer queries
    # 64 × 300 × 2 = 38 400 bytes fit the 107 374-byte budget; 64 × 2000 × 2 = 256 000 do not
    pw = df[df["method"] == "pairwise"].set_index("n")
    assert pw.loc[300, "p50_ms"] > 0 and np.isnan(pw.loc[2000, "p50_ms"]) and pw.loc[2000, "index_bytes"] == 256_000
    assert df["joules_per_query"].isna().all() or (df["joules_per_query"].dropna() > 0).all()
    assert "pairwise materialisation refused" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["lcp", "build", "--input", "{tmp}/missing.npy", "--out", "{tmp}/x.lcp"], "no such input file"),
        (["lcp", "build", "--input", "{tmp}/empty.txt", "--out", "{tmp}/x.lcp"], "zero sequences"),
        (["lcp", "build", "--input", "{tmp}/floats.npy", "--out", "{tmp}/x.lcp"], "dtype torch.float64"),
        (["lcp", "query", "{tmp}/junk.lcp", "--queries", "{tmp}/empty.txt"], "bad magic"),
        (["lcp", "query", "{tmp}/good.lcp", "--queries", "{tmp}/q.npy", "-k", "0"], "k must be a positive"),
        (["lcp", "bench", "--methods", "index,magic", "--out", "{tmp}/b"], "unknown methods"),
        (["lcp", "query", "/dev/zero", "--queries", "{tmp}/q.npy"], "not a regular file"),
        (["lcp", "query", "{tmp}/good.lcp", "--queries", "/dev/zero"], "not a regular file"),
        (["lcp", "query", "{tmp}/good.lcp", "--queries", "{tmp}/q.npy", "-k", "1000000000000"], "k = 1000000000000"),
        (["lcp", "query", "{tmp}/good.lcp", "--queries", "{tmp}/q.npy", "--device", "meta"], "'meta' is not supp"),
        (["lcp", "build", "--input", "{tmp}/q.npy", "--out", "{tmp}/y.lcp", "--device", "meta"], "'meta' is not"),
        (["lcp", "bench", "--n", "1e12", "--out", "{tmp}/b"], "--n 1000000000000 × --length 32"),
        (["lcp", "bench", "--length", "1e9", "--out", "{tmp}/b"], "--length 1000000000 is more than"),
        (["lcp", "bench", "--batch", "1e11", "--out", "{tmp}/b"], "--batch 100000000000"),
        (["lcp", "bench", "--device", "meta", "--n", "100", "--out", "{tmp}/b"], "'meta' is not supported"),
        (["lcp", "bench", "--data", "{tmp}/missing.txt", "--out", "{tmp}/b"], "data must be uniform, zipf, text or"),
        (["lcp", "bench", "--data", "text", "--dtype", "int16", "--out", "{tmp}/b"], "dtype must be uint8"),
        (["lcp", "bench", "--data", "{tmp}/empty.txt", "--n", "10", "--out", "{tmp}/b"], "has 0 bytes, fewer than"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_loses_nothing(tmp_path, rows_npy, capsys, argv, message):
    _, rows = rows_npy
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "junk.lcp").write_bytes(b"junk" * 10)
    np.save(tmp_path / "floats.npy", np.zeros((3, 4)))
    np.save(tmp_path / "q.npy", rows[:2].numpy())
    LCPIndex.build(rows).save(tmp_path / "x.lcp")  # an existing index that a failed build must not touch
    LCPIndex.build(rows).save(tmp_path / "good.lcp")
    before = (tmp_path / "x.lcp").read_bytes()
    capsys.readouterr()
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pipeplan lcp: error:") and message in err
    assert (tmp_path / "x.lcp").read_bytes() == before
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["lcp", "bench", "--threads", "-1"], "--threads: not a positive whole number"),
        (["lcp", "bench", "--threads", "0"], "--threads: not a positive whole number"),
        (["lcp", "bench", "--n", "1e99"], "--n: 1e99 is more than"),
        (["lcp", "bench", "--pairwise-budget-gib", "nan"], "not a positive finite number"),
    ],
)
def test_bad_flags_are_refused_in_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        main([*argv, "--out", str(tmp_path / "b")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "b").exists()


def test_paper_preset_refuses_what_does_not_fit_or_runs_reduced(tmp_path, capsys, monkeypatch):
    import pipeplan.lcp.limits

    monkeypatch.setattr(pipeplan.lcp.limits, "available_bytes", lambda: 8 << 30)  # an 8 GiB machine
    assert main(["lcp", "bench", "--preset", "paper", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "--n 20000000 × --length 256 (uint16)" in err and err.count("\n") == 1
    monkeypatch.undo()
    argv = ["lcp", "bench", "--preset", "paper", "--n", "2000", "--batch", "16", "--repeats", "1",
            "--scan-repeats", "1", "--out", str(tmp_path / "p")]  # fmt: skip
    assert main(argv) == 0
    df = pd.read_csv(tmp_path / "p" / "bench.csv")
    assert set(df["method"]) == {"index", "scan"} and set(df["k"]) == {1} and set(df["length"]) == {256}


def test_bench_threads_reach_numba(tmp_path):
    """--threads sizes numba's pool as well as torch's, and meta.json records what numba took."""
    import json

    from pipeplan.lcp.engine import kernel

    out = tmp_path / "bench"
    argv = ["lcp", "bench", "--n", "300", "--length", "8", "--batch", "16", "--methods", "index",
            "--repeats", "1", "--threads", "1", "--out", str(out)]  # fmt: skip
    numba = pytest.importorskip("numba") if kernel() is not None else None
    before = numba.get_num_threads() if numba else None
    try:
        assert main(argv) == 0
        meta = json.loads((out / "meta.json").read_text())
        assert meta["numba_threads"] == (1 if numba else None)
        if numba:
            assert numba.get_num_threads() == 1
    finally:
        if numba:
            numba.set_num_threads(before)


def test_bench_reuse_out_times_the_index_into_one_result(tmp_path, monkeypatch):
    """--reuse-out: every timed index call gets `out=` (the same pair each time, from an untimed call),
    the answers still pass the check against the scan, and meta.json records the flag."""
    import json

    from pipeplan.lcp.index import LCPIndex

    seen = []
    real = LCPIndex.topk

    def spy(self, queries, k, query_lengths=None, *, out=None):
        seen.append(None if out is None else (out.lcps.data_ptr(), out.ids.data_ptr()))
        return real(self, queries, k, query_lengths, out=out)

    monkeypatch.setattr(LCPIndex, "topk", spy)
    out = tmp_path / "bench"
    argv = ["lcp", "bench", "--n", "500", "--length", "8", "--batch", "32", "--scan-batch", "4", "--methods",
            "index,scan", "--repeats", "3", "--reuse-out", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    timed = [s for s in seen if s is not None]
    assert len(timed) == 3 and len(set(timed)) == 1  # three timed calls, one reused pair
    assert json.loads((out / "meta.json").read_text())["config"]["reuse_out"] is True
    assert (pd.read_csv(out / "bench.csv").set_index("method").loc["index", "p50_ms"]) > 0


def test_out_file_of_another_kind_is_kept_unless_force(tmp_path, rows_npy, capsys):
    """build and query replace their own kind of file (an index, a query CSV) but not a user's unrelated file."""
    path, rows = rows_npy
    index, hits, notes = tmp_path / "rows.lcp", tmp_path / "hits.csv", tmp_path / "notes.txt"
    np.save(tmp_path / "q.npy", rows[:3].numpy())
    notes.write_text("my notes\n")
    build = ["lcp", "build", "--input", str(path), "--out"]
    query = ["lcp", "query", str(index), "--queries", str(tmp_path / "q.npy"), "--out"]
    assert main([*build, str(index)]) == 0 and main([*build, str(index)]) == 0  # an index is rebuilt
    assert main([*query, str(hits)]) == 0 and main([*query, str(hits)]) == 0  # a query CSV is rewritten
    capsys.readouterr()
    assert main([*build, str(notes)]) == 2
    assert "notes.txt: exists and is not an LCP index" in capsys.readouterr().err
    assert main([*query, str(notes)]) == 2
    assert "not a query CSV" in capsys.readouterr().err
    assert notes.read_text() == "my notes\n"
    assert main([*query, str(notes), "--force"]) == 0
    assert notes.read_text().startswith("query,rank,id,lcp\n")


@pytest.mark.parametrize("sub", ["build", "query", "bench"])
def test_each_subcommand_help_ends_with_its_examples(capsys, sub):
    with pytest.raises(SystemExit):
        main(["lcp", sub, "--help"])
    examples = capsys.readouterr().out.split("examples:\n")[1].splitlines()
    assert examples and all(ln.startswith((f"  pipeplan lcp {sub} ", "      --")) for ln in examples)


@pytest.mark.parametrize("data", ["zipf", "text", "file"])
def test_bench_data_kinds_are_checked_against_the_scan(tmp_path, data):
    """--data zipf|text|FILE: the sweep runs, the index's answers pass the bench's check against the full scan,
    and the rows are what was asked (Zipf: the most frequent token far above 1/256; text: the file's bytes)."""
    from pipeplan.lcp.bench import make_data

    path = tmp_path / "corpus.txt"
    path.write_bytes(b"the cat sat on the mat; the dog sat on the log. " * 40)
    name = str(path) if data == "file" else data
    argv = ["lcp", "bench", "--n", "400", "--length", "8", "--batch", "16", "--scan-batch", "4", "--methods",
            "index,numpy,scan", "--repeats", "2", "--data", name, "--out", str(tmp_path / "b")]  # fmt: skip
    assert main(argv) == 0
    assert set(pd.read_csv(tmp_path / "b" / "bench.csv")["method"]) >= {"index", "numpy", "scan"}
    rows, _ = make_data(4000, 8, 16, 0, data=name)
    counts = torch.bincount(rows.flatten().long(), minlength=256)
    if data == "zipf":
        assert counts.max() > 0.1 * rows.numel()  # rank 1 of 256 under 1/r: ~16% of tokens
    elif data == "file":
        assert set(torch.nonzero(counts).flatten().tolist()) <= set(path.read_bytes())
        assert bytes(rows[0].tolist()) in path.read_bytes()
