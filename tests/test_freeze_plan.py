"""`pipeplan plan` end to end: outputs, verification, schedule-blind baselines, the cap sweep, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.analysis.cli import main
from pipeplan.sim.config import load_scenario
from pipeplan.sim.errors import PipeplanError, ScenarioError
from pipeplan.solver.errors import VerificationError
from pipeplan.solver.plan import plan_scenario, sweep_caps, verify
from tests.conftest import independent_longest_path_s

UNIT = str(scenario_path("explicit-unit"))


def write_scenario(tmp_path: Path, freeze_toml: str, name: str = "s.toml") -> str:
    path = tmp_path / name
    path.write_text(Path(UNIT).read_text() + "\n[freeze]\n" + freeze_toml + "\n")
    return str(path)


def test_plan_on_the_default_scenario_writes_every_output(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", "--out", str(out)]) == 0
    expected = {
        "plan.json",
        "freeze.csv",
        "baselines.csv",
        "freeze_heatmap.png",
        "gantt_before.png",
        "gantt_after.png",
        "summary.json",
        "timeline.csv",
        "memory.csv",
        "schedule.csv",
        "trace.json",
        "memory.png",
    }
    assert expected <= {p.name for p in out.iterdir()}
    plan = json.loads((out / "plan.json").read_text())
    for key in (
        "baseline_makespan_s",
        "planned_makespan_s",
        "simulated_makespan_s",
        "speedup",
        "solve_wall_s",
        "stage_mean_freeze_ratio",
        "actions",
    ):
        assert key in plan
    assert plan["simulated_makespan_s"] == pytest.approx(plan["planned_makespan_s"], rel=1e-6)
    assert plan["speedup"] == pytest.approx(plan["baseline_makespan_s"] / plan["simulated_makespan_s"])
    assert plan["speedup"] > 1.0
    assert len(plan["actions"]) == 4 * 8 * 2  # p=4, m=8: an F and a B per stage and microbatch
    assert set(plan["actions"][0]) == {"stage", "microbatch", "kind", "freeze_ratio", "duration_s"}
    assert max(plan["stage_mean_freeze_ratio"]) <= 0.9 + 1e-9
    frozen = [a for a in plan["actions"] if a["freeze_ratio"] > 0]
    assert frozen and all(a["kind"] == "B" for a in frozen)
    freeze = pd.read_csv(out / "freeze.csv")
    assert len(freeze) == len(plan["actions"])
    assert "speedup" in capsys.readouterr().out


def test_lp_plan_beats_schedule_blind_freezing_at_the_same_budget():
    plan = plan_scenario(load_scenario(None))
    assert {b.name for b in plan.baselines} == {"uniform", "apf-like", "autofreeze-like"}
    for b in plan.baselines:
        assert b.mean_ratio == pytest.approx(plan.mean_ratio, rel=1e-6)
        assert b.makespan_s >= plan.planned.makespan_s * (1 - 1e-9)
        assert b.gain_per_freeze <= plan.gain_per_freeze + 1e-9
    # schedule-blind uniform freezing at the full cap freezes ~2x as much and is still slower
    assert plan.uniform_at_cap.mean_ratio == pytest.approx(0.9)
    assert plan.uniform_at_cap.speedup <= plan.speedup + 1e-9
    assert plan.mean_ratio < 0.6


def test_explicit_unit_plan_has_the_hand_computed_makespan(tmp_path):
    # 1f1b p=4 m=8, F = I = W = 1: unfrozen (m + p - 1)(F + B) = 33; verified against the engine
    plan = plan_scenario(load_scenario(UNIT, {"freeze.cap": 0.0}))
    assert plan.baseline.makespan_s == pytest.approx(33.0)
    assert plan.planned.makespan_s == pytest.approx(33.0)
    assert plan.speedup == pytest.approx(1.0)
    assert plan.mean_ratio == 0.0


def test_sweep_speedup_is_monotone_in_the_cap(tmp_path):
    rows = pd.DataFrame(sweep_caps(UNIT, caps=[0.0, 0.3, 0.6, 0.9]))
    assert set(rows["schedule"]) == {"gpipe", "1f1b", "interleaved-1f1b", "zbv"}
    for _, g in rows.groupby("schedule"):
        assert g["speedup"].iloc[0] == pytest.approx(1.0)
        assert np.all(np.diff(g["speedup"].to_numpy()) >= -1e-9)
    np.testing.assert_allclose(rows["simulated_makespan_s"], rows["planned_makespan_s"], rtol=1e-6)


def test_sweep_cli_writes_csv_and_plot(tmp_path):
    out = tmp_path / "sweep"
    assert main(["plan", UNIT, "--sweep-cap", "--schedule", "1f1b", "--out", str(out)]) == 0
    sweep = pd.read_csv(out / "sweep.csv")
    assert list(sweep["cap"]) == pytest.approx([0.1 * k for k in range(10)])
    assert (out / "sweep.png").stat().st_size > 0


def test_report_on_a_cap_sweep_leads_with_the_fastest_planned_step(tmp_path):
    """`plan --sweep-cap` folders get a headline like every other kind (analysis.report_answers)."""
    out = tmp_path / "sweep"
    assert main(["plan", UNIT, "--sweep-cap", "--schedule", "1f1b", "--out", str(out)]) == 0
    assert main(["report", str(out)]) == 0
    sweep = pd.read_csv(out / "sweep.csv")
    fast = sweep.loc[sweep["simulated_makespan_s"].idxmin()]
    md = (out / "report.md").read_text()
    assert md.startswith(f"# pipeplan report: {out.name} (freeze cap sweep)")
    lead = md.split("\n")[2]
    assert lead.startswith("**Fastest planned step: 1f1b at cap ") and lead.endswith(".**")
    assert f"at cap {fast['cap']:g}, {fast['simulated_makespan_s']:.4g} s ({fast['speedup']:.3f}× faster" in lead
    assert f"{len(sweep)} schedule × cap plans" in lead
    assert "Speedup per schedule and cap" in md and "Fastest planned step: 1f1b" in (out / "report.html").read_text()


def test_verification_failure_is_loud():
    with pytest.raises(VerificationError, match="differs from the LP"):
        verify(10.0, 10.001)
    verify(10.0, 10.0 + 1e-6)


# ---- bad input: PipeplanError naming the field, and exit code 2 with one line --------------------------
@pytest.mark.parametrize(
    ("freeze_toml", "field"),
    [
        ("cap = 1.5", "freeze.cap"),
        ("backward_min_s = 5.0", "freeze.backward_min_s"),
        ("curve = [[0.0, 1.0], [0.5, 0.8], [1.0, 0.0]]", "freeze.curve"),  # concave
        ("curve = [[0.0, 1.0], [0.5, 1.0], [1.0, 0.0]]", "freeze.curve"),  # flat, then a cliff
    ],
)
def test_bad_freeze_settings_exit_2_naming_the_field(tmp_path, capsys, freeze_toml, field):
    path = write_scenario(tmp_path, freeze_toml)
    with pytest.raises(PipeplanError, match=field.replace(".", r"\.")):
        plan_scenario(load_scenario(path))
    assert main(["plan", path, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err
    assert not (tmp_path / "out").exists()


def test_cap_flag_out_of_range(tmp_path, capsys):
    with pytest.raises(ScenarioError, match=r"freeze\.cap"):
        load_scenario(UNIT, {"freeze.cap": -0.1})
    assert main(["plan", UNIT, "--cap", "-0.1", "--out", str(tmp_path / "o")]) == 2
    assert "freeze.cap" in capsys.readouterr().err


def test_deadlocking_order_is_an_infeasible_lp(tmp_path, capsys):
    # rank 1 runs 1F1 first, which needs 0F1, which waits behind 0B0, which needs 1B0: a cycle
    csv = tmp_path / "cyclic.csv"
    csv.write_text("0F0,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n")
    scenario = tmp_path / "p2m2.toml"
    scenario.write_text(
        Path(UNIT)
        .read_text()
        .replace("stages = 4", "stages = 2")
        .replace("microbatches = 8", "microbatches = 2")
    )
    assert main(["plan", str(scenario), "--schedule-csv", str(csv), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "infeasible" in err and "cycle" in err


def test_recomputation_is_timed(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text(Path(UNIT).read_text() + '\n[memory]\nrecompute = "full"\n')
    plan = plan_scenario(load_scenario(path))
    plain = plan_scenario(load_scenario(UNIT))
    # every B carries a recomputed forward (1 s), so B = I + W + 1 = 3 s and the unfrozen 1F1B step is
    # (m + p - 1)(F + B) = 11 x 4 = 44 s against 11 x 3 = 33 s without recomputation
    assert plain.baseline.makespan_s == pytest.approx(33.0, rel=1e-12)
    assert plan.baseline.makespan_s == pytest.approx(44.0, rel=1e-12)
    # the planned durations (recomputation included) laid on the step's longest path, written out
    # independently in tests/conftest.py, give the planned step; freezing shortens it
    durations = plan.durations()  # every B (1F1B has no I) at its planned length
    assert plan.planned.makespan_s == pytest.approx(
        independent_longest_path_s(plan.schedule, lambda a: durations.get(a, plan.costs.duration(a))), rel=1e-12)
    assert plan.planned.makespan_s < plan.baseline.makespan_s
