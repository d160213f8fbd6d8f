"""Capacity: for each memory policy, the deepest model of the scenario's width that fits HBM, and how fast.

A policy is a schedule plus a memory treatment. `fits(layers)` simulates the step (or, for planner
policies, solves the memory MILP and re-simulates its plan) and checks peak HBM against capacity - margin on
every rank. Depth is searched over multiples of stages * virtual_stages: doubling until a depth fails, then
bisection (fitting is monotone in depth: every per-layer cost grows with it).

The chronos policies are chosen jointly per depth (`Policy.joint`): the schedule's chunks per rank v, its
admission cap, its W stash limit and the clock its order is built on, or another policy's own order (1F1B's,
interleaved 1F1B's, ZB-V's: `chronos_variants`), with the policy's memory treatment, the fastest variant that
fits winning.
The planner's MILP runs on a variant only while it could still win: each order's bound is the smaller of its
keep-everything speed (recomputation and offload only add work and copies) and what the MILP's LP relaxation
allows (`planner_bound`); orders are planned in order of that bound, and the search stops once the best found
is at least the next one. So it gives the answer of planning every order, in a fraction of the MILPs. The LP
bounds are computed lazily, best-first: only for the orders that reach the head of the queue.

Given micro-batch sizes (`evaluate_sizes`), every policy also chooses, per depth, how the scenario's global
batch is cut into microbatches; plain 1F1B too, so the reference of every ratio follows.

Evaluations are deterministic and independent of each other, so with `jobs` > 1 they run in worker processes
(each policy's depth search in one; the target and frontier depths all at once) and give the serial answer;
for the same reason a journal (analysis.capacity_journal, any `EvaluationJournal`) can keep them for a later run
to resume from.

This is the search; analysis/capacity.py builds `pipeplan capacity`'s tables on it (and another search, such as
`pipeplan search`, may reuse `evaluate`, `PolicyDepths` and `max_layers`).
"""

from __future__ import annotations

import contextlib
import heapq
import math
import multiprocessing
import signal
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from multiprocessing.managers import SyncManager
from typing import Any, Protocol, TypeVar

import numpy as np

from pipeplan.sim.config import Scenario, load_scenario
from pipeplan.sim.costs import CostTable, build_cost_table
from pipeplan.sim.engine import SimResult, simulate
from pipeplan.sim.errors import ScenarioError
from pipeplan.sim.ir import Schedule
from pipeplan.sim.schedules import size_problem
from pipeplan.sim.schedules.v_shape import ActionTimes, chronos_plan, deferred_w_limit, v_half_limit
from pipeplan.sim.step import list_clock, resolve_schedule
from pipeplan.solver.errors import SolverError, SolverTimeoutError
from pipeplan.solver.memory_milp import MemoryInfeasibleError, makespan_lower_bound
from pipeplan.solver.step import resolve_memory_plan

MAX_LAYERS = 4096
INTERLEAVED_V = (2, 3, 4)  # interleaved 1F1B's v among a joint policy's orders (why these: standard_orders)


