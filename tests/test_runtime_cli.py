"""`pipeplan profile` and `pipeplan run` end to end through torchrun (2 ranks, tiny model), failure
propagation with a bounded exit, and bad input rejected before anything is launched."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pandas as pd
import pytest

from pipeplan.analysis.cli import main
from pipeplan.sim.config import load_scenario
from pipeplan.sim.ir import Schedule
from pipeplan.sim.step import simulate_scenario

TINY = """
[pipeline]
stages = 2
microbatches = 4
schedule = "zb-h1"

[model]
layers = 4
hidden = 32
ffn_hidden = 64
heads = 4
kv_heads = 2
vocab = 256
seq_len = 16

[training]
micro_batch_size = 2
dtype = "fp32"
"""
RUN_FILES = {"metrics.csv", "timeline.csv", "timelines.csv", "memory.csv", "schedule.csv", "summary.json",
             "trace.json", "gantt.png", "memory.png", "loss.png", "pipeplan.json"}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    path = tmp_path_factory.mktemp("scen") / "tiny2.toml"
    path.write_text(TINY)
    return str(path)


def pipeplan(*argv: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeplan.analysis.cli", *argv], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def profiled(scenario, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    proc = pipeplan("profile", scenario, "--steps", "4", "--validate", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_profile_writes_an_explicit_costs_scenario_the_simulator_reads(profiled):
    sc = load_scenario(profiled / "scenario.toml")
    assert sc.costs is not None and sc.model is None
    assert all(v > 0 for v in sc.costs.forward_s + sc.costs.backward_input_s + sc.costs.activation_bytes)
    assert simulate_scenario(sc).makespan_s > 0
    profile = json.loads((profiled / "profile.json").read_text())
    assert profile["p2p_s"] > 0 and len(profile["backward_weight_s"]) == 2
    v = profile["validation"]  # plain steps 0, 2 (0 dropped) against the costs of profiled steps 1, 3
    assert v["plain_steps"] == [2] and v["measured_makespan_s"] > 0 and v["predicted_makespan_s"] > 0
    timelines = pd.read_csv(profiled / "timelines.csv")
    assert set(timelines["phase"]) == {"plain", "profile"}


def test_run_writes_measurements_in_the_simulator_schema(scenario, profiled, tmp_path):
    out = tmp_path / "run"
    proc = pipeplan("run", scenario, "--steps", "3", "--data", "synthetic", "--costs",
                    str(profiled / "scenario.toml"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == RUN_FILES
    metrics = pd.read_csv(out / "metrics.csv")
    assert list(metrics.columns[:4]) == ["step", "loss", "step_time_s", "tokens_per_s"]
    assert list(metrics["step"]) == [0, 1, 2]
    timeline = pd.read_csv(out / "timeline.csv")
    assert list(timeline.columns) == ["rank", "stage", "microbatch", "kind", "start_s", "end_s"]
    sched = Schedule.read_csv(out / "schedule.csv")
    for rank, rows in timeline.groupby("rank"):  # each rank ran exactly the IR's order
        executed = [f"{s}{k}{m}" for s, k, m in zip(rows["stage"], rows["kind"], rows["microbatch"], strict=True)]
        assert executed == [str(a) for a in sched.ranks[rank]]
    summary = json.loads((out / "summary.json").read_text())
    for key in ("measured_makespan_s", "predicted_makespan_s", "makespan_rel_error",
                "measured_peak_activation_bytes", "predicted_peak_activation_bytes", "tokens_per_s"):
        assert key in summary
    assert summary["prediction_costs"].endswith("scenario.toml")
    assert summary["measured_makespan_s"] == pytest.approx(timeline["end_s"].max())
    memory = pd.read_csv(out / "memory.csv")
    assert list(memory.columns[:3]) == ["rank", "time_s", "hbm_bytes"]
    trace = json.loads((out / "trace.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == len(timeline)


def test_run_executes_torchtitans_op_level_recompute(scenario, tmp_path):
    """`--recompute selective-op` trains (zb-h1: its split backward's linear layers under torch's SAC) and the
    metered peak stays below the prediction, as no recomputation's does (docs/runtime.md, memory table)."""
    out = tmp_path / "sac"
    proc = pipeplan("run", scenario, "--steps", "2", "--data", "synthetic", "--recompute", "selective-op",
                    "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["recompute"] == ["selective-op"] * 2
    assert all(0 < m < p for m, p in zip(summary["measured_peak_activation_bytes"],
                                         summary["predicted_peak_activation_bytes"], strict=True))


def test_run_offloads_the_w_stash_to_the_same_losses(scenario, tmp_path):
    """`memory.offload_stash` under torchrun (zb-h1's split backward): half of every W stash waits in host
    memory from I to W, and the losses are those of the stash kept on the device, bit for bit; so with
    activations offloaded too and copies moving layer by layer (memory.copy_granularity = "layer")."""
    runs = {}
    for name, keys in (("kept", ["memory.offload_stash=0"]), ("stash", ["memory.offload_stash=0.5"]),
                       ("layers", ["memory.offload_stash=0.5", "memory.offload_activations=0.5",
                                   "memory.copy_granularity=\"layer\""])):
        out = tmp_path / name
        sets = [arg for key in keys for arg in ("--set", key)]
        proc = pipeplan("run", scenario, "--steps", "2", "--data", "synthetic", *sets, "--out", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = (json.loads((out / "summary.json").read_text()), pd.read_csv(out / "metrics.csv"))
    assert runs["kept"][0]["stash_offload_share_per_chunk"] == [0.0, 0.0]
    for name in ("stash", "layers"):
        summary, metrics = runs[name]
        assert summary["stash_offload_share_per_chunk"] == [0.5, 0.5]
        assert all(b > 0 for b in summary["offloaded_stash_bytes"])
        assert list(metrics["loss"]) == list(runs["kept"][1]["loss"])
    assert all(b > 0 for b in runs["layers"][0]["offloaded_activation_bytes"])


def test_a_failing_rank_stops_every_rank_with_its_error(scenario, tmp_path):
    out = tmp_path / "failed"
    start = time.monotonic()
    proc = pipeplan("run", scenario, "--steps", "3", "--data", "synthetic", "--timeout-s", "30",
                    "--fail-rank", "1", "--fail-step", "1", "--out", str(out), timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - start < 90
    assert "injected failure on rank 1 at step 1" in proc.stdout + proc.stderr
    assert not out.exists()  # nothing written


@pytest.mark.parametrize("argv,expected", [
    (["run", "scenarios/explicit-unit.toml"], "has explicit [costs] but no [model]"),
    (["run", "--nproc-per-node", "3"], "one process runs one pipeline rank"),
    (["run", "--schedule", "zbv", "--virtual-stages", "1"], "virtual_stages"),
    (["run", "--data", "/no/such/file.txt"], "file not found"),
    (["run", "--costs", "scenarios/explicit-unit.toml", "--microbatches", "8"], None),
    (["run", "--recompute", "selective-op"], None),  # torchtitan's op-level policy: the runtime runs it
    (["run", "--freeze", "uniform", "--cap", "1.5"], "--cap"),
])
def test_bad_input_is_one_line_and_exit_2_before_launching(argv, expected, capsys, tmp_path, monkeypatch):
    import pipeplan.runtime.launch

    monkeypatch.setattr(pipeplan.runtime.launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    if expected is None:  # accepted (explicit-unit has 4 chunks, like tiny-cpu); stop before the launch
        monkeypatch.setattr("pipeplan.analysis.commands.run.launch", lambda *a, **k: 0)
        assert main([*argv, "--out", str(tmp_path / "x")]) == 0
        return
    assert main([*argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0]


def test_freeze_study_trains_once_per_cap_and_reports_loss_and_speed(scenario, tmp_path):
    out = tmp_path / "study"
    proc = pipeplan("freeze-study", scenario, "--caps", "0,0.9", "--tokens", "1024", "--freeze-ramp", "1",
                    "--freeze-monitor", "2", "--out", str(out), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pd.read_csv(out / "freeze_study.csv")
    assert list(table.columns[:7]) == ["cap", "tokens", "final_loss", "heldout_loss", "mean_step_time_s",
                                       "predicted_step_time_s", "wall_s"]
    assert list(table["cap"]) == [0.0, 0.9] and set(table["tokens"]) == {1024}  # 8 steps of 2 x 16 x 4
    assert table[["final_loss", "heldout_loss", "mean_step_time_s", "predicted_step_time_s"]].gt(0).all().all()
    assert table["realized_mean_ratio"].iloc[0] == 0 and table["realized_mean_ratio"].iloc[1] > 0
    # same seed, same data, same phases: the runs differ only by what the cap froze
    a, b = (pd.read_csv(out / f"timelyfreeze-cap-{c}-seed-0" / "metrics.csv") for c in ("0", "0.9"))
    assert list(table["method"]) == ["timelyfreeze"] * 2 and list(table["seed"]) == [0, 0]
    assert table["measured_cpu_ratio"].iloc[0] == 1.0
    assert a["loss"].iloc[0] == b["loss"].iloc[0] and list(a["phase"]) == list(b["phase"])
    assert (out / "loss_curves.png").stat().st_size > 0
    assert not (out / "checkpoints").exists() and not list(out.glob(".progress-*"))  # no scratch left behind
    assert json.loads((out / "pipeplan.json").read_text())["command"] == "freeze-study"  # may be re-run into


@pytest.mark.parametrize("argv,expected", [
    (["freeze-study", "--caps", "0,1.5"], "--caps"),
    (["freeze-study", "--tokens", "100"], "no steady steps"),
])
def test_freeze_study_bad_input_is_one_line(argv, expected, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0]


@pytest.mark.parametrize("command", ["run", "profile"])
def test_help_names_the_runtimes_default_scenario(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "tiny-cpu" in capsys.readouterr().out


def test_a_model_too_big_for_this_cpu_is_refused_before_launching(capsys, tmp_path, monkeypatch):
    """LLaMA-3 8B's 4 ranks need 8e9 x 16 bytes of fp32 weights, gradients and Adam state: with 64 GiB free
    the run is refused in one line instead of being OOM-killed minutes later; tiny-cpu is not refused."""
    import pipeplan.runtime.launch

    monkeypatch.setattr(pipeplan.runtime.launch.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr("pipeplan.analysis.commands.run.host_memory_available", lambda: 64 * 2**30)
    assert main(["run", "llama3-8b-pp4-h100", "--device", "cpu", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "llama3-8b on the CPU" in err[0] and "64.0 GiB is free" in err[0]
    need = float(err[0].split("at least ")[1].split(" GiB")[0])
    assert 8.0e9 * 16 / 2**30 * 0.95 < need < 8.1e9 * 16 / 2**30  # 16 bytes per parameter of LLaMA-3 8B
    assert not (tmp_path / "x").exists()
    monkeypatch.setattr("pipeplan.analysis.commands.run.launch", lambda *a, **k: 0)
    assert main(["run", "tiny-cpu", "--device", "cpu", "--out", str(tmp_path / "y")]) == 0


@pytest.mark.parametrize("costs,error,hint", [("scenario", -0.777, True), ("scenario", 0.05, False),
                                              ("out/profile/scenario.toml", -0.777, False)])
def test_run_summary_hints_at_profile_when_the_scenarios_costs_miss(costs, error, hint, capsys):
    """`pipeplan run` on tiny-cpu measured 523 ms against 116 ms predicted from the scenario's [device]: the
    console says how to predict with this machine's costs; a profiled prediction gets no such hint."""
    from pipeplan.analysis.commands.run import print_run_summary

    print_run_summary({"schedule": "1f1b", "stages": 4, "microbatches": 8, "virtual_stages": 1, "device": "cpu",
                       "final_loss": 3.7588, "step_time_s": 0.5286, "tokens_per_s": 1937.0,
                       "measured_makespan_s": 0.52296, "predicted_makespan_s": 0.11643,
                       "makespan_rel_error": error, "prediction_costs": costs})
    out = capsys.readouterr().out
    assert f"costs: {costs})" in out and ("`pipeplan profile` measures its costs" in out) == hint
