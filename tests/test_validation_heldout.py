"""The held-out validation set (scenarios/validation/heldout.csv, docs/validation.md "Held-out figures"): published
figures no model constant was ever fitted to or developed against. Two kinds of checks:

- the transcription against the papers' own arithmetic and text (ratios, repeated rows, §5.2's percentages,
  Table 2's training-time column by Eq. 3, the scenario shapes against the printed GPU counts and batches);
- a regression guard, not an accuracy target: the mean |error| per metric must not grow past the figure recorded
  in docs/validation.md, rounded up to the next whole percent. The held-out errors are what they are (ZeRO-3's
  rows at 384 and 640 GPUs miss by 43% and 49%); the guard only catches a change that makes them worse unnoticed.
"""

from __future__ import annotations

import tomllib

import pytest

from pipeplan.analysis.validation import VALIDATION_DIR, load_published, predict_all
from tests.validation_guard import assert_every_scored_row_predicted, assert_mean_error_within

HELDOUT_CSV = VALIDATION_DIR / "heldout.csv"

# Mean |relative error| per metric measured on the held-out set (docs/validation.md, "Held-out figures":
# memory 6.37%, throughput 6.64%, ratio 5.53%, measured at the FSDP-under-PP memory fix of 2026-12-01; throughput
# and ratio were 10.56% and 9.45% before ZeRO-3's parameter traffic bounded its passes), rounded up to the next
# whole percent. Issue #41 added torchtitan's context-parallel rows (6 throughput, 6 memory; 8.7% / 36.8% mean on
# their source) and Megatron-Bridge's DGX-H100 rows (2 throughput, 2 oom): memory 6.71%, throughput 10.03%,
# ratio 5.53% with them. Hagemann et al. 2023's sheets (65 step times, 130 oom rows) brought the time metric: 18.10%.
RECORDED_MEAN_BOUND = {"memory": 0.07, "throughput": 0.11, "ratio": 0.06, "time": 0.19}


@pytest.fixture(scope="module")
def figures():
    return load_published(HELDOUT_CSV)


@pytest.fixture(scope="module")
def shipped():
    return {(f.source, f.case): f for f in load_published()}


@pytest.fixture(scope="module")
def predictions(figures):
    return predict_all(figures)


def _by_case(figures):
    return {(f.source, f.case): f for f in figures}


def _shape(scenario: str) -> dict:
    with (VALIDATION_DIR / scenario).open("rb") as f:
        return tomllib.load(f)


def _setting(f) -> dict:
    """A row's scenario with its overrides applied (dotted keys), as plain values."""
    raw = _shape(f.scenario)
    for key, value in f.overrides.items():
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = value
    return raw


# ---- the transcription ---------------------------------------------------------------------------------------

def test_the_set_is_separate_from_the_shipped_one(figures, shipped):
    """Every held-out row names a scenario next to it and a citation; no scored row repeats a shipped figure."""
    assert len(figures) == 165 + 12 + 4 + 195  # + torchtitan's CP rows, Megatron-Bridge's, Hagemann's sheets (#41)
    for f in figures:
        assert f.citation and f.table, f.case
        if f.ratio_of is None:
            assert (VALIDATION_DIR / f.scenario).is_file(), f.scenario
    tables = {(f.source, f.table) for f in figures}
    assert tables == {("zerobubble2024", "Table 7"), ("zerobubble2024", "Table 8"), ("zerobubble2024", "Table 9"),
                      ("narayanan2021", "Table 2"), ("torchtitan2024", "Table 2"), ("torchtitan2024", "Table 6"),
                      ("megatronbridge2025", "25.11 DGX-H100"),
                      ("hagemann2023", "llama_13B_bfloat16_64_GPUs_all_runs.xlsx"),
                      ("hagemann2023", "llama_65B_bfloat16_128_GPUs_all_runs.xlsx"),
                      ("hagemann2023", "llama_30B_8k_seq_length_bfloat16_128_GPUs_all_runs.xlsx")}
    shipped_tables = {(s.source, s.table) for s in shipped.values()}
    assert not tables & shipped_tables


def test_ratios_are_the_quotients_of_their_printed_rows(figures):
    rows = _by_case(figures)
    ratios = [f for f in figures if f.ratio_of]
    assert len(ratios) == 4 + 12 + 9 + 8
    for f in ratios:
        num, den = (rows[(f.source, c)].published for c in f.ratio_of)
        assert f.published == pytest.approx(num / den, abs=6e-5), f.case  # 4 decimals


