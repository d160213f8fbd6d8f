"""Freeze-LP speed: pipeplan's lexicographic highspy LP against TimelyFreeze's scipy formulation.

Both get the same DAG (solver.freeze_dag over interleaved-1f1b, v=2, up to p=32 m=256) and the same limits;
each is timed from its DAG arrays to its solution (model build + solve). TimelyFreeze's public code solves
one `scipy.optimize.linprog(method="highs")` with variables (start, duration, makespan) and the big-M
objective 999999·makespan - Σ durations; that is reconstructed here from its description. scipy is a dev
dependency, imported only inside this module's runner.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd

SIZES = [(4, 16), (8, 32), (16, 64), (16, 128), (32, 128), (32, 256)]
BIG_M = 999999.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        default=",".join(f"{p}x{m}" for p, m in SIZES),
        help="comma-separated PxM pipeline sizes (default: %(default)s)",
    )
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="chunks per rank of the schedule (default: %(default)s)")
    parser.add_argument("--schedule", default="interleaved-1f1b",
                        help="schedule whose freeze LP is timed (default: %(default)s)")
    parser.add_argument("--cap", type=float, default=0.9, help="freeze cap of the LP (default: %(default)s)")
    parser.add_argument(
        "--scipy-max-actions",
        type=int,
        default=100_000,
        help="skip the scipy formulation above this many actions (default: %(default)s)",
    )


def bench_costs(p: int, v: int, m: int):
    """Explicit costs with a heavier last chunk (the LM head), so the LP is not trivially symmetric."""
    from pipeplan.sim.costs import CostTable

    n = p * v
    f = 1.0 + 0.2 * (np.arange(n) == n - 1)
    return CostTable(p, v, m, f, 1.1 * f, 0.8 * f, np.ones(n), np.zeros(n), p2p_s=0.05)


def scipy_timelyfreeze(dag, cap: float, max_ratio: float = 1.0) -> tuple[float, float, float, float]:
    """TimelyFreeze's single LP on scipy: min 999999·T - Σ d over (t, d, T); returns (makespan_s, Σ r,
    build_s, solve_s)."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_array

    t0 = time.perf_counter()
    n, fz = dag.n_nodes, dag.freezable
    nf = len(fz)
    w_max, w_min = dag.w_max, dag.w_max - max_ratio * (dag.w_max - dag.w_min)
    slot = np.full(n, -1)
    slot[fz] = np.arange(nf)
    T = n + nf
    rows, cols, vals, rhs = [], [], [], []

    def finish_le(u: np.ndarray, later: np.ndarray, gap: np.ndarray) -> None:
        """t_u + dur_u - x[later] <= -gap."""
        k = len(u)
        base = sum(len(b) for b in rhs)
        r = base + np.arange(k)
        var = slot[u] >= 0
        rows.extend([r, r, r[var]])
        cols.extend([u, later, n + slot[u][var]])
        vals.extend([np.ones(k), -np.ones(k), np.ones(int(var.sum()))])
        rhs.append(-gap - np.where(var, 0.0, w_max[u]))

    finish_le(dag.edge_u, dag.edge_v, dag.edge_delay)
    finish_le(dag.sinks, np.full(len(dag.sinks), T), np.zeros(len(dag.sinks)))
    # mean over a stage of r = (w̄ - d)/Δ <= cap
    stage = dag.freezable_stage
    delta = dag.w_max[fz] - dag.w_min[fz]
    ok = delta > 0
    chunks, which = np.unique(stage, return_inverse=True)
    base = sum(len(b) for b in rhs)
    rows.append(base + which[ok])
    cols.append(n + np.flatnonzero(ok))
    vals.append(-1.0 / delta[ok])
    count = np.bincount(which, minlength=len(chunks))
    rhs.append(
        cap * count - np.bincount(which[ok], weights=dag.w_max[fz][ok] / delta[ok], minlength=len(chunks))
    )
    b_ub = np.concatenate(rhs)
    a_ub = coo_array(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(len(b_ub), n + nf + 1)
    ).tocsr()
    c = np.zeros(n + nf + 1)
    c[n : n + nf] = -1.0
    c[T] = BIG_M
    bounds = np.column_stack([np.zeros(n + nf + 1), np.full(n + nf + 1, np.inf)])
    bounds[n : n + nf, 0], bounds[n : n + nf, 1] = w_min[fz], w_max[fz]
    t1 = time.perf_counter()
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    t2 = time.perf_counter()
    if res.status != 0:
        return float("nan"), float("nan"), t1 - t0, t2 - t1
    d = res.x[n : n + nf]
    ratio = np.divide(w_max[fz] - d, delta, out=np.zeros(nf), where=ok)
    return float(res.x[T]), float(ratio.sum()), t1 - t0, t2 - t1


