"""The validation set (issue #12): transcription checks against the papers' own arithmetic, `pipeplan validate`
end to end, and the issue's accuracy targets (the numbers are in docs/validation.md)."""

from __future__ import annotations

import tomllib

import pandas as pd
import pytest

from pipeplan.analysis.cli import main
from pipeplan.analysis.validation import (
    OUTPUT_COLUMNS,
    TARGETS,
    VALIDATION_DIR,
    korthikanti_hardware_flops,
    korthikanti_model_flops,
    load_published,
    predict_all,
    summarize,
)

A100_PEAK_FLOPS = 312e12  # "The peak device throughput of an A100 GPU with 16-bit precision is 312 teraFLOP/s"

@pytest.fixture(scope="module")
def figures():
    return load_published()


@pytest.fixture(scope="module")
def predictions(figures):
    return predict_all(figures)


def _by_case(figures, source):
    return {f.case: f for f in figures if f.source == source}


def _shape(scenario: str) -> dict:
    with (VALIDATION_DIR / scenario).open("rb") as f:
        return tomllib.load(f)


# ---- the transcription, checked against numbers obtained another way ----------------------------------------

def test_every_row_names_a_shipped_scenario_and_a_citation(figures):
    assert len(figures) >= 200
    for f in figures:
        assert f.citation, f.case
        if f.ratio_of is None:
            assert (VALIDATION_DIR / f.scenario).is_file(), f.scenario
    counts = pd.Series([f.source for f in figures]).value_counts().to_dict()
    assert counts["zerobubble2024"] == 4 * 4 * 3 * 2 + 4 * 3 * 3 + 4 * 3  # Table 4: 96 figures + 48 ratios
    assert counts["narayanan2021"] == 10 + 1  # Table 1 rows + the weak-scaling trend


def test_table2_rows_are_the_formulas_at_table3_shapes(figures):
    """Korthikanti Table 2's per-layer formulas, evaluated independently from each scenario's shape."""
    rows = [f for f in figures if f.source == "korthikanti2022" and f.table == "Table 2"]
    assert len(rows) == 6 * 4
    for f in rows:
        raw = _shape(f.scenario)
        s, h, a = raw["model"]["seq_len"], raw["model"]["hidden"], raw["model"]["heads"]
        b = raw["training"]["micro_batch_size"]
        t = f.overrides.get("parallel.tp", raw["parallel"]["tp"])
        sp = f.overrides.get("parallel.sequence_parallel", raw["parallel"]["sequence_parallel"])
        recompute = f.overrides.get("memory.recompute", raw["memory"]["recompute"])
        attention = 0 if recompute == "selective" else 5 * a * s / h  # selective drops the 5as/h term
        if recompute == "full":
            per_token_bytes = 2
        elif t == 1 or sp:
            per_token_bytes = (34 + attention) / t
        else:
            per_token_bytes = 10 + (24 + attention) / t
        assert f.published == pytest.approx(s * b * h * per_token_bytes / 2**30, rel=1e-4), f.case


def test_korthikanti_printed_overheads_match_the_printed_times(figures):
    k = _by_case(figures, "korthikanti2022")
    for f in k.values():
        if f.table == "Table 4" and f.quantity == "layer_combined":
            parts = f.case.removesuffix(" combined")
            assert f.published == pytest.approx(k[parts + " forward"].published + k[parts + " backward"].published)
        if f.metric == "ratio":  # printed overheads and throughput increases, rounded as printed
            num, den = (k[c].published for c in f.ratio_of)
            assert f.published == pytest.approx(num / den, abs=0.006), f.case


