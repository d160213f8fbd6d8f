"""What a new user meets: answers that say whether a plan fits, defaults that need no knowledge, shipped
scenarios by name, templates, --version and examples, and planning commands that never import torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.analysis.cli import COMMANDS, main
from pipeplan.sim.config import HBM_MARGIN_SHARE, load_scenario

UNIT = str(scenario_path("explicit-unit"))


def _summary(folder) -> dict:
    return json.loads((folder / "summary.json").read_text())


# --- fits ----------------------------------------------------------------------------------------------------


def test_fits_is_peak_against_capacity_on_the_tightest_rank(tmp_path, capsys):
    tight, roomy = tmp_path / "zbv", tmp_path / "1f1b"
    no_recompute = ["--set", "memory.recompute=none"]  # the default recomputes; without it zbv does not fit
    assert main(["simulate", "--schedule", "zbv", *no_recompute, "--out", str(tight)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    # with runtime memory and fragmentation counted (docs/cost-model.md) 1F1B then needs the 96 GB H100
    assert main(["simulate", *no_recompute, "--set", "device.hbm_gib=93.6", "--out", str(roomy)]) == 0
    for folder in (tight, roomy):
        s = _summary(folder)
        peaks = np.array(s["peak_hbm_bytes"])
        # no margin in the scenario: the default keeps 5% of capacity free (MemoryConfig.margin_bytes)
        assert s["hbm_limit_bytes"] == pytest.approx((1 - HBM_MARGIN_SHARE) * s["hbm_capacity_bytes"])
        assert s["tightest_rank"] == int(peaks.argmax())
        assert s["over_capacity_bytes"] == pytest.approx(max(0.0, peaks.max() - s["hbm_limit_bytes"]))
        assert s["fits"] == bool(peaks.max() <= s["hbm_limit_bytes"])
    s = _summary(tight)
    assert not s["fits"] and s["oom"]
    over = f"{s['over_capacity_bytes'] / 2**30:.2f} GiB over"
    assert first.startswith("DOES NOT FIT") and over in first  # the console's first line says it
    assert _summary(roomy)["fits"]


def test_plan_says_plainly_when_it_does_not_fit(tmp_path, capsys):
    out = tmp_path / "plan"
    # unit costs hold 1 byte per activation: a 1-byte-ish HBM cannot hold the 1F1B warm-up
    assert main(["plan", UNIT, "--cap", "0.5", "--set", "costs.hbm_gib=1e-9", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    plan = json.loads((out / "plan.json").read_text())
    assert plan["fits"] is False and plan["fits_before"] is False
    limit = (1 - HBM_MARGIN_SHARE) * 2**30 * 1e-9  # the default margin: 5% of capacity
    assert plan["over_capacity_bytes"] == pytest.approx(plan["peak_hbm_bytes_after"] - limit)
    assert text.startswith("DOES NOT FIT") and "The plan does not fit" in text and "peak HBM (GiB)" in text
    assert not (out / "gantt.png").exists() and (out / "gantt_after.png").exists()  # no duplicate Gantt


# --- defaults ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("schedule", "v"), [("zbv", 2), ("v-half", 2), ("interleaved-1f1b", 2), ("chronos", 2),
                                             ("zb-h1", 1), ("gpipe", 1)])
def test_schedule_alone_gets_the_chunks_it_takes(schedule, v):
    assert load_scenario(UNIT, {"pipeline.schedule": schedule}).pipeline.virtual_stages == v


def test_virtual_stages_default_in_a_file_and_kept_when_valid(tmp_path):
    text = scenario_path("explicit-unit").read_text().replace("virtual_stages = 1\n", "")
    assert "virtual_stages" not in text
    f = tmp_path / "s.toml"
    f.write_text(text.replace('schedule = "1f1b"', 'schedule = "zbv"'))
    assert load_scenario(f).pipeline.virtual_stages == 2
    # a chronos file with 4 chunks per rank, switched to interleaved-1f1b, keeps 4 (interleaved takes it)
    f.write_text(text.replace('schedule = "1f1b"', 'schedule = "chronos"\nvirtual_stages = 4'))
    assert load_scenario(f, {"pipeline.schedule": "interleaved-1f1b"}).pipeline.virtual_stages == 4
    assert load_scenario(f, {"pipeline.schedule": "zbv"}).pipeline.virtual_stages == 2


# --- sweeps: like with like, invalid by reason, the report ----------------------------------------------------


def test_sweep_per_gpu_columns_invalid_reasons_and_report(tmp_path, capsys):
    out = tmp_path / "sw"
    argv = ["sweep", "llama3-8b-pp4-h100", "--grid", "pipeline.stages=2,4", "--grid", "pipeline.schedule=1f1b,zbv",
            "--grid", "pipeline.virtual_stages=1", "--set", "parallel.dp=2", "--set", "device.hbm_gib=93.6",
            "--jobs", "1", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    df = pd.read_csv(out / "sweep.csv")
    ok = df[df["status"] == "ok"]
    assert (ok["gpus"] == ok["pipeline.stages"] * 2).all()  # stages x tp (1) x dp (2)
    assert (ok["global_batch"] == 8 * 2).all()  # microbatches x micro_batch_size x dp
    assert np.allclose(ok["tokens_per_s_per_gpu"] * ok["gpus"], ok["tokens_per_s"])
    assert "2 invalid combinations" in text
    assert "2 x pipeline: schedule 'zbv' needs pipeline.virtual_stages = 2" in text

    assert main(["report", str(out)]) == 0
    md = (out / "report.md").read_text()
    fit = ok[ok["fits"]]
    best = fit.loc[fit["tokens_per_s_per_gpu"].idxmax()]
    lead = md.split("\n")[2]
    config = f"stages = {best['pipeline.stages']}, schedule = {best['pipeline.schedule']}"
    assert lead.startswith(f"**Best that fits: {config}")
    assert f"{best['tokens_per_s']:,.0f} tokens/s" in lead
    assert "## Invalid combinations (2), not simulated" in md and "nan" not in md.lower()
    assert md.index("Best that fits") < md.index("## Files") and md.count("![pareto.png]") == 1
    # communication: transfer waits are part of the bubble; dp=2 adds a gradient reduction after the pipeline
    assert ((ok["p2p_wait_share"] > 0) & (ok["p2p_wait_share"] <= ok["bubble_ratio"])).all()
    assert (ok["step_tail_share"] > 0).all()
    assert "in transit between stages" in md and f"{best['step_tail_share']:.1%} of the step" in md


@pytest.mark.parametrize("step,makespan,spec,shown_apart", [
    (10.0000004, 10.0, ".6g", False),  # both print "10"
    (10.0004, 10.0, ".6g", True),  # "10.0004" vs "10"
    (10.0004, 10.0, ".4g", False),  # the report's precision hides it
    (10.02, 10.0, ".4g", True),
    (None, 10.0, ".6g", False),  # an older summary: no step_time_s, the step is the makespan
])
def test_step_is_shown_apart_only_where_it_prints_differently(step, makespan, spec, shown_apart):
    """One rule for `simulate`, `show` and the report's lead (analysis.console.step_differs)."""
    from pipeplan.analysis.console import step_differs

    summary = {"makespan_s": makespan} | ({} if step is None else {"step_time_s": step})
    assert step_differs(summary, spec) is shown_apart