def _parse_sizes(text: str) -> list[tuple[int, int]]:
    from pipeplan.sim.errors import PipeplanError

    try:
        return [(int(p), int(m)) for p, m in (s.lower().split("x") for s in text.split(","))]
    except ValueError:
        raise PipeplanError(f"--sizes: {text!r}; expected comma-separated PxM, e.g. 4x16,32x256") from None


def run(args: argparse.Namespace, out_dir: Path) -> str:
    from rich.progress import track

    from pipeplan.analysis.freeze_plots import bench_plot
    from pipeplan.sim.config import FreezeConfig
    from pipeplan.sim.schedules import build_schedule
    from pipeplan.solver.freeze_dag import build_freeze_dag
    from pipeplan.solver.freeze_lp import solve_freeze_lp

    try:
        import scipy.optimize  # noqa: F401  (imported before the clock starts)
    except ImportError:
        args.scipy_max_actions = -1  # scipy is a dev dependency: bench pipeplan alone
    v, rows = args.virtual_stages, []
    freeze = FreezeConfig(cap=args.cap)
    for p, m in track(_parse_sizes(args.sizes), description="bench plan"):
        sched = build_schedule(args.schedule, p, m, v)
        costs = bench_costs(p, v, m)
        t0 = time.perf_counter()
        dag = build_freeze_dag(sched, costs, freeze)
        dag_s = time.perf_counter() - t0
        cpu0 = time.process_time()
        sol = solve_freeze_lp(dag, args.cap)
        cpu_s = time.process_time() - cpu0
        row = {
            "schedule": args.schedule,
            "p": p,
            "m": m,
            "v": v,
            "actions": sched.num_actions,
            "freezable": len(dag.freezable),
            "lp_rows": sol.rows,
            "lp_columns": sol.columns,
            "dag_s": dag_s,
            "pipeplan_build_s": sol.build_s,
            "pipeplan_solve_s": sol.solve_s,
            "pipeplan_wall_s": sol.wall_s,
            "pipeplan_cpu_s": cpu_s,
            "pipeplan_iterations": f"{sol.iterations[0]}+{sol.iterations[1]}",
            "pipeplan_makespan_s": sol.makespan_s,
            "pipeplan_sum_ratio": float(sol.ratio.sum()),
        }
        if sched.num_actions <= args.scipy_max_actions:
            cpu0 = time.process_time()
            mk, sum_r, build_s, solve_s = scipy_timelyfreeze(dag, args.cap)
            cpu_s = time.process_time() - cpu0
            row |= {
                "scipy_build_s": build_s,
                "scipy_solve_s": solve_s,
                "scipy_wall_s": build_s + solve_s,
                "scipy_cpu_s": cpu_s,
                "scipy_makespan_s": mk,
                "scipy_sum_ratio": sum_r,
                "makespan_rel_diff": abs(mk - sol.makespan_s) / sol.makespan_s,
            }
        rows.append(row)
    df = pd.DataFrame(rows)
    for col in ("scipy_wall_s", "scipy_cpu_s"):
        if col not in df:
            df[col] = np.nan
    df["speedup_vs_scipy"] = df["scipy_wall_s"] / df["pipeplan_wall_s"]
    df["cpu_speedup_vs_scipy"] = df["scipy_cpu_s"] / df["pipeplan_cpu_s"]
    (out_dir / "bench_plan.csv").write_text(df.to_csv(index=False))
    bench_plot(df, out_dir / "bench_plan.png", f"freeze LP, {args.schedule} v={v}, cap {args.cap:g}")
    big = df.iloc[-1]
    line = (
        f"largest: p={big['p']} m={big['m']} v={v} ({big['actions']} actions): pipeplan "
        f"{big['pipeplan_wall_s']:.2f} s wall / {big['pipeplan_cpu_s']:.2f} s CPU"
    )
    if not np.isnan(big["scipy_wall_s"]):
        line += (
            f"; scipy TimelyFreeze {big['scipy_wall_s']:.2f} s wall / {big['scipy_cpu_s']:.2f} s CPU "
            f"({big['speedup_vs_scipy']:.1f}x wall, {big['cpu_speedup_vs_scipy']:.1f}x CPU)"
        )
    return line
