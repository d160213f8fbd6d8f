"""Memory planner: per chunk, how many layers keep, recompute, or offload their activations, and per rank
whether model states go to host memory — the fastest step whose HBM fits. A MILP on HiGHS.

Sets: actions i (the schedule DAG, sim/dag.py via solver.freeze_dag), chunks c with L_c layers, ranks r,
positions k in each rank's order. Per layer of chunk c: a_c activation bytes, q_c kept under recomputation,
f_c forward seconds; A_c the chunk's activation bytes; m microbatches.

    variables   k_c, d_c, n_c ∈ {0..L_c}  layers recomputed / offloaded to DRAM / offloaded to NVMe
                z_c, t_c, y_r ∈ {0, 1}     chunk recomputes at all / chunk offloads to NVMe / rank offloads states
                s_i >= 0 start times,  T makespan
    duration    D_i = w_i + f_c k_c for B/I of chunk c, else w_i
    minimise    T + ε Σ_c (f_c k_c m + x_c m)      (ε = 1e-6: prefer less work on ties; MIP gap 1%)
    subject to  s_v >= s_u + D_u + delay_uv                                  every DAG edge
                T >= s_i + D_i                                               the last action of every rank
                k_c + d_c + n_c <= L_c,  k_c <= L_c z_c,  n_c <= L_c t_c,  d_c <= L_c (1 - t_c)
                HBM at every position k of rank r, with N_kc microbatches of chunk c in flight and R_kc of
                them resident (the current action's, the next `lookahead` backwards' (prefetched), the last two
                forwards' (copies out may be unfinished)):
                  S_r - y_r H_r + Σ_c [N_kc (A_c - (a_c - q_c) k_c) - (N_kc - R_kc) a_c (d_c + n_c)]
                  + a_c z_c [k is a B/I of c]  <=  capacity - margin
                copies, FIFO per rank and direction, x_c = a_c (d_c / bw_link + n_c / bw_nvme) per microbatch:
                  e_j >= s_Fj + w_Fj + x_c,  e_j >= e_(j-1) + x_c,  s_F(j+1) >= e_(j-1)   (copy out, bounded)
                  p_b >= e_F(b) + x_c,  p_b >= s_(b - lookahead) + x_c,  p_b >= p_(b-1) + x_c,  s_b >= p_b
                T >= s_last(c) + D_last(c) + y_r C_c         (the optimizer step's copies, chunk c on rank r)
                host: Σ_c N^max_c a_c d_c + y_r H_r <= DRAM,  Σ_c N^max_c a_c n_c <= NVMe

With no plan fitting, the same constraints with `capacity` replaced by a variable P and minimise P give the
smallest HBM that would do. Every plan is re-simulated (sim.engine) and must fit with the simulated time
within 2% of T; the planner tightens its copy-time model from the simulation's stalls and re-solves a few
times before it gives up with an explicit error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim.config import FreezeConfig, Scenario
from sim.costs import CostTable, per_rank_sum
from sim.engine import SimResult, simulate
from sim.ir import Action, Kind, Schedule
from sim.memory import MemoryPlan, activation_arrays, with_states
from solver.errors import InfeasibleError, SolverError, VerificationError
from solver.freeze_dag import build_freeze_dag
from solver.highs import LinearProgram

EPS = 1e-6
TOLERANCE = 0.02
ROUNDS = 4


class MemoryInfeasibleError(InfeasibleError):
    """No keep/recompute/offload plan fits; the message gives the smallest HBM that would."""


@dataclass(frozen=True)
class MemoryPlanResult:
    plan: MemoryPlan
    predicted_makespan_s: float
    simulated: SimResult
    recompute_layers: np.ndarray  # per chunk
    dram_layers: np.ndarray
    nvme_layers: np.ndarray
    states_on_host: np.ndarray  # per rank
    solve_wall_s: float
    rounds: int


@dataclass(frozen=True)
class _Positions:
    """Per rank and position: chunks in flight (N), resident in full (R), and the B/I chunk at k (or -1)."""

    rank: np.ndarray  # (P,)
    inflight: np.ndarray  # (P, C)
    resident: np.ndarray  # (P, C)
    backward_chunk: np.ndarray  # (P,)
    max_inflight: np.ndarray  # (C,)


def _positions(schedule: Schedule, lookahead: int) -> _Positions:
    n_chunks = schedule.num_stages
    rows_rank, rows_n, rows_r, rows_b = [], [], [], []
    for r, actions in enumerate(schedule.ranks):
        inflight: dict[tuple[int, int], None] = {}
        recent_f: list[tuple[int, int]] = []
        backwards = [k for k, a in enumerate(actions) if a.kind in (Kind.B, Kind.I)]
        for k, a in enumerate(actions):
            key = (a.stage, a.microbatch)
            if a.kind is Kind.F:
                inflight[key] = None
            n_vec = np.zeros(n_chunks)
            for s, _mb in inflight:
                n_vec[s] += 1
            resident = {key} if key in inflight else set()
            resident.update(x for x in recent_f[-2:] if x in inflight)  # copies out possibly unfinished
            for kb in backwards:
                if k < kb <= k + lookahead:
                    resident.add((actions[kb].stage, actions[kb].microbatch))
            r_vec = np.zeros(n_chunks)
            for s, _mb in resident & set(inflight):
                r_vec[s] += 1
            rows_rank.append(r)
            rows_n.append(n_vec)
            rows_r.append(r_vec)
            rows_b.append(a.stage if a.kind in (Kind.B, Kind.I) else -1)
            if a.kind in (Kind.B, Kind.I):
                inflight.pop(key, None)
            if a.kind is Kind.F:
                recent_f.append(key)
    inflight_arr = np.asarray(rows_n)
    # identical rows constrain nothing new
    keys = np.concatenate([np.asarray(rows_rank)[:, None], inflight_arr, np.asarray(rows_r),
                           np.asarray(rows_b)[:, None]], axis=1)
    _, keep = np.unique(keys, axis=0, return_index=True)
    keep.sort()
    return _Positions(np.asarray(rows_rank)[keep], inflight_arr[keep], np.asarray(rows_r)[keep],
                      np.asarray(rows_b)[keep], inflight_arr.max(axis=0))


def plan_memory(
    sc: Scenario, costs: CostTable, schedule: Schedule, allow_state_offload: bool = True
) -> MemoryPlanResult:
    """Solve the MILP, re-simulate, refine the copy-time model on disagreement; raise if nothing fits."""
    d = costs.detail
    if d is None:
        raise SolverError("memory planner: the cost table has no per-layer detail")
    base = with_states(sc, costs, _keep_all(costs))
    lookahead = sc.memory.prefetch_lookahead
    slowdown = np.ones(costs.num_chunks)  # multiplies the modelled copy time per chunk, learnt from stalls
    limit = base.hbm_limit_bytes
    wall = 0.0
    for rnd in range(1, ROUNDS + 1):
        sol, t_pred, solve_s = _solve(sc, costs, schedule, base, lookahead, slowdown, limit, allow_state_offload)
        wall += solve_s
        plan = _to_plan(sc, costs, schedule, base, sol, lookahead)
        res = simulate(schedule, costs, memory=plan)
        fits = not (res.peak_hbm_bytes > base.hbm_limit_bytes * (1 + 1e-9)).any()
        close = abs(res.makespan_s - t_pred) <= TOLERANCE * t_pred
        if fits and close:
            return MemoryPlanResult(plan, t_pred, res, sol["k"], sol["d"], sol["n"], sol["y"], wall, rnd)
        if not fits:
            limit -= float((res.peak_hbm_bytes - base.hbm_limit_bytes).max())
        if res.stall_s is not None and res.makespan_s > t_pred:
            slowdown = np.where(plan.offload_bytes > 0, slowdown * 2.0, slowdown)
    raise VerificationError(
        f"memory planner: after {ROUNDS} rounds the simulation still disagrees with the MILP "
        f"(simulated {res.makespan_s:.6g} s vs planned {t_pred:.6g} s, peak HBM "
        f"{res.peak_hbm_bytes.max() / 2**30:.2f} GiB vs limit {base.hbm_limit_bytes / 2**30:.2f} GiB)"
    )


def smallest_hbm_bytes(sc: Scenario, costs: CostTable, schedule: Schedule, allow_state_offload: bool = True) -> float:
    """The least peak HBM any keep/recompute/offload plan reaches (capacity as a variable, minimised)."""
    base = with_states(sc, costs, _keep_all(costs))
    sol, _t, _w = _solve(sc, costs, schedule, base, sc.memory.prefetch_lookahead, np.ones(costs.num_chunks),
                         None, allow_state_offload)
    return float(sol["peak"])


def _keep_all(costs: CostTable) -> MemoryPlan:
    from sim.memory import keep_everything

    return keep_everything(costs)


def _solve(sc, costs, schedule, base: MemoryPlan, lookahead, slowdown, limit, allow_state_offload):
    d = costs.detail
    n_c, m = costs.num_chunks, schedule.num_microbatches
    n_r = schedule.num_ranks
    s2r = np.asarray(schedule.stage_to_rank)
    dag = build_freeze_dag(schedule, costs, FreezeConfig(cap=0.0))
    acts = dag.actions
    n_nodes = dag.n_nodes
    layers = d.layers.astype(float)
    a = d.layer_activation_bytes
    saved = a - d.layer_checkpoint_bytes
    f = d.layer_forward_s
    A = costs.activation_bytes
    link_bw, nvme_bw = base.host_link_bps, base.nvme_bps

    lp = LinearProgram("memory MILP", {"mip_rel_gap": 1e-2, "time_limit": 60.0})
    k = lp.add_variables(n_c, 0, layers)
    dv = lp.add_variables(n_c, 0, layers)
    nv = lp.add_variables(n_c, 0, layers)
    z = lp.add_variables(n_c, 0, 1)
    tn = lp.add_variables(n_c, 0, 1)
    y = lp.add_variables(n_r, 0, 1 if allow_state_offload else 0)
    s = lp.add_variables(n_nodes, 0, np.inf)
    T = lp.add_variables(1, 0, np.inf)[0]
    P = lp.add_variables(1, 0, np.inf)[0]  # peak HBM (bounded by limit, or minimised)
    lp.set_integer(np.concatenate([k, dv, nv, z, tn, y]))
    rows = _Rows()

    # layer choices
    for c in range(n_c):
        rows.add(-np.inf, layers[c], [k[c], dv[c], nv[c]], [1, 1, 1])
        rows.add(-np.inf, 0, [k[c], z[c]], [1, -layers[c]])
        rows.add(-np.inf, 0, [nv[c], tn[c]], [1, -layers[c]])
        rows.add(-np.inf, layers[c], [dv[c], tn[c]], [1, layers[c]])

    stage_of = np.array([acts[i].stage if i < len(acts) else -1 for i in range(n_nodes)])
    is_bwd = np.array([i < len(acts) and acts[i].kind in (Kind.B, Kind.I) for i in range(n_nodes)])
    w = dag.w_max

    def end_terms(i: int) -> tuple[list[int], list[float]]:
        """Columns and coefficients of D_i beyond its constant w_i."""
        return ([k[stage_of[i]]], [f[stage_of[i]]]) if is_bwd[i] else ([], [])

    # precedence
    for u, v, delay in zip(dag.edge_u, dag.edge_v, dag.edge_delay, strict=True):
        cols, vals = end_terms(u)
        rows.add(w[u] + delay, np.inf, [s[v], s[u], *cols], [1, -1, *[-x for x in vals]])
    for i in dag.sinks:
        cols, vals = end_terms(i)
        rows.add(w[i], np.inf, [T, s[i], *cols], [1, -1, *[-x for x in vals]])

    # offload timing, stream semantics as the engine: X_c = a_c (d_c / link + n_c / nvme) per microbatch.
    # Copies out run FIFO after each forward (e_j), a forward waits for the copy two forwards back, prefetches
    # run FIFO from the start of the action `lookahead` places before their backward (p_b), after the copy out.
    xd = a * slowdown / link_bw  # seconds per DRAM-offloaded layer
    xn = a * slowdown / nvme_bw
    index = {act: i for i, act in enumerate(acts)}
    fwd_rank = [[index[x] for x in actions if x.kind is Kind.F] for actions in schedule.ranks]
    e = {i: col for chain in fwd_rank for i, col in zip(chain, lp.add_variables(len(chain), 0, np.inf), strict=True)}
    for chain in fwd_rank:
        for j, i in enumerate(chain):
            c = stage_of[i]
            rows.add(w[i], np.inf, [e[i], s[i], dv[c], nv[c]], [1, -1, -xd[c], -xn[c]])
            if j >= 1:
                rows.add(0, np.inf, [e[i], e[chain[j - 1]], dv[c], nv[c]], [1, -1, -xd[c], -xn[c]])
            if j >= 2:
                rows.add(0, np.inf, [s[i], e[chain[j - 2]]], [1, -1])
    for actions in schedule.ranks:
        prev = None
        for pos, act in enumerate(actions):
            if act.kind not in (Kind.B, Kind.I):
                continue
            c, ib = act.stage, index[act]
            pb = lp.add_variables(1, 0, np.inf)[0]
            jf = index[Action(c, Kind.F, act.microbatch)]
            ahead = index[actions[max(pos - lookahead, 0)]]
            rows.add(0, np.inf, [pb, e[jf], dv[c], nv[c]], [1, -1, -xd[c], -xn[c]])
            rows.add(0, np.inf, [pb, s[ahead], dv[c], nv[c]], [1, -1, -xd[c], -xn[c]])
            if prev is not None:
                rows.add(0, np.inf, [pb, prev, dv[c], nv[c]], [1, -1, -xd[c], -xn[c]])
            rows.add(0, np.inf, [s[ib], pb], [1, -1])
            prev = pb
    for col in e.values():  # the last copies out also end within the step
        rows.add(0, np.inf, [T, col], [1, -1])

    # optimizer-step copies when rank r's states go to host
    host_states = _host_state_bytes(sc, costs)
    step_s = _step_copy_s(sc, costs, base)
    last = {}
    for i, act in enumerate(acts):
        if act.kind in (Kind.B, Kind.W):
            last[act.stage] = i
    for c, i in last.items():
        cols, vals = end_terms(i)
        rows.add(w[i], np.inf, [T, s[i], y[s2r[c]], *cols], [1, -1, -step_s[c], *[-x for x in vals]])

    # HBM at every distinct position
    pos = _positions(schedule, lookahead)
    static_r = per_rank_sum(base.static_hbm_bytes, s2r, n_r)
    hs_r = per_rank_sum(host_states, s2r, n_r)
    for p in range(len(pos.rank)):
        r = pos.rank[p]
        N, R = pos.inflight[p], pos.resident[p]
        const = static_r[r] + float(N @ A)
        cols = [P, y[r]]
        vals = [-1.0, -hs_r[r]]
        for c in np.flatnonzero(N):
            cols += [k[c], dv[c], nv[c]]
            vals += [-N[c] * saved[c], -(N[c] - R[c]) * a[c], -(N[c] - R[c]) * a[c]]
        bc = pos.backward_chunk[p]
        if bc >= 0:
            cols.append(z[bc])
            vals.append(a[bc])
        rows.add(-np.inf, -const, cols, vals)

    # host capacities per rank
    for r in range(n_r):
        chunks_r = np.flatnonzero(s2r == r)
        per = pos.max_inflight[chunks_r] * a[chunks_r]
        rows.add(-np.inf, d.dram_bytes, [*dv[chunks_r], y[r]], [*per, hs_r[r]])
        rows.add(-np.inf, d.nvme_bytes, [*nv[chunks_r]], [*per])

    rows.flush(lp)
    if limit is not None:
        lp.set_upper_bound(P, max(limit, 0.0))
        obj_cols = np.concatenate([[T], k, dv, nv])
        obj = np.concatenate([[1.0], EPS * m * f, EPS * m * xd, EPS * m * xn])
        what = "fitting the step into HBM"
    else:
        obj_cols = np.concatenate([[P], [T]])
        obj = np.array([1.0, 1e-9])
        what = "the smallest HBM"
    try:
        sol = lp.minimize(obj_cols, obj, what)
    except InfeasibleError:
        peak = smallest_hbm_bytes(sc, costs, schedule, allow_state_offload) if limit is not None else math.nan
        raise MemoryInfeasibleError(
            f"memory: no keep/recompute/offload plan fits {base.hbm_limit_bytes / 2**30:.2f} GiB (capacity - "
            f"margin); the smallest HBM that would do is {peak / 2**30:.2f} GiB"
        ) from None
    x = sol.x
    out = {
        "k": np.rint(x[k]), "d": np.rint(x[dv]), "n": np.rint(x[nv]), "y": np.rint(x[y]).astype(bool),
        "peak": x[P],
    }
    return out, float(x[T]), sol.wall_s


def _host_state_bytes(sc: Scenario, costs: CostTable) -> np.ndarray:
    """Per chunk, the model-state bytes that go to DRAM when its rank offloads states (optimizer + master)."""
    parts = costs.detail.state_bytes
    zero = np.zeros(costs.num_chunks)
    if sc.memory.optimizer != "hbm" or sc.memory.master_weights != "hbm":
        return zero  # the scenario already keeps them off HBM
    return parts.get("optimizer", zero) + parts.get("master_weights", zero)


def _step_copy_s(sc: Scenario, costs: CostTable, base: MemoryPlan) -> np.ndarray:
    """Per chunk, the optimizer step's exposed time with states on the host: grads out, Adam, weights back."""
    parts = costs.detail.state_bytes
    zero = np.zeros(costs.num_chunks)
    params = costs.params if costs.params is not None else zero
    return (parts.get("gradients", zero) / base.host_link_bps + params * 28 / costs.detail.dram_bps
            + parts.get("weights", zero) / base.host_link_bps)


