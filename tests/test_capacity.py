"""`pipeplan capacity`: depth search per memory policy on the ChronosPipe scenario."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.analysis.cli import main
from pipeplan.sim.config import load_scenario
from pipeplan.solver.capacity import POLICIES, Evaluation, max_layers

SEVENTY = str(scenario_path("llama2-70b-48l-pp8-tp8-a100"))
TINY = str(scenario_path("tiny-cpu"))


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
    assert main(["capacity", SEVENTY, "--policies", ",", "--out", str(tmp_path / "c")]) == 2  # no name at all
    out, err = capsys.readouterr()
    assert "unknown magic; allowed: 1f1b" in err and "needs a [model] scenario" in err
    assert "--policies: give at least one; allowed: 1f1b" in err
    assert f"{', '.join(POLICIES)}\n" in err  # every name allowed, none cut off by the one-line limit
    assert out == ""  # refused before any progress bar: not even an empty line on stdout
    assert not any((tmp_path / name).exists() for name in "abc")


def test_frontier_depths_are_multiples_from_end_to_end():
    from pipeplan.analysis.capacity import frontier_depths

    assert frontier_depths(40, 72, 16, 24) == [32, 48, 64]  # ends rounded down onto multiples of the step
    grid = frontier_depths(48, 832, 16, 8)
    assert grid[0] == 48 and grid[-1] == 832 and len(grid) <= 8 + 2
    assert all(d % 16 == 0 for d in grid) and grid == sorted(set(grid))
    assert frontier_depths(64, 32, 16, 8) == []


class _FakeDepths:
    """A policy whose per-layer throughput falls linearly with depth past 100 layers (and fits to 400)."""

    step = 8
    policy = type("P", (), {"name": "fake"})()

    def __call__(self, layers: int) -> Evaluation:
        from types import SimpleNamespace

        rate = 1.0 if layers <= 100 else 1.0 - (layers - 100) / 600
        return Evaluation(layers, layers <= 400, SimpleNamespace(tokens_per_s=rate * 1000 / layers))


def test_deepest_at_matches_a_scan_of_every_depth():
    from pipeplan.analysis.capacity import deepest_at, frontier_depths, frontier_row

    fits = _FakeDepths()
    rows = [frontier_row("fake", fits(d), 1000.0) for d in frontier_depths(8, 400, 8, 6)]
    for x in (0.99, 0.95, 0.8, 0.5):
        scan = max(d for d in range(8, 401, 8) if fits(d).fits and fits(d).result.tokens_per_s * d / 1000 >= x)
        best = deepest_at(rows, fits, x, 1000.0)
        assert best["layers"] == scan, x
        assert best["layer_throughput_vs_1f1b"] >= x
    assert deepest_at(rows, fits, 1.5, 1000.0) is None


def test_capacity_frontier_cli(tmp_path, capsys):
    out = tmp_path / "cap"
    assert main(["capacity", SEVENTY, "--policies", "v-half", "--frontier", "--points", "3", "--out", str(out)]) == 0
    cap = pd.read_csv(out / "capacity.csv").set_index("policy")
    fr = pd.read_csv(out / "frontier.csv")
    assert list(fr.columns) == ["policy", "layers", "fits", "tokens_per_s", "layer_throughput_vs_1f1b",
                                "micro_batch_size", "variant", "note"]
    assert set(fr["micro_batch_size"]) == {4}  # the scenario's own, when no other is offered
    assert set(fr["policy"]) == {"1f1b", "v-half"}  # 1f1b joins as the reference
    assert (out / "frontier.png").exists()
    ref = cap.loc["1f1b", "tokens_per_s"] * cap.loc["1f1b", "max_layers"]
    for r in fr[fr["fits"]].itertuples():
        assert abs(r.layer_throughput_vs_1f1b - r.tokens_per_s * r.layers / ref) < 1e-9
    vh = fr[fr["policy"] == "v-half"]
    assert vh["layers"].max() == cap.loc["v-half", "max_layers"] and vh["fits"].all()
    one = fr[fr["policy"] == "1f1b"]
    assert list(one["layers"]) == [cap.loc["1f1b", "max_layers"]] and one["layer_throughput_vs_1f1b"].iloc[0] == 1.0
    assert "deepest model at >= 95%" in capsys.readouterr().out
    # the console's answer is kept: per policy the deepest depth at >= 95 %, which the grid need not hold
    depths = [line.split(",")[2] for line in (out / "frontier_answers.csv").read_text().splitlines()[1:]]
    assert all(d.isdigit() for d in depths), depths  # whole numbers, not 48.0
    ans = pd.read_csv(out / "frontier_answers.csv").set_index("policy")
    assert list(ans.index) == ["1f1b", "v-half"] and set(ans["min_throughput"]) == {0.95}
    assert ans.loc["1f1b", "layers"] == cap.loc["1f1b", "max_layers"]
    assert ans.loc["1f1b", "layer_throughput_vs_1f1b"] == 1.0
    best = ans.loc["v-half"]
    assert best["layer_throughput_vs_1f1b"] >= 0.95 and best["layers"] <= cap.loc["v-half", "max_layers"]
    assert best["layers_vs_1f1b"] == best["layers"] / cap.loc["1f1b", "max_layers"]
    assert abs(best["layer_throughput_vs_1f1b"] - best["tokens_per_s"] * best["layers"] / ref) < 1e-9
    assert not any(r.layers > best["layers"] and r.layer_throughput_vs_1f1b >= 0.95
                   for r in fr[(fr["policy"] == "v-half") & fr["fits"]].itertuples())
    # and the report leads with it
    assert main(["report", str(out)]) == 0
    lead = (out / "report.md").read_text().split("\n")[2]
    assert lead.startswith(f"**Deepest model at >= 95% of plain 1F1B's per-layer throughput: {int(best['layers'])} "
                           "layers"), lead
    from pipeplan.analysis.capacity import ANSWER_COLUMNS, answer_rows

    none = pd.DataFrame(answer_rows({"1f1b": None, "v-half": None}, 5.0, 32), columns=ANSWER_COLUMNS)
    assert none["layers"].isna().all()
    none.to_csv(out / "frontier_answers.csv", index=False)
    assert main(["report", str(out)]) == 0
    assert "No policy keeps 500% of plain 1F1B's per-layer throughput" in (out / "report.md").read_text()
    assert main(["capacity", SEVENTY, "--frontier", "--points", "1", "--out", str(tmp_path / "b")]) == 2


def test_joint_chronos_is_at_least_every_v_schedule_and_memory_policy():
    """p = 4, m = 8: chronos chosen jointly (v, admission cap, memory treatment) against the other policies,
    each simulated (or planned) on its own. V-Half's order is one of chronos' variants (its cap as admission cap
    and stash limit at v = 2), as are ZB-V's, 1F1B's and interleaved 1F1B's, and
    the planner may choose any fixed treatment, so none can beat the joint choice (beyond the MILP's 1%
    gap); and the wider search is strictly faster than V-Half where both fit."""
    from pipeplan.solver.capacity import POLICIES, PolicyDepths

    small = {"pipeline.stages": 4, "pipeline.microbatches": 8}
    bounds: dict = {}
    speed = {}
    for layers in (16, 32):
        for name in ("1f1b", "1f1b+recompute", "interleaved-1f1b", "v-half", "zbv", "chronos", "chronos+recomp",
                     "chronos+recomp+offload"):
            ev = PolicyDepths(SEVENTY, small, POLICIES[name], 4, bounds)(layers)
            speed[name, layers] = ev.result.tokens_per_s if ev.fits else 0.0
            if POLICIES[name].joint and ev.fits:
                assert ev.variant.startswith(("v=1 1f1b", "v=2 ", "v=3 interleaved-1f1b", "v=4 "))
        best = speed["chronos+recomp+offload", layers]
        assert best > 0
        plain = ("1f1b", "interleaved-1f1b", "v-half", "zbv")
        assert speed["chronos", layers] >= max(speed[n, layers] for n in plain)  # their orders too
        for other in (*plain, "1f1b+recompute", "chronos", "chronos+recomp"):
            assert best >= speed[other, layers] * (1 - 1e-2), (other, layers)
    assert speed["chronos", 16] > speed["v-half", 16] > 0


def test_chronos_takes_the_loop_placed_orders_where_a_v_holds_too_much_on_rank_0():
    """Default 8B scenario (p = 4, m = 8): a V puts the embedding and the LM head on rank 0, so at 40 layers no
    V-shaped order keeps everything as fast as interleaved 1F1B, and at 44 none fits where 1F1B does; the joint
    search tries their orders too, so `chronos` is at least both (before: 14,122 against 23,308 tokens/s at 40
    layers, and no fit at 44); at 40 layers interleaved 1F1B's order at v = 4 (more chunks per rank, a
    smaller bubble) fits too and is strictly faster than the interleaved policy's v = 2."""
    from pipeplan.solver.capacity import POLICIES, evaluate

    full = {"memory.hbm_margin_gib": 0.0}  # these depths are the ones that fit the whole 80 GB (no margin)
    for layers, other, chosen in ((40, "interleaved-1f1b", "v=4 interleaved-1f1b"), (44, "1f1b", "v=1 1f1b")):
        ref = evaluate(None, full, POLICIES[other], layers)
        ev = evaluate(None, full, POLICIES["chronos"], layers)
        assert ref.fits and ev.fits and ev.variant == chosen
        if layers == 40:
            assert ev.result.tokens_per_s > ref.result.tokens_per_s  # more chunks per rank: a smaller bubble
        else:
            assert ev.result.tokens_per_s == ref.result.tokens_per_s  # 1F1B's own order at its own speed


