"""The TimelyFreeze LP: per-action freeze ratios that shorten one pipeline step, solved lexicographically.

Given the step's DAG (solver.freeze_dag) with nodes V, precedence edges E with delays δ_uv, freezable
actions F ⊆ V (B, or W when the backward is split), each of chunk s(a), and per node the unfrozen and
fully frozen durations w̄_a >= w_a (Δ_a = w̄_a - w_a; nodes off F have a fixed duration w̄_a):

    variables  t_a >= 0                 start of node a                                  a ∈ V
               r_a ∈ [0, ρ]             freeze ratio (ρ = freeze.max_ratio)              a ∈ F
               d_a ∈ [w_a, w̄_a]         duration, only with a curve; linear: d_a ≡ w̄_a - Δ_a r_a
               T >= 0                   makespan

    precedence t_v - t_u - d_u >= δ_uv                                                   (u, v) ∈ E
               (a tied node u, the first chunk's I, has d_u = w̄_u - Δ_u r_w with w its W: no new column)
    makespan   T - t_a - d_a >= 0                                           a last on its rank
    cap        Σ_{a ∈ F, s(a) = s} r_a <= cap · |{a ∈ F : s(a) = s}|                     every chunk s
    curve      d_a >= w_a + Δ_a (α_k + β_k r_a)     each segment k of the chunk's convex share c(r)
               (c(r) = max_k α_k + β_k r is the share of Δ_a still spent; linear: c(r) = 1 - r)

    stage 1    T* = min T
    stage 2    min Σ_{a ∈ F} r_a    subject to all of the above and T <= T* (1 + 1e-9) + 1e-9 τ

Stage 2 makes "nothing is frozen that does not shorten the step" exact: any ratio that could drop without
lengthening the step does. No big-M weights. The tolerance only absorbs HiGHS's own round-off (1e-9
relative plus one nano-unit); it cannot buy measurable freezing (Σ r may land ~1e-8 under a round
number). Times are scaled by τ = the longest unfrozen duration, so every coefficient is O(1) whatever the
model's size, and scaled back at the end.

Warm starts. Each stage starts the dual simplex from a basis read off an ASAP schedule: every start time
basic and pinned by the in-edge that sets it, the makespan by the latest sink, every r at a bound. Its duals
are one unit of flow along the critical path, so it is dual feasible whenever the critical path's freezable
actions sit at ρ (stage 1) or nothing is frozen (stage 2). Stage 1 reads it off a guess: per chunk, the
floor(cap·n/ρ) actions with the least total float, fully frozen; if that guess meets the caps it is optimal
already (every action on its critical path is at its shortest), otherwise the dual simplex repairs a few
caps. Stage 2 starts from the ASAP tree of stage 1's optimum thawed greedily (every frozen action lengthened
as far as its float allows, latest first) with every r at 0: dual feasible like the unfrozen one, and far
nearer the optimum. Most rows are tight in these schedules, so ties are broken towards the rank's own order.
Dual simplex with Devex pricing. The guesses only choose the starting bases, never the answer (several
vertices may share stage 2's optimum; docs/freeze-planner.md: measurements).

At the optimum the start times are a feasible schedule, so T >= the longest path at durations d(r), which is
what the engine simulates; stage 1's optimality pins both to T* (solver.plan verifies it).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pipeplan.solver.errors import InfeasibleError
from pipeplan.solver.freeze_dag import FreezeDag
from pipeplan.solver.highs import AT_LOWER, AT_UPPER, BASIC, LinearProgram

MAKESPAN_REL_TOL = 1e-9
MAKESPAN_ABS_TOL = 1e-9  # in units of τ
RATIO_SNAP = 1e-9  # solver noise below this is no freezing
HIGHS_OPTIONS: dict[str, float | int | str | bool] = {
    "primal_feasibility_tolerance": 1e-9,
    "dual_feasibility_tolerance": 1e-9,
    "simplex_strategy": 1,  # dual simplex: the crash bases below are dual feasible
    # Devex pricing: steepest edge first spends one BTRAN per row on exact weights for the crash basis
    # (0.6 s a stage at 65k rows) and then an FTRAN per iteration that is ~15% dense on these long
    # chains. HiGHS keeps the first solve's choice on an instance (1.16), so both stages use it.
    "simplex_dual_edge_weight_strategy": 1,
}


@dataclass(frozen=True)
class FreezeSolution:
    ratio: np.ndarray  # (n_freezable,) r_a, aligned with dag.freezable
    duration_s: np.ndarray  # (n_freezable,) planned duration of each freezable action
    makespan_s: float  # T* (stage 1)
    build_s: float
    solve_s: float  # both stages
    rows: int
    columns: int
    iterations: tuple[int, int]

    @property
    def wall_s(self) -> float:
        return self.build_s + self.solve_s


@dataclass(frozen=True)
class _Model:
    lp: LinearProgram
    t: np.ndarray  # (n_nodes,) column of each start time
    r: np.ndarray  # (n_freezable,) column of each freeze ratio
    T: int
    n_edges: int  # rows 0..n_edges-1 are precedence, then one makespan row per sink


def solve_freeze_lp(dag: FreezeDag, cap: float, max_ratio: float = 1.0, crash: bool = True) -> FreezeSolution:
    """Build the LP over `dag` and solve it lexicographically: least makespan, then least freezing."""
    t0 = time.perf_counter()
    tau = float(dag.w_max.max()) if dag.n_nodes and dag.w_max.max() > 0 else 1.0
    model = _build(dag, cap, max_ratio, tau)
    lp, r, T = model.lp, model.r, model.T
    build_s = time.perf_counter() - t0

    asap = dag.earliest_starts(dag.w_max)  # None: the graph has a cycle
    crash = crash and asap is not None and dag.curves is None  # the curve's d columns need their own basis
    if crash and asap is not None:  # crash implies asap; the type checker needs it said
        guess = _least_float_freezing(dag, asap, cap, max_ratio)
        guess_dur = dag.node_durations(guess)
        guess_asap = dag.earliest_starts(guess_dur)
        assert guess_asap is not None  # same graph, other durations
        guess_asap = _pinned_by_rank_order(dag, guess_asap, guess_dur)
        col, row = _asap_basis(dag, model, guess_asap, guess_dur)
        col[model.r[guess > 0]] = AT_UPPER
        col[model.r[_critical_freezable(dag, guess_asap, guess_dur)]] = AT_UPPER
        lp.set_basis(col, row)
    try:
        first = lp.minimize(np.asarray([T]), 1.0, "stage 1 (least makespan)")
    except InfeasibleError as exc:
        if asap is None:
            raise InfeasibleError(
                f"{exc}: the step's dependency graph has a cycle, so the schedule "
                "deadlocks; fix the action order"
            ) from None
        raise
    t_star = float(first.x[T])
    lp.set_upper_bound(T, t_star * (1 + MAKESPAN_REL_TOL) + MAKESPAN_ABS_TOL)
    if crash:
        thawed = _thaw(dag, np.clip(first.x[r], 0.0, max_ratio), t_star * tau)
        thawed_dur = dag.node_durations(thawed)
        thawed_asap = dag.earliest_starts(thawed_dur)
        assert thawed_asap is not None
        lp.set_basis(*_asap_basis(dag, model, _pinned_by_rank_order(dag, thawed_asap, thawed_dur), thawed_dur))
    second = lp.minimize(r, 1.0, "stage 2 (least freezing at the least makespan)")

    ratio = np.clip(second.x[r], 0.0, max_ratio)
    ratio[ratio < RATIO_SNAP] = 0.0
    return FreezeSolution(
        ratio=ratio,
        duration_s=dag.durations(ratio),
        makespan_s=t_star * tau,
        build_s=build_s,
        solve_s=time.perf_counter() - t0 - build_s,
        rows=lp.num_rows,
        columns=lp.num_columns,
        iterations=(first.iterations, second.iterations),
    )


def _build(dag: FreezeDag, cap: float, max_ratio: float, tau: float) -> _Model:
    w_max, w_min = dag.w_max / tau, dag.w_min / tau
    fz = dag.freezable
    nf = len(fz)
    delta = w_max[fz] - w_min[fz]  # (n_freezable,)
    lp = LinearProgram("freeze LP", HIGHS_OPTIONS)
    t = lp.add_variables(dag.n_nodes, lb=0.0)
    r = lp.add_variables(nf, lb=0.0, ub=max_ratio)
    d = lp.add_variables(nf, lb=w_min[fz], ub=w_max[fz]) if dag.curves is not None else None
    T = int(lp.add_variables(1, lb=0.0)[0])

    # dur_u = const_u + coef_u * x[col_u]: fixed, w̄ - Δ r (linear), or the column d (curve)
    dur_col = np.full(dag.n_nodes, -1, dtype=np.int64)
    dur_coef = np.zeros(dag.n_nodes)
    dur_const = w_max.copy()
    if d is None:
        dur_col[fz], dur_coef[fz] = r, -delta
    else:
        dur_col[fz], dur_coef[fz], dur_const[fz] = d, 1.0, 0.0
    if dag.tied is not None and len(dag.tied):  # the first chunk's I: w̄ - Δ r on its W's ratio column
        dur_col[dag.tied], dur_coef[dag.tied] = r[dag.tied_slot], -(w_max - w_min)[dag.tied]

    def finish_rows(u: np.ndarray, later: np.ndarray, gap: np.ndarray) -> None:
        """x[later] - t_u - dur_u >= gap, one row per entry of u."""
        k = len(u)
        rows = np.arange(k)
        var = dur_col[u] >= 0
        lp.add_rows(
            gap + dur_const[u],
            np.inf,
            np.concatenate([rows, rows, rows[var]]),
            np.concatenate([later, t[u], dur_col[u][var]]),
            np.concatenate([np.ones(k), -np.ones(k), -dur_coef[u][var]]),
            num_rows=k,
        )

    finish_rows(dag.edge_u, t[dag.edge_v], dag.edge_delay / tau)  # precedence
    finish_rows(dag.sinks, np.full(len(dag.sinks), T), np.zeros(len(dag.sinks)))  # makespan

    stage = dag.freezable_stage
    chunks, chunk_row = np.unique(stage, return_inverse=True)
    counts = np.bincount(chunk_row, minlength=len(chunks))
    lp.add_rows(-np.inf, cap * counts, chunk_row, r, np.ones(nf), num_rows=len(chunks))  # cap

    if d is not None:  # curve epigraph: d_a - Δ_a β_k r_a >= w_a + Δ_a α_k
        rows_: list[np.ndarray] = []
        cols_: list[np.ndarray] = []
        vals_: list[np.ndarray] = []
        lo_: list[np.ndarray] = []
        for alpha, beta, members in _segments(dag, stage):
            rr = sum(len(x) for x in lo_) + np.arange(len(members))
            rows_ += [rr, rr]
            cols_ += [d[members], r[members]]
            vals_ += [np.ones(len(members)), -delta[members] * beta]
            lo_.append(w_min[fz][members] + delta[members] * alpha)
        lo = np.concatenate(lo_)
        lp.add_rows(
            lo, np.inf, np.concatenate(rows_), np.concatenate(cols_), np.concatenate(vals_), num_rows=len(lo)
        )
    return _Model(lp, t, r, T, len(dag.edge_u))


def _least_float_freezing(
    dag: FreezeDag, asap: tuple[np.ndarray, np.ndarray], cap: float, max_ratio: float
) -> np.ndarray:
    """A cap-feasible first guess for stage 1: per chunk, the floor(cap·n/ρ) freezable actions with the
    least total float in the unfrozen step, fully frozen. Critical work is what freezing shortens."""
    start, _ = asap
    finish = start + dag.w_max
    slack = dag.latest_finishes(dag.w_max, float(finish[dag.sinks].max())) - finish  # total float
    stage = dag.freezable_stage
    guess = np.zeros(len(dag.freezable))
    if max_ratio <= 0:
        return guess
    for s in np.unique(stage):
        members = np.flatnonzero(stage == s)
        k = int(np.floor(cap * len(members) / max_ratio + 1e-9))
        guess[members[np.argsort(slack[dag.freezable[members]], kind="stable")[:k]]] = max_ratio
    return guess


def _thaw(dag: FreezeDag, ratio: np.ndarray, makespan: float) -> np.ndarray:
    """`ratio` (a stage-1 optimum, linear time model) with every frozen action thawed as far as its float
    allows without lengthening the step past `makespan` (seconds), latest actions first. Only chooses
    stage 2's starting basis: its ASAP tree is much nearer stage 2's optimal basis than the unfrozen one."""
    dur = dag.node_durations(ratio)
    asap = dag.earliest_starts(dur)
    assert asap is not None  # the graph the caller's ASAP pass ran on, other durations
    start, _ = asap
    slot = np.full(dag.n_nodes, -1, dtype=np.int64)
    slot[dag.freezable] = np.arange(len(dag.freezable))
    slot_l, hi, lo, es, d = slot.tolist(), dag.w_max.tolist(), dag.w_min.tolist(), start.tolist(), dur.tolist()
    r = ratio.tolist()

    def settle(v: int, latest_finish: float) -> float:
        """Lengthen a frozen v into its float; successors are final (reverse topological order), and es[v]
        only grows as predecessors thaw, which stay within their own latest finishes."""
        k, room = slot_l[v], latest_finish - es[v] - d[v]
        if k >= 0 and r[k] > 0 and room > 0 and hi[v] > lo[v]:
            d[v] = min(hi[v], d[v] + room)
            r[k] = (hi[v] - d[v]) / (hi[v] - lo[v])
        return float(d[v])

    dag.latest_finishes(dur, makespan, settle)
    return np.asarray(r)


def _pinned_by_rank_order(
    dag: FreezeDag, asap: tuple[np.ndarray, np.ndarray], duration: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """`asap` with ties broken towards the rank's own order: a start time that its rank predecessor's
    finish sets as well as another in-edge is pinned by the rank predecessor. Most rows are tight in
    these schedules, so the tie-break decides the starting tree; trees along the ranks are closer to the
    optimal basis (stage 2 at 32x256: ~29.9k -> ~22.8k iterations)."""
    start, tight = asap
    lengths = [len(rank) for rank in dag.schedule.ranks]
    rank = np.full(dag.n_nodes, -1, dtype=np.int64)  # copy and transfer nodes belong to no rank
    rank[: dag.n_actions] = np.repeat(np.arange(len(lengths)), lengths)
    u, v = dag.edge_u, dag.edge_v
    finish = start + duration
    tol = 1e-12 * max(1.0, float(np.abs(finish).max(initial=0.0)))
    along = (v == u + 1) & (rank[u] == rank[v]) & (rank[u] >= 0)
    tied = along & (finish[u] + dag.edge_delay >= start[v] - tol)
    pinned = tight.copy()
    pinned[v[tied]] = np.flatnonzero(tied)
    return start, pinned


def _asap_basis(
    dag: FreezeDag, model: _Model, asap: tuple[np.ndarray, np.ndarray], duration: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The unfrozen step's ASAP schedule as a basis: each start time basic and pinned by the in-edge that
    sets it (that row nonbasic), the makespan pinned by the latest sink, every other row's slack basic, every
    r at 0. Its duals are one unit of flow along the critical path, so r_a's reduced cost is 1 for min Σ r
    (stage 2: dual feasible, only T <= T* violated) and -Δ_a·flow_a for min T (stage 1: dual feasible once
    the critical path's freezable actions sit at their upper bound ρ)."""
    start, tight = asap
    lp = model.lp
    col = np.full(lp.num_columns, AT_LOWER, dtype=np.int8)
    row = np.full(lp.num_rows, BASIC, dtype=np.int8)
    pinned = tight >= 0
    col[model.t[pinned]] = BASIC
    row[tight[pinned]] = AT_LOWER
    col[model.T] = BASIC
    row[model.n_edges + int(np.argmax(start[dag.sinks] + duration[dag.sinks]))] = AT_LOWER
    return col, row