def _to_plan(sc, costs, schedule, base: MemoryPlan, sol, lookahead) -> MemoryPlan:
    d = costs.detail
    s2r = np.asarray(schedule.stage_to_rank)
    kept, transient, extra = activation_arrays(costs, sol["k"], np.zeros(costs.num_chunks))
    off = d.layer_activation_bytes * (sol["d"] + sol["n"])
    chunk_states = sol["y"][s2r]  # per chunk: its rank offloads states
    hs = _host_state_bytes(sc, costs)
    params = costs.params if costs.params is not None else np.zeros(costs.num_chunks)
    parts = d.state_bytes
    zero = np.zeros(costs.num_chunks)
    policy = tuple(
        f"recompute {int(sol['k'][c])}/{int(d.layers[c])}, dram {int(sol['d'][c])}, nvme {int(sol['n'][c])}"
        + (", states on host" if chunk_states[c] else "")
        for c in range(costs.num_chunks)
    )
    return MemoryPlan(
        kept_bytes=kept,
        transient_bytes=transient,
        recompute_s=extra,
        offload_bytes=off,
        offload_nvme=sol["n"] > 0,
        static_hbm_bytes=base.static_hbm_bytes - np.where(chunk_states, hs, 0.0),
        static_host_bytes={"dram": base.static_host_bytes.get("dram", zero) + np.where(chunk_states, hs, 0.0),
                           "nvme": base.static_host_bytes.get("nvme", zero)},
        step_d2h_bytes=base.step_d2h_bytes + np.where(chunk_states, parts.get("gradients", zero), 0.0),
        step_host_s=base.step_host_s + np.where(chunk_states, params * 28 / d.dram_bps, 0.0),
        step_h2d_bytes=base.step_h2d_bytes + np.where(chunk_states, parts.get("weights", zero), 0.0),
        prefetch_lookahead=lookahead,
        hbm_limit_bytes=base.hbm_limit_bytes,
        policy=policy,
        host_link_bps=base.host_link_bps,
        nvme_bps=base.nvme_bps,
    )


class _Rows:
    """Collects sparse rows, then hands them to the LP in one block."""

    def __init__(self) -> None:
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []

    def add(self, lo: float, hi: float, cols, vals) -> None:
        row = len(self.lo)
        self.lo.append(lo)
        self.hi.append(hi)
        for col, val in zip(cols, vals, strict=True):
            if val != 0:
                self.r.append(row)
                self.c.append(int(col))
                self.v.append(float(val))

    def flush(self, lp: LinearProgram) -> None:
        lp.add_rows(np.asarray(self.lo), np.asarray(self.hi), np.asarray(self.r), np.asarray(self.c),
                    np.asarray(self.v), num_rows=len(self.lo))
