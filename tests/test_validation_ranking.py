"""Ranking and fits in `pipeplan validate` (issue #41): Spearman's rho per group, the predicted best against the
published best, and the confusion table of published out-of-memory rows."""

from __future__ import annotations

import pandas as pd
import pytest

from pipeplan.analysis.cli import main
from pipeplan.analysis.validation import COLUMNS, VALIDATION_DIR, Prediction, PublishedFigure, load_published
from pipeplan.analysis.validation_ranking import fit_table, rank_groups, spearman


def _row(case: str, metric: str, published: float, predicted: float | None, group: str = "g",
         quantity: str | None = None) -> Prediction:
    quantity = quantity or {"time": "step_time", "throughput": "tokens_per_gpu_s", "oom": "oom"}[metric]
    unit = {"time": "s", "throughput": "tokens/s/GPU", "oom": "bool"}[metric]
    f = PublishedFigure(source="s", table="T", case=case, metric=metric, quantity=quantity, published=published,
                        unit=unit, scenario="x.toml", group=group)
    return Prediction(f, predicted)


def test_spearman_is_pearson_of_ranks_with_mean_ranks_for_ties():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks (1, 2.5, 2.5, 4) against (1, 2, 3, 4), by hand: sums of products 4.5, of squares 4.5 and 5
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / (4.5 * 5) ** 0.5)
    assert spearman([1, 1, 1], [1, 2, 3]) != spearman([1, 1, 1], [1, 2, 3])  # NaN: a constant side


def test_throughput_ranks_as_inverse_time_and_the_best_pick_has_a_tolerance():
    # published throughputs 100, 90, 80, 70 (a fastest); predicted order b > a > c > d: rho 0.8, best b is
    # 100/90 - 1 = 11% slower than a in published time, so a wrong pick
    rows = [_row("a", "throughput", 100, 10), _row("b", "throughput", 90, 11),
            _row("c", "throughput", 80, 9), _row("d", "throughput", 70, 8)]
    (r,) = rank_groups(rows)
    assert (r.group, r.rows, r.predicted_best, r.published_best) == ("g", 4, "b", "a")
    assert r.spearman == pytest.approx(0.8)
    assert r.best_gap == pytest.approx(100 / 90 - 1)
    assert not r.picks_best and r.meets_rho
    close = [_row("a", "time", 1.00, 5), _row("b", "time", 1.02, 4), _row("c", "time", 1.5, 6),
             _row("d", "time", 2.0, 7)]
    (r,) = rank_groups(close)
    assert r.predicted_best == "b" and r.picks_best  # 2% slower than the published best: within 3%


def test_groups_under_four_rows_ungrouped_and_unpredicted_rows_are_not_ranked():
    rows = [_row(c, "time", t, t) for c, t in zip("abc", (1, 2, 3), strict=True)]
    rows += [_row("x", "time", 1, 1, group=""), _row("y", "time", 2, None)]
    assert rank_groups(rows) == []


def test_fit_table_counts_each_cell():
    rows = [_row("a", "oom", 1.0, 1.0), _row("b", "oom", 1.0, 0.0), _row("c", "oom", 0.0, 0.0),
            _row("d", "oom", 0.0, 1.0), _row("e", "oom", 0.0, 0.0), _row("f", "oom", 1.0, None)]
    fits = fit_table(rows)
    assert len(fits.rows) == 5
    assert (fits.count(True, True), fits.missed_ooms, fits.false_ooms, fits.count(False, False)) == (1, 1, 1, 2)
    assert all(p.rel_error is None for p in rows)  # oom rows have no relative error


def test_oom_rows_load_and_a_bad_value_exits_2(tmp_path, capsys):
    header = ",".join((*COLUMNS, "group"))
    path = tmp_path / "published.csv"
    path.write_text(f"{header}\ns,T,c,oom,oom,true,bool,x.toml,,,true,cite,,g1\n")
    (f,) = load_published(path)
    assert (f.metric, f.published, f.group) == ("oom", 1.0, "g1")
    path.write_text(f"{header}\ns,T,c,oom,oom,1.5,bool,x.toml,,,true,cite,,\n")
    assert main(["validate", "--published", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "published must be true" in err and err.count("\n") == 1


def test_validate_predicts_an_oom_and_ranks_a_group(tmp_path):
    """Zero Bubble's 1.5B 1F1B at 4 microbatch counts (one group), and the same setting at micro batch 64
    (a made-up OOM row: ~6x the activations of the 59 GiB ZB-2p run must not fit an 80 GB A100)."""
    scenario = str(VALIDATION_DIR / "zerobubble-1.5b.toml")
    rows = [{"case": f"m={m}", "metric": "throughput", "quantity": "samples_per_gpu_s", "published": v,
             "unit": "samples/s/GPU", "overrides": f"pipeline.microbatches={m}", "group": "zb"}
            for m, v in ((8, 8.26), (24, 11.8), (32, 12.6), (64, 13.8))]
    rows += [{"case": "b=64", "metric": "oom", "quantity": "oom", "published": "true", "unit": "bool",
              "overrides": "training.micro_batch_size=64;pipeline.microbatches=24", "group": "zb"},
             {"case": "b=6", "metric": "oom", "quantity": "oom", "published": "false", "unit": "bool",
              "overrides": "pipeline.microbatches=24", "group": "zb"}]
    df = pd.DataFrame([{c: "" for c in COLUMNS} | {"source": "s", "table": "T", "scenario": scenario,
                                                    "scored": "true", "citation": "test"} | r for r in rows])
    df.to_csv(tmp_path / "published.csv", index=False)
    out = tmp_path / "val"
    assert main(["validate", "--published", str(tmp_path / "published.csv"), "--out", str(out)]) == 0
    ranking = pd.read_csv(out / "ranking.csv")
    assert list(ranking["group"]) == ["zb"] and ranking["rows"].iloc[0] == 4
    assert ranking["spearman"].iloc[0] == pytest.approx(1.0)  # more microbatches, less bubble: the same order
    fits = pd.read_csv(out / "fits.csv").set_index("case")
    assert bool(fits.loc["b=64", "predicted_oom"]) and not bool(fits.loc["b=6", "predicted_oom"])


def test_shipped_sets_group_only_comparable_rows():
    """Every group holds one source, one table and one scenario's model (or model size)."""
    for name in ("published.csv", "heldout.csv", "production.csv"):
        groups: dict[str, set[tuple[str, str]]] = {}
        for f in load_published(VALIDATION_DIR / name):
            if f.group:
                groups.setdefault(f.group, set()).add((f.source, f.table))
        assert all(len(v) == 1 for v in groups.values()), name