def test_zero_bubble_repeated_rows_equal_table_4(figures, shipped):
    """Table 7's post-validation column and Table 8's ZB-2p rows repeat Table 4's ZB-2p runs (same size, m and micro
    batch): they agree with the shipped transcription, and they are not scored a second time. This also settles
    Table 8's middle groups of 14.6B and 28.3B, printed m = 32: their ZB-2p rows are Table 4's m = 64 and 128."""
    repeats = [f for f in figures if f.source == "zerobubble2024" and "ZB-2p" in f.case
               and f.table in ("Table 7", "Table 8") and "synchronization" not in f.case and f.ratio_of is None]
    assert len(repeats) == 4 + 12 + 12
    for f in repeats:
        size, m = f.case.split()[:2]
        memory = f.case.endswith(" memory")
        key = f"{size} {m} ZB-2p" + (" memory" if memory else "")
        assert not f.scored, f.case
        assert f.published == shipped[("zerobubble2024", key)].published, f.case
        assert f.overrides.get("training.micro_batch_size") is None  # the base micro batch, as in Table 4


def test_zero_bubble_table_8_doubles_the_micro_batch(figures):
    """Appendix F: 1F1B and ZB-1p run at twice ZB-2p's micro batch, with the same number of microbatches."""
    t8 = [f for f in figures if f.table == "Table 8" and f.ratio_of is None and not f.case.endswith("memory")]
    assert len(t8) == 36
    for f in t8:
        base_b = _shape(f.scenario)["training"]["micro_batch_size"]
        b = _setting(f)["training"]["micro_batch_size"]
        assert b == (base_b if "ZB-2p" in f.case else 2 * base_b), f.case
        assert f.case.split()[3] == f"b={b}"


def test_zero_bubble_appendix_text(figures):
    """Appendix E: synchronized ZB-2p is 'approximately 8%' slower (7.2-9.6%, 8.1% on average); Appendix H: at
    m <= p the zero-bubble schedule gains 'approximately 20% to 30%' (19-33%)."""
    drops = [1 - f.published for f in figures if f.table == "Table 7" and f.ratio_of]
    assert len(drops) == 4
    assert sum(drops) / len(drops) == pytest.approx(0.08, abs=0.005)
    gains = [f.published for f in figures if f.table == "Table 9" and f.ratio_of]
    assert len(gains) == 9 and all(1.15 <= g <= 1.35 for g in gains)
    for f in figures:
        if f.table == "Table 9" and f.ratio_of is None:
            raw = _setting(f)
            assert raw["pipeline"]["microbatches"] <= raw["pipeline"]["stages"], f.case


# Narayanan et al. 2021 Table 2's last column, "Training time for 300B tokens (days)", as printed.
NARAYANAN_T2_DAYS = {
    "ZeRO-3 174.6B 384 GPUs": 90, "ZeRO-3 174.6B 768 GPUs": 74, "ZeRO-3 174.6B 1536 GPUs": 74,
    "ZeRO-3 529.6B 640 GPUs": 169, "ZeRO-3 529.6B 1120 GPUs": 137, "ZeRO-3 529.6B 2240 GPUs": 140,
    "PTD-P 174.6B 384 GPUs": 84, "PTD-P 174.6B 768 GPUs": 43, "PTD-P 174.6B 1536 GPUs": 23,
    "PTD-P 529.6B 560 GPUs": 156, "PTD-P 529.6B 1120 GPUs": 80, "PTD-P 529.6B 2240 GPUs": 42,
}


def test_narayanan_table_2_shapes_and_training_times(figures):
    """Each row's scenario holds the printed GPU count, model-parallel size and batch; and the printed training
    time for 300B tokens follows from the printed TFLOP/s by Eq. 3's FLOPs per token, 96 l h^2 (1 + s/6h +
    V/16lh), over the scenario's shape (within 2%: the days are printed whole)."""
    rows = [f for f in figures if f.source == "narayanan2021" and f.ratio_of is None]
    assert {f.case for f in rows} == set(NARAYANAN_T2_DAYS)
    for f in rows:
        raw = _setting(f)
        gpus = int(f.case.split()[2])
        tp, pp, dp = raw["parallel"]["tp"], raw["pipeline"]["stages"], raw["parallel"]["dp"]
        assert tp * pp * dp == gpus, f.case
        assert tp * pp == {"ZeRO-3": 1, "PTD-P": 96 if "174.6B" in f.case else 280}[f.case.split()[0]]
        batch = raw["pipeline"]["microbatches"] * raw["training"]["micro_batch_size"] * dp
        assert batch == (2560 if gpus == 640 else 1536 if "174.6B" in f.case else 2240), f.case
        m = raw["model"]
        s, l, h, v = m["seq_len"], m["layers"], m["hidden"], m["vocab"]
        flops_per_token = 96 * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))  # Eq. 3 over B s tokens
        days = 300e9 * flops_per_token / (gpus * f.published * 1e12) / 86400
        assert days == pytest.approx(NARAYANAN_T2_DAYS[f.case], rel=0.02), f.case


