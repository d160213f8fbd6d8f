"""`pipeplan capacity`'s tables: per policy the deepest model that fits and how fast, the depth/speed frontier and
its answers, built on the capacity search (solver.capacity: policies, evaluations, the MILP-bounded joint
search, the depth search), which the CLI and other searches import from there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from pipeplan.sim.errors import ScenarioError
from pipeplan.solver.capacity import (
    INTERLEAVED_V,
    Evaluation,
    EvaluationJournal,
    PolicyDepths,
    _search_all,
    batch_overrides,
    checked_scenario,
    evaluate_all,
    max_layers,
    model_params,
    resolved_policy,
)


def capacity_table(
    sc_path: str | None,
    policies: list[str],
    progress: Callable[[str], None] | None = None,
    target_ratio: float = 2.4,
    depths: dict[str, PolicyDepths] | None = None,
    overrides: dict[str, Any] | None = None,
    detail: Callable[[str], None] | None = None,
    jobs: int = 1,
    micro_batch_sizes: Iterable[int] = (),
    journal: EvaluationJournal | None = None,
    interleaved_v: tuple[int, ...] = INTERLEAVED_V,
) -> list[dict]:
    """One row per policy: max layers and params that fit, throughput there, the scenario's own depth, and
    the depth `target_ratio` x plain 1F1B's maximum (ChronosPipe's 2.4x claim): fits there, and how fast.
    `depths` (filled here when given) keeps every evaluation for a later frontier; `overrides` (--set) apply
    under every policy; `detail` hears of every depth evaluated; `jobs` > 1 runs the evaluations in that many
    processes (module docstring); `micro_batch_sizes` lets every policy, plain 1F1B's reference included,
    take the fastest of these sizes that fits at each depth, the global batch fixed (`evaluate_sizes`); a
    `journal` supplies the evaluations of an earlier run with the same inputs and records every new one; the
    joint policies try interleaved 1F1B's order at each v of `interleaved_v` (`resolved_policy`)."""
    base = checked_scenario(sc_path, policies, overrides)
    keep = {**(overrides or {}), "memory.hbm_margin_gib": base.memory.hbm_margin_gib}
    depths = {} if depths is None else depths
    bounds: dict = {}
    own = base.model.layers
    sizes = tuple(dict.fromkeys(micro_batch_sizes))
    for size in sizes:  # refused before any work
        batch_overrides(base, size)
    for name in policies:
        depths.setdefault(name, PolicyDepths(sc_path, keep, resolved_policy(name, base, interleaved_v),
                                             base.pipeline.stages, bounds, detail, sizes, journal))
    if jobs > 1:
        _search_all({n: depths[n] for n in policies}, own, jobs, detail)
    rows = []
    for name in policies:
        if progress:
            progress(name)
        fits = depths[name]
        best = max_layers(fits, fits.step)
        at_own = fits(own) if own % fits.step == 0 else None
        row: dict[str, Any] = {"policy": name, "schedule": fits.policy.schedule,
                               "virtual_stages": fits.policy.virtual_stages}
        if best is None or best.result is None:
            row |= {"max_layers": 0, "params": 0}
        else:
            r = best.result
            row |= {
                "max_layers": best.layers,
                "params": model_params(base, best.layers),
                "tokens_per_s": r.tokens_per_s,
                "layer_tokens_per_s": r.tokens_per_s * best.layers,
                "peak_hbm_bytes": float(r.peak_hbm_bytes.max()),
                "makespan_s": r.makespan_s,
                "mfu": r.mfu,
                "micro_batch_size": best.micro_batch_size,
                "variant": best.variant,
            }
        unknown = sorted(d for d, ev in fits.evaluated().items() if ev.unknown)
        notes = [f"max_layers is a lower bound: the MILP timed out at {', '.join(map(str, unknown))} layers"
                 ] if unknown else []
        if best is not None and best.note and not best.unknown:
            notes.append(best.note)
        row["note"] = "; ".join(notes)
        row["scenario_layers"] = own
        row["fits_scenario_layers"] = bool(at_own.fits) if at_own is not None else None
        if at_own is not None and at_own.result is not None:
            row["scenario_peak_hbm_bytes"] = float(at_own.result.peak_hbm_bytes.max())
            row["scenario_tokens_per_s"] = at_own.result.tokens_per_s
        rows.append(row)
    ref = next((r for r in rows if r["policy"] == "1f1b" and r["max_layers"]), None)
    for r in rows:
        if ref and r["max_layers"]:
            r["layers_vs_1f1b"] = r["max_layers"] / ref["max_layers"]
            r["layer_throughput_vs_1f1b"] = r["layer_tokens_per_s"] / ref["layer_tokens_per_s"]
    if ref:
        targets = {r["policy"]: depths[r["policy"]].round_up(target_ratio * ref["max_layers"]) for r in rows}
        from pipeplan.sim.errors import PipeplanError
        from pipeplan.sim.limits import MAX_LAYERS

        if max(targets.values()) > MAX_LAYERS:  # the user set the ratio, not model.layers: name the ratio
            raise PipeplanError(f"--target-ratio {target_ratio:g}: {target_ratio:g} x 1F1B's deepest fit "
                                f"({ref['max_layers']} layers) is above the limit of {MAX_LAYERS:,} layers; give a "
                                "smaller ratio (the depths evaluated are kept in the journal)")
        evaluate_all(depths, targets.items(), jobs, detail)
        for r in rows:
            fits = depths[r["policy"]]
            target = targets[r["policy"]]
            ev = fits(target)
            r["target_layers"] = target
            r["fits_target"] = ev.fits
            if ev.fits and ev.result is not None:
                r["target_layer_throughput_vs_1f1b"] = ev.result.tokens_per_s * target / ref["layer_tokens_per_s"]
    return rows


