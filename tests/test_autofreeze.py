"""AutoFreeze (arXiv 2102.01386) in the runtime: the median-change rule, front to back, within the cap; frozen
blocks stop changing."""

from __future__ import annotations

import pytest
import torch

from pipeplan.runtime.autofreeze import AutoFreeze, block_of
from pipeplan.runtime.config import RunConfig

ONE_STAGE = {"model.hidden": 32, "model.layers": 4, "model.ffn_hidden": 64, "model.seq_len": 16,
             "pipeline.stages": 1, "pipeline.microbatches": 2, "pipeline.schedule": "1f1b"}


def gathered(norms: dict[int, float], sizes: dict[int, float] | None = None, head: float = 0.0) -> list[dict]:
    return [{"norms": norms, "sizes": sizes or dict.fromkeys(norms, 1.0), "head": {0: head}}]


def test_blocks():
    assert block_of("tok_embeddings.weight") == 0 and block_of("layers.3.attention.wq.weight") == 3
    assert block_of("output.weight") is None and block_of("norm.weight") is None


def test_converged_blocks_freeze_front_to_back_only():
    auto = AutoFreeze(cap=1.0)
    auto.decide(gathered({0: 1.0, 1: 1.0, 2: 1.0, 3: 1.0}), step=3)  # no previous interval: nothing to compare
    assert auto.frozen_through == -1
    # changes 0.01, 0.02, 0.5, 0.001: the median is 0.015; block 0 converged, block 1 is above the median, so
    # block 3 (the calmest) stays trained: front to back
    auto.decide(gathered({0: 1.01, 1: 1.02, 2: 1.5, 3: 1.001}), step=7)
    assert auto.frozen_through == 0
    auto.decide(gathered({1: 1.02, 2: 3.0, 3: 1.5}), step=11)  # block 1 now the calmest of the active ones
    assert auto.frozen_through == 1
    assert [h["frozen_through"] for h in auto.history] == [-1, 0, 1]


def test_the_cap_bounds_the_frozen_share():
    auto = AutoFreeze(cap=0.3)
    sizes = {0: 25.0, 1: 25.0, 2: 25.0}
    auto.decide(gathered({0: 1.0, 1: 1.0, 2: 1.0}, sizes, head=25.0), step=3)
    auto.decide(gathered({0: 1.0, 1: 1.0, 2: 2.0}, sizes, head=25.0), step=7)  # 0 and 1 converged
    assert auto.frozen_through == 0  # a second block would freeze 50% > 30%


def test_frozen_blocks_stop_changing_and_the_rest_train(world_of_one):
    from pipeplan.runtime.train import Trainer

    cfg = RunConfig(overrides=ONE_STAGE, data="synthetic", timeout_s=30, freeze="autofreeze", freeze_cap=0.9,
                    freeze_warmup=0, steps=2)
    t = Trainer(cfg, 0, 1, torch.device("cpu"))
    t.freezer.auto.frozen_through = 0  # as if block 0 had converged
    before = {n: p.detach().clone() for n, p in t.chunks[0].named_parameters()}
    history = t.train()
    after = dict(t.chunks[0].named_parameters())
    for n, p in after.items():
        changed = not torch.equal(before[n], p.detach())
        assert changed == (block_of(n) != 0), n
    assert all(r.phase == "autofreeze" and r.freeze_ratio > 0 for r in history)
    assert t.freezer.auto.squares  # the unfrozen blocks' gradient norms were observed


def test_the_study_summary_finds_the_front_and_the_prediction_error():
    import pandas as pd

    from pipeplan.analysis.commands.freeze_study import COLUMNS, front_line, summarise, with_measured_ratios

    rows = []
    for seed in (0, 1):
        for method, cap, loss, cpu, gain in (("none", 0.0, 3.0, 0.20, None), ("timelyfreeze", 0.5, 3.1, 0.15, 0.70),
                                             ("autofreeze", 0.5, 3.2, 0.16, None)):
            rows.append({c: None for c in COLUMNS} | {"method": method, "cap": cap, "seed": seed,
                                                       "heldout_loss": loss + 0.01 * seed,
                                                       "cpu_time_per_step_s": cpu, "predicted_gain": gain,
                                                       "realized_mean_ratio": cap, "final_loss": loss})
    table = with_measured_ratios(pd.DataFrame(rows, columns=COLUMNS))
    tf = table[table["method"] == "timelyfreeze"]
    assert list(tf["measured_cpu_ratio"]) == pytest.approx([0.75, 0.75])
    assert list(tf["prediction_error"]) == pytest.approx([0.7 / 0.75 - 1] * 2)
    summary = summarise(table)
    assert dict(zip(summary["method"], summary["on_front"], strict=True)) == {
        "none": True, "timelyfreeze": True, "autofreeze": False}  # autofreeze: slower and worse than TF
    assert summary.loc[summary["method"] == "none", "heldout_loss_spread"].iloc[0] == pytest.approx(0.01)
    assert front_line(summary).startswith("on the front (held-out loss vs CPU time per step, mean over seeds): "
                                          "none, timelyfreeze")


# ---- APF (Chen et al., ICDCS 2021) ----------------------------------------------------------------------
def test_apf_freezes_oscillating_scalars_not_drifting_ones_with_aimd_periods():
    from pipeplan.runtime.apf import APF

    w = torch.nn.Parameter(torch.zeros(2))
    chunk = torch.nn.Module()
    chunk.w = w
    apf = APF(cap=1.0, alpha=0.9, threshold=0.3)
    apf.start({0: chunk})
    periods = []
    for k in range(6):  # scalar 0 oscillates (+1, -1, ...), scalar 1 drifts (+1 every check)
        with torch.no_grad():
            w += torch.tensor([1.0 if k % 2 == 0 else -1.0, 1.0])
        apf.check({0: chunk})
        periods.append(apf.state["w"]["period"].tolist())
        apf.roll_back({0: chunk})
    assert all(p[1] == 0 for p in periods)  # P = 1 while drifting: never frozen
    assert periods[-1][0] >= 1 and apf.frozen_mask("w").tolist()[1] is False
    # a frozen scalar keeps its value through the optimizer's update
    frozen = apf.frozen_mask("w")
    if frozen[0]:
        before = float(w[0])
        with torch.no_grad():
            w += 5.0
        apf.roll_back({0: chunk})
        assert float(w[0]) == before and float(w[1]) != before


def test_apf_runs_in_the_trainer_within_the_cap(world_of_one):
    from pipeplan.runtime.train import Trainer

    cfg = RunConfig(overrides=ONE_STAGE, data="synthetic", timeout_s=30, freeze="apf", freeze_cap=0.3,
                    freeze_warmup=0, steps=8)
    t = Trainer(cfg, 0, 1, torch.device("cpu"))
    t.freezer.apf.threshold = 0.9  # most scalars count as stable: the cap is what binds
    history = t.train()
    assert all(r.phase == "apf" for r in history)
    assert 0 < t.freezer.apf.frozen_share() <= 0.3 + 1e-9 and t.freezer.apf.checks == 4