def test_narayanan_section_5_2_percentages(figures):
    """§5.2: 'With fewer GPUs and a microbatch size of 4, PTD-P results in 6% and 24% higher throughput for the 175-
    and 530-billion-parameter models'; 'by doubling the number of GPUs ... PTD-P outperforms ZeRO-3 by 70% for both
    models'."""
    rows = _by_case(figures)

    def r(case: str) -> float:
        return rows[("narayanan2021", case)].published

    assert round(100 * (r("PTD-P / ZeRO-3 174.6B 384 GPUs") - 1)) == 6
    assert round(100 * (r("PTD-P / ZeRO-3 529.6B 560 / 640 GPUs") - 1)) == 24
    assert r("PTD-P / ZeRO-3 174.6B 768 GPUs") == pytest.approx(1.70, abs=0.01)
    assert r("PTD-P / ZeRO-3 529.6B 1120 GPUs") == pytest.approx(1.70, abs=0.01)


def test_torchtitan_context_parallel_rows(figures):
    """Tables 2 and 6 whole: FSDP 8 / CP 1 at sequence 32768 to FSDP 1 / CP 8 at 262144, dp x cp = 8 and the
    per-rank sequence 32768 throughout; the page's local batch; full checkpointing."""
    rows = [f for f in figures if f.source == "torchtitan2024"]
    assert len(rows) == 16
    for f in rows:
        raw = _setting(f)
        cp = f.overrides.get("parallel.cp", 1)
        dp = f.overrides.get("parallel.dp", raw["parallel"]["dp"])
        seq = f.overrides["model.seq_len"]
        assert dp * cp == 8 and seq == 32768 * cp and f"CP {cp} seq {seq}" in f.case, f.case
        local_batch = raw["pipeline"]["microbatches"] * raw["training"]["micro_batch_size"]
        assert local_batch == (1 if f.table == "Table 2" else 8), f.case
        assert raw["memory"]["recompute"] == "full"
        assert raw["parallel"]["cp_comm"] == "all-gather"


def test_megatron_bridge_rows_hold_the_printed_gpus_and_batch(figures):
    """Megatron-Bridge's DGX-H100 table: #GPUs = TP x PP x CP x DP and GBS = DP x MBS x microbatches, as printed
    (70B: 64 GPUs, GBS 128, TP 4, PP 8, VP 5; 405B: 1024 GPUs, GBS 512, TP 8, PP 8, CP 2, VP 8)."""
    printed = {"megatronbridge-llama3-70b-h100.toml": (64, 128, 4, 8, 1, 5),
               "megatronbridge-llama3.1-405b-h100.toml": (1024, 512, 8, 8, 2, 8)}
    rows = [f for f in figures if f.source == "megatronbridge2025"]
    assert len(rows) == 4 and {f.scenario for f in rows} == set(printed)
    for f in rows:
        raw = _setting(f)
        gpus, gbs, tp, pp, cp, vp = printed[f.scenario]
        par, pipe = raw["parallel"], raw["pipeline"]
        assert (par["tp"], pipe["stages"], par.get("cp", 1), pipe["virtual_stages"]) == (tp, pp, cp, vp)
        assert par["tp"] * pipe["stages"] * par.get("cp", 1) * par["dp"] == gpus
        assert par["dp"] * raw["training"]["micro_batch_size"] * pipe["microbatches"] == gbs


# ---- the regression guard ------------------------------------------------------------------------------------

def test_every_scored_held_out_row_is_predicted(predictions):
    assert_every_scored_row_predicted(predictions, 50 + 68 + 33 + 65 + 132)  # memory, throughput, ratio, time, oom


@pytest.mark.parametrize("metric", ["memory", "throughput", "ratio", "time"])
def test_held_out_mean_error_does_not_grow(predictions, metric):
    """A regression guard, not an accuracy target: the mean |error| per metric stays within the figure recorded in
    docs/validation.md, rounded up to the next whole percent (the targets of issue #12 are not met here:
    throughput and ratio miss them because of ZeRO-3)."""
    assert_mean_error_within(predictions, metric, RECORDED_MEAN_BOUND[metric])