# ---- the depth/speed frontier (`pipeplan capacity --frontier`) --------------------------------------------
FRONTIER_COLUMNS = ["policy", "layers", "fits", "tokens_per_s", "layer_throughput_vs_1f1b", "micro_batch_size",
                    "variant", "note"]


def frontier_depths(lo: int, hi: int, step: int, points: int) -> list[int]:
    """Multiples of `step` from `lo` to `hi`: all of them when there are at most `points`, else `points`
    of them spaced evenly in log(depth) (depth ranges span 20x and more), both ends included."""
    lo, hi = max(step, lo - lo % step), hi - hi % step
    if hi < lo:
        return []
    count = (hi - lo) // step + 1
    if count <= points:
        return list(range(lo, hi + 1, step))
    grid = np.geomspace(lo, hi, points)
    return sorted({round(float(d) / step) * step for d in grid} | {lo, hi})


def frontier_table(rows: list[dict], depths: dict[str, PolicyDepths], points: int = 24,
                   progress: Callable[[str], None] | None = None, jobs: int = 1,
                   detail: Callable[[str], None] | None = None) -> list[dict]:
    """Per policy, every depth (or a log grid of `points`) from plain 1F1B's deepest fit (or the policy's
    own, if shallower) to the policy's deepest fit: fits, tokens/s, and tokens/s x layers relative to plain
    1F1B at its own deepest fit (the "comparable throughput" reading of ChronosPipe's claims). `jobs` > 1
    evaluates the grid in that many processes first."""
    ref = next((r for r in rows if r["policy"] == "1f1b" and r["max_layers"]), None)
    if ref is None:
        raise ScenarioError("capacity --frontier: needs the 1f1b policy and a depth at which it fits")
    grid = {}
    for r in rows:
        if r["max_layers"]:
            fits = depths[r["policy"]]
            lo = min(fits.round_up(ref["max_layers"]), r["max_layers"])
            grid[r["policy"]] = frontier_depths(lo, r["max_layers"], fits.step, points)
    evaluate_all(depths, [(name, layers) for name, at in grid.items() for layers in at], jobs, detail)
    out = []
    for name, at in grid.items():
        if progress:
            progress(name)
        out += [frontier_row(name, depths[name](layers), ref["layer_tokens_per_s"]) for layers in at]
    return out


def frontier_row(policy: str, ev: Evaluation, ref_layer_tokens_per_s: float) -> dict[str, Any]:
    tps = ev.result.tokens_per_s if ev.fits and ev.result is not None else None
    return {"policy": policy, "layers": ev.layers, "fits": ev.fits, "tokens_per_s": tps,
            "layer_throughput_vs_1f1b": None if tps is None else tps * ev.layers / ref_layer_tokens_per_s,
            "micro_batch_size": ev.micro_batch_size, "variant": ev.variant, "note": ev.note}


ANSWER_COLUMNS = ["policy", "min_throughput", "layers", "layers_vs_1f1b", "tokens_per_s", "layer_throughput_vs_1f1b",
                  "micro_batch_size", "variant", "note"]


def answer_rows(answers: dict[str, dict[str, Any] | None], min_throughput: float, ref_layers: int) -> list[dict]:
    """`frontier_answers.csv`: per policy, the deepest model at >= `min_throughput` (`deepest_at`; a depth the
    grid may not hold), with its depth against plain 1F1B's deepest fit; a policy with none keeps its row,
    depth empty, so the file answers for every policy asked."""
    out = []
    for policy, best in answers.items():
        row = {"policy": policy, "min_throughput": min_throughput}
        if best is not None:
            row |= {k: best[k] for k in ANSWER_COLUMNS if k in best}
            row["layers_vs_1f1b"] = best["layers"] / ref_layers
        out.append(row)
    return out


def deepest_at(frontier: list[dict], fits: PolicyDepths, min_throughput: float,
               ref_layer_tokens_per_s: float) -> dict[str, Any] | None:
    """The deepest model of one policy at >= `min_throughput` x 1F1B's per-layer throughput: the deepest
    qualifying grid depth, refined by bisection towards the next grid depth (per-layer throughput falls
    with depth between two neighbouring grid points once memory binds; the result is re-evaluated, so it
    always qualifies)."""
    def ok(row: dict) -> bool:
        return bool(row["fits"]) and (row["layer_throughput_vs_1f1b"] or 0.0) >= min_throughput

    mine = sorted((r for r in frontier if r["policy"] == fits.policy.name), key=lambda r: r["layers"])
    good = [i for i, r in enumerate(mine) if ok(r)]
    if not good:
        return None
    i = good[-1]
    best = mine[i]
    if i + 1 < len(mine):
        lo, hi = best["layers"] // fits.step, mine[i + 1]["layers"] // fits.step
        while hi - lo > 1:
            mid = (lo + hi) // 2
            row = frontier_row(fits.policy.name, fits(mid * fits.step), ref_layer_tokens_per_s)
            if ok(row):
                best, lo = row, mid
            else:
                hi = mid
    return best
