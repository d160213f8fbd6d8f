"""Memory planner: per chunk, how many layers keep, recompute, or offload their activations, and per rank
whether model states go to host memory — the fastest step whose HBM fits. A MILP on HiGHS.

Sets: nodes i of the step graph (sim/graph.py, as solver.freeze_dag arrays), chunks c with L_c layers, ranks r,
positions k in each rank's order. Per layer of chunk c: a_c activation bytes, q_c kept under recomputation,
f_c forward seconds; A_c the chunk's activation bytes; m microbatches.

    variables   k_c, d_c, n_c ∈ {0..L_c}  layers recomputed / offloaded to DRAM / offloaded to NVMe
                j_c ∈ {0..L_c}             layers under op-level selective recomputation (torchtitan's "op"
                                           policy, sim/layer_ops.py): keep q'_c, redo f'_c; 0 without a
                                           [model] (explicit costs have no ops) or with
                                           memory.plan_recompute = "full"
                z_c, t_c, y_r ∈ {0, 1}     chunk recomputes at all / chunk offloads to NVMe / rank offloads states
                o_c ∈ {0, 1}               chunk offloads its bf16 weights W_c in its idle windows
                                           (memory.offload_weights = "auto"; fixed by "all" or a list)
                u_c ∈ [0, L_c]             layers' worth of chunk c's W stash (w_c / L_c = σ_c each) that goes
                                           to DRAM after I and comes back before W (memory.offload_stash =
                                           "auto"; a share fixes it; 0 without a split backward); continuous:
                                           a stash is many tensors (two per linear layer and microbatch), so
                                           any share is a set of them to within one tensor
                h_c ∈ [0, 1]               share of the chunk's non-layer activations E_c (embedding output,
                                           LM head and loss) offloaded to DRAM with its layers'; 0 with
                                           layer-wise copies (they move whole layers)
                s_i >= 0 start times,  T makespan
    duration    D_i = w_i + f_c k_c + f'_c j_c for B/I of chunk c, else w_i; under ZeRO-3 without a pipeline,
                whose B/I already waits ς_c on its parameter traffic (ChunkDetail.backward_comm_slack_s),
                w_i + x_c with x_c >= f_c k_c + f'_c j_c - ς_c, x_c >= 0 (sim.memory.exposed_recompute_s)
    minimise    T + ε Σ_c (f_c k_c m + f'_c j_c m + x_c m + ξ_c m)   (ε = 1e-6: prefer less work on ties;
                                                                        MIP gap 1%)
    subject to  s_v >= s_u + D_u + delay_uv                                  every DAG edge
                T >= s_i + D_i                                               the last action of every rank
                k_c + j_c + d_c + n_c <= L_c,  k_c + j_c <= L_c z_c,  n_c <= L_c t_c,  d_c <= L_c (1 - t_c),
                h_c <= 1 - t_c
                HBM at every position k of rank r, with N_kc microbatches of chunk c in flight and R_kc of
                them resident (the current action's, the next `lookahead` backwards' (prefetched), the last two
                forwards' (copies out may be unfinished; at a forward, the last one: the engine gates a forward
                on the copy two back)): an upper bound where the engine's timing ends a copy or starts a
                prefetch sooner (docs/memory.md, tests/test_memory_brute_force.py):
                  S_r - y_r H_r + Σ_c [N_kc (A_c - (a_c - q_c) k_c - (a_c - q'_c) j_c)
                                       - (N_kc - R_kc) (a_c (d_c + n_c) + E_c h_c)]
                  + max(ℓ_c, a_c z_c) [k is a B/I of c] - Σ_c o_c W_c [k inside a weight window of c]
                  + Σ_c [S_kc w_c - (S_kc - SR_kc) σ_c u_c] + Σ_c (D_kc g_c + F_kc o_c)  <=  capacity - margin
                (ℓ_c: the loss's working set, last chunk only; freed before the first recomputation starts, so
                the max, written ℓ_c + max(a_c - ℓ_c, 0) z_c);
                S_kc: microbatches of c between their I's end and their W's end, each holding its W stash
                w_c; SR_kc of them resident in full: the current W's, the next `lookahead` W's (prefetched), the
                last two I's (stash copies out may be unfinished; at an I, the last one); D_kc: microbatches
                of c whose B/I has ended, each leaving g_c until the step's end, and F_kc those whose F has
                started (the current one included), each leaving o_c (torch pipelining's input gradients and
                stage outputs, sim/p2p_buffers.py); after the last action, S_r - y_r H_r + Σ_c m (g_c + o_c)
                + the optimizer step's working memory <= the same
                copies, FIFO per rank and direction, x_c = a_c (d_c / bw_link + n_c / bw_nvme) + E_c h_c / bw_link
                per microbatch after F, ξ_c = σ_c u_c / bw_link after I; j runs over the rank's F and I in its order:
                  e_j >= s_j + D_j + x_j,  e_j >= e_(j-1) + x_j                        (copy out, FIFO)
                  s_F >= e of the F two forwards back,  s_I >= e of the I two I's back  (bounded pinned buffers)
                  p_b >= e_F(b) + x_c,  p_b >= s_(b - lookahead) + x_c,  p_b >= p_(b-1) + x_c,  s_b >= p_b
                  (and the same for a W's stash prefetch, ξ_c, after its I's copy out e_I(W))
                weight prefetches in the same h2d chain (sim.graph.weight_windows), ω_c = W_c / bw_link:
                  q_w >= s_issuer(w) + o_c ω_c,  q_w >= (previous h2d copy) + o_c ω_c,  s_use(w) >= q_w
                T >= s_last(c) + D_last(c) + B_c + y_r C_c + δ_c o_c ω_c   (the optimizer step's copies, chunk c
                     on rank r: B_c those of states the scenario already keeps off HBM, C_c those of states the
                     MILP moves there (y_r is fixed at 0 when the scenario's states are off HBM already);
                     sim.memory.with_weight_offload's rule with α_c = 1 if c starts the step away
                     (sim.graph.starts_away): δ_c = 1 + α_c with a GPU optimizer (refresh the host copy,
                     bring α-chunks back for the update), δ_c = -α_c with a host optimizer (no weights-back)
                     and, its chunks' chains queueing FIFO on the rank's copy engines, every staircase
                     through them (_step_copy_rows)
                host: Σ_c (N^max_c (a_c d_c + E_c h_c) + S^max_c σ_c u_c + o_c W_c) + y_r H_r <= DRAM,
                      Σ_c N^max_c a_c n_c <= NVMe

With memory.copy_granularity = "layer" (sim.graph.LayerCopy: a chunk's action takes w_i / L_c per layer after
its recomputation; u the layers a copy moves, d_c + n_c or u_c; c the first-needed piece's copy time) the copy
out and consumer rows are instead
                  e_j >= s_j + D_j - w_j + w_j / L_c + x_j,   e_j >= s_j + D_j - w_j + u w_j / L_c + c
                  s_b >= p_b - x_c,   s_b + D_b >= p_b - x_c + c + u w_b / L_c,   s_b + D_b >= p_b + w_b / L_c
               with c a DRAM layer's copy (+ t_c times the NVMe difference) for activations (whole layers:
               exact), and min(σ_c / link, w / L_c) for a stash share (exact when a layer's copy is the slower,
               _layer_terms); a layer-wise plan is accepted when it fits and simulates within T (1 + 2%),
               however much faster, and a disagreement slows its copies by the step's own excess.

With no plan fitting, the same constraints with `capacity` replaced by a variable P and minimise P give the
smallest HBM that would do. Every plan is re-simulated (sim.engine) and must fit with the simulated time
within 2% of T; the planner tightens its copy-time model from the simulation's stalls and re-solves a few
times before it gives up with an explicit error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pipeplan.sim.config import FreezeConfig, Scenario
from pipeplan.sim.copy_rules import PINNED_BUFFERS
from pipeplan.sim.costs import CostTable, per_rank_sum
from pipeplan.sim.engine import SimResult, simulate
from pipeplan.sim.graph import (
    STASH_KINDS,
    has_windows,
    prefetch_issuer,
    splits_backward,
    starts_away,
    step_structure,
    weight_windows,
)
from pipeplan.sim.ir import BACKWARD_KINDS, Kind, Schedule
from pipeplan.sim.memory import (
    HOST_ADAM_BYTES_PER_PARAM,
    MemoryPlan,
    activation_arrays,
    exposed_recompute_s,
    keep_everything,
    or_zeros,
    weight_offload_mask,
    with_copy_granularity,
    with_states,
    with_weight_offload,
)
from pipeplan.solver.errors import InfeasibleError, SolverError, VerificationError
from pipeplan.solver.freeze_dag import FreezeDag, build_freeze_dag
from pipeplan.solver.highs import LinearProgram

EPS = 1e-6
TOLERANCE = 0.02
ROUNDS = 4
# Limit work, not time, so the answer never depends on machine load (docs/memory.md, the MILP section): HiGHS
# stops at the 1% gap or after MAX_NODES branch-and-bound nodes, with a fixed seed and one thread
# (solver.highs); past the node limit the incumbent is kept, flagged as not proven (every plan is re-simulated
# anyway). The time limit is only a safety net; reaching it raises SolverTimeoutError, never a guess.
# Its LP relaxation is tight but good incumbents are hard to find: at 208 layers (v = 4, cap 40, full B) the root
# bound is 73.0 s, HiGHS' default heuristic effort (0.05) found only a 144.9 s incumbent in 1000 nodes, and at
# 0.3 it finds a 73.9 s plan, within the gap (docs/memory.md, the MILP section).
MAX_NODES = 1000
MILP_OPTIONS: dict[str, float | int | str | bool] = {
    "mip_rel_gap": 1e-2, "mip_max_nodes": MAX_NODES, "random_seed": 0, "time_limit": 600.0,  # threads: highs.py
    "mip_heuristic_effort": 0.3,
}
# The model counts memory in GiB (P and every HBM and host row): in bytes its rows spanned 6e-3 to 4e12, HiGHS
# warned that the model was badly scaled for its 1e-6 feasibility tolerance, and its root node ran for minutes
# (docs/memory.md, the MILP section). FEASIBILITY is that tolerance, in GiB: P's bound keeps twice it clear of
# the HBM limit (P's bound and its row may each be off by it), so a plan within tolerance still fits.
GIB = float(2**30)
FEASIBILITY = 1e-6


class MemoryInfeasibleError(InfeasibleError):
    """No keep/recompute/offload plan fits; the message gives the smallest HBM that would."""


@dataclass(frozen=True)
class MemoryChoice:
    """The MILP's integer decision: per chunk, layers recomputed / offloaded to DRAM / to NVMe; per rank,
    whether its optimizer state and master weights live on the host. Plain data: it travels to the ranks."""

    recompute_layers: np.ndarray  # (chunks,)
    dram_layers: np.ndarray  # (chunks,)
    nvme_layers: np.ndarray  # (chunks,)
    states_on_host: np.ndarray  # (ranks,) bool
    weights_offloaded: np.ndarray | None = None  # (chunks,) bool: bf16 weights off HBM in idle windows
    stash_layers: np.ndarray | None = None  # (chunks,): layers' worth of W stash (a real) in DRAM between I and W
    op_layers: np.ndarray | None = None  # (chunks,): layers under op-level selective recomputation (after the k)
    # (chunks,): share in [0, 1] of the chunk's activations outside its layers (the last chunk's LM head and
    # loss, the first chunk's embedding output) offloaded to DRAM with the layers' (0: kept in HBM)
    head_share: np.ndarray | None = None

    @property
    def weight_mask(self) -> np.ndarray:
        n = len(self.recompute_layers)
        return np.zeros(n, bool) if self.weights_offloaded is None else np.asarray(self.weights_offloaded, bool)

    @property
    def stash_offload_layers(self) -> np.ndarray:
        return or_zeros(self.stash_layers, len(self.recompute_layers))

    @property
    def op_recompute_layers(self) -> np.ndarray:
        return or_zeros(self.op_layers, len(self.recompute_layers))

    @property
    def head_offload_share(self) -> np.ndarray:
        return or_zeros(self.head_share, len(self.recompute_layers))

    def to_dict(self) -> dict[str, list]:
        return {"recompute_layers": [int(x) for x in self.recompute_layers],
                "dram_layers": [int(x) for x in self.dram_layers], "nvme_layers": [int(x) for x in self.nvme_layers],
                "states_on_host": [bool(x) for x in self.states_on_host],
                "weights_offloaded": [bool(x) for x in self.weight_mask],
                "stash_layers": [float(x) for x in self.stash_offload_layers],
                "op_layers": [int(x) for x in self.op_recompute_layers],
                "head_share": [float(x) for x in self.head_offload_share]}

    @classmethod
    def from_dict(cls, d: dict[str, list]) -> MemoryChoice:
        return cls(np.asarray(d["recompute_layers"], float), np.asarray(d["dram_layers"], float),
                   np.asarray(d["nvme_layers"], float), np.asarray(d["states_on_host"], bool),
                   np.asarray(d.get("weights_offloaded", [False] * len(d["recompute_layers"])), bool),
                   np.asarray(d.get("stash_layers", [0] * len(d["recompute_layers"])), float),
                   np.asarray(d.get("op_layers", [0] * len(d["recompute_layers"])), float),
                   np.asarray(d.get("head_share", [0] * len(d["recompute_layers"])), float))


@dataclass(frozen=True)
class MilpSolution:
    choice: MemoryChoice
    makespan_s: float  # T
    peak_hbm_bytes: float  # P
    wall_s: float
    proven_optimal: bool = True  # False: HiGHS' incumbent at the node limit (MILP_OPTIONS), not proven
    mip_gap: float = 0.0  # HiGHS' relative gap at the end (<= 1% when proven)
    dual_bound: float = math.nan  # the proven lower bound on the objective (T, or P when minimising HBM)


@dataclass(frozen=True)
class MemoryPlanResult:
    plan: MemoryPlan
    predicted_makespan_s: float
    simulated: SimResult
    choice: MemoryChoice
    solve_wall_s: float
    rounds: int
    proven_optimal: bool = True  # the last round's MILP reached its 1% gap (else: a verified incumbent)
    mip_gap: float = 0.0  # the last round's MILP gap

    @property
    def recompute_layers(self) -> np.ndarray:
        return self.choice.recompute_layers

    @property
    def dram_layers(self) -> np.ndarray:
        return self.choice.dram_layers

    @property
    def nvme_layers(self) -> np.ndarray:
        return self.choice.nvme_layers

    @property
    def states_on_host(self) -> np.ndarray:
        return self.choice.states_on_host


@dataclass(frozen=True)
class _Positions:
    """Per rank and position: chunks in flight (N), resident in full (R), and the B/I chunk at k (or -1)."""

    rank: np.ndarray  # (P,)
    inflight: np.ndarray  # (P, C)
    resident: np.ndarray  # (P, C)
    backward_chunk: np.ndarray  # (P,)
    max_inflight: np.ndarray  # (C,)
    weights_away: np.ndarray  # (P, C): 1 where the position lies inside a weight window of the chunk
    stashed: np.ndarray  # (P, C): microbatches whose I has ended and whose W has not (each holds a W stash)
    stash_resident: np.ndarray  # (P, C): of those, the ones whose stash is whole in HBM even when offloaded
    max_stashed: np.ndarray  # (C,)
    forwards_started: np.ndarray  # (P, C): microbatches whose F has started, the current one included (each
    # leaves MemoryPlan.forward_retained_bytes)
    backwards_done: np.ndarray  # (P, C): microbatches whose B/I has ended (each leaves backward_retained_bytes)


def _away_positions(schedule: Schedule, lookahead: int) -> list[np.ndarray]:
    """Per rank, (positions, C): 1 where an offloading chunk's weights are off HBM (sim.graph.weight_windows):
    after the action that releases them, before the action that issues their prefetch."""
    st = step_structure(schedule)
    away = [np.zeros((len(r), schedule.num_stages)) for r in schedule.ranks]
    for w in weight_windows(schedule, lookahead):
        r = schedule.stage_to_rank[w.chunk]
        first = 0 if w.release_after < 0 else w.release_after - st.rank_offsets[r] + 1
        last = len(schedule.ranks[r]) if w.issuer < 0 else w.issuer - st.rank_offsets[r]
        away[r][first:last, w.chunk] = 1.0
    return away


def _whole_per_chunk(held: dict, key: tuple[int, int], recent: list, users: list[int], actions: list, k: int,
                     lookahead: int, n_chunks: int, gated: bool) -> np.ndarray:
    """Per chunk, how many of the `held` (activations or W stashes) are whole in HBM at position k even when
    offloaded: the current action's, the last two copied out (possibly unfinished; only the last one when the
    action at k is `gated`, a producer that the engine starts only once the copy two producers back has
    ended), and those whose user (a position in `users`) lies within `lookahead` actions, already
    prefetched."""
    whole = {key} if key in held else set()
    # at a forward or an I (gated by the pinned buffers) only the last copy out can still be in flight
    in_flight = PINNED_BUFFERS - 1 if gated else PINNED_BUFFERS
    whole.update(x for x in recent[-in_flight:] if x in held)  # their copies out may be unfinished
    whole.update((actions[j].stage, actions[j].microbatch) for j in users if k < j <= k + lookahead)
    vec = np.zeros(n_chunks)
    for s, _mb in whole & set(held):
        vec[s] += 1
    return vec


def _positions(schedule: Schedule, lookahead: int, weights: bool = False, retained: bool = False) -> _Positions:
    """The distinct memory states of every rank (`weights`: with the weight windows' positions, which only a
    plan that may offload weights needs; `retained`: with the counts of forwards started and backwards ended,
    which only a plan with MemoryPlan's forward/backward_retained_bytes needs; without them fewer rows are
    distinct)."""
    n_chunks = schedule.num_stages
    away = _away_positions(schedule, lookahead) if weights else [np.zeros((len(r), n_chunks)) for r in schedule.ranks]
    rows_rank, rows_n, rows_r, rows_b, rows_w, rows_s, rows_sr, rows_f, rows_d = [], [], [], [], [], [], [], [], []
    for r, actions in enumerate(schedule.ranks):
        started, done = np.zeros(n_chunks), np.zeros(n_chunks)
        inflight: dict[tuple[int, int], None] = {}
        stashed: dict[tuple[int, int], None] = {}  # the engine holds a stash from I's end to W's end
        recent_f: list[tuple[int, int]] = []
        recent_i: list[tuple[int, int]] = []
        backwards = [k for k, a in enumerate(actions) if a.kind in BACKWARD_KINDS]
        w_nodes = [k for k, a in enumerate(actions) if a.kind is Kind.W]
        for k, a in enumerate(actions):
            key = (a.stage, a.microbatch)
            if a.kind is Kind.F:
                inflight[key] = None
                started[a.stage] += 1
            n_vec = np.zeros(n_chunks)
            for s, _mb in inflight:
                n_vec[s] += 1
            r_vec = _whole_per_chunk(inflight, key, recent_f, backwards, actions, k, lookahead, n_chunks,
                                     a.kind is Kind.F)
            rows_rank.append(r)
            rows_n.append(n_vec)
            rows_r.append(r_vec)
            rows_b.append(a.stage if a.kind in BACKWARD_KINDS else -1)
            rows_w.append(away[r][k])
            s_vec = np.zeros(n_chunks)
            for s, _mb in stashed:
                s_vec[s] += 1
            rows_s.append(s_vec)
            rows_sr.append(_whole_per_chunk(stashed, key, recent_i, w_nodes, actions, k, lookahead, n_chunks,
                                            a.kind is Kind.I))
            rows_f.append(started.copy() if retained else np.zeros(n_chunks))
            rows_d.append(done.copy() if retained else np.zeros(n_chunks))
            if a.kind is Kind.I:
                stashed[key] = None
                recent_i.append(key)
            elif a.kind is Kind.W:
                stashed.pop(key, None)
            if a.kind in BACKWARD_KINDS:
                inflight.pop(key, None)
                done[a.stage] += 1
            if a.kind is Kind.F:
                recent_f.append(key)
    inflight_arr = np.asarray(rows_n)
    # identical rows constrain nothing new
    away_arr, stash_arr, whole_arr = np.asarray(rows_w), np.asarray(rows_s), np.asarray(rows_sr)
    started_arr, done_arr = np.asarray(rows_f), np.asarray(rows_d)
    keys = np.concatenate([np.asarray(rows_rank)[:, None], inflight_arr, np.asarray(rows_r),
                           np.asarray(rows_b)[:, None], away_arr, stash_arr, whole_arr, started_arr, done_arr], axis=1)
    _, keep = np.unique(keys, axis=0, return_index=True)
    keep.sort()
    return _Positions(np.asarray(rows_rank)[keep], inflight_arr[keep], np.asarray(rows_r)[keep],
                      np.asarray(rows_b)[keep], inflight_arr.max(axis=0), away_arr[keep], stash_arr[keep],
                      whole_arr[keep], stash_arr.max(axis=0), started_arr[keep],
                      done_arr[keep])


def plan_memory(
    sc: Scenario, costs: CostTable, schedule: Schedule, allow_state_offload: bool = True, explain: bool = True
) -> MemoryPlanResult:
    """Solve the MILP, re-simulate, refine the copy-time model on disagreement; raise if nothing fits, with the
    smallest HBM that would do unless `explain` is False (a second MILP, often minutes: a search that only asks
    whether a plan fits skips it)."""
    d = costs.detail
    if d is None:
        raise SolverError("memory planner: the cost table has no per-layer detail")
    base = with_states(sc, costs, keep_everything(costs))
    lookahead = sc.memory.prefetch_lookahead
    slowdown = np.ones(costs.num_chunks)  # multiplies the modelled copy time per chunk, learnt from stalls
    limit = base.hbm_limit_bytes
    wall = 0.0
    for rnd in range(1, ROUNDS + 1):
        sol = _solve(sc, costs, schedule, base, lookahead, slowdown, limit, allow_state_offload, explain)
        t_pred = sol.makespan_s
        wall += sol.wall_s
        plan = plan_from_choice(sc, costs, schedule, base, sol.choice, lookahead)
        res = simulate(schedule, costs, memory=plan)
        fits = not (res.peak_hbm_bytes > base.hbm_limit_bytes * (1 + 1e-9)).any()
        close = abs(res.makespan_s - t_pred) <= TOLERANCE * t_pred
        if plan.layer_copies:  # copies overlap compute: a plan faster than predicted is fine
            close = res.makespan_s <= (1 + TOLERANCE) * t_pred
        if fits and close:
            return MemoryPlanResult(plan, t_pred, res, sol.choice, wall, rnd, sol.proven_optimal, sol.mip_gap)
        if not fits:
            limit -= float((res.peak_hbm_bytes - base.hbm_limit_bytes).max())
        if res.stall_s is not None and res.makespan_s > t_pred:
            copies = (plan.offload_bytes > 0) | (plan.stash_offload_bytes > 0)  # plan_from_choice sets both per chunk
            # layer-wise copies overlap their producer and consumer, so a doubled copy time overshoots far:
            # their copies slow by the step's own excess instead
            step = 2.0 if not plan.layer_copies else res.makespan_s / t_pred
            slowdown = np.where(copies, slowdown * step, slowdown)
    raise VerificationError(
        f"memory planner: after {ROUNDS} rounds the simulation still disagrees with the MILP "
        f"(simulated {res.makespan_s:.6g} s vs planned {t_pred:.6g} s, peak HBM "
        f"{res.peak_hbm_bytes.max() / 2**30:.2f} GiB vs limit {base.hbm_limit_bytes / 2**30:.2f} GiB)"
    )


def makespan_lower_bound(sc: Scenario, costs: CostTable, schedule: Schedule,
                         allow_state_offload: bool = True) -> float | None:
    """Seconds no plan `plan_memory` returns can beat in simulation, from the first round's LP relaxation (seconds
    to solve where the MILP takes minutes); None when that relaxation is infeasible, so no plan fits. Why it
    bounds: later rounds only lengthen copies and lower the HBM limit (their T is no smaller), the plan's T is
    at least its round's relaxation, and a chunk-copy plan is accepted only within TOLERANCE of its T. Plans
    with layer-wise copies may run faster than their T (plan_memory), so for them the bound is 0, as it is when
    HiGHS ends the relaxation without an optimum (status Unknown: rows at their tolerance can leave a residual
    after postsolve, as byte-scaled rows did at ~1e-5 B) or at its time limit."""
    if sc.memory.copy_granularity == "layer":
        return 0.0
    base = with_states(sc, costs, keep_everything(costs))
    try:
        sol = _solve(sc, costs, schedule, base, sc.memory.prefetch_lookahead, np.ones(costs.num_chunks),
                     base.hbm_limit_bytes, allow_state_offload, explain=False, relax=True)
    except InfeasibleError:
        return None
    except SolverError:  # no optimum, so no proven bound: the caller plans this order as if unbounded
        return 0.0
    return (1 - TOLERANCE) * sol.makespan_s


@dataclass(frozen=True)
class SmallestHbm:
    """The least peak HBM any plan reaches: `bytes` is a plan's peak; proven, it is the least within the MIP gap,
    else (node limit) the least lies between `lower_bytes` (HiGHS' dual bound) and `bytes`."""

    bytes: float
    proven_optimal: bool
    lower_bytes: float

    def describe(self) -> str:
        """`the smallest HBM that would do is 12.30 GiB`, or `... is at most 12.30 GiB (at least 11.90 GiB)`."""
        if self.proven_optimal:
            return f"the smallest HBM that would do is {self.bytes / 2**30:.2f} GiB"
        return (f"the smallest HBM that would do is at most {self.bytes / 2**30:.2f} GiB (at least "
                f"{self.lower_bytes / 2**30:.2f} GiB; the MILP stopped at its node limit)")


def smallest_hbm_bytes(sc: Scenario, costs: CostTable, schedule: Schedule,
                       allow_state_offload: bool = True) -> SmallestHbm:
    """The least peak HBM any keep/recompute/offload plan reaches (capacity as a variable, minimised)."""
    base = with_states(sc, costs, keep_everything(costs))
    sol = _solve(sc, costs, schedule, base, sc.memory.prefetch_lookahead, np.ones(costs.num_chunks), None,
                 allow_state_offload)
    return SmallestHbm(sol.peak_hbm_bytes, sol.proven_optimal, sol.dual_bound)


@dataclass(frozen=True)
class _Columns:
    """The model's variables (column indices), shaped like the problem."""

    recompute: np.ndarray  # k_c
    op: np.ndarray  # j_c
    dram: np.ndarray  # d_c
    nvme: np.ndarray  # n_c
    recomputes: np.ndarray  # z_c
    to_nvme: np.ndarray  # t_c
    states_on_host: np.ndarray  # y_r
    weights: np.ndarray  # o_c
    stash: np.ndarray  # u_c
    start: np.ndarray  # s_i, one per node of the step graph
    makespan: int  # T
    peak: int  # P
    # x_c >= f_c k_c + f'_c j_c - ς_c, x_c >= 0: the recomputation B/I still adds past its ZeRO-3 slack ς_c
    # (sim.memory.exposed_recompute_s); None without slack, where B/I adds f_c k_c itself
    exposed: np.ndarray | None = None
    head: np.ndarray | None = None  # h_c, the share of the chunk's non-layer activations offloaded to DRAM


@dataclass(frozen=True)
class _Chunks:
    """Per chunk, the coefficients the rows use (module docstring's names)."""

    layers: np.ndarray  # L_c
    act: np.ndarray  # a_c, bytes per layer
    saved: np.ndarray  # a_c - q_c, bytes recomputation frees per layer
    fwd: np.ndarray  # f_c, seconds per recomputed layer
    op_saved: np.ndarray  # a_c - q'_c, bytes op-level recomputation frees per layer
    op_fwd: np.ndarray  # f'_c, seconds op-level recomputation redoes per layer
    slack: np.ndarray  # ς_c, seconds B/I waits on ZeRO-3 parameter traffic beyond its compute (recomputation fills it)
    copy_dram: np.ndarray  # seconds per DRAM-offloaded layer (slowdown included)
    copy_nvme: np.ndarray  # seconds per NVMe-offloaded layer
    weight_bytes: np.ndarray  # W_c, the bf16 weights
    weight_copy: np.ndarray  # ω_c, seconds to bring them back (slowdown included)
    stash: np.ndarray  # σ_c, W stash bytes per layer and microbatch
    stash_copy: np.ndarray  # seconds per offloaded stash layer, each way (slowdown included)
    head: np.ndarray  # E_c, activation bytes per microbatch outside the chunk's layers (LM head, loss, ...)
    head_copy: np.ndarray  # seconds to move all of E_c, each way (slowdown included)


def _solve(sc: Scenario, costs: CostTable, schedule: Schedule, base: MemoryPlan, lookahead: int,
           slowdown: np.ndarray, limit: float | None, allow_state_offload: bool, explain: bool = True,
           relax: bool = False) -> MilpSolution:
    """Build the MILP (module docstring) over the step graph and solve it; `limit` None minimises HBM. Infeasible,
    the error names the smallest HBM that would do when `explain` (plan_memory). `relax`: its LP relaxation,
    minimising T alone (a lower bound on the MILP's T, makespan_lower_bound)."""
    d = costs.detail
    n_c, n_r = costs.num_chunks, schedule.num_ranks
    dag = build_freeze_dag(schedule, costs, FreezeConfig(cap=0.0))
    weights = d.state_bytes.get("weights", np.zeros(n_c))
    layers = d.layers.astype(float)
    sigma = or_zeros(base.stash_bytes, n_c) / np.maximum(layers, 1)
    slack = or_zeros(d.backward_comm_slack_s, n_c)
    head = head_activation_bytes(costs)
    # a [model]'s ops make op-level recomputation a choice, unless memory.plan_recompute = "full"
    ops = d.op_checkpoint_bytes is not None and sc.memory.plan_recompute == "full+op"
    ch = _Chunks(layers, d.layer_activation_bytes, d.layer_activation_bytes - d.layer_checkpoint_bytes,
                 d.layer_forward_s, d.layer_activation_bytes - or_zeros(d.op_checkpoint_bytes, n_c),
                 or_zeros(d.op_recompute_s, n_c), slack, d.layer_activation_bytes * slowdown / base.host_link_bps,
                 d.layer_activation_bytes * slowdown / base.nvme_bps, weights, weights * slowdown / base.host_link_bps,
                 sigma, sigma * slowdown / base.host_link_bps, head, head * slowdown / base.host_link_bps)
    # u_c: memory.offload_stash = "auto" lets the MILP choose, a share fixes it (0: the stash stays in HBM)
    share = sc.memory.offload_stash
    u_lo, u_hi = (np.zeros(n_c), layers) if share == "auto" else (layers * share, layers * share)
    if not (splits_backward(schedule) and sigma.any()):  # no W stash to move at all
        u_lo, u_hi = np.zeros(n_c), np.zeros(n_c)
    stash = bool(u_hi.any())
    mode = sc.memory.offload_weights
    fixed = weight_offload_mask(sc, n_c).astype(float)
    w_lo, w_hi = (np.zeros(n_c), np.ones(n_c)) if mode == "auto" else (fixed, fixed)
    windowed = has_windows(schedule, lookahead)  # a chunk without a window offloads nothing (with_weight_offload)
    w_lo, w_hi = w_lo * windowed, w_hi * windowed
    host_states = _host_state_bytes(sc, costs)  # what moving a rank's states to host frees (0: already there)
    lp = LinearProgram("memory MILP", MILP_OPTIONS)
    col = _Columns(
        lp.add_variables(n_c, 0, ch.layers), lp.add_variables(n_c, 0, ch.layers if ops else 0),
        lp.add_variables(n_c, 0, ch.layers), lp.add_variables(n_c, 0, ch.layers),
        lp.add_variables(n_c, 0, 1), lp.add_variables(n_c, 0, 1),
        lp.add_variables(n_r, 0, 1 if allow_state_offload and host_states.any() else 0),
        lp.add_variables(n_c, w_lo, w_hi),
        lp.add_variables(n_c, u_lo, u_hi),
        lp.add_variables(dag.n_nodes, 0, np.inf), lp.add_variables(1, 0, np.inf)[0], lp.add_variables(1, 0, np.inf)[0],
        lp.add_variables(n_c, 0, np.inf) if slack.any() else None,
        # h_c: layer-wise copies move whole layers only (sim.graph.LayerCopy), so there the head stays in HBM
        lp.add_variables(n_c, 0, 0.0 if sc.memory.copy_granularity == "layer" else (head > 0).astype(float)),
    )
    if not relax:
        lp.set_integer(np.concatenate([col.recompute, col.op, col.dram, col.nvme, col.recomputes, col.to_nvme,
                                       col.states_on_host, col.weights]))
    rows = _Rows()
    _layer_choice_rows(rows, col, ch)
    if col.exposed is not None:  # x_c - f_c k_c - f'_c j_c >= -ς_c
        for c in range(n_c):
            rows.add(-ch.slack[c], np.inf, [col.exposed[c], col.recompute[c], col.op[c]],
                     [1, -ch.fwd[c], -ch.op_fwd[c]])
    _precedence_rows(rows, col, ch, dag)
    _copy_rows(rows, lp, col, ch, dag, lookahead, w_hi.any(), stash, sc.memory.copy_granularity == "layer")
    _step_copy_rows(rows, col, ch, dag, _step_copy_stages(costs, base), _base_step_stages(base),
                    sc.memory.optimizer != "hbm",
                    starts_away(schedule, lookahead))
    retained = bool(base.forward_retained_bytes.any() or base.backward_retained_bytes.any())
    pos = _positions(schedule, lookahead, bool(w_hi.any()), retained)
    _hbm_rows(rows, col, ch, pos, base, costs, schedule, host_states)
    _host_rows(rows, col, ch, pos, costs, schedule, host_states)
    rows.flush(lp)

    m = schedule.num_microbatches
    if limit is not None:
        lp.set_upper_bound(col.peak, max(limit / GIB - 2 * FEASIBILITY, 0.0))
        obj_cols = np.concatenate([[col.makespan], col.recompute, col.op, col.dram, col.nvme, col.weights, col.stash,
                                   col.head])
        obj = np.concatenate([[1.0], EPS * m * ch.fwd, EPS * m * ch.op_fwd, EPS * m * ch.copy_dram,
                              EPS * m * ch.copy_nvme, EPS * m * ch.weight_copy, EPS * m * ch.stash_copy,
                              EPS * m * ch.head_copy])
        what = "fitting the step into HBM"
        if relax:
            obj_cols, obj, what = np.array([col.makespan]), np.array([1.0]), "the LP relaxation of " + what
    else:
        obj_cols = np.concatenate([[col.peak], [col.makespan]])
        obj = np.array([1.0, 1e-9])
        what = "the smallest HBM"
    try:
        sol = lp.minimize(obj_cols, obj, what, accept_incumbent=True)  # every plan is re-simulated
    except InfeasibleError:
        least = ("; " + smallest_hbm_bytes(sc, costs, schedule, allow_state_offload).describe() if explain
                 else "") if limit is not None else "; the smallest HBM is unknown"
        raise MemoryInfeasibleError(
            f"memory: no keep/recompute/offload plan fits {base.hbm_limit_bytes / 2**30:.2f} GiB (capacity - "
            f"margin){least}"
        ) from None
    x = sol.x
    choice = MemoryChoice(np.rint(x[col.recompute]), np.rint(x[col.dram]), np.rint(x[col.nvme]),
                          np.rint(x[col.states_on_host]).astype(bool), np.rint(x[col.weights]).astype(bool),
                          _stash_layers(x[col.stash], ch.layers), np.rint(x[col.op]), _head_share(x[col.head]))
    bound = sol.dual_bound if limit is not None else sol.dual_bound * GIB  # minimising P, the bound is GiB
    return MilpSolution(choice, float(x[col.makespan]), float(x[col.peak]) * GIB, sol.wall_s, sol.proven_optimal,
                        sol.mip_gap, bound)


STASH_GRAIN = 1e-4  # layers: a continuous stash share is rounded up to this, off the LP's feasibility tolerance


def _head_share(h: np.ndarray) -> np.ndarray:
    """The LP's h_c as a plan, rounded up to STASH_GRAIN like a stash share (offloading a hair more only lowers
    HBM)."""
    return np.minimum(np.where(h < STASH_GRAIN, 0.0, np.ceil(h / STASH_GRAIN) * STASH_GRAIN), 1.0)


def head_activation_bytes(costs: CostTable) -> np.ndarray:
    """Per chunk and microbatch, the activation bytes outside its layers (E_c: the last chunk's LM head and
    loss, the first chunk's embedding output): what a whole-chunk offload share moves beyond the layers'."""
    d = costs.detail
    return np.maximum(costs.activation_bytes - d.layers * d.layer_activation_bytes, 0.0)


def _stash_layers(u: np.ndarray, layers: np.ndarray) -> np.ndarray:
    """The LP's u_c as a plan: rounded up to STASH_GRAIN (a bound row met within HiGHS' feasibility tolerance
    then holds exactly: offloading a hair more only lowers HBM), noise below one grain dropped."""
    return np.minimum(np.where(u < STASH_GRAIN, 0.0, np.ceil(u / STASH_GRAIN) * STASH_GRAIN), layers)


def _layer_choice_rows(rows: _Rows, col: _Columns, ch: _Chunks) -> None:
    """k + j + d + n <= L, k + j <= L z, n <= L t, d <= L (1 - t), h <= 1 - t: a layer is kept, recomputed (whole
    or op-level) or offloaded; a chunk's NVMe and DRAM layers exclude each other, and its head goes to DRAM."""
    k, j, dv, nv, z, tn, layers = col.recompute, col.op, col.dram, col.nvme, col.recomputes, col.to_nvme, ch.layers
    for c in range(len(layers)):  # (u_c, the stash's layers, is bounded by L_c alone: its column's bounds)
        rows.add(-np.inf, layers[c], [k[c], j[c], dv[c], nv[c]], [1, 1, 1, 1])
        rows.add(-np.inf, 0, [k[c], j[c], z[c]], [1, 1, -layers[c]])
        rows.add(-np.inf, 0, [nv[c], tn[c]], [1, -layers[c]])
        rows.add(-np.inf, layers[c], [dv[c], tn[c]], [1, layers[c]])
        rows.add(-np.inf, 1, [col.head[c], tn[c]], [1, 1])  # the engine sends a chunk's whole share to one tier


def _end_terms(col: _Columns, ch: _Chunks, dag: FreezeDag, i: int) -> tuple[list[int], list[float]]:
    """Columns and coefficients of node i's duration beyond its constant w_i: recomputation, whole and op-level,
    before B/I (under ZeRO-3's slack, only what it adds past the slack: x_c)."""
    if i < dag.n_actions and dag.actions[i].kind in BACKWARD_KINDS:
        c = dag.actions[i].stage
        if col.exposed is not None:
            return [col.exposed[c]], [1.0]
        return [col.recompute[c], col.op[c]], [ch.fwd[c], ch.op_fwd[c]]
    return [], []


def _precedence_rows(rows: _Rows, col: _Columns, ch: _Chunks, dag: FreezeDag) -> None:
    """s_v >= s_u + D_u + delay over every edge of the step graph; T >= the end of every sink."""
    s, w = col.start, dag.w_max
    for u, v, delay in zip(dag.edge_u.tolist(), dag.edge_v.tolist(), dag.edge_delay.tolist(), strict=True):
        cols, vals = _end_terms(col, ch, dag, u)
        rows.add(w[u] + delay, np.inf, [s[v], s[u], *cols], [1, -1, *[-x for x in vals]])
    for i in dag.sinks:
        cols, vals = _end_terms(col, ch, dag, i)
        rows.add(w[i], np.inf, [col.makespan, s[i], *cols], [1, -1, *[-x for x in vals]])


def _copy_rows(rows: _Rows, lp: LinearProgram, col: _Columns, ch: _Chunks, dag: FreezeDag, lookahead: int,
               weights: bool, stash: bool, layers: bool = False) -> None:
    """Offload timing with the engine's stream semantics, X_c = a_c (d_c / link + n_c / nvme) per microbatch:
    copies out run FIFO after each forward (e_j), a forward waits for the copy two forwards back, prefetches
    (p_b) run FIFO from the start of their issuer (sim.graph.prefetch_issuer), after the copy out. With
    `stash`, each I's W stash copy out (ξ_c = σ_c u_c / link) joins the d2h chain in the rank's order, an I
    waits for the stash copy two I's back, and each W's stash prefetch joins the h2d chain like a B/I's. With
    `weights`, weight prefetches (o_c ω_c each, sim.graph.weight_windows) join the same h2d chain, ahead of
    the activation and stash prefetches their issuer also issues (the engine's order). With `layers` (memory.
    copy_granularity = "layer"), copies out and consumers follow sim.graph.LayerCopy instead (_layer_out_rows,
    _layer_in_rows)."""
    st = step_structure(dag.schedule)
    s, w, dv, nv = col.start, dag.w_max, col.dram, col.nvme
    xd, xn = ch.copy_dram, ch.copy_nvme

    def copy_terms(i: int) -> tuple[list[int], list[float]]:  # the node's copy time: activations or stash
        c = dag.actions[i].stage
        if dag.actions[i].kind is Kind.F:
            return [dv[c], nv[c], col.head[c]], [-xd[c], -xn[c], -ch.head_copy[c]]
        return [col.stash[c]], [-ch.stash_copy[c]]

    copied = (Kind.F, Kind.I) if stash else (Kind.F,)
    d2h_rank = [[i for i in st.rank_nodes(r) if dag.actions[i].kind in copied] for r in range(dag.schedule.num_ranks)]
    e = {i: c for chain in d2h_rank for i, c in zip(chain, lp.add_variables(len(chain), 0, np.inf), strict=True)}
    for chain in d2h_rank:
        seen: dict[Kind, list[int]] = {kind: [] for kind in copied}
        for j, i in enumerate(chain):
            cols, vals = copy_terms(i)
            end_cols, end_vals = _end_terms(col, ch, dag, i)  # an I's recomputation delays its stash copy
            if layers:
                _layer_out_rows(rows, col, ch, dag, i, e[i], cols, vals)
            else:
                rows.add(w[i], np.inf, [e[i], s[i], *end_cols, *cols], [1, -1, *[-x for x in end_vals], *vals])
            if j >= 1:
                rows.add(0, np.inf, [e[i], e[chain[j - 1]], *cols], [1, -1, *vals])
            same = seen[dag.actions[i].kind]
            if len(same) >= PINNED_BUFFERS:  # bounded pinned buffers: that copy of the same kind back has ended
                rows.add(0, np.inf, [s[i], e[same[-PINNED_BUFFERS]]], [1, -1])
            same.append(i)
    h2d = [(ahead, 1, ib, dag.actions[ib].stage) for ib, ahead in prefetch_issuer(dag.schedule, lookahead).items()]
    if stash:
        h2d += [(ahead, 1, iw, dag.actions[iw].stage)
                for iw, ahead in prefetch_issuer(dag.schedule, lookahead, STASH_KINDS).items()]
    if weights:
        h2d += [(w.issuer, 0, w.next_use, w.chunk) for w in weight_windows(dag.schedule, lookahead) if w.next_use >= 0]
    prev: dict[int, int] = {}  # rank -> its previous prefetch's column
    for ahead, copies, ib, c in sorted(h2d):
        r = st.rank_of[ib]
        pb = lp.add_variables(1, 0, np.inf)[0]
        if copies and dag.actions[ib].kind is Kind.W:
            cols, vals = [col.stash[c]], [-ch.stash_copy[c]]
            rows.add(0, np.inf, [pb, e[st.split_of(ib)], *cols], [1, -1, *vals])
        elif copies:
            cols, vals = [dv[c], nv[c], col.head[c]], [-xd[c], -xn[c], -ch.head_copy[c]]
            rows.add(0, np.inf, [pb, e[st.forward_of[ib]], *cols], [1, -1, *vals])
        else:
            cols, vals = [col.weights[c]], [-ch.weight_copy[c]]
        rows.add(0, np.inf, [pb, s[ahead], *cols], [1, -1, *vals])
        if r in prev:
            rows.add(0, np.inf, [pb, prev[r], *cols], [1, -1, *vals])
        if copies and layers:
            _layer_in_rows(rows, col, ch, dag, ib, pb, cols, vals)
        else:
            rows.add(0, np.inf, [s[ib], pb], [1, -1])
        prev[r] = pb
    for c in e.values():  # the last copies out also end within the step
        rows.add(0, np.inf, [col.makespan, c], [1, -1])


def _layer_terms(col: _Columns, ch: _Chunks, dag: FreezeDag, i: int, stash: bool
                 ) -> tuple[float, list[int], list[float], float]:
    """For node i's copy (its W stash's, or its activations'): i's layer time w_i / L_c, the columns and
    coefficients of u (the layers the copy moves), and the first-needed piece's copy time c: a DRAM layer's (the
    NVMe binary adds the difference), exact for whole layers; for a stash share (u = k - 1 + f, a partial piece
    first) min(a layer's copy c, a layer's time w/L). sim.graph.LayerCopy's consumer bound is then exact when
    c >= w/L (its last piece binds: p + w/L; the 70B stash: 55 ms a layer against W's 16.5 ms), and otherwise
    short of k w/L + f c by (1 - f)(w/L - c) at most."""
    c = dag.actions[i].stage
    layer = dag.w_max[i] / max(ch.layers[c], 1.0)
    if stash:
        return layer, [col.stash[c]], [1.0], min(ch.stash_copy[c], layer)
    return layer, [col.dram[c], col.nvme[c]], [1.0, 1.0], ch.copy_dram[c]


def _layer_out_rows(rows: _Rows, col: _Columns, ch: _Chunks, dag: FreezeDag, i: int, e: int, cols: list[int],
                    vals: list[float]) -> None:
    """A copy out e after producer i, layer by layer (sim.graph.LayerCopy.out_offsets): queued once i's first
    layer is done, e >= s_i + rec + w/L + X; its last piece, e >= s_i + rec + u w/L + c."""
    layer, u_cols, u_vals, first = _layer_terms(col, ch, dag, i, stash=dag.actions[i].kind is Kind.I)
    end_cols, end_vals = _end_terms(col, ch, dag, i)
    rec = [-x for x in end_vals]
    rows.add(layer, np.inf, [e, col.start[i], *end_cols, *cols], [1, -1, *rec, *vals])
    c = dag.actions[i].stage
    nvme = {col.to_nvme[c]: -(ch.copy_nvme[c] - ch.copy_dram[c])} if dag.actions[i].kind is Kind.F else {}
    rows.add(first, np.inf, [e, col.start[i], *end_cols, *u_cols, *nvme],
             [1, -1, *rec, *[-layer * x for x in u_vals], *nvme.values()])


def _layer_in_rows(rows: _Rows, col: _Columns, ch: _Chunks, dag: FreezeDag, b: int, pb: int, cols: list[int],
                   vals: list[float]) -> None:
    """Consumer b of the prefetch ending at pb (taking X), layer by layer (sim.graph.LayerCopy.in_offsets):
    s_b >= pb - X; s_b + D_b >= pb - X + c + u w/L; s_b + D_b >= pb + w/L (D_b = w_b + its recomputation)."""
    layer, u_cols, u_vals, first = _layer_terms(col, ch, dag, b, stash=dag.actions[b].kind is Kind.W)
    end_cols, end_vals = _end_terms(col, ch, dag, b)
    plus_x = [-x for x in vals]  # vals are -X's coefficients on cols
    rows.add(0, np.inf, [col.start[b], pb, *cols], [1, -1, *plus_x])
    coef: dict[int, float] = {}
    for cc, v in zip(cols, plus_x, strict=True):
        coef[cc] = coef.get(cc, 0.0) + v
    for cc, v in zip(u_cols, u_vals, strict=True):
        coef[cc] = coef.get(cc, 0.0) - layer * v
    c = dag.actions[b].stage
    nvme = {col.to_nvme[c]: -(ch.copy_nvme[c] - ch.copy_dram[c])} if dag.actions[b].kind is not Kind.W else {}
    rows.add(first - dag.w_max[b], np.inf, [col.start[b], pb, *end_cols, *coef, *nvme],
             [1, -1, *end_vals, *coef.values(), *nvme.values()])
    rows.add(layer - dag.w_max[b], np.inf, [col.start[b], pb, *end_cols], [1, -1, *end_vals])


def _step_copy_rows(rows: _Rows, col: _Columns, ch: _Chunks, dag: FreezeDag, stages: list[np.ndarray],
                    base: list[np.ndarray], host_optimizer: bool, away: np.ndarray) -> None:
    """The optimizer step's copies (sim.graph.side_chains): after chunk c's last B/W, d2h_c on the rank's d2h
    engine, host_c on the host, h2d_c on its h2d engine, each stage `base` (the copies the scenario already
    places) + y_r `stages` (those when the MILP moves rank r's states to the host) + the weight-offload terms
    of sim.memory.with_weight_offload, with `away` (sim.graph.starts_away) the chunks off HBM across the step
    boundary: a host optimizer drops the weights-back copy of those only (h2d_c -= away_c ω_c o_c), a GPU
    optimizer refreshes the host copy of every offloading chunk (d2h_c += ω_c o_c) and brings those back for
    the update (h2d_c += away_c ω_c o_c). The chains of one rank's chunks queue FIFO on its two engines in the
    order their last backwards end, so T is at least every staircase through them: for chunks i <= j' <= j
    of the rank in that order, T >= end(last_i) + Σ_(c=i..j') d2h_c + host_j' + Σ_(c=j'..j) h2d_c (exact
    for FIFO engines and unbounded host work). (With y_r = 1 chosen here under a GPU optimizer the host rule
    applies though the GPU one is counted: an overestimate of at most 3 ω_c, tens of ms, well inside the
    re-simulation's tolerance.)"""
    sched = dag.schedule
    last = step_structure(sched).last_backward
    order = {r: sorted((i, c) for c, i in last.items() if sched.stage_to_rank[c] == r) for r in range(sched.num_ranks)}
    for r, chunks in order.items():
        y = col.states_on_host[r]

        def part(stage: int, c: int, y: int = y) -> tuple[float, dict[int, float]]:  # a stage of c's chain
            coef = {y: float(stages[stage][c])}
            if stage == 0 and not host_optimizer:
                coef[col.weights[c]] = float(ch.weight_copy[c])
            elif stage == 2:
                coef[col.weights[c]] = float((-1.0 if host_optimizer else 1.0) * away[c] * ch.weight_copy[c])
            return float(base[stage][c]), coef

        for a, (i, _ci) in enumerate(chunks):
            cols, vals = _end_terms(col, ch, dag, i)
            for b in range(a, len(chunks)):
                for j in range(b, len(chunks)):
                    const = dag.w_max[i]
                    coef: dict[int, float] = {col.makespan: 1.0, col.start[i]: -1.0}
                    for cc, v in zip(cols, vals, strict=True):
                        coef[cc] = coef.get(cc, 0.0) - v
                    terms = [(0, c) for _n, c in chunks[a:b + 1]] + [(1, chunks[b][1])]
                    terms += [(2, c) for _n, c in chunks[b:j + 1]]
                    for stage, c in terms:
                        k, more = part(stage, c)
                        const += k
                        for cc, v in more.items():
                            coef[cc] = coef.get(cc, 0.0) - v
                    rows.add(const, np.inf, list(coef), list(coef.values()))


def _hbm_rows(rows: _Rows, col: _Columns, ch: _Chunks, pos: _Positions, base: MemoryPlan, costs: CostTable,
              schedule: Schedule, host_states: np.ndarray) -> None:
    """HBM at every distinct position of every rank is at most P (module docstring), with what every plan
    holds alike: a split backward's W stash (I's end to W's end), the loss's working set during B/I, and the
    optimizer step's working memory after the rank's last action."""
    s2r, n_r = np.asarray(schedule.stage_to_rank), schedule.num_ranks
    static_r = per_rank_sum(base.static_hbm_bytes, s2r, n_r)
    hs_r = per_rank_sum(host_states, s2r, n_r)
    n_c = costs.num_chunks
    stash = or_zeros(base.stash_bytes, n_c)
    f_left, b_left = or_zeros(base.forward_retained_bytes, n_c), or_zeros(base.backward_retained_bytes, n_c)
    for p in range(len(pos.rank)):
        r = pos.rank[p]
        N, R = pos.inflight[p], pos.resident[p]
        const = (static_r[r] + float(N @ costs.activation_bytes) + float(pos.stashed[p] @ stash)
                 + float(pos.forwards_started[p] @ f_left) + float(pos.backwards_done[p] @ b_left))
        if pos.backward_chunk[p] >= 0:
            const += float(base.transient_bytes[pos.backward_chunk[p]])
        cols = [col.peak, col.states_on_host[r]]
        vals = [-GIB, -hs_r[r]]  # built in bytes (P counts GiB), added in GiB
        for c in np.flatnonzero(N):
            cols += [col.recompute[c], col.op[c], col.dram[c], col.nvme[c], col.head[c]]
            away = -(N[c] - R[c]) * ch.act[c]
            vals += [-N[c] * ch.saved[c], -N[c] * ch.op_saved[c], away, away, -(N[c] - R[c]) * ch.head[c]]
        bc = pos.backward_chunk[p]
        if bc >= 0:  # a recomputed layer's working set replaces the loss's (sim.memory.activation_arrays: max)
            cols.append(col.recomputes[bc])
            vals.append(max(float(costs.detail.recompute_working_bytes[bc]) - float(base.transient_bytes[bc]), 0.0))
        for c in np.flatnonzero(pos.weights_away[p]):
            cols.append(col.weights[c])
            vals.append(-ch.weight_bytes[c])
        for c in np.flatnonzero(pos.stashed[p] - pos.stash_resident[p]):  # stashes whose offloaded part is away
            cols.append(col.stash[c])
            vals.append(-(pos.stashed[p][c] - pos.stash_resident[p][c]) * ch.stash[c])
        rows.add(-np.inf, -const / GIB, cols, np.asarray(vals) / GIB)
    if len(base.step_transient_bytes):
        step_r = per_rank_sum(base.step_transient_bytes, s2r, n_r)
        left_r = per_rank_sum((f_left + b_left) * schedule.num_microbatches, s2r, n_r)  # every F and B has run
        for r in range(n_r):
            rows.add(-np.inf, -(static_r[r] + step_r[r] + left_r[r]) / GIB, [col.peak, col.states_on_host[r]],
                     [-1.0, -hs_r[r] / GIB])


def _host_rows(rows: _Rows, col: _Columns, ch: _Chunks, pos: _Positions, costs: CostTable, schedule: Schedule,
               host_states: np.ndarray) -> None:
    """Per rank, what goes to DRAM and to NVMe fits there."""
    s2r, n_r = np.asarray(schedule.stage_to_rank), schedule.num_ranks
    hs_r = per_rank_sum(host_states, s2r, n_r)
    for r in range(n_r):
        chunks_r = np.flatnonzero(s2r == r)
        per = pos.max_inflight[chunks_r] * ch.act[chunks_r]
        stash_r = pos.max_stashed[chunks_r] * ch.stash[chunks_r]
        heads = pos.max_inflight[chunks_r] * ch.head[chunks_r]
        dram = np.concatenate([per, [hs_r[r]], ch.weight_bytes[chunks_r], stash_r, heads])
        rows.add(-np.inf, costs.detail.dram_bytes / GIB,
                 [*col.dram[chunks_r], col.states_on_host[r], *col.weights[chunks_r], *col.stash[chunks_r],
                  *col.head[chunks_r]], dram / GIB)
        rows.add(-np.inf, costs.detail.nvme_bytes / GIB, [*col.nvme[chunks_r]], per / GIB)


def _host_state_bytes(sc: Scenario, costs: CostTable) -> np.ndarray:
    """Per chunk, the model-state bytes that go to DRAM when its rank offloads states (optimizer + master)."""
    parts = costs.detail.state_bytes
    zero = np.zeros(costs.num_chunks)
    if sc.memory.optimizer != "hbm" or sc.memory.master_weights != "hbm":
        return zero  # the scenario already keeps them off HBM
    return parts.get("optimizer", zero) + parts.get("master_weights", zero)


def _base_step_stages(base: MemoryPlan) -> list[np.ndarray]:
    """Per chunk, the optimizer step's d2h copy, host work and h2d copy (seconds) every plan pays because the
    scenario itself keeps states or gradients off HBM (sim.memory.with_states): the engine runs them as one
    chain after the chunk's last backward (sim.graph's STEP_D2H, STEP_HOST, STEP_H2D)."""
    return [base.step_d2h_bytes / base.host_link_bps, np.asarray(base.step_host_s, float),
            base.step_h2d_bytes / base.host_link_bps]


def _step_copy_stages(costs: CostTable, base: MemoryPlan) -> list[np.ndarray]:
    """Per chunk, the optimizer step's d2h, host and h2d seconds with states on the host: grads out, Adam,
    weights back."""
    parts = costs.detail.state_bytes
    zero = np.zeros(costs.num_chunks)
    params = costs.params if costs.params is not None else zero
    adam_s = params * HOST_ADAM_BYTES_PER_PARAM / costs.detail.dram_bps
    return [parts.get("gradients", zero) / base.host_link_bps, adam_s, parts.get("weights", zero) / base.host_link_bps]


def plan_from_choice(sc: Scenario, costs: CostTable, schedule: Schedule, base: MemoryPlan, choice: MemoryChoice,
                     lookahead: int) -> MemoryPlan:
    """The MemoryPlan the engine runs for the MILP's `choice` (`base`: the scenario's keep-everything plan with
    its states placed, sim.memory.with_states)."""
    d = costs.detail
    k, j, dram, nvme = choice.recompute_layers, choice.op_recompute_layers, choice.dram_layers, choice.nvme_layers
    s2r = np.asarray(schedule.stage_to_rank)
    kept, transient, extra = activation_arrays(costs, k, np.zeros(costs.num_chunks), j)
    off = d.layer_activation_bytes * (dram + nvme) + head_activation_bytes(costs) * choice.head_offload_share
    chunk_states = choice.states_on_host[s2r]  # per chunk: its rank offloads states
    hs = _host_state_bytes(sc, costs)
    params = costs.params if costs.params is not None else np.zeros(costs.num_chunks)
    parts = d.state_bytes
    zero = np.zeros(costs.num_chunks)
    stash_layers = choice.stash_offload_layers
    policy = tuple(
        f"recompute {int(k[c])}/{int(d.layers[c])}" + (f", op {int(j[c])}" if j[c] else "")
        + f", dram {int(dram[c])}, nvme {int(nvme[c])}"
        + (f", stash {stash_layers[c]:.2f}" if stash_layers[c] else "")
        + (f", head {choice.head_offload_share[c]:.2f}" if choice.head_offload_share[c] else "")
        + (", states on host" if chunk_states[c] else "")
        for c in range(costs.num_chunks)
    )
    plan = MemoryPlan(
        kept_bytes=kept,
        transient_bytes=transient,
        recompute_s=exposed_recompute_s(costs, extra),
        offload_bytes=off,
        offload_nvme=nvme > 0,
        static_hbm_bytes=base.static_hbm_bytes - np.where(chunk_states, hs, 0.0),
        static_host_bytes={"dram": base.static_host_bytes.get("dram", zero) + np.where(chunk_states, hs, 0.0),
                           "nvme": base.static_host_bytes.get("nvme", zero)},
        step_d2h_bytes=base.step_d2h_bytes + np.where(chunk_states, parts.get("gradients", zero), 0.0),
        step_host_s=base.step_host_s + np.where(chunk_states, params * HOST_ADAM_BYTES_PER_PARAM / d.dram_bps, 0.0),
        step_h2d_bytes=base.step_h2d_bytes + np.where(chunk_states, parts.get("weights", zero), 0.0),
        prefetch_lookahead=lookahead,
        hbm_limit_bytes=base.hbm_limit_bytes,
        policy=policy,
        host_link_bps=base.host_link_bps,
        nvme_bps=base.nvme_bps,
        stash_bytes=base.stash_bytes,  # a split backward's W stash and the optimizer step's working memory:
        step_transient_bytes=base.step_transient_bytes,  # the engine holds them under every plan
        forward_retained_bytes=base.forward_retained_bytes,  # torch pipelining's outputs and input gradients:
        backward_retained_bytes=base.backward_retained_bytes,  # every plan alike
        # the offloaded layers' share of the stash (MilpSolution's u_c; none without a split backward)
        stash_offload_bytes=(or_zeros(base.stash_bytes, costs.num_chunks) * stash_layers / np.maximum(d.layers, 1)
                             if splits_backward(schedule) else np.zeros(costs.num_chunks)),
    )
    host_optimizer = chunk_states | (sc.memory.optimizer != "hbm")
    plan = with_copy_granularity(sc, costs, plan)
    return with_weight_offload(plan, costs, choice.weight_mask, host_optimizer, schedule)


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
