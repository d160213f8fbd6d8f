"""Scenario validation: every kind of bad input is one ScenarioError naming the field and what is allowed."""

from __future__ import annotations

import tomllib

import pytest
from pipeplan.scenarios import scenario_names, scenario_path

from pipeplan.sim.config import load_scenario, parse_scenario
from pipeplan.sim.errors import ScenarioError

COSTS = "[costs]\nforward_s = 1.0\nbackward_input_s = 1.0\nbackward_weight_s = 1.0\nactivation_bytes = 1.0\n"
INT_ERR = r"pipeline\.stages: input should be a valid integer"
MODEL = "[model]\nlayers = 8\nhidden = 64\nffn_hidden = 176\nheads = 4\nkv_heads = 2\nvocab = 100\nseq_len = 16\n"


def pipeline(stages=4, microbatches=8, schedule="1f1b", v=1) -> str:
    return (
        f'[pipeline]\nstages = {stages}\nmicrobatches = {microbatches}\nschedule = "{schedule}"\n'
        f"virtual_stages = {v}\n"
    )


def parse(text: str):
    return parse_scenario(tomllib.loads(text))


def test_issue_explicit_shape_loads():
    sc = parse(pipeline() + COSTS + "p2p_s = 0.0\n")
    assert sc.costs.forward_s == 1.0 and sc.model is None


@pytest.mark.parametrize("name", scenario_names())
def test_shipped_scenarios_load(name):
    sc = load_scenario(scenario_path(name))
    assert sc.pipeline.stages >= 1


def test_default_scenario_is_the_8b_one():
    assert load_scenario().model.name == "llama3-8b"


@pytest.mark.parametrize(
    "text,expected",
    [
        (pipeline(stages=0) + COSTS, r"pipeline\.stages: input should be greater than 0 \(got 0\)"),
        (pipeline(schedule="foo") + COSTS, r"pipeline\.schedule: unknown schedule 'foo'; allowed: .*gpipe.*zbv"),
        (pipeline() + COSTS.replace("forward_s = 1.0", 'forward_s = "x"'), r"costs\.forward_s"),
        (pipeline() + COSTS + "forwad_s = 2\n", r"costs\.forwad_s: unknown key; allowed: forward_s, "),
        (pipeline() + COSTS.replace("forward_s = 1.0\n", ""), r"costs\.forward_s: missing required key"),
        (pipeline() + COSTS.replace("forward_s = 1.0", "forward_s = [1, 2, 3]"), r"costs\.forward_s: has 3 values"),
        (pipeline() + COSTS.replace("forward_s = 1.0", "forward_s = -1.0"),
         r"costs\.forward_s: input should be greater than or equal to 0 \(got -1\.0\)"),
        (pipeline() + COSTS.replace("forward_s = 1.0", 'forward_s = [1, "a", 1, 1]'),
         r"costs\.forward_s\.1: input should be a valid number \(got 'a'\)"),
        (pipeline(), r"give exactly one of \[costs\]"),
        (pipeline() + COSTS + MODEL, r"give exactly one of \[costs\]"),
        (pipeline(stages=3) + MODEL.replace("layers = 8", "layers = 2"),
         r"model\.layers: 2 layers cannot fill pipeline\.stages \* pipeline\.virtual_stages = 3 chunks"),
        (pipeline() + "layers_per_stage = [4, 4, 1, 0]\n" + MODEL,
         r"pipeline\.layers_per_stage: sums to 9; must sum to model\.layers = 8"),
        (pipeline() + "layers_per_stage = [4, 4]\n" + MODEL, r"pipeline\.layers_per_stage: has 2 entries"),
        (pipeline() + MODEL.replace("kv_heads = 2", "kv_heads = 3"), r"model\.kv_heads: 3 must divide heads"),
        (pipeline() + MODEL + '[device]\npreset = "TPU"\n', r"device\.preset: unknown device 'TPU'; allowed: H100"),
        (pipeline() + MODEL + "[freeze]\ncap = 1.5\n", r"freeze\.cap: input should be less than or equal to 1"),
        (pipeline().replace("stages = 4", "stages = true") + COSTS, INT_ERR),
        (pipeline().replace("stages = 4", 'stages = "4"') + COSTS, INT_ERR),
        ("[pipelin]\nstages = 1\n", r"pipelin: unknown key; allowed: pipeline, costs, model"),
        (pipeline() + MODEL + '[training]\ndtype = "int8"\n',
         r"training\.dtype: input should be 'bf16', 'fp16', 'fp32' or 'fp8'"),
    ],
)
def test_bad_scenarios_name_the_field(text, expected):
    with pytest.raises(ScenarioError, match=expected) as info:
        parse(text)
    assert "\n" not in str(info.value)


def test_schedule_sizes_are_checked_when_the_schedule_is_built():
    from pipeplan.sim.step import resolve_schedule

    sc = parse(pipeline(schedule="zbv", v=1) + COSTS)
    from pipeplan.sim.errors import ScheduleError

    with pytest.raises(ScheduleError, match="virtual_stages"):
        resolve_schedule(sc)


def test_missing_and_non_toml_files(tmp_path):
    with pytest.raises(ScenarioError, match="file not found"):
        load_scenario(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[pipeline\nstages = 1")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(bad)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(binary)


def test_overrides_apply_dotted_keys():
    sc = load_scenario(scenario_path("explicit-unit"), {"pipeline.schedule": "gpipe", "costs.p2p_s": 0.5})
    assert sc.pipeline.schedule == "gpipe" and sc.costs.p2p_s == 0.5


def test_a_bad_override_is_blamed_on_the_override_not_the_file(tmp_path):
    """`--set pipeline.microbatches=abc` is not an error of the scenario file, which holds a good value."""
    unit = scenario_path("explicit-unit")
    with pytest.raises(ScenarioError) as info:
        load_scenario(unit, {"pipeline.microbatches": "abc"})
    assert str(info.value) == "override pipeline.microbatches: input should be a valid integer (got 'abc')"
    bad = tmp_path / "bad.toml"
    bad.write_text(unit.read_text().replace("microbatches = 8", "microbatches = 0"))
    with pytest.raises(ScenarioError, match=f"^{bad}: pipeline.microbatches: input should be greater than 0"):
        load_scenario(bad, {"pipeline.schedule": "gpipe"})  # the file's own error still names the file


def test_p2p_blocking_reaches_the_cost_table_in_both_forms():
    """interconnect.p2p_blocking is runtime semantics, so it applies to explicit [costs] as to a model."""
    from pipeplan.sim.costs import build_cost_table

    explicit = load_scenario(scenario_path("explicit-unit"), {"interconnect.p2p_blocking": True})
    model = load_scenario(scenario_path("llama3-8b-pp4-h100"), {"interconnect.p2p_blocking": True})
    assert build_cost_table(explicit).p2p_blocking and build_cost_table(model).p2p_blocking
    assert not build_cost_table(load_scenario(scenario_path("explicit-unit"))).p2p_blocking


def test_optimizer_post_validation_reaches_the_cost_table_in_both_forms():
    """training.optimizer_post_validation is runtime semantics (no end-of-step barrier), for [costs] as for a
    model; off by default (Megatron-LM's all-reduce before the optimizer step)."""
    from pipeplan.sim.costs import build_cost_table

    key = {"training.optimizer_post_validation": True}
    explicit = load_scenario(scenario_path("explicit-unit"), key)
    model = load_scenario(scenario_path("llama3-8b-pp4-h100"), key)
    assert build_cost_table(explicit).post_validation and build_cost_table(model).post_validation
    assert not build_cost_table(load_scenario(scenario_path("explicit-unit"))).post_validation