def _critical_freezable(
    dag: FreezeDag, asap: tuple[np.ndarray, np.ndarray], duration: np.ndarray
) -> np.ndarray:
    """Slots (into dag.freezable) of the freezable actions on the unfrozen step's critical path."""
    start, tight = asap
    slot = np.full(dag.n_nodes, -1, dtype=np.int64)
    slot[dag.freezable] = np.arange(len(dag.freezable))
    node, out = int(dag.sinks[int(np.argmax(start[dag.sinks] + duration[dag.sinks]))]), []
    while node >= 0:
        if slot[node] >= 0:
            out.append(int(slot[node]))
        edge = int(tight[node])
        node = int(dag.edge_u[edge]) if edge >= 0 else -1
    return np.asarray(out, dtype=np.int64)


def _segments(dag: FreezeDag, stage: np.ndarray) -> Iterator[tuple[float, float, np.ndarray]]:
    """(α, β, freezable slots) per segment of each chunk's curve: c(r) >= α + β r on that segment's line."""
    assert dag.curves is not None
    for s in np.unique(stage):
        members = np.flatnonzero(stage == s)
        pts = dag.curves[s]
        for (x0, y0), (x1, y1) in itertools.pairwise(pts):
            beta = (y1 - y0) / (x1 - x0)
            yield y0 - beta * x0, beta, members