def test_report_answers_for_simulate_and_plan(tmp_path):
    sim, plan = tmp_path / "sim", tmp_path / "plan"
    assert main(["simulate", "--set", "device.hbm_gib=93.6", "--out", str(sim)]) == 0  # the 96 GB H100 fits
    assert main(["report", str(sim)]) == 0
    s = _summary(sim)
    md = (sim / "report.md").read_text()
    # the step tokens/s counts (the optimizer step's tail included), then the pipeline's makespan the bubble is of
    assert s["step_time_s"] > s["makespan_s"]
    assert f"one step takes {s['step_time_s']:.4g} s" in md and "Fits: the tightest rank" in md
    assert f"makespan is {s['makespan_s']:.4g} s" in md
    assert main(["plan", UNIT, "--cap", "0.5", "--out", str(plan)]) == 0 and main(["report", str(plan)]) == 0
    p = json.loads((plan / "plan.json").read_text())
    assert f"{p['speedup']:.3f}× faster" in (plan / "report.md").read_text()


def test_post_validation_step_is_what_simulate_show_report_and_plan_print(tmp_path, capsys):
    """Under optimizer post-validation the step is the longest rank span, not the makespan: ZB-2p on unit costs
    (p = 4, m = 8) steps every 24 s though its makespan is 27 s (tests/test_engine.py). Every command says so,
    and `plan` reports the spans before and after freezing beside the LP's makespans."""
    sets = ["--set", "pipeline.schedule=zb-2p", "--set", "training.optimizer_post_validation=true"]
    sim, plan = tmp_path / "sim", tmp_path / "plan"
    assert main(["simulate", UNIT, *sets, "--out", str(sim)]) == 0
    assert "makespan 27 s · step 24 s" in capsys.readouterr().out
    assert main(["report", str(sim)]) == 0
    md = (sim / "report.md").read_text()
    assert "one step takes 24 s" in md and "makespan is 27 s" in md
    assert main(["show", UNIT, *sets]) == 0
    text = capsys.readouterr().out
    assert "step 24 s (makespan 27 s)" in text and "optimizer post-validation" in text
    assert "4 stages x 1 chunk per rank = 4 chunks" in text  # not "1 chunks"
    assert main(["plan", UNIT, *sets, "--cap", "0.5", "--out", str(plan)]) == 0
    text = capsys.readouterr().out
    p = json.loads((plan / "plan.json").read_text())
    assert p["step_time_s_before"] == 24.0 and p["step_time_s_after"] == _summary(plan)["step_time_s"]
    assert p["baseline_makespan_s"] == 27.0 and p["step_time_s_after"] < p["step_time_s_before"]
    assert f"{p['step_time_s_before']:.6g} s -> {p['step_time_s_after']:.6g} s" in text
    assert main(["report", str(plan)]) == 0
    gain = p["step_time_s_before"] / p["step_time_s_after"]
    assert f"longest rank span: 24 s → {p['step_time_s_after']:.4g} s ({gain:.3f}× faster)" in (
        plan / "report.md").read_text()
    assert main(["plan", UNIT, "--out", str(tmp_path / "barrier")]) == 0  # with the barrier: nothing added
    assert "step_time_s_after" not in json.loads((tmp_path / "barrier" / "plan.json").read_text())


