"""`pipeplan search`: on reduced spaces, branch and bound gives exhaustive simulation's winner and fits; its
bounds are bounds; the command's outputs and bad input."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import numpy as np
import pandas as pd
import pytest

from pipeplan.sim.config import parse_scenario, resolve_scenario_path, set_dotted
from pipeplan.sim.ir import BACKWARD_KINDS, Kind
from pipeplan.sim.schedules import SCHEDULES, build_schedule, schedule_names
from pipeplan.solver.search.run import search, winner
from pipeplan.solver.search.screen import inflight_lower_bound, screen
from pipeplan.solver.search.space import SpaceOptions, build_space


def _tiny(hbm_gib: float, **keys):
    path = resolve_scenario_path("tiny-cpu")
    raw = tomllib.loads(path.read_text())
    set_dotted(raw, "device.hbm_gib", hbm_gib)
    for k, v in keys.items():
        set_dotted(raw, k.replace("__", "."), v)
    return raw, str(path), str(path.parent), parse_scenario(raw, str(path), path.parent)


REDUCED = SpaceOptions(schedules={"gpipe": (1,), "1f1b": (1,), "zb-2p": (1,), "interleaved-1f1b": (2,),
                                  "zbv": (2,), "v-half": (2,)},
                       recompute=("none", "full", "selective-op"), offload=(0.0, 0.5), optimizer=("hbm", "dram"),
                       zero=(0, 1), max_micro_batch=2)


@pytest.mark.parametrize(("hbm_gib", "gpus", "batch"), [(0.12, 8, 16), (0.06, 4, 16), (1.0, 8, 32)])
def test_search_equals_exhaustive_simulation(hbm_gib, gpus, batch):
    raw, source, folder, sc = _tiny(hbm_gib)
    space = build_space(sc, gpus, batch, REDUCED)
    fast = search(raw, source, folder, sc, space)
    full = search(raw, source, folder, sc, space, exhaustive=True)
    assert len(full.rows) == len(space)  # every candidate valid and simulated
    w_fast, w_full = winner(fast), winner(full)
    assert (w_fast is None) == (w_full is None)
    if w_full is not None:
        assert int(w_fast["candidate"]) == int(w_full["candidate"])
        assert w_fast["step_time_s"] == w_full["step_time_s"]
    # what search simulated, it reports as exhaustive simulation does
    both = fast.rows.merge(full.rows, on="candidate", suffixes=("", "_full"))
    assert len(both) == len(fast.rows)
    assert (both["fits"] == both["fits_full"]).all()
    assert np.allclose(both["step_time_s"], both["step_time_s_full"])
    # bounds are bounds: no simulated step below its screen or refined bound, nothing screened out fits
    assert (full.rows["step_time_s"] >= full.rows["screen_lb_s"]).all()
    assert (full.rows["step_time_s"] >= full.rows["refined_lb_s"]).all()
    bounds = screen(sc, space)
    out = bounds.hbm_lb_bytes > bounds.hbm_limit_bytes
    fits = full.rows.set_index("candidate")["fits"].astype(bool)
    assert not fits[np.flatnonzero(out)].any()
    peaks = full.rows.set_index("candidate")["max_peak_hbm_bytes"].sort_index().to_numpy()
    assert (peaks >= bounds.hbm_lb_bytes).all()
    # and it did prune: fewer simulations than candidates
    assert len(fast.rows) < len(space)


def test_search_with_workers_gives_the_same_winner():
    raw, source, folder, sc = _tiny(0.12)
    space = build_space(sc, 8, 16, REDUCED)
    one, two = search(raw, source, folder, sc, space), search(raw, source, folder, sc, space, jobs=2)
    assert int(winner(one)["candidate"]) == int(winner(two)["candidate"])


def _inflight(schedule) -> int:
    best = 0
    for acts in schedule.ranks:
        live = 0
        for a in acts:
            live += a.kind is Kind.F
            live -= a.kind in BACKWARD_KINDS
            best = max(best, live)
    return best


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-2p", "interleaved-1f1b", "zbv", "v-half", "chronos"])
def test_inflight_lower_bound_holds_on_built_schedules(name):
    schedule_names()  # registers the built-in schedules
    for p in (1, 2, 3, 4, 6, 8):
        for m in (1, 2, 3, p, 2 * p, 3 * p + 1, 4 * p):
            for v in (1, 2, 4):
                if SCHEDULES[name].check(p, m, v):
                    continue
                bound = inflight_lower_bound(name, np.array([p]), np.array([v]), np.array([m]))[0]
                assert bound <= _inflight(build_schedule(name, p, m, v)), (p, m, v)


def test_space_holds_the_batch_and_gpu_count_fixed():
    _, _, _, sc = _tiny(1.0)
    space = build_space(sc, 8, 32)
    assert len(space) > 1000
    assert (space.tp * space.pp * space.dp == 8).all()
    assert (space.m * space.mbs * space.dp == 32).all()
    assert (sc.parallel.gpus_per_node % space.tp == 0).all()


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "pipeplan.analysis.cli", "search", *args],
                          capture_output=True, text=True, timeout=300)


def test_search_command_writes_answer(tmp_path):
    out = tmp_path / "s"
    r = _cli("tiny-cpu", "--gpus", "4", "--global-batch", "8", "--set", "device.hbm_gib=0.12", "--out", str(out))
    assert r.returncode == 0, r.stderr
    rows = pd.read_csv(out / "search.csv")
    for col in ("gpus", "global_batch", "tokens_per_s_per_gpu", "fits", "peak_hbm_gib", "headroom_gib"):
        assert col in rows
    assert (rows["gpus"] == 4).all() and (rows["global_batch"] == 8).all()
    assert bool(rows.iloc[0]["fits"]) and rows.iloc[0]["headroom_gib"] >= 0
    pruned = pd.read_csv(out / "pruned.csv")
    assert pruned["count"].sum() > len(rows)
    assert "fastest that fit" in r.stdout


@pytest.mark.parametrize(("args", "field"), [
    (["--gpus", "x", "--global-batch", "8"], "--gpus"),
    (["--gpus", "4", "--global-batch", "0"], "--global-batch"),
    (["--gpus", "64", "--global-batch", "7"], "--gpus 64 --global-batch 7"),
    (["--gpus", "4", "--global-batch", "8", "--margin", "-1"], "--margin"),
    (["--gpus", "4", "--global-batch", "8", "--device", "nope"], "device"),
])
def test_search_bad_input_is_one_line(tmp_path, args, field):
    r = _cli("tiny-cpu", *args, "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert field in r.stderr and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_best_per_gpu_count_keeps_the_ranking():
    """Regression: sort_values("gpus") (quicksort) reordered rows of equal GPU count and the table showed the
    wrong row per count; here 200 rows, best first, with the best of each count far from the front."""
    from pipeplan.analysis.report_answers import best_per_gpu_count
    from pipeplan.analysis.sweep import ranked

    rng = np.random.default_rng(0)
    df = pd.DataFrame({"gpus": rng.choice([32, 64, 128], 200), "tokens_per_s_per_gpu": rng.uniform(100, 500, 200),
                       "max_peak_hbm_bytes": 1.0, "step_time_s": 1.0})
    per = best_per_gpu_count(ranked(df))
    assert list(per["gpus"]) == [32, 64, 128]
    assert np.allclose(per["tokens_per_s_per_gpu"], df.groupby("gpus")["tokens_per_s_per_gpu"].max().to_numpy())


def test_heatmap_axis_order_is_numeric_for_numpy_integers():
    from pipeplan.analysis.sweep_plots import _order

    values = [np.int64(16), np.int64(8), np.int64(128), np.float64(2.5)]
    assert sorted(values, key=_order) == [2.5, 8, 16, 128]
    assert sorted(["zbv", np.int64(4), "1f1b"], key=_order)[0] == 4


def test_report_leads_with_the_search_answer(tmp_path):
    out = tmp_path / "s"
    assert _cli("tiny-cpu", "--gpus", "4", "--global-batch", "8", "--out", str(out)).returncode == 0
    r = subprocess.run([sys.executable, "-m", "pipeplan.analysis.cli", "report", str(out)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    text = (out / "report.md").read_text()
    best = pd.read_csv(out / "search.csv").iloc[0]
    lead = text.split("\n\n")[1]
    assert lead.startswith("**4 GPUs, global batch 8: run") and f"schedule = {best['pipeline.schedule']}" in lead
    assert "Headroom" in lead and "How the rest was ruled out" in text


def test_sweep_holds_gpus_and_global_batch_fixed(tmp_path):
    out = tmp_path / "sw"
    r = subprocess.run([sys.executable, "-m", "pipeplan.analysis.cli", "sweep", "tiny-cpu",
                        "--grid", "pipeline.stages=2,4", "--grid", "parallel.dp=1,2",
                        "--grid", "pipeline.microbatches=4,8",
                        "--gpus", "8", "--global-batch", "16", "--jobs", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = pd.read_csv(out / "sweep.csv")
    assert len(rows) == 1 and rows.iloc[0]["gpus"] == 8 and rows.iloc[0]["global_batch"] == 16


def test_report_leads_with_answers_for_validate_and_freeze_study(tmp_path):
    from pipeplan.analysis.report_answers import answer

    val = tmp_path / "val"
    val.mkdir()
    pd.DataFrame({"source": ["a", "a", "b"], "table": ["1", "1", "2"], "case": ["x", "y", "z"],
                  "metric": ["memory", "time", "memory"], "published": [1, 2, 3], "predicted": [1.1, 2, 2.4],
                  "rel_error": [0.1, 0.0, -0.2]}).to_csv(val / "validation.csv", index=False)
    kind, blocks = answer(val)
    assert kind == "validation" and blocks[0].kind == "lead"
    assert blocks[0].payload == "3 published figures predicted: mean |error| 10.0%, max 20.0% (b, z)."
    memory = blocks[1].payload[0]
    assert "memory: 2 figures, mean |error| 15.0%, max 20.0%" in memory and "not met" in memory
    study = tmp_path / "study"
    study.mkdir()
    pd.DataFrame({"cap": [0, 0.3, 0.6], "heldout_loss": [2.5, 2.55, 2.7], "mean_step_time_s": [1.0, 0.8, 0.85],
                  "predicted_step_time_s": [0.9, 0.75, 0.8]}).to_csv(study / "freeze_study.csv", index=False)
    kind, blocks = answer(study)
    assert kind == "freeze study"
    assert blocks[0].payload.startswith("Cap 0.3 is fastest: mean step 0.8 s, 1.25x cap 0's")
    assert "(+0.050 against cap 0)" in blocks[0].payload
