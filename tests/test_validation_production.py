"""Production training runs (scenarios/validation/production.csv, docs/validation.md "Production runs"): published
step times of real training runs (Megatron-Turing NLG 530B, BLOOM-176B) that no model constant was fitted to or
developed against. Two kinds of checks:

- the transcription against the sources' own arithmetic: the printed TFLOP/s follow from the printed iteration
  times by Eq. 3 of Narayanan et al. (the formula both codebases log), BLOOM's printed samples per second from its
  time and batch, the ratios from their rows, and the scenarios hold the printed GPU counts (TP x PP x DP), batches
  and pipeline split;
- a regression guard, not an accuracy target: the mean |error| per metric must not grow past the figure recorded
  in docs/validation.md, rounded up to the next whole percent.
"""

from __future__ import annotations

import tomllib

import pytest

from pipeplan.analysis.validation import VALIDATION_DIR, load_published, narayanan_flops, predict_all
from pipeplan.sim.config import load_scenario
from pipeplan.sim.cost_model import chunk_layers
from tests.validation_guard import assert_every_scored_row_predicted, assert_mean_error_within

PRODUCTION_CSV = VALIDATION_DIR / "production.csv"

# Mean |relative error| per metric measured on production.csv (docs/validation.md, "Production runs"), rounded up
# to the next whole percent (measured: memory 21.19% since BLOOM runs DeepSpeed's BF16_Optimizer, issue #41, was
# 33.61%; time 19.67%, ratio 2.83%). A guard against unnoticed
# regressions, not a target: issue #12's targets are not met here (docs/validation.md). The time guard has little
# headroom by design (0.33 points: a change that slows these A100 pipelines by ~0.4% trips it); when a
# modelling change moves it, re-measure and re-round rather than loosen it in advance.
RECORDED_MEAN_BOUND = {"memory": 0.22, "time": 0.20, "ratio": 0.03}

# BLOOM's log line at iteration 85376 (train/tr11-176B-ml/README.md, "Important checkpoints"), as printed.
BLOOM_SAMPLES_PER_S = 19.561


@pytest.fixture(scope="module")
def figures():
    return load_published(PRODUCTION_CSV)


@pytest.fixture(scope="module")
def predictions(figures):
    return predict_all(figures)


def _rows(figures):
    return {(f.source, f.case): f for f in figures}


def _setting(f) -> dict:
    """A row's scenario with its overrides applied (dotted keys), as plain values."""
    with (VALIDATION_DIR / f.scenario).open("rb") as fh:
        raw = tomllib.load(fh)
    for key, value in f.overrides.items():
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = value
    return raw


def _gpus_and_batch(raw: dict) -> tuple[int, int]:
    par, pipe = raw["parallel"], raw["pipeline"]
    gpus = par["tp"] * pipe["stages"] * par["dp"]
    return gpus, pipe["microbatches"] * raw["training"]["micro_batch_size"] * par["dp"]


# ---- the transcription ---------------------------------------------------------------------------------------

def test_the_set(figures):
    """Two runs, every row cited, every scenario next to the CSV; no case repeats one of the other sets."""
    assert len(figures) == 11
    assert {f.source for f in figures} == {"smith2022", "bigscience2022"}
    for f in figures:
        assert f.citation and f.table, f.case
        if f.ratio_of is None:
            assert (VALIDATION_DIR / f.scenario).is_file(), f.scenario
    others = {(f.source, f.case) for csv in ("published.csv", "heldout.csv")
              for f in load_published(VALIDATION_DIR / csv)}
    assert not others & set(_rows(figures))


