"""`pipeplan capacity`: depth search per memory policy on the ChronosPipe scenario."""

from __future__ import annotations

import pandas as pd

from analysis.capacity import Evaluation, max_layers
from analysis.cli import main
from scenarios import scenario_path

SEVENTY = str(scenario_path("llama2-70b-48l-pp8-tp8-a100"))


def test_max_layers_search_finds_the_boundary():
    calls = []

    def fits(layers: int) -> Evaluation:
        calls.append(layers)
        return Evaluation(layers, layers <= 104, None)

    assert max_layers(fits, 8).layers == 104
    assert len(calls) < 12
    assert max_layers(lambda n: Evaluation(n, False, None), 8) is None


def test_capacity_1f1b_and_recompute(tmp_path, capsys):
    out = tmp_path / "cap"
    assert main(["capacity", SEVENTY, "--policies", "1f1b,1f1b+recompute,interleaved-1f1b", "--out", str(out)]) == 0
    df = pd.read_csv(out / "capacity.csv").set_index("policy")
    assert (out / "capacity.png").exists()
    assert df.loc["1f1b", "max_layers"] < 48 <= df.loc["1f1b+recompute", "max_layers"]  # the paper's OOM
    assert not df.loc["1f1b", "fits_scenario_layers"] and not df.loc["interleaved-1f1b", "fits_scenario_layers"]
    assert df.loc["1f1b+recompute", "tokens_per_s"] < df.loc["1f1b", "tokens_per_s"]
    assert df.loc["1f1b", "layers_vs_1f1b"] == 1.0
    assert "capacity" in capsys.readouterr().out


def test_capacity_bad_input(tmp_path, capsys):
    assert main(["capacity", SEVENTY, "--policies", "magic", "--out", str(tmp_path / "a")]) == 2
    assert main(["capacity", str(scenario_path("explicit-unit")), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "unknown magic; allowed: 1f1b" in err and "needs a [model] scenario" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