class EvaluationJournal(Protocol):
    """Where a search keeps its evaluations for a later run (analysis.capacity_journal.Journal): JSON records by
    a key of the inputs and by depth."""

    damaged: int  # records found unreadable (evaluated again)

    def key(self, sc_path: str | None, overrides: dict[str, Any], policy: dict[str, Any],
            sizes: tuple[int, ...]) -> str: ...

    def entries(self, key: str) -> dict[int, dict[str, Any]]: ...

    def append(self, key: str, record: dict[str, Any]) -> None: ...

    def remember(self, key: str, record: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Policy:
    name: str
    schedule: str
    virtual_stages: int
    overrides: dict[str, Any] = field(default_factory=dict)
    joint: bool = False  # v, cap, stash limit and clock chosen per depth (chronos_variants), the fastest that fits
    by_default: bool = True  # run when --policies is not given (opt-in ones take much longer)
    interleaved_v: tuple[int, ...] = INTERLEAVED_V  # a joint policy's loop-placed orders (--interleaved-v)

    @property
    def planner(self) -> bool:
        """The MILP chooses keep / recompute / offload per chunk and states per rank (memory.plan = true)."""
        return bool(self.overrides.get("memory.plan"))


def _by_name(policies: list[Policy]) -> dict[str, Policy]:
    """The policy registry; a name given twice is refused rather than silently replaced."""
    registry: dict[str, Policy] = {}
    for p in policies:
        if p.name in registry:
            raise ValueError(f"capacity policy {p.name!r} is defined twice")
        registry[p.name] = p
    return registry


PLANNED = {"memory.plan": True, "memory.recompute_norms": True}
POLICIES: dict[str, Policy] = _by_name(
    [
        Policy("1f1b", "1f1b", 1),
        Policy("1f1b+recompute", "1f1b", 1, {"memory.recompute": "full"}),
        Policy("interleaved-1f1b", "interleaved-1f1b", 2),
        Policy("zbv", "zbv", 2),
        Policy("v-half", "v-half", 2),
        Policy("chronos", "chronos", 2, joint=True),
        Policy("chronos+recomp", "chronos", 2, {"memory.recompute": "chronos"}, joint=True),
        # the planner's plans also recompute every kept layer's norms (memory.recompute_norms: a third of a LLaMA
        # layer's bytes without SP for ~1 % of its time); its keep-everything candidates do not
        Policy("chronos+recomp+offload", "chronos", 2, {**PLANNED, "memory.offload_weights": "auto"}, joint=True),
        # + the W stash moved by the MILP in the stash-bounded orders: 30-70 s per MILP at deep depths on the
        # shipped 70B setting (a --frontier run 45+ min against 5), so only on request (docs/memory.md)
        Policy("chronos+recomp+offload+stash", "chronos", 2, {**PLANNED, "memory.offload_weights": "auto",
                                                              "memory.offload_stash": "auto"}, joint=True,
               by_default=False),
        # + copies that move layer by layer (memory.copy_granularity = "layer"; the runtime copies tensor by tensor)
        Policy("chronos+recomp+offload+stash+layers", "chronos", 2,
               {**PLANNED, "memory.offload_weights": "auto", "memory.offload_stash": "auto",
                "memory.copy_granularity": "layer"}, joint=True, by_default=False),
    ]
)
DEFAULT_POLICIES = tuple(name for name, p in POLICIES.items() if p.by_default)


@dataclass(frozen=True)
class Outcome:
    """What capacity keeps of a simulated step: a SimResult holds the whole timeline (~10 MB at m = 128, v = 4),
    and a search caches thousands of evaluations (14.7 GB peak RSS for one --micro-batch-sizes run before)."""

    tokens_per_s: float | None
    makespan_s: float
    mfu: float | None
    peak_hbm_bytes: np.ndarray  # per rank
    oom_over_limit: bool

    @classmethod
    def of(cls, r: SimResult) -> Outcome:
        return cls(r.tokens_per_s, r.makespan_s, r.mfu, r.peak_hbm_bytes, r.oom_over_limit)


@dataclass(frozen=True)
class Evaluation:
    layers: int
    fits: bool
    result: Outcome | None  # None when the planner found no plan
    variant: str = ""  # a joint policy's choice at this depth, e.g. "v=4 cap=32"
    unknown: bool = False  # the MILP hit its safety time limit: neither a fit nor no fit (`fits` is False)
    note: str = ""  # why unknown, or that the plan is the MILP's unproven incumbent
    micro_batch_size: int | None = None  # the size evaluated, or chosen from several (evaluate_sizes)

    def to_json(self) -> dict[str, Any]:
        """As JSON data for the journal (capacity_journal), floats exact."""
        r = self.result
        result = None if r is None else {
            "tokens_per_s": r.tokens_per_s, "makespan_s": r.makespan_s, "mfu": r.mfu,
            "peak_hbm_bytes": [float(b) for b in np.asarray(r.peak_hbm_bytes, dtype=float)],
            "oom_over_limit": bool(r.oom_over_limit)}
        return {"layers": self.layers, "fits": self.fits, "result": result, "variant": self.variant,
                "note": self.note, "micro_batch_size": self.micro_batch_size}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Evaluation:
        """`to_json`'s inverse; KeyError, TypeError or ValueError on data it did not write."""
        r = d["result"]
        result = None if r is None else Outcome(
            None if r["tokens_per_s"] is None else float(r["tokens_per_s"]), float(r["makespan_s"]),
            None if r["mfu"] is None else float(r["mfu"]), np.asarray(r["peak_hbm_bytes"], dtype=float),
            bool(r["oom_over_limit"]))
        size = d["micro_batch_size"]
        return cls(int(d["layers"]), bool(d["fits"]), result, str(d["variant"]), False, str(d["note"]),
                   None if size is None else int(size))


JOINT_V = (2, 4)  # chunks per rank a joint chronos policy tries (even, as its zig-zag placement needs)
# Orders other schedules build, each tried as one more chronos order (chronos_variants), so that a chronos policy
# is at least each of them under the same memory treatment: ZB-V's V-shaped order with a split backward (the
# list scheduler's nearest orders keep everything at ZB-V's speed only with more HBM), and 1F1B's and interleaved
# 1F1B's loop placement, which puts the embedding and the LM head on different ranks where a V puts both on
# rank 0 (at 40 layers of the default 8B scenario: 55.0 GiB besides activations there, against 46.2; and at 144
# layers of the 70B one the fastest plans the planner finds: docs/memory.md). Interleaved at v = 3 and 4 as
# well: each chunk more per rank cuts the bubble again ((p - 1) / (v m + p - 1)), and their MILPs solve from 80 to
# 192 layers there since the MILP counts memory in GiB (solver.memory_milp.GIB; at 144 layers, the norms
# recomputed, v = 4 plans 1.145 in 43 s and v = 3 1.134). More chunks are searched only on request
# (INTERLEAVED_V, above the policies; `pipeplan capacity --interleaved-v 2,3,4,6`): with the norms recomputed
# v = 6 plans 1.180 at 144 layers of the shipped 70B setting in 41 s, but its MILP runs into the 600 s net at 240,
# which a default run would pay at every deep depth (docs/memory.md)


def standard_orders(interleaved_v: tuple[int, ...] = INTERLEAVED_V) -> tuple[dict[str, Any], ...]:
    """ZB-V's, 1F1B's and interleaved 1F1B's own orders at each v of `interleaved_v` (chronos_variants)."""
    return ({"pipeline.schedule": "zbv", "pipeline.virtual_stages": 2},
            {"pipeline.schedule": "1f1b", "pipeline.virtual_stages": 1},
            *({"pipeline.schedule": "interleaved-1f1b", "pipeline.virtual_stages": v} for v in interleaved_v))

KEEP: tuple[tuple[str, Any], ...] = ()  # a joint run's memory treatment, as sorted override items


def planner_treatment(treatment: tuple[tuple[str, Any], ...], var: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The planner's treatment of one variant: with W deferred as usual (no stash limit) the W stash stays in
    HBM. Its MILP with the stash movable is the hardest here and never won where measured (80 layers, p = 8:
    v = 2 planned 0.780 against 0.926 with the stash under the cap; v = 4 ran past the 600 s safety net with
    its root bound at 0.856; docs/memory.md), so the stash moves only in the orders that bound it."""
    if "pipeline.stash_limit" in var or dict(treatment).get("memory.offload_stash") != "auto":
        return treatment
    return tuple(sorted({**dict(treatment), "memory.offload_stash": 0.0}.items()))


@dataclass(frozen=True)
class OwnCaps:
    """Chronos' own cap on one clock (the smallest within CHRONOS_SLOWDOWN of the uncapped order's step): for the
    order with a split backward, and for the one with a full B (no W stash), whose own cap is larger."""

    split: int
    full_b: int


def own_caps(stages: int, microbatches: int, v: int, times: ActionTimes | None = None) -> OwnCaps:
    return OwnCaps(chronos_plan(stages, microbatches, v, times=times)[0],
                   chronos_plan(stages, microbatches, v, times=times, full_b=True)[0])


def chronos_variants(stages: int, microbatches: int, layers: int, timed_caps: dict[int, OwnCaps] | None = None,
                     interleaved_v: tuple[int, ...] = INTERLEAVED_V) -> list[dict[str, Any]]:
    """(v, admission cap, stash limit, list clock) a joint chronos policy tries at `layers`: v in JOINT_V where
    every chunk gets a layer; caps in chunk-activations: chronos' own choice, V-Half's (v_half_limit, per chunk
    pair; with the stash limit = cap at v = 2 on unit costs, exactly v-half's order, so `chronos` >= `v-half`
    at every depth), one whole-rank microbatch below and above it, and 1F1B's p microbatches (the list scheduler
    gains little above: docs/memory.md); each with W deferred as usual (the stash limit's default), with the W
    stash counted against the cap (stash limit = cap), or with no stash (0: full B); and the full B's own cap
    (OwnCaps.full_b). Every order is built on unit costs and, for each v in `timed_caps` (chronos' own caps on
    the step's cost clock, `timed_own_caps`), again on the step's costs (pipeline.order_timing = "costs"), with
    that clock's own caps. Every chronos policy
    tries the same set of orders, but not the same plans in each: `chronos+recomp` applies the chronos
    recompute rule to every variant and never tries keep-everything, and the planner runs the MILP only on the
    orders `planned_variant` names (keeping everything elsewhere), so a policy with more memory treatments is
    not guaranteed to be faster than one with fewer at every depth. ZB-V's, 1F1B's and interleaved 1F1B's own
    orders (`standard_orders(interleaved_v)`, where their schedules take the sizes) are variants too, as V-Half's
    is, so every chronos policy is at least each of them under the same memory treatment."""
    out = [dict(var) for var in standard_orders(interleaved_v)
           if standard_order_fits(stages, microbatches, layers, var)]
    for v in JOINT_V:
        if layers < stages * v:
            continue
        half = v_half_limit(stages) // 2  # V-Half's whole-rank microbatches
        clocks = {"unit": own_caps(stages, microbatches, v)}
        if timed_caps and v in timed_caps:
            clocks["costs"] = timed_caps[v]
        for clock, own in clocks.items():
            caps = {own.split} | {v * k for k in (half - 1, half, half + 1, stages) if k >= 1}
            timing = {} if clock == "unit" else {"pipeline.order_timing": "costs"}
            for c in sorted(caps | {own.full_b}):
                stashes = {deferred_w_limit(stages, v), c, 0} if c in caps else {0}
                for stash in sorted(stashes, reverse=True):
                    var = {"pipeline.virtual_stages": v, "pipeline.admission_cap": c, **timing}
                    out.append(var if stash == deferred_w_limit(stages, v) else {**var, "pipeline.stash_limit": stash})
    return out


def standard_order_fits(stages: int, microbatches: int, layers: int, var: dict[str, Any]) -> bool:
    """Whether a standard order's schedule takes (stages, microbatches, v) and every chunk gets a layer."""
    v = var["pipeline.virtual_stages"]
    return layers >= stages * v and size_problem(var["pipeline.schedule"], stages, microbatches, v) is None


def timed_own_caps(sc_path: str | None, base_overrides: dict[str, Any], stages: int, microbatches: int,
                   layers: int) -> dict[int, OwnCaps]:
    """Per v in JOINT_V (where every chunk gets a layer), chronos' own caps on the clock of the step's costs at
    `layers`: the smallest within CHRONOS_SLOWDOWN of its uncapped order, timed as the step will run."""
    out = {}
    for v in JOINT_V:
        if layers >= stages * v:
            at = load_scenario(sc_path, {**base_overrides, "pipeline.schedule": "chronos",
                                         "pipeline.virtual_stages": v, "model.layers": layers})
            out[v] = own_caps(stages, microbatches, v, times=list_clock(build_cost_table(at)))
    return out


def planned_variant(stages: int, microbatches: int, var: dict[str, Any], timed_caps: dict[int, OwnCaps]) -> bool:
    """Whether the planner runs its MILP on this order: with a W stash, a cap from V-Half's up to chronos' own on
    the order's clock (on unit costs the two coincide at p = 8, v = 2; on the step's costs chronos' own is
    larger, and the caps between trade bubble against what must move: 0.962, 0.992, 0.939 at caps 14, 12, 10
    at 80 layers, docs/memory.md); with a full B, those caps and its own cap on that clock (OwnCaps.full_b; at 144
    layers the best full-B plans measured were at the own caps, and past ~200 layers only the small caps fit,
    docs/memory.md). Each MILP costs 2-480 s at 48-320 layers;
    `_evaluate_joint` runs them in order of their bound and stops once none left can win."""
    if "pipeline.schedule" in var:  # a standard order (chronos' own variants name no schedule)
        return True  # one order each, planned (ZB-V's with its W stash in HBM: planner_treatment)
    v: int = var["pipeline.virtual_stages"]
    cap: int = var["pipeline.admission_cap"]
    own = timed_caps[v] if var.get("pipeline.order_timing") == "costs" else own_caps(stages, microbatches, v)
    low = v_half_limit(stages) // 2 * v <= cap <= own.split
    if var.get("pipeline.stash_limit") == 0:
        return low or cap == own.full_b  # the small caps hold least: the deepest fits are theirs
    return low


def variant_label(var: dict[str, Any]) -> str:
    """`v=2 cap=10`; with the W stash counted against the cap `v=2 cap=10 stash<=10`; without one, `... full-B`;
    built on the step's costs (pipeline.order_timing = "costs"), `... timed`; a standard order by its schedule's
    name, `v=2 zbv`, `v=1 1f1b`, `v=2 interleaved-1f1b` (and v = 3, 4)."""
    if "pipeline.schedule" in var:
        return f"v={var['pipeline.virtual_stages']} {var['pipeline.schedule']}"
    stash = var.get("pipeline.stash_limit")
    tail = "" if stash is None else " full-B" if stash == 0 else f" stash<={stash}"
    timed = " timed" if var.get("pipeline.order_timing") == "costs" else ""
    return f"v={var['pipeline.virtual_stages']} cap={var['pipeline.admission_cap']}{tail}{timed}"


Say = Callable[[str], None]  # hears what an evaluation is doing now (the live progress line)
RunKey = tuple[Any, ...]  # (layers, micro-batch size, microbatches, variant label, treatment); a bound's: "bound" first
RunCache = dict[RunKey, Evaluation | float]  # a joint policy's runs: an Evaluation per run, tokens/s per bound


def _speed(ev: Evaluation) -> float:
    """Tokens/s of an evaluation with a result (capacity scenarios have a model, so the step's tokens are known)."""
    assert ev.result is not None and ev.result.tokens_per_s is not None
    return ev.result.tokens_per_s


def evaluate(sc_path: str | None, base_overrides: dict[str, Any], policy: Policy, layers: int,
             bounds: RunCache | None = None, floor: float = 0.0, say: Say | None = None) -> Evaluation:
    """Simulate (or plan and simulate) the scenario at `layers` under `policy`; a joint policy searches its
    variants (module docstring), `bounds` caching their keep-everything runs across policies. A planner skips
    the MILP on orders that cannot beat `floor` tokens/s (a plan found elsewhere, e.g. at another micro-batch
    size), so it may then return a slower plan or none."""
    if policy.joint:
        return _evaluate_joint(sc_path, base_overrides, policy, layers, {} if bounds is None else bounds, floor,
                               say)
    sc, costs, schedule = _policy_step(sc_path, base_overrides, policy, layers)
    try:
        memory = resolve_memory_plan(sc, costs, schedule, explain=False)  # only whether it fits matters here
    except MemoryInfeasibleError:
        return Evaluation(layers, False, None)
    except SolverTimeoutError:  # the MILP's safety net: say so, never count it as "does not fit"
        return Evaluation(layers, False, None, unknown=True, note=f"MILP timed out at {layers} layers")
    except SolverError as e:  # the planner's verification or HiGHS' numerics failed: no plan at this depth
        return Evaluation(layers, False, None, note=f"no plan: {e}")
    planned = memory.planned
    if planned is not None:  # the planner's plan fits by construction and is already simulated
        note = "" if planned.proven_optimal else f"MILP incumbent (gap {planned.mip_gap:.1%}) at {layers} layers"
        return Evaluation(layers, True, Outcome.of(planned.simulated), note=note)
    res = simulate(schedule, costs, memory=memory.plan)
    return Evaluation(layers, not res.oom_over_limit, Outcome.of(res))


def _policy_step(sc_path: str | None, base_overrides: dict[str, Any], policy: Policy, layers: int
                 ) -> tuple[Scenario, CostTable, Schedule]:
    """The scenario at `layers` under a (non-joint) policy, its cost table and its schedule."""
    sc = load_scenario(sc_path, {**base_overrides, "pipeline.schedule": policy.schedule,
                                 "pipeline.virtual_stages": policy.virtual_stages, "model.layers": layers,
                                 **policy.overrides})
    return sc, build_cost_table(sc), resolve_schedule(sc)


def planner_bound(sc_path: str | None, base_overrides: dict[str, Any], policy: Policy, layers: int,
                  keep: Outcome) -> float:
    """Tokens/s no plan of the memory planner (`policy`, one order) can beat (0 when none fits), from the MILP's
    LP relaxation (solver.memory_milp.makespan_lower_bound: seconds, where the MILP takes up to minutes); `keep`
    is the order's keep-everything step, which gives the step's tokens; inf where the relaxation bounds nothing."""
    seconds = makespan_lower_bound(*_policy_step(sc_path, base_overrides, policy, layers))
    if seconds is None:
        return 0.0
    assert keep.tokens_per_s is not None  # a keep-everything step of a model scenario counts its tokens
    return math.inf if seconds <= 0 else keep.tokens_per_s * keep.makespan_s / seconds


def _evaluate_joint(sc_path: str | None, base_overrides: dict[str, Any], policy: Policy, layers: int,
                    runs: RunCache, floor: float = 0.0, say: Say | None = None) -> Evaluation:
    """The fastest fitting variant of a joint policy (module docstring). `runs` caches every (depth, variant,
    treatment) run across the chronos policies. The planner's candidates are every variant's keep-everything
    plan (in the MILP's plan space) and the MILP's own plan for the variants `planned_variant` names, tried in
    order of their bound while they can still win (docs/memory.md)."""
    sc = load_scenario(sc_path, base_overrides)

    def key_of(var: dict[str, Any], treatment: tuple[tuple[str, Any], ...]) -> RunKey:
        return layers, sc.training.micro_batch_size, sc.pipeline.microbatches, variant_label(var), treatment

    def policy_of(var: dict[str, Any], treatment: tuple[tuple[str, Any], ...]) -> Policy:
        return Policy(policy.name, var.get("pipeline.schedule", "chronos"), var["pipeline.virtual_stages"],
                      dict(treatment))

    def run(var: dict[str, Any], treatment: tuple[tuple[str, Any], ...]) -> tuple[RunKey, Evaluation]:
        key = key_of(var, treatment)
        if key not in runs:
            runs[key] = evaluate(sc_path, {**base_overrides, **var}, policy_of(var, treatment), layers)
        ev = runs[key]
        assert isinstance(ev, Evaluation)  # a run's key (a bound's starts with "bound")
        return key, ev

    p, m = sc.pipeline.stages, sc.pipeline.microbatches
    timed = timed_own_caps(sc_path, base_overrides, p, m, layers)
    variants = chronos_variants(p, m, layers, timed, policy.interleaved_v)
    treatment = tuple(sorted(policy.overrides.items()))
    cheap = (KEEP,) if policy.planner else (treatment,)
    tried = [run(var, t) for var in variants for t in cheap]
    if policy.planner:
        # best-first on each order's bound, computed lazily: an order's keep-everything speed bounds it from above
        # at no cost, and its LP relaxation (seconds to minutes) is solved only once the order reaches the head
        # of the queue; a refined order at the head bounds every other, so the MILPs run in the order of their
        # bounds and stop at the same point as with every bound computed first (same answers, fewer LPs)
        queue: list[tuple[float, int, bool, dict[str, Any]]] = []
        for idx, var in enumerate(var for var in variants if planned_variant(p, m, var, timed)):
            heapq.heappush(queue, (-_speed(run(var, KEEP)[1]), idx, False, var))
        while queue:
            negative, idx, refined, var = heapq.heappop(queue)
            best = _fastest(tried)
            if max(floor, _speed(best[1]) if best is not None else 0.0) >= -negative:
                break  # no memory treatment of the remaining orders can be faster
            how = planner_treatment(treatment, var)
            here = f"{policy.name} at {layers} layers, {variant_label(var)}"
            if not refined:
                key = ("bound", *key_of(var, how))
                if key not in runs:
                    if say:
                        say(f"{here}: LP bound")
                    keep = run(var, KEEP)[1].result
                    assert keep is not None  # its queue entry read its speed
                    runs[key] = planner_bound(sc_path, {**base_overrides, **var}, policy_of(var, how), layers, keep)
                bound = runs[key]
                assert not isinstance(bound, Evaluation)  # a bound's key
                heapq.heappush(queue, (-min(-negative, bound), idx, True, var))
                continue
            if say:
                say(f"{here}: MILP (bound {-negative:,.0f} tokens/s)")
            tried.append(run(var, how))
            if say:
                ev = tried[-1][1]
                say(f"{here}: " + (f"planned {_speed(ev):,.0f} tokens/s" if ev.fits else "no plan")
                    + (f" ({ev.note})" if ev.note else ""))
    best = _fastest(tried)
    if best is None:
        timed_out = next((e for _, e in tried if e.unknown), None)
        if timed_out is not None:  # some variant might have fitted: unknown, not "does not fit"
            return Evaluation(layers, False, None, unknown=True, note=timed_out.note)
        return Evaluation(layers, False, None)
    (*_, label, how), ev = best
    plan = "" if not policy.planner else (" kept" if how == KEEP else " planned")
    return Evaluation(layers, True, ev.result, variant=label + plan, note=ev.note)


def _fastest(tried: list[tuple[RunKey, Evaluation]]) -> tuple[RunKey, Evaluation] | None:
    """The (key, evaluation) pair of `_quickest`'s evaluation."""
    best = _quickest([e for _, e in tried])
    return next((ke for ke in tried if ke[1] is best), None)


def batch_overrides(sc: Scenario, size: int) -> dict[str, Any]:
    """The scenario's global batch (micro_batch_size x microbatches sequences) cut into microbatches of `size`
    sequences: the same training run, unlike more microbatches of the same size."""
    total = sc.training.micro_batch_size * sc.pipeline.microbatches
    if not 1 <= size <= total or total % size:
        allowed = ", ".join(str(d) for d in range(1, total + 1) if total % d == 0)
        raise ScenarioError(f"--micro-batch-sizes: {size} does not divide the global batch of {total} sequences "
                            f"({sc.pipeline.microbatches} x {sc.training.micro_batch_size}); allowed: {allowed}")
    return {"training.micro_batch_size": size, "pipeline.microbatches": total // size}


def evaluate_sizes(sc_path: str | None, overrides: dict[str, Any], policy: Policy, layers: int,
                   bounds: RunCache | None = None, sizes: tuple[int, ...] = (), say: Say | None = None
                   ) -> Evaluation:
    """`evaluate` at each micro-batch size of `sizes` with the global batch fixed (`batch_overrides`), the
    fastest that fits winning (labelled `mbs=N ...`); with no `sizes`, the scenario's own. A planner skips the
    MILP on any order whose bound cannot beat the best plan of the sizes before it."""
    sc = load_scenario(sc_path, overrides)
    if not sizes:
        return replace(evaluate(sc_path, overrides, policy, layers, bounds, say=say),
                       micro_batch_size=sc.training.micro_batch_size)
    tried: list[Evaluation] = []
    for size in sizes:
        best = _quickest(tried)
        floor = _speed(best) if best is not None else 0.0
        ev = evaluate(sc_path, {**overrides, **batch_overrides(sc, size)}, policy, layers, bounds, floor, say)
        tried.append(replace(ev, micro_batch_size=size, variant=" ".join(filter(None, (f"mbs={size}", ev.variant)))))
    return _quickest(tried) or next((e for e in tried if e.unknown), Evaluation(layers, False, None))


def _quickest(evaluations: list[Evaluation]) -> Evaluation | None:
    """The fastest evaluation that fits (the first of equals), or None."""
    return max((e for e in evaluations if e.fits and e.result is not None), key=_speed, default=None)


def max_layers(fits: Callable[[int], Evaluation], step: int) -> Evaluation | None:
    """Largest multiple of `step` that fits (doubling, then bisection); None if even `step` does not. A depth
    whose MILP timed out (`unknown`) bounds the search like a failure, so the answer is then a lower bound:
    `capacity_table` notes it."""
    first = fits(step)
    if not first.fits:
        return None
    best, k = first, 1
    hi = None
    while hi is None:
        k2 = k * 2
        if k2 * step > MAX_LAYERS:
            hi = MAX_LAYERS // step + 1
            break
        ev = fits(k2 * step)
        if ev.fits:
            best, k = ev, k2
        else:
            hi = k2
    lo = k
    while hi - lo > 1:
        mid = (lo + hi) // 2
        ev = fits(mid * step)
        if ev.fits:
            best, lo = ev, mid
        else:
            hi = mid
    return best


def model_params(sc: Scenario, layers: int) -> int:
    """Parameters of the whole model (all TP and PP ranks) at `layers` layers."""
    m = sc.model
    assert m is not None  # checked_scenario requires a [model]
    h_kv = m.kv_heads * (m.hidden // m.heads)
    per_layer = m.hidden * (m.hidden + 2 * h_kv) + m.hidden**2 + 3 * m.hidden * m.ffn_hidden + 2 * m.hidden
    return layers * per_layer + 2 * m.vocab * m.hidden + m.hidden


class PolicyDepths:
    """Evaluations of one policy at any depth, cached: the capacity search and the frontier share them."""

    def __init__(self, sc_path: str | None, overrides: dict[str, Any], policy: Policy, stages: int,
                 bounds: RunCache | None = None, progress: Callable[[str], None] | None = None,
                 sizes: tuple[int, ...] = (), journal: EvaluationJournal | None = None):
        self.sc_path, self.overrides, self.policy, self.stages = sc_path, overrides, policy, stages
        self.sizes = sizes  # micro-batch sizes to choose from per depth (evaluate_sizes); () = the scenario's
        self.step = stages * policy.virtual_stages  # depths are multiples of the chunk count
        self._cache: dict[int, Evaluation] = {}
        self.bounds = {} if bounds is None else bounds  # joint policies' keep-everything runs, shared
        self.progress = progress
        self.journal = journal  # every evaluation recorded as it is made, for a later run to resume from
        self.key = "" if journal is None else journal.key(sc_path, overrides, {
            "name": policy.name, "schedule": policy.schedule, "virtual_stages": policy.virtual_stages,
            "overrides": policy.overrides, "joint": policy.joint, "interleaved_v": list(policy.interleaved_v)}, sizes)
        if journal is not None:
            for layers, data in journal.entries(self.key).items():
                try:
                    self._cache[layers] = Evaluation.from_json(data)
                except (KeyError, TypeError, ValueError):  # not what to_json writes: evaluate it again
                    journal.damaged += 1
        self.resumed = len(self._cache)  # evaluations an earlier run made

    def __call__(self, layers: int) -> Evaluation:
        if layers not in self._cache:
            if self.progress:
                self.progress(f"{self.policy.name} at {layers} layers")
            self.record(evaluate_sizes(self.sc_path, self.overrides, self.policy, layers, self.bounds, self.sizes,
                                       self.progress))
        return self._cache[layers]

    def record(self, ev: Evaluation) -> None:
        """Take a new evaluation (made here or in a worker process) and journal it."""
        self._cache[ev.layers] = ev
        if self.journal is not None and not ev.unknown:  # a timed-out MILP: a later run tries again
            self.journal.append(self.key, ev.to_json())

    def evaluated(self) -> dict[int, Evaluation]:
        """Every depth evaluated so far."""
        return dict(self._cache)

    def __contains__(self, layers: int) -> bool:
        return layers in self._cache

    def store(self, evaluations: dict[int, Evaluation]) -> None:
        """Take evaluations made and journaled elsewhere (a worker's depth search) as this policy's own."""
        self._cache.update(evaluations)
        if self.journal is not None:
            for ev in evaluations.values():
                if not ev.unknown:
                    self.journal.remember(self.key, ev.to_json())

    def replays(self, own: int) -> bool:
        """Whether the depth search (and the scenario's own depth) needs no evaluation not made yet."""
        def known(layers: int) -> Evaluation:
            if layers not in self._cache:
                raise LookupError(layers)
            return self._cache[layers]

        try:
            max_layers(known, self.step)
            if own % self.step == 0:
                known(own)
        except LookupError:
            return False
        return True

    def round_up(self, layers: float) -> int:
        return max(self.step, -(-int(layers * 1000) // (1000 * self.step)) * self.step)


class _Teller:
    """`say` in a worker process: its lines reach the parent's progress display through a managed queue."""

    def __init__(self, queue: Any) -> None:
        self.queue = queue

    def __call__(self, line: str) -> None:
        self.queue.put(line)


def _quiet_manager(context: Any) -> SyncManager:
    """A started manager (for the workers' progress queue) that ignores Ctrl-C like the workers: the parent
    stops it, after the workers, so a worker's last line never meets a dead queue."""
    manager = SyncManager(ctx=context)
    manager.start(signal.signal, (signal.SIGINT, signal.SIG_IGN))
    return manager


K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


def _in_workers(jobs: int, calls: Mapping[K, tuple[Callable[..., R], tuple[Any, ...]]], say: Say | None = None
                ) -> Iterator[tuple[K, R]]:
    """Run each `key: (function, args)` in up to `jobs` fresh worker processes and yield (key, result) as each
    finishes (spawned, not forked: HiGHS keeps one thread pool per process, solver/highs.py, which a forked
    child would inherit in whatever state the parent left it). Every function takes a last argument `say`:
    with `say` given, what the workers say reaches it as they go (every half second), else None."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(calls)), mp_context=context,
                             initializer=signal.signal, initargs=(signal.SIGINT, signal.SIG_IGN)) as pool, \
            (_quiet_manager(context) if say else contextlib.nullcontext()) as manager:
        queue = manager.Queue() if manager is not None else None  # a manager is started iff `say` is given
        teller = _Teller(queue) if say else None
        try:
            futures = {pool.submit(function, *args, teller): key for key, (function, args) in calls.items()}
            pending = set(futures)
            while pending:
                done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                while say is not None and queue is not None and not queue.empty():
                    say(queue.get())
                for future in done:
                    yield futures[future], future.result()
        except BaseException:  # Ctrl-C (the workers ignore it: no traceback from each) or a failure: stop them
            _stop_workers(pool)
            raise


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """End the workers now rather than after their current evaluation (minutes of MILP): what they journaled
    stays, whole lines only (capacity_journal)."""
    stop = getattr(pool, "terminate_workers", None)  # Python 3.14
    if stop is not None:
        stop()
        return
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.terminate()
    pool.shutdown(wait=True, cancel_futures=True)


def _search(sc_path: str | None, overrides: dict[str, Any], policy: Policy, stages: int, own: int,
            sizes: tuple[int, ...] = (), journal: EvaluationJournal | None = None, say: Say | None = None
            ) -> dict[int, Evaluation]:
    """A worker's share of `capacity_table`: one policy's depth search and its scenario depth, with every
    evaluation made on the way (the parent replays the search on them without evaluating again); each is
    journaled here as it is made, so a run stopped during a long search keeps what it had."""
    fits = PolicyDepths(sc_path, overrides, policy, stages, progress=say, sizes=sizes, journal=journal)
    max_layers(fits, fits.step)
    if own % fits.step == 0:
        fits(own)
    return fits.evaluated()


def _search_all(depths: dict[str, PolicyDepths], own: int, jobs: int,
                detail: Callable[[str], None] | None) -> None:
    """Every policy's depth search at once, in up to `jobs` processes, the planner's and the joint ones first
    (they take longest)."""
    names = sorted((n for n in depths if not depths[n].replays(own)),
                   key=lambda n: (not depths[n].policy.planner, not depths[n].policy.joint))
    if len(names) <= 1:  # no company: the caller's own search is as fast
        return
    calls = {n: (_search, (depths[n].sc_path, depths[n].overrides, depths[n].policy, depths[n].stages, own,
                           depths[n].sizes, depths[n].journal)) for n in names}
    for n, evaluations in _in_workers(jobs, calls, detail):
        depths[n].store(evaluations)
        if detail:
            detail(f"{n}: depth found")


def evaluate_all(depths: dict[str, PolicyDepths], pairs: Iterable[tuple[str, int]], jobs: int = 1,
                 detail: Callable[[str], None] | None = None) -> None:
    """Evaluate the (policy, layers) pairs not evaluated yet: here, in order, with `jobs` = 1; else in up to
    `jobs` worker processes."""
    todo = [(n, layers) for n, layers in dict.fromkeys(pairs) if layers not in depths[n]]
    if jobs <= 1 or len(todo) <= 1:
        for n, layers in todo:
            depths[n](layers)
        return
    calls = {(n, layers): (evaluate_sizes, (depths[n].sc_path, depths[n].overrides, depths[n].policy, layers,
                                             None, depths[n].sizes))
             for n, layers in todo}
    for (n, layers), ev in _in_workers(jobs, calls, detail):
        depths[n].record(ev)
        if detail:
            detail(f"{n} at {layers} layers")


def resolved_policy(name: str, base: Scenario, interleaved_v: tuple[int, ...] = INTERLEAVED_V) -> Policy:
    """POLICIES[name] for this run: a joint policy trying interleaved 1F1B's order at each v of `interleaved_v`,
    and without memory.recompute_norms where the scenario's TP keeps gathered norm outputs, which recomputing
    the norms would not free (Scenario.norms_recomputable), so the planner plans without it there."""
    policy = POLICIES[name]
    if policy.joint:
        policy = replace(policy, interleaved_v=interleaved_v)
    if policy.overrides.get("memory.recompute_norms") and not base.norms_recomputable:
        policy = replace(policy, overrides={**policy.overrides, "memory.recompute_norms": False})
    return policy


def checked_scenario(sc_path: str | None, policies: list[str], overrides: dict[str, Any] | None = None) -> Scenario:
    """The scenario capacity varies, with the policy names checked: bad input is one line before any work."""
    base = load_scenario(sc_path, overrides)
    if base.model is None:
        raise ScenarioError("capacity: needs a [model] scenario (explicit costs have no depth to vary)")
    unknown = [p for p in policies if p not in POLICIES]
    if not policies:
        raise ScenarioError(f"--policies: give at least one; allowed: {', '.join(POLICIES)}")
    if unknown:
        raise ScenarioError(f"--policies: unknown {', '.join(unknown)}; allowed: {', '.join(POLICIES)}")
    return base