def test_scenarios_hold_the_printed_gpu_counts_and_batches(figures):
    """MT-NLG: 280, 350 and 420 DGX A100 servers of 8 GPUs, TP 8 x PP 35 per replica, global batch 1920, 3 layers
    per stage (the assumed `type:transformer` split, which pipeplan's own balancing gives: pinned here). BLOOM: 48
    nodes of 8, TP 4 x PP 12 x DP 8, MBS 2, GBS 2048."""
    for f in figures:
        if f.ratio_of is not None:
            continue
        raw = _setting(f)
        gpus, batch = _gpus_and_batch(raw)
        if f.source == "smith2022":
            servers = int(f.case.split()[1])
            assert gpus == 8 * servers, f.case
            assert (raw["parallel"]["tp"], raw["pipeline"]["stages"]) == (8, 35)
            assert batch == 1920, f.case
            assert raw["model"]["layers"] == 105 and raw["model"]["hidden"] == 20480 and raw["model"]["heads"] == 128
            assert chunk_layers(load_scenario(VALIDATION_DIR / f.scenario, f.overrides)) == [3] * 35, f.case
        else:
            assert gpus == 384 == 48 * 8
            assert (raw["parallel"]["tp"], raw["pipeline"]["stages"], raw["parallel"]["dp"]) == (4, 12, 8)
            assert raw["training"]["micro_batch_size"] == 2 and batch == 2048
            split = raw["pipeline"]["layers_per_stage"]  # [embed | 5 blocks], 6 x 10, [5 blocks | embed]
            assert sum(split) == raw["model"]["layers"] == 70
            assert split[0] == split[-1] == 5 and set(split[1:-1]) == {6}


def test_printed_tflops_follow_from_the_printed_times_by_eq_3(figures):
    """Both codebases log Eq. 3 of Narayanan et al., 96 B s l h^2 (1 + s/6h + V/16lh), over time x GPUs: the
    printed TFLOP/s follow from the printed iteration times within the printing's rounding (MT-NLG prints three
    significant digits: 0.6%; BLOOM's log five: 0.05%)."""
    rows = _rows(figures)
    def tflops_case(case: str, source: str) -> str:  # "530B 280 servers (2240 GPUs)" -> "530B 280 servers TFLOP/s"
        return " ".join(case.split()[:3]) + " TFLOP/s" if source == "smith2022" else case + " TFLOPs"

    pairs = [(f, rows[(f.source, tflops_case(f.case, f.source))]) for f in figures if f.quantity == "step_time"]
    assert len(pairs) == 4
    for time_row, tflops_row in pairs:
        raw = _setting(time_row)
        gpus, batch = _gpus_and_batch(raw)
        m = raw["model"]
        flops = narayanan_flops(batch, m["seq_len"], m["layers"], m["hidden"], m["vocab"])
        tflops = flops / (time_row.published * gpus) / 1e12
        rel = 0.006 if time_row.source == "smith2022" else 5e-4
        assert tflops == pytest.approx(tflops_row.published, rel=rel), time_row.case
        assert not tflops_row.scored  # it repeats the scored time


def test_bloom_samples_per_second(figures):
    """BLOOM's log line: samples per second 19.561 = global batch 2048 / 104.70 s."""
    f = _rows(figures)[("bigscience2022", "176B 384 GPUs iteration 85376")]
    _, batch = _gpus_and_batch(_setting(f))
    assert batch / f.published == pytest.approx(BLOOM_SAMPLES_PER_S, abs=5e-4)


def test_ratios_are_the_quotients_of_their_printed_rows(figures):
    rows = _rows(figures)
    ratios = [f for f in figures if f.ratio_of]
    assert len(ratios) == 2
    for f in ratios:
        num, den = (rows[(f.source, c)].published for c in f.ratio_of)
        assert f.published == pytest.approx(num / den, abs=6e-5), f.case


# ---- the regression guard ------------------------------------------------------------------------------------

def test_every_scored_row_is_predicted(predictions):
    assert_every_scored_row_predicted(predictions, 4 + 1 + 2)


@pytest.mark.parametrize("metric", ["memory", "time", "ratio"])
def test_production_mean_error_does_not_grow(predictions, metric):
    """A regression guard, not an accuracy target: the mean |error| per metric stays within the figure recorded in
    docs/validation.md ("Production runs"), rounded up to the next whole percent."""
    assert_mean_error_within(predictions, metric, RECORDED_MEAN_BOUND[metric])
