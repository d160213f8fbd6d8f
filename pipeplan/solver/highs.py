"""The one place that speaks highspy: a minimisation LP over array-shaped variable blocks.

Everything camelCase stays in this file. Columns are added as blocks (`h.addVariables(n, lb=, ub=)`), rows
as sparse (row, col, value) triplets passed to HiGHS in one `addRows` call per block, which is what keeps a
50k-action DAG's model build in tens of milliseconds (building one highspy expression per row costs seconds).
`minimize` solves and turns `getModelStatus()` into an `LPSolution` or an error: the `HighsStatus` that
`run()` returns only says the call went through, never that the solution is optimal.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import time
from dataclasses import dataclass

import highspy
import numpy as np

from pipeplan.solver.errors import InfeasibleError, SolverError, SolverTimeoutError

FEASIBLE_POINT = 2  # HiGHS' primal_solution_status for "a feasible point is known" (kSolutionStatusFeasible)

THREADS = 1  # every Highs of the process (see _new_highs)
AT_LOWER, BASIC, AT_UPPER = 0, 1, 2  # basis states for `LinearProgram.set_basis`
_banner_silenced = False


def _new_highs() -> highspy.Highs:
    """A silent Highs. Its constructor prints a banner through C stdout once per process; swallow it."""
    global _banner_silenced
    if _banner_silenced:
        h = highspy.Highs()
    else:
        sys.stdout.flush()
        saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
            h = highspy.Highs()
            ctypes.CDLL(None).fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            os.close(devnull)
        _banner_silenced = True
    h.setOptionValue("output_flag", os.environ.get("PIPEPLAN_HIGHS_LOG") == "1")
    # HiGHS' thread pool is global, sized by the first solve of the process: every model asks for the same
    # count, else a later one asking for another fails `run()` with kError. One thread: the memory MILP's
    # answer must not depend on the machine (its node limit does the rest); the LPs run serial simplex anyway.
    h.setOptionValue("threads", THREADS)
    return h


@dataclass(frozen=True)
class LPSolution:
    x: np.ndarray  # (num_columns,) primal values
    objective: float
    iterations: int
    wall_s: float
    proven_optimal: bool = True  # False: a MILP's incumbent, kept when a work limit (node count) stopped it
    mip_gap: float = 0.0  # HiGHS' relative gap |primal - dual bound| / |primal| at the end (0 for an LP)
    dual_bound: float = math.nan  # a MILP's proven lower bound on the objective (the objective for an LP)


class LinearProgram:
    """min c·x subject to lower <= A x <= upper and column bounds, built block by block."""

    def __init__(self, name: str, options: dict[str, float | int | str | bool] | None = None):
        self.name = name
        self._h = _new_highs()
        for key, value in (options or {}).items():
            self._h.setOptionValue(key, value)
        self.num_columns = 0
        self.num_rows = 0
        self._is_mip = False

    def add_variables(
        self, n: int, lb: float | np.ndarray = 0.0, ub: float | np.ndarray = np.inf
    ) -> np.ndarray:
        """Add n columns; returns their indices (int32), to be shaped like the problem by the caller."""
        if n == 0:
            return np.empty(0, dtype=np.int32)
        lb_arr = np.broadcast_to(np.asarray(lb, dtype=np.float64), (n,))
        ub_arr = np.broadcast_to(np.asarray(ub, dtype=np.float64), (n,))
        self._h.addVariables(n, lb=lb_arr.tolist(), ub=np.minimum(ub_arr, highspy.kHighsInf).tolist())
        idx = np.arange(self.num_columns, self.num_columns + n, dtype=np.int32)
        self.num_columns += n
        return idx

    def add_rows(
        self,
        lower: np.ndarray | float,
        upper: np.ndarray | float,
        row: np.ndarray,
        col: np.ndarray,
        val: np.ndarray,
        num_rows: int | None = None,
    ) -> np.ndarray:
        """Add rows lower <= sum(val * x[col] for entries of that row) <= upper; `row` counts from 0."""
        row = np.asarray(row, dtype=np.int64)
        k = int(num_rows if num_rows is not None else (row.max() + 1 if row.size else 0))
        if k == 0:
            return np.empty(0, dtype=np.int32)
        order = np.argsort(row, kind="stable")
        starts = np.searchsorted(row[order], np.arange(k)).astype(np.int32)
        lo = np.broadcast_to(np.asarray(lower, dtype=np.float64), (k,))
        hi = np.broadcast_to(np.asarray(upper, dtype=np.float64), (k,))
        inf = highspy.kHighsInf
        status = self._h.addRows(
            k,
            np.clip(lo, -inf, inf),
            np.clip(hi, -inf, inf),
            int(row.size),
            starts,
            np.asarray(col, dtype=np.int32)[order],
            np.asarray(val, dtype=np.float64)[order],
        )
        if status == highspy.HighsStatus.kError:
            raise SolverError(f"{self.name}: HiGHS rejected {k} rows (bad index or NaN coefficient)")
        idx = np.arange(self.num_rows, self.num_rows + k, dtype=np.int32)
        self.num_rows += k
        return idx

    def set_basis(self, col_state: np.ndarray, row_state: np.ndarray) -> None:
        """Start the next solve from this basis (AT_LOWER / BASIC / AT_UPPER per column and row).

        A basis the caller knows to be dual feasible lets the dual simplex skip its phase 1; HiGHS rejects
        a singular or miscounted one with an error, which is a bug in the caller.
        """
        status = [
            highspy.HighsBasisStatus.kLower,
            highspy.HighsBasisStatus.kBasic,
            highspy.HighsBasisStatus.kUpper,
        ]
        basis = highspy.HighsBasis()
        basis.col_status = [status[k] for k in np.asarray(col_state).tolist()]
        basis.row_status = [status[k] for k in np.asarray(row_state).tolist()]
        basis.valid = True
        if self._h.setBasis(basis) == highspy.HighsStatus.kError:
            raise SolverError(f"{self.name}: HiGHS rejected the starting basis")

    def set_upper_bound(self, col: int, ub: float) -> None:
        lb = float(self._h.getLp().col_lower_[col])
        self._h.changeColBounds(int(col), lb, float(ub))

    def minimize(
        self,
        cols: np.ndarray,
        costs: np.ndarray | float,
        what: str,
        options: dict[str, float | int | str | bool] | None = None,
        accept_incumbent: bool = False,
    ) -> LPSolution:
        """Minimise sum(costs * x[cols]) (every other column costs 0); `what` names the solve in errors.
        `accept_incumbent`: a MILP stopped by a work limit (mip_max_nodes, mip_max_leaves, ... — HiGHS reports
        kSolutionLimit) returns its best feasible point flagged `proven_optimal=False`, with its gap (for
        callers that verify what they get, as the memory planner re-simulates every plan). The wall-clock
        `time_limit` is never accepted: what it returns depends on machine load, so it raises
        SolverTimeoutError whatever it found.

        HiGHS keeps the basis of the previous solve, so a second objective on the same model starts warm.
        """
        h = self._h
        all_cols = np.arange(self.num_columns, dtype=np.int32)
        h.changeColsCost(self.num_columns, all_cols, np.zeros(self.num_columns))
        cols = np.asarray(cols, dtype=np.int32)
        c = np.broadcast_to(np.asarray(costs, dtype=np.float64), cols.shape)
        h.changeColsCost(int(cols.size), cols, np.ascontiguousarray(c))
        h.changeObjectiveSense(highspy.ObjSense.kMinimize)
        for key, value in (options or {}).items():
            h.setOptionValue(key, value)
        t0 = time.perf_counter()
        run_status = h.run()
        wall = time.perf_counter() - t0
        model_status = h.getModelStatus()
        info = h.getInfo()
        feasible = info.primal_solution_status == FEASIBLE_POINT
        optimal = model_status == highspy.HighsModelStatus.kOptimal
        stopped_by_work = model_status in (highspy.HighsModelStatus.kSolutionLimit,
                                           highspy.HighsModelStatus.kIterationLimit)
        if optimal or (accept_incumbent and stopped_by_work and feasible):
            x = np.asarray(h.getSolution().col_value, dtype=np.float64)
            iters = int(info.simplex_iteration_count) + int(info.ipm_iteration_count)
            objective = float(info.objective_function_value)
            is_mip = self._is_mip
            gap = float(info.mip_gap) if is_mip else 0.0
            bound = float(info.mip_dual_bound) if is_mip else objective
            return LPSolution(x, objective, iters, wall, optimal, max(gap, 0.0) if math.isfinite(gap) else gap,
                              bound)
        reason = h.modelStatusToString(model_status)
        if model_status == highspy.HighsModelStatus.kInfeasible:
            raise InfeasibleError(f"{self.name}: {what} is infeasible (HiGHS: {reason})")
        if model_status == highspy.HighsModelStatus.kTimeLimit:
            limit = h.getOptionValue("time_limit")[1]
            raise SolverTimeoutError(
                f"{self.name}: {what} ran past its {limit:g} s safety time limit (HiGHS: {reason}); nothing "
                f"is known about this model, neither a fit nor no fit"
            )
        raise SolverError(
            f"{self.name}: {what} ended without an optimum (HiGHS: {reason}; run: {run_status.name})"
        )

    def set_integer(self, cols: np.ndarray) -> None:
        """Make columns integer (the model becomes a MILP; `minimize` then runs branch and bound)."""
        cols = np.asarray(cols, dtype=np.int32)
        if cols.size:
            kinds = np.full(cols.size, highspy.HighsVarType.kInteger)
            self._h.changeColsIntegrality(int(cols.size), cols, kinds)
            self._is_mip = True