def test_v_half_s_order_is_one_of_the_chronos_variants():
    """What makes `chronos` >= `v-half` hold by construction: V-Half's cap as admission cap and stash limit at
    v = 2 is a variant the joint search tries, and it builds exactly v-half's order."""
    from pipeplan.sim.schedules import build_schedule
    from pipeplan.sim.schedules.v_shape import v_half_limit
    from pipeplan.solver.capacity import chronos_variants

    for p, m in [(3, 6), (4, 8), (8, 32)]:
        half = v_half_limit(p)
        var = {"pipeline.virtual_stages": 2, "pipeline.admission_cap": half, "pipeline.stash_limit": half}
        assert var in chronos_variants(p, m, 2 * p)
        assert build_schedule("chronos", p, m, 2, half, half).ranks == build_schedule("v-half", p, m, 2).ranks


def test_the_joint_search_builds_every_order_on_both_clocks_and_plans_the_caps_up_to_chronos_own():
    """With chronos' own cap on the step's costs given per v, each order is tried on unit costs and on the
    step's costs; the MILP runs on the caps from V-Half's up to the order's own clock's chronos cap, with or
    without a W stash, and on a full B's own cap."""
    from pipeplan.sim.schedules.v_shape import chronos_plan
    from pipeplan.solver.capacity import (
        chronos_variants,
        planned_variant,
        standard_orders,
        timed_own_caps,
        variant_label,
    )

    p, m = 4, 8
    timed = timed_own_caps(None, {"pipeline.stages": p, "pipeline.microbatches": m}, p, m, 4 * p)
    assert set(timed) == {2, 4}
    assert all(own.full_b > own.split for own in timed.values())
    variants = chronos_variants(p, m, 4 * p, timed)
    orders = standard_orders()  # the default's: ZB-V's, 1F1B's and interleaved 1F1B's at v = 2, 3, 4
    assert all(v in variants for v in chronos_variants(p, m, 4 * p))  # the unit-cost orders, as before
    on_costs = [v for v in variants if v.get("pipeline.order_timing") == "costs"]
    assert {v["pipeline.admission_cap"] for v in on_costs if v["pipeline.virtual_stages"] == 2} >= {timed[2].split, 6}
    assert {"pipeline.virtual_stages": 2, "pipeline.admission_cap": timed[2].full_b, "pipeline.stash_limit": 0,
            "pipeline.order_timing": "costs"} in on_costs
    assert all(variant_label(v).endswith("timed") for v in on_costs)
    assert len({variant_label(v) for v in variants}) == len(variants)  # one label per order: the cache's key
    for v in (3, 4):
        assert {"pipeline.schedule": "interleaved-1f1b", "pipeline.virtual_stages": v} in orders
    for order in orders:  # ZB-V's, 1F1B's and interleaved 1F1B's (v = 2, 3, 4) own orders, each planned
        assert order in variants and planned_variant(p, m, order, timed)
    for var in (v for v in variants if v not in orders):
        v, cap = var["pipeline.virtual_stages"], var["pipeline.admission_cap"]
        full_b = var.get("pipeline.stash_limit") == 0
        caps = timed[v] if var in on_costs else None
        split = caps.split if caps else chronos_plan(p, m, v)[0]
        own_full_b = caps.full_b if caps else chronos_plan(p, m, v, full_b=True)[0]
        planned = v * 3 <= cap <= split or (full_b and cap == own_full_b)  # V-Half's 3 microbatches at p = 4
        assert planned_variant(p, m, var, timed) == planned


