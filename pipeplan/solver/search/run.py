"""Branch and bound over the screened space: candidates in order of their screen bound, each refined and
simulated only while its bound is below the fastest fitting step simulated so far.

The answer is the one exhaustive simulation would give: a candidate is dropped only when a lower bound on
its peak HBM exceeds the limit (it cannot fit) or a lower bound on its step exceeds a step already simulated
and fitting (it cannot win; ties are simulated and broken as exhaustive ranking breaks them: faster, then
lower peak HBM, then space order). tests/test_search.py checks it against exhaustive simulation.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from pipeplan.solver.search.refine import evaluate, set_base
from pipeplan.solver.search.screen import Screen, screen
from pipeplan.solver.search.space import KEYS, Space

Progress = Callable[[int, int, str], None]
SEEDS = 4
"""Candidates simulated first to set a good incumbent (branch and bound's pruning is only as good as it)."""
SEED_HEADROOM = 0.8
"""Seeds are taken among candidates whose peak-HBM bound is at most this share of the limit."""


@dataclass(frozen=True)
class SearchResult:
    """Every candidate simulated (rows, best first), the counts of what was pruned and why, the space size."""

    rows: pd.DataFrame
    pruned: dict[str, int]
    candidates: int
    screen_wall_s: float


def rank_key(row: dict[str, Any], index: int) -> tuple[float, float, int]:
    """Winner order: fitting rows by step time, then peak HBM, then the candidate's place in the space."""
    return (row["step_time_s"], row["max_peak_hbm_bytes"], index)


def _row(space: Space, i: int, screened: Screen, result: dict[str, Any]) -> dict[str, Any]:
    return {"candidate": i, **space.overrides(i), "screen_lb_s": float(screened.step_lb_s[i]), **result}


def search(raw: dict[str, Any], source: str, base_dir: str | None, sc: Any, space: Space, jobs: int = 1,
           progress: Progress | None = None, exhaustive: bool = False) -> SearchResult:
    """Branch and bound over `space` (the scenario `sc`, read from `raw`); `exhaustive` simulates everything."""
    import time

    t0 = time.perf_counter()
    screened = screen(sc, space)
    screen_s = time.perf_counter() - t0
    set_base(raw, source, base_dir)
    pruned: Counter[str] = Counter()
    fits_mem = screened.hbm_lb_bytes <= screened.hbm_limit_bytes + 1e-6
    if not exhaustive:
        pruned["memory (screen)"] = int((~fits_mem).sum())
        order = np.flatnonzero(fits_mem)
    else:
        order = np.arange(len(space))
    order = order[np.argsort(screened.step_lb_s[order], kind="stable")]
    heap = [(float(screened.step_lb_s[i]), int(i)) for i in order]  # already sorted: a valid heap
    best: tuple[float, float, int] = (float("inf"), float("inf"), -1)
    rows: list[dict[str, Any]] = []
    done = 0

    def take(i: int, result: dict[str, Any]) -> None:
        nonlocal best, done
        done += 1
        if result["status"] == "ok":
            rows.append(_row(space, i, screened, result))
            if result["fits"]:
                best = min(best, rank_key(result, i))
        else:
            pruned[result["reason"] if result["status"] == "pruned" else "invalid"] += 1
        if progress:
            progress(done, len(order), f"best {best[0]:.3g} s" if best[2] >= 0 else "")

    def next_index() -> int | None:
        if not heap:
            return None
        lb, i = heapq.heappop(heap)
        if not exhaustive and lb > best[0]:
            pruned["bound (screen)"] += 1 + len(heap)
            heap.clear()
            return None
        return i

    # seed the incumbent: a few candidates likely to be fast and to fit (screen bound stretched by a 1F1B-like
    # bubble, memory bound well under the limit) are simulated first, so the refine can prune against a good
    # step from the start. Only the order of work changes; the stopping rule is the same.
    seeds: list[int] = []
    if not exhaustive and len(order):
        guess = screened.step_lb_s * (1.0 + (space.pp - 1) / (space.m * space.v))
        roomy = order[screened.hbm_lb_bytes[order] <= SEED_HEADROOM * screened.hbm_limit_bytes]
        seeds = [int(i) for i in roomy[np.argsort(guess[roomy], kind="stable")[:SEEDS]]]
        for seed in seeds:
            take(seed, evaluate(space.overrides(seed), best[0]))
        heap = [(lb, i) for lb, i in heap if i not in set(seeds)]
    if jobs <= 1:
        while (i := next_index()) is not None:
            take(i, evaluate(space.overrides(i), best[0], prune=not exhaustive))
    else:
        with ProcessPoolExecutor(max_workers=jobs, initializer=set_base, initargs=(raw, source, base_dir)) as pool:
            running: dict[Future[dict[str, Any]], int] = {}
            while True:
                while len(running) < 2 * jobs and (i := next_index()) is not None:
                    running[pool.submit(evaluate, space.overrides(i), best[0], not exhaustive)] = i
                if not running:
                    break
                ready, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in ready:
                    take(running.pop(fut), fut.result())
    df = pd.DataFrame(rows)
    if len(df):
        df = df.assign(_fit=~df["fits"].astype(bool)).sort_values(
            ["_fit", "step_time_s", "max_peak_hbm_bytes", "candidate"], kind="stable").drop(columns="_fit")
        df = df.reset_index(drop=True)
    return SearchResult(df, dict(pruned), len(space), screen_s)


def winner(result: SearchResult) -> pd.Series | None:
    """The fastest fitting candidate (the first row), or None when nothing fits."""
    df = result.rows
    if not len(df) or not bool(df.iloc[0]["fits"]):
        return None
    return df.iloc[0]


__all__ = ["KEYS", "SearchResult", "search", "winner"]