# --- scenarios, init, show, --version, examples -----------------------------------------------------------------


def test_shipped_scenario_by_name_equals_its_path(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["simulate", "explicit-unit", "--out", str(a)]) == 0
    assert main(["simulate", UNIT, "--out", str(b)]) == 0
    assert _summary(a)["makespan_s"] == _summary(b)["makespan_s"]
    assert main(["simulate", "no-such-scenario", "--out", str(tmp_path / "c")]) == 2


def test_scenarios_lists_every_shipped_one(capsys):
    from pipeplan.scenarios import scenario_names

    assert main(["scenarios"]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in scenario_names())


def test_titles_say_when_the_device_is_not_the_preset_itself():
    """tiny-cpu's [device] (4 GiB, 0.1 TFLOP/s: a CPU core) starts from the H100 preset; a title that said
    "4 x H100-SXM-80GB" above a 4 GiB capacity line would mislead."""
    from pipeplan.analysis.outputs import scenario_title

    assert scenario_title(load_scenario("tiny-cpu")) == "tiny on 4 x custom device (from H100-SXM-80GB)"
    assert scenario_title(load_scenario("llama3-8b-pp4-h100")) == "llama3-8b on 4 x H100-SXM-80GB"
    assert scenario_title(load_scenario("llama3-8b-pp4-h100", {"device.hbm_gib": 40})).endswith("(from H100-SXM-80GB)")


def test_scenario_description_is_the_whole_first_sentence(monkeypatch, tmp_path):
    """A description wrapping over comment lines is read to its full stop, not cut at the first line's end."""
    from pipeplan import scenarios

    (tmp_path / "wrapped.toml").write_text("# A model on a CPU: wide layers, so that the linear\n"
                                           "# layers' W work (arXiv 2503.03182) is a real share. Two ranks.\n"
                                           "\n# not the description\n[pipeline]\n")
    monkeypatch.setattr(scenarios, "SCENARIO_DIR", tmp_path)
    assert scenarios.scenario_description("wrapped") == ("A model on a CPU: wide layers, so that the linear "
                                                         "layers' W work (arXiv 2503.03182) is a real share.")


@pytest.mark.parametrize("flags", [[], ["--costs"]])
def test_init_template_simulates_as_written(tmp_path, flags):
    path = tmp_path / "mine.toml"
    assert main(["init", str(path), *flags]) == 0
    assert main(["simulate", str(path), "--out", str(tmp_path / "sim")]) == 0
    assert _summary(tmp_path / "sim")["fits"]  # a new user's first simulation fits its GPUs
    assert main(["init", str(path)]) == 2  # never overwrites


def test_init_template_lists_what_the_registries_hold(tmp_path):
    """The template's lists of names are read from the registries, so a new schedule or preset shows up."""
    from pipeplan.sim.devices import load_presets
    from pipeplan.sim.schedules import schedule_names

    path = tmp_path / "mine.toml"
    assert main(["init", str(path)]) == 0
    lines = path.read_text().splitlines()
    assert next(ln for ln in lines if ln.startswith("schedule =")).endswith("# " + " | ".join(schedule_names()))
    assert "zb-2p" in schedule_names()
    assert next(ln for ln in lines if ln.startswith("preset =")).endswith("# " + " | ".join(load_presets()))


def test_show_resolves_costs_and_memory(tmp_path, capsys):
    from pipeplan.sim.costs import build_cost_table

    sets = ["--set", "pipeline.schedule=zbv", "--set", "memory.recompute=none"]
    assert main(["show", "llama3-8b-pp4-h100", *sets]) == 0
    text = capsys.readouterr().out
    costs = build_cost_table(load_scenario("llama3-8b-pp4-h100", {"pipeline.schedule": "zbv"}))
    assert "4 stages x 2 chunks per rank = 8 chunks" in text and f"{costs.forward_s[7] * 1e3:.4g}" in text
    assert main(["simulate", "--schedule", "zbv", "--set", "memory.recompute=none", "--out", str(tmp_path)]) == 0
    s = _summary(tmp_path)
    assert f"{max(s['peak_hbm_bytes']) / 2**30:.2f}" in text and "DOES NOT FIT" in text