def test_the_lp_bound_skips_only_plans_that_cannot_win():
    """p = 4, m = 8: the planner's bound from its MILP's LP relaxation is never below what the MILP's plan runs
    in simulation (0 exactly when no plan fits), so skipping the orders it rules out keeps the answer of the
    search that plans every one of them."""
    from pipeplan.solver.capacity import (
        KEEP,
        POLICIES,
        Policy,
        chronos_variants,
        evaluate,
        planned_variant,
        planner_bound,
        planner_treatment,
        timed_own_caps,
    )

    small = {"pipeline.stages": 4, "pipeline.microbatches": 8}
    policy = POLICIES["chronos+recomp+offload"]
    treatment = tuple(sorted(policy.overrides.items()))
    for layers in (16, 32):
        timed = timed_own_caps(SEVENTY, small, 4, 8, layers)
        speeds = []
        for var in chronos_variants(4, 8, layers, timed):
            v, schedule = var["pipeline.virtual_stages"], var.get("pipeline.schedule", "chronos")
            keep = evaluate(SEVENTY, {**small, **var}, Policy("keep", schedule, v, dict(KEEP)), layers)
            speeds.append(keep.result.tokens_per_s if keep.fits else 0.0)
            if not planned_variant(4, 8, var, timed):
                continue
            how = dict(planner_treatment(treatment, var))
            plan = evaluate(SEVENTY, {**small, **var}, Policy("plan", schedule, v, how), layers)
            bound = planner_bound(SEVENTY, {**small, **var}, Policy("plan", schedule, v, how), layers, keep.result)
            assert bound > 0 if plan.fits else bound in (0.0, math.inf), (layers, var)  # inf: no optimum
            if plan.fits:
                assert plan.result.tokens_per_s <= bound, (layers, var)
                speeds.append(plan.result.tokens_per_s)
        joint = evaluate(SEVENTY, small, policy, layers)
        assert joint.fits and joint.result.tokens_per_s == max(speeds)