@pytest.mark.parametrize("size,scenario,overrides", [
    ("22B", "korthikanti-22b.toml", {}),
    ("175B", "korthikanti-175b.toml", {}),
    ("530B", "korthikanti-530b.toml", {}),
    ("1T", "korthikanti-1t.toml", {}),
    ("530B 8-way data parallel", "korthikanti-530b.toml", {"dp": 8}),
])
def test_korthikanti_utilisation_follows_from_eqs_7_and_8(figures, size, scenario, overrides):
    """MFU and HFU printed in Table 5 (and §6.3) are Eq. 7 and Eq. 8 over the printed time: this checks the
    transcribed times, the scenario shapes and the FLOP formulas the validation uses, all at once."""
    k = _by_case(figures, "korthikanti2022")
    raw = _shape(scenario)
    dp = overrides.get("dp", 1)
    batch = raw["pipeline"]["microbatches"] * raw["training"]["micro_batch_size"] * dp
    gpus = raw["pipeline"]["stages"] * raw["parallel"]["tp"] * dp
    shape = (batch, raw["model"]["seq_len"], raw["model"]["layers"], raw["model"]["hidden"], raw["model"]["vocab"])
    if dp == 1:
        time_s, mfu, hfu = (k[f"{size} {x}"].published for x in ("Present Work", "MFU", "HFU"))
    else:
        time_s, mfu, hfu = k[size + " (2240 GPUs)"].published, k[size + " MFU"].published, None

    def tolerance(u: float) -> float:  # times are printed to 0.01 s, utilisations to 0.1 points
        return u * 0.005 / time_s + 0.05

    assert 100 * korthikanti_model_flops(*shape) / (time_s * gpus * A100_PEAK_FLOPS) == pytest.approx(
        mfu, abs=tolerance(mfu))
    if hfu is not None:
        assert 100 * korthikanti_hardware_flops(*shape) / (time_s * gpus * A100_PEAK_FLOPS) == pytest.approx(
            hfu, abs=tolerance(hfu))


def test_derived_ratios_are_the_quotients_of_their_rows(figures):
    for source in {f.source for f in figures}:
        rows = _by_case(figures, source)
        for f in rows.values():
            if f.ratio_of and f.notes.startswith("ratio of the two printed figures"):
                num, den = (rows[c].published for c in f.ratio_of)
                assert f.published == pytest.approx(num / den, abs=6e-5), f.case  # 4 decimals


def test_zero_bubble_memory_does_not_depend_on_microbatches(figures):
    """Table 4 prints one memory per schedule and size: the rows of one schedule agree across m."""
    z = [f for f in figures if f.source == "zerobubble2024" and f.quantity == "peak_hbm"]
    groups = pd.DataFrame([(f.scenario, f.overrides.get("pipeline.schedule", "1f1b"), f.published) for f in z],
                          columns=["scenario", "schedule", "gib"]).groupby(["scenario", "schedule"])["gib"]
    assert (groups.nunique() == 1).all()
    assert len(groups) == 16


# ---- the command ---------------------------------------------------------------------------------------------