def test_version_and_an_example_in_every_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith("pipeplan ")
    for command in COMMANDS:
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert "examples:" in text and f"pipeplan {command}" in text.split("examples:")[1], command


# --- light install: planning imports no torch --------------------------------------------------------------------

TORCH_FREE = """
import sys
from pathlib import Path
from pipeplan.analysis.cli import main
out = Path(sys.argv[1])
runs = [
    ["simulate", "explicit-unit", "--out", str(out / "sim")],
    ["simulate", "--schedule", "nope", "--out", str(out / "bad")],
    ["plan", "explicit-unit", "--cap", "0.5", "--out", str(out / "plan")],
    ["capacity", "tiny-cpu", "--policies", "1f1b", "--out", str(out / "cap")],
    ["sweep", "explicit-unit", "--grid", "pipeline.microbatches=4,8", "--jobs", "1", "--out", str(out / "sw")],
    ["report", str(out / "sw")],
    ["scenarios"],
    ["init", str(out / "t.toml")],
    ["show", "tiny-cpu"],
]
if "validate" in __import__("pipeplan.analysis.cli").analysis.cli.COMMANDS:
    runs.append(["validate", "--help"])  # its module and flags (its run belongs to its own tests)
for argv in runs:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    print("RESULT", argv[0], code, "torch" in sys.modules)
"""


def test_planning_commands_import_no_torch(tmp_path):
    proc = subprocess.run([sys.executable, "-c", TORCH_FREE, str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    results = [line.split() for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) >= 9, proc.stderr[-2000:]
    assert [r for r in results if r[3] != "False"] == []  # no command loaded torch
    # each ran as it would with torch: the unknown schedule is refused (2), everything else succeeds
    assert [(r[1], r[2]) for r in results][:2] == [("simulate", "0"), ("simulate", "2")]
    assert [r for r in results[2:] if r[2] != "0"] == []


@pytest.mark.parametrize("argv", [["run"], ["profile"], ["profile", "--gemm"], ["freeze-study"],
                                  ["lcp", "bench", "--n", "1e3"]])
def test_torch_commands_name_the_extra_when_torch_is_missing(argv, tmp_path):
    out = tmp_path / "out"
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # as if torch were not installed
        from pipeplan.analysis.cli import main
        sys.exit(main({[*argv, "--out", str(out)]!r}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "install pipeplan[runtime]" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()  # refused before any output


@pytest.mark.parametrize("command", ["run", "profile", "freeze-study"])
def test_torch_commands_print_help_without_torch(command):
    """--help needs no torch: the runtime modules that import it load only when a job starts
    (analysis/commands/run.py); runtime.config, which the flags' choices come from, imports none."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # as if torch were not installed
        from pipeplan.analysis.cli import main
        try:
            main([{command!r}, "--help"])
        except SystemExit as exc:
            print("EXIT", exc.code)
        print("LOADED", *sorted(m for m, mod in sys.modules.items()
                                if mod is not None and m.split(".")[0] == "torch" or m.startswith("pipeplan.runtime")))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = proc.stdout.splitlines()
    assert f"usage: pipeplan {command}" in proc.stdout and "examples:" in proc.stdout, proc.stderr[-2000:]
    assert "EXIT 0" in lines
    assert [ln for ln in lines if ln.startswith("LOADED")] == ["LOADED pipeplan.runtime pipeplan.runtime.config"]


@pytest.mark.parametrize("scenario,tiny", [("explicit-unit", "costs.hbm_gib=1e-9"),
                                           ("llama3-8b-pp4-h100", "device.hbm_gib=1")])
def test_report_on_a_sweep_where_nothing_fits(tmp_path, scenario, tiny):
    """No configuration fits HBM: the report says so and still lists what was simulated (no empty argmax)."""
    out = tmp_path / "sw"
    assert main(["sweep", scenario, "--grid", "pipeline.stages=2,4", "--set", tiny, "--jobs", "1",
                 "--out", str(out)]) == 0
    df = pd.read_csv(out / "sweep.csv")
    assert (df["status"] == "ok").all() and not df["fits"].any()
    assert main(["report", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert f"**Nothing fits: every simulated configuration runs out of HBM ({len(df)} configurations).**" in md
    assert "## Configurations that fit (0)" in md
    assert f"do not fit HBM ({len(df)})" in md and "nan" not in md.lower()