def test_a_timed_out_milp_is_reported_not_counted_as_no_fit(monkeypatch):
    """The MILP's safety time limit says nothing about the depth: the evaluation is `unknown`, and the capacity
    row says its max_layers is a lower bound and where the search was cut, instead of a silent "no fit"."""
    import pipeplan.solver.capacity as capacity
    from pipeplan.analysis.capacity import capacity_table
    from pipeplan.solver.capacity import POLICIES, evaluate
    from pipeplan.solver.errors import SolverTimeoutError

    real = capacity.resolve_memory_plan
    plain = capacity_table(SEVENTY, ["1f1b"])[0]
    cut = plain["max_layers"] // 2  # from here on, pretend the MILP times out

    def slow(sc, costs, schedule, *a, **kw):
        if sc.model.layers > cut:
            raise SolverTimeoutError("memory MILP: ran past its safety time limit")
        return real(sc, costs, schedule, *a, **kw)

    monkeypatch.setattr(capacity, "resolve_memory_plan", slow)
    ev = evaluate(SEVENTY, {}, POLICIES["1f1b"], plain["max_layers"])
    assert (ev.fits, ev.unknown) == (False, True) and "timed out" in ev.note
    row = capacity_table(SEVENTY, ["1f1b"])[0]
    assert row["max_layers"] <= cut < plain["max_layers"]
    assert row["note"].startswith("max_layers is a lower bound: the MILP timed out at")
    assert plain["note"] == ""