def test_validate_writes_csv_and_plot(tmp_path):
    """The command on a slice of the shipped set: torchtitan's Llama 3.1 8B rows (calibration anchors, scored
    rows and ratios) and the Zero Bubble 1.5B rows."""
    shipped = pd.read_csv(VALIDATION_DIR / "published.csv", keep_default_na=False, dtype=str)
    part = shipped[shipped["case"].str.startswith(("8B FSDP", "1.5B m=24"))].copy()
    part["scenario"] = [str(VALIDATION_DIR / s) if s else "" for s in part["scenario"]]  # absolute: CSV moves
    part.to_csv(tmp_path / "published.csv", index=False)
    out = tmp_path / "val"
    assert main(["validate", "--published", str(tmp_path / "published.csv"), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"validation.csv", "ranking.csv", "fits.csv", "parity.png",
                                               "pipeplan.json"}
    df = pd.read_csv(out / "validation.csv")
    assert tuple(df.columns) == OUTPUT_COLUMNS
    assert len(df) == (part["scored"] == "true").sum()
    assert set(df["metric"]) <= set(TARGETS)
    done = df.dropna(subset=["predicted"])
    assert {"8B FSDP 8 GPUs memory", "8B FSDP 128 GPUs", "8B FSDP 128 / 8 GPUs throughput"} <= set(done["case"])
    assert "8B FSDP 8 GPUs" not in set(df["case"])  # a calibration anchor: predicted, never scored
    assert ((done["predicted"] - done["published"]) / done["published"]).to_numpy() == pytest.approx(
        done["rel_error"].to_numpy())


def test_a_row_without_a_prediction_says_why(predictions):
    for p in predictions:
        assert (p.predicted is None) == bool(p.reason), p.figure.case
        if p.predicted is not None:
            assert p.predicted > 0, p.figure.case


@pytest.mark.parametrize("text,expected", [
    (None, "file not found"),
    ("source,case\nx,y\n", "missing columns"),
    ("{header}\ns,T,c,memory,peak_hbm,1,furlongs,x.toml,,,true,cite,\n", "unit 'furlongs'"),
    ("{header}\ns,T,c,speed,peak_hbm,1,GiB,x.toml,,,true,cite,\n", "metric 'speed'"),
    ("{header}\ns,T,c,ratio,ratio,1,1,,,a|b,true,cite,\n", "refers to 'a'"),
    ("{header}\ns,T,a,time,step_time,1,s,x.toml,,,true,cite,\ns,T,r,ratio,ratio,1,1,,,a|r,true,cite,\n",
     "refers to 'r'"),
])
def test_bad_published_csv_exits_2_with_one_line(tmp_path, capsys, text, expected):
    from pipeplan.analysis.validation import COLUMNS

    path = tmp_path / "published.csv"
    if text is not None:
        path.write_text(text.format(header=",".join(COLUMNS)))
    assert main(["validate", "--published", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


# ---- issue #12's targets on the shipped set ------------------------------------------------------------------

def _overall(predictions, metric):
    return next(s for s in summarize(predictions) if s.metric == metric and s.source == "all")


def test_every_scored_row_is_predicted(predictions):
    missing = sorted({p.reason for p in predictions if p.figure.scored and p.predicted is None})
    assert not missing, missing


# The one row beyond issue #12's 20% max target since FSDP's per-layer buffers stopped being counted twice
# under a pipeline (2026-12-01; docs/validation.md): torchtitan's 405B 1F1B memory, -21.3% (82.5 GiB published,
# 64.9 predicted). Its gap to the interleaved run of the same table (9.8 GiB more, published) is unexplained.
KNOWN_MAX_MISSES = {"405B 1F1B memory"}


@pytest.mark.parametrize("metric", ["memory", "time", "throughput"])
def test_absolute_errors_meet_the_targets(predictions, metric):
    """Mean |error| <= 10% per metric, and every row within 20% but the known misses, which are pinned: one that
    comes back within 20% fails here too, so that the list stays true."""
    s = _overall(predictions, metric)
    mean_bound, max_bound = TARGETS[metric]
    assert s.predicted == s.cases
    assert s.mean_abs_error <= mean_bound
    scored = [p for p in predictions if p.figure.scored and p.figure.metric == metric]
    beyond = {p.figure.case for p in scored if abs(p.rel_error) > max_bound}
    assert beyond == KNOWN_MAX_MISSES & {p.figure.case for p in scored}


def test_ratios_between_settings_meet_the_target(predictions):
    """Ratios between settings of one paper, all sources: mean |error| <= 3% (2.6% measured; the torchtitan 405B
    interleaved / 1F1B memory ratio, +31%, and the Narayanan trend, -14%, stay the largest; docs/validation.md)."""
    s = _overall(predictions, "ratio")
    assert s.predicted == s.cases
    assert s.mean_abs_error <= TARGETS["ratio"][0]


@pytest.mark.parametrize("source", ["korthikanti2022", "zerobubble2024"])
def test_ratios_of_the_megatron_papers_meet_the_target(predictions, source):
    """Korthikanti's overheads and Zero Bubble's schedule ratios (ZB-2p, ZB-1p, 1F1B-I over 1F1B; memory):
    Zero Bubble's meet 3% with Megatron's blocking P2P in its 1F1B and 1F1B-I runs (interconnect.p2p_blocking)
    and the fork's optimizer post-validation in its ZB runs (training.optimizer_post_validation)."""
    s = next(s for s in summarize(predictions) if s.metric == "ratio" and s.source == source)
    assert s.predicted == s.cases
    assert s.mean_abs_error <= TARGETS["ratio"][0]


def test_weak_scaling_trend_has_the_published_direction(predictions):
    """Narayanan et al. Table 1: per-GPU throughput rises from 1.7B to 1T parameters (137 -> 163 TFLOP/s)."""
    trend = next(p for p in predictions if p.figure.case == "weak-scaling trend 1008.0B / 1.7B")
    assert trend.figure.published > 1
    assert trend.predicted is not None and trend.predicted > 1


def test_a100_rows_held_out_from_the_calibration_meet_the_targets(predictions):
    """The A100 validation rows (Narayanan Table 1, Zero Bubble Table 4, Korthikanti Table 5) against the one
    constant fitted on Korthikanti Table 4 (analysis/calibrate.py): the time and throughput targets hold."""
    for metric in ("time", "throughput"):
        for s in summarize(predictions):
            if s.metric == metric and s.source in ("korthikanti2022", "narayanan2021", "zerobubble2024"):
                assert s.predicted == s.cases, s
                assert s.mean_abs_error <= TARGETS[metric][0] and s.max_abs_error <= TARGETS[metric][1], s


def test_calibration_rows_are_predicted_but_not_scored(predictions):
    anchors = [p for p in predictions if p.figure.calibration]
    assert len(anchors) == 10 + 3  # Korthikanti Table 4 (A100), torchtitan Table 1 (the 500 W H100)
    assert all(p.predicted is not None and not p.figure.scored for p in anchors)