def test_the_stash_moving_policy_is_opt_in_and_plans_where_the_default_planner_does():
    """`chronos+recomp+offload+stash` runs only when named (its MILPs take tens of seconds at deep depths), and
    on a small case it fits wherever `chronos+recomp+offload` does, at a speed within the MILP's 1% gap of it
    or better (its plan space holds the other's)."""
    from pipeplan.solver.capacity import DEFAULT_POLICIES, POLICIES, PolicyDepths

    stash = POLICIES["chronos+recomp+offload+stash"]
    assert stash.name not in DEFAULT_POLICIES and "chronos+recomp+offload" in DEFAULT_POLICIES
    assert stash.overrides["memory.offload_stash"] == "auto"
    small = {"pipeline.stages": 4, "pipeline.microbatches": 8}
    plain = PolicyDepths(SEVENTY, small, POLICIES["chronos+recomp+offload"], 4, {})(32)
    moved = PolicyDepths(SEVENTY, small, stash, 4, {})(32)
    assert plain.fits and moved.fits
    assert moved.result.tokens_per_s >= plain.result.tokens_per_s * (1 - 1e-2)



def test_the_layer_copy_policy_is_opt_in_and_at_least_as_fast():
    """`chronos+recomp+offload+stash+layers` runs only when named; on the small case it fits where the stash
    policy does, and no slower beyond the planner's 2% (layer-wise copies never delay a step, and its MILP
    prices them)."""
    from pipeplan.solver.capacity import DEFAULT_POLICIES, POLICIES, PolicyDepths

    layers, stash = POLICIES["chronos+recomp+offload+stash+layers"], POLICIES["chronos+recomp+offload+stash"]
    assert layers.name not in DEFAULT_POLICIES and layers.overrides["memory.copy_granularity"] == "layer"
    small = {"pipeline.stages": 4, "pipeline.microbatches": 8}
    moved = PolicyDepths(SEVENTY, small, stash, 4, {})(32)
    by_layer = PolicyDepths(SEVENTY, small, layers, 4, {})(32)
    assert moved.fits and by_layer.fits
    assert by_layer.result.tokens_per_s >= moved.result.tokens_per_s * (1 - 2e-2)


def test_chronos_fits_2_4x_plain_1f1b_s_depth_at_95_percent_of_its_per_layer_throughput():
    """Issue #18's first target on the shipped ChronosPipe setting (docs/memory.md): plain 1F1B's deepest fit is
    32 layers; at 80 (2.5×) the default planner's plan on chronos' v = 4, cap-24 order built on the step's costs
    fits HBM on every rank and runs ≥ 95% of 1F1B's per-layer throughput (0.972 when measured)."""
    from pipeplan.solver.capacity import POLICIES, Policy, evaluate, variant_label

    plain = evaluate(SEVENTY, {}, POLICIES["1f1b"], 32)
    assert plain.fits and not evaluate(SEVENTY, {}, POLICIES["1f1b"], 48).fits
    var = {"pipeline.virtual_stages": 4, "pipeline.admission_cap": 24, "pipeline.order_timing": "costs"}
    planner = POLICIES["chronos+recomp+offload"]
    ev = evaluate(SEVENTY, var, Policy(planner.name, "chronos", 4, planner.overrides), 80)
    assert variant_label(var) == "v=4 cap=24 timed"
    assert ev.fits and not ev.result.oom_over_limit
    ratio = ev.result.tokens_per_s * 80 / (plain.result.tokens_per_s * 32)
    assert ratio >= 0.95, ratio


def test_worker_processes_give_the_serial_answer():
    """--jobs: each policy's search in its own process, the target and frontier depths spread over them; every
    row (floats included) and the depths evaluated are those of the serial run."""
    from pipeplan.analysis.capacity import capacity_table, frontier_table

    policies = ["1f1b", "v-half"]
    runs = {}
    for jobs in (1, 2):
        depths: dict = {}
        rows = capacity_table(SEVENTY, policies, depths=depths, jobs=jobs)
        runs[jobs] = (rows, frontier_table(rows, depths, 3, jobs=jobs),
                      {n: sorted(d.evaluated()) for n, d in depths.items()})
    assert runs[1] == runs[2]
    assert len(runs[2][1]) > len(policies)  # the frontier has depths to spread


def test_micro_batch_sizes_take_the_fastest_cut_that_fits_with_the_reference_following(tmp_path):
    """--micro-batch-sizes: at every depth each policy takes the fastest of the sizes that fits, the global batch
    (32 x 4 sequences) fixed; plain 1F1B's reference follows. Each row is the best of the separate runs."""
    from pipeplan.analysis.capacity import capacity_table

    policies = ["1f1b", "1f1b+recompute"]
    alone = {size: {r["policy"]: r for r in capacity_table(SEVENTY, policies, overrides={
        "training.micro_batch_size": size, "pipeline.microbatches": 128 // size})} for size in (4, 2)}
    out = tmp_path / "cap"
    assert main(["capacity", SEVENTY, "--policies", ",".join(policies), "--micro-batch-sizes", "4,2",
                 "--out", str(out)]) == 0
    df = pd.read_csv(out / "capacity.csv").set_index("policy")
    for name in policies:
        deepest = max(alone[s][name]["max_layers"] for s in (4, 2))
        assert df.loc[name, "max_layers"] == deepest
        at_deepest = {s: alone[s][name] for s in (4, 2) if alone[s][name]["max_layers"] == deepest}
        size = max(at_deepest, key=lambda s: at_deepest[s]["tokens_per_s"])
        assert df.loc[name, "micro_batch_size"] == size
        assert df.loc[name, "tokens_per_s"] == pytest.approx(at_deepest[size]["tokens_per_s"], rel=1e-12)
    assert alone[2]["1f1b"]["max_layers"] > alone[4]["1f1b"]["max_layers"]  # half the activations per microbatch
    assert df.loc["1f1b", "layers_vs_1f1b"] == 1.0  # the reference is 1F1B at its own best cut
    ref = df.loc["1f1b", "tokens_per_s"] * df.loc["1f1b", "max_layers"]
    assert df.loc["1f1b+recompute", "layer_throughput_vs_1f1b"] == pytest.approx(
        df.loc["1f1b+recompute", "layer_tokens_per_s"] / ref)


def test_micro_batch_sizes_are_checked_before_any_work(tmp_path, capsys):
    for i, sizes in enumerate(("3", "4,x", "0", "2,256")):
        assert main(["capacity", SEVENTY, "--policies", "1f1b,zbv", "--micro-batch-sizes", sizes,
                     "--out", str(tmp_path / str(i))]) == 2
    err = capsys.readouterr().err
    assert "--micro-batch-sizes: 3 does not divide the global batch of 128 sequences (32 x 4); allowed: 1, 2, 4" in err
    assert "--micro-batch-sizes: '4,x'; give positive integers" in err
    assert "--micro-batch-sizes: 256 does not divide" in err
    assert "Traceback" not in err and not any(tmp_path.iterdir())


def test_interleaved_v_widens_the_joint_policies_loop_placed_orders(tmp_path):
    """--interleaved-v 2,3,4,6: the joint chronos policies also try interleaved 1F1B's order at v = 6 (planned,
    labelled), the other policies are untouched, and the journal keeps the two searches apart."""
    from pipeplan.analysis.capacity_journal import Journal
    from pipeplan.solver.capacity import (
        INTERLEAVED_V,
        PolicyDepths,
        chronos_variants,
        planned_variant,
        resolved_policy,
        timed_own_caps,
        variant_label,
    )

    p, m, layers = 4, 8, 24
    six = {"pipeline.schedule": "interleaved-1f1b", "pipeline.virtual_stages": 6}
    timed = timed_own_caps(None, {"pipeline.stages": p, "pipeline.microbatches": m}, p, m, layers)
    assert INTERLEAVED_V == (2, 3, 4) and six not in chronos_variants(p, m, layers, timed)
    wide = chronos_variants(p, m, layers, timed, (2, 3, 4, 6))
    assert six in wide and planned_variant(p, m, six, timed) and variant_label(six) == "v=6 interleaved-1f1b"
    assert all(v in wide for v in chronos_variants(p, m, layers, timed))
    assert six not in chronos_variants(p, m, 20, timed, (2, 3, 4, 6))  # 20 layers: a chunk of 24 would be empty
    base = load_scenario(SEVENTY)
    policies = [resolved_policy(n, base, (2, 3, 4, 6)) for n in ("1f1b", "chronos", "chronos+recomp+offload")]
    assert [q.interleaved_v for q in policies] == [INTERLEAVED_V, (2, 3, 4, 6), (2, 3, 4, 6)]
    journal = Journal(tmp_path, {})
    keys = {PolicyDepths(SEVENTY, {}, q, 8, journal=journal).key
            for q in (POLICIES["chronos"], resolved_policy("chronos", base, (2, 3, 4, 6)))}
    assert len(keys) == 2


def test_the_planner_recomputes_the_norms_only_where_that_frees_them():
    """memory.recompute_norms in the planner's policies, dropped once per run where torch's TP keeps gathered
    norm outputs (tp_style "dtensor" with SP), which the scenario would refuse the flag for."""
    from pipeplan.solver.capacity import resolved_policy

    plain = resolved_policy("chronos+recomp+offload", load_scenario(SEVENTY))
    gathered = resolved_policy("chronos+recomp+offload", load_scenario(
        SEVENTY, {"parallel.tp_style": "dtensor", "parallel.sequence_parallel": True}))
    assert plain.overrides["memory.recompute_norms"] is True
    assert gathered.overrides["memory.recompute_norms"] is False
    assert {k: v for k, v in gathered.overrides.items() if k != "memory.recompute_norms"} == {
        k: v for k, v in plain.overrides.items() if k != "memory.recompute_norms"}


def test_a_policy_named_twice_runs_once(tmp_path, capsys):
    """The fuzz campaign of 2026-12-06 (seed 20261207): `--policies 1f1b,1f1b+recompute,1f1b --frontier` wrote its
    outputs, then failed on the console table's duplicate row with an unexpected TypeError."""
    out = tmp_path / "dup"
    assert main(["capacity", TINY, "--policies", "1f1b,1f1b+recompute,1f1b", "--jobs", "1", "--frontier",
                 "--points", "2", "--out", str(out)]) == 0
    assert list(pd.read_csv(out / "capacity.csv")["policy"]) == ["1f1b", "1f1b+recompute"]
    assert "Traceback" not in capsys.readouterr().err


def test_interleaved_v_is_checked_before_any_work(tmp_path, capsys):
    for i, vs in enumerate(("1", "2,x", "33")):
        assert main(["capacity", SEVENTY, "--policies", "chronos", "--interleaved-v", vs,
                     "--out", str(tmp_path / str(i))]) == 2
    err = capsys.readouterr().err
    assert err.count("--interleaved-v: ") == 3 and "give chunks per rank from 2 to 32" in err
    assert len(err.strip().splitlines()) == 3 and "Traceback" not in err and not any(tmp_path.iterdir())


def test_the_planner_bounds_orders_lazily_best_first_and_finds_the_best_plan(monkeypatch):
    """With made-up speeds (every order's keep-everything step, fitting or not, its MILP's plan, and an LP bound
    between the two),
    the joint search returns the fastest of every kept and every planned candidate, as planning every order
    would, while it solves the LP bound only for the orders that reach the head of its queue."""
    import zlib

    import pipeplan.solver.capacity as capacity
    from pipeplan.solver.capacity import POLICIES, Evaluation, Outcome, planned_variant, timed_own_caps

    def speed(var: dict, salt: str) -> float:  # deterministic, distinct per order
        return 1000.0 + zlib.crc32((salt + repr(sorted(var.items()))).encode()) % 1000

    def keep_fits(var: dict) -> bool:  # keeping everything fits in a quarter of the orders, and they are slow
        return speed(var, "fits") % 4 == 0

    def keep_speed(var: dict) -> float:
        return speed(var, "keep") % 200 + (1000.0 if keep_fits(var) else 1500.0)

    def fake_evaluate(sc_path, overrides, policy, layers, bounds=None, floor=0.0, say=None):
        var = {k: v for k, v in overrides.items() if k.startswith("pipeline.")}
        fits = policy.planner or keep_fits(var)
        tps = keep_speed(var) - (speed(var, "cut") % 300 if policy.planner else 0.0)
        return Evaluation(layers, fits, Outcome(tps, 1.0, None, np.zeros(1), not fits))

    bounded = []

    def fake_bound(sc_path, overrides, policy, layers, keep):
        var = {k: v for k, v in overrides.items() if k.startswith("pipeline.")}
        bounded.append(repr(sorted(var.items())))
        planned = fake_evaluate(sc_path, overrides, policy, layers).result.tokens_per_s
        return planned + (keep.tokens_per_s - planned) * (speed(var, "bound") % 100) / 100  # in [planned, keep]

    monkeypatch.setattr(capacity, "evaluate", fake_evaluate)
    monkeypatch.setattr(capacity, "planner_bound", fake_bound)
    small = {"pipeline.stages": 4, "pipeline.microbatches": 8}
    policy, layers = POLICIES["chronos+recomp+offload"], 32
    said: list[str] = []  # the progress line: which order's LP bound or MILP runs, and what it planned
    ev = capacity._evaluate_joint(SEVENTY, small, policy, layers, {}, say=said.append)
    timed = timed_own_caps(SEVENTY, small, 4, 8, layers)
    variants = capacity.chronos_variants(4, 8, layers, timed, policy.interleaved_v)
    planned = [v for v in variants if planned_variant(4, 8, v, timed)]
    every = [keep_speed({**small, **v}) for v in variants if keep_fits({**small, **v})]
    every += [fake_evaluate(SEVENTY, {**small, **v}, replace(policy, overrides={"memory.plan": True}), layers)
              .result.tokens_per_s for v in planned]
    assert ev.result.tokens_per_s == max(every)
    assert 1 <= len(bounded) < len(planned)
    assert sum(line.endswith(": LP bound") for line in said) == len(bounded)
    assert any(": MILP (bound " in line for line in said) and any(" tokens/s" in line for line in said)
    assert all(line.startswith(f"chronos+recomp+offload at {layers} layers, v=") for line in said)


def _talking_job(n: int, say) -> int:
    """A worker's evaluation stand-in: says three lines, returns a number."""
    for i in range(3):
        say(f"job {n} line {i}")
    return 10 * n


def test_worker_processes_report_progress_as_they_go():
    """What workers say (the policy, depth, order and MILP of the evaluation they run) reaches the parent's
    progress display, every line, through the managed queue."""
    from pipeplan.solver.capacity import _in_workers

    heard: list[str] = []
    assert dict(_in_workers(2, {n: (_talking_job, (n,)) for n in range(3)}, heard.append)) == {0: 0, 1: 10, 2: 20}
    assert sorted(heard) == sorted(f"job {n} line {i}" for n in range(3) for i in range(3))
