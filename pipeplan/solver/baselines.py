"""Schedule-blind freezing at a given mean freeze ratio (the budget), to set the LP plan against.

Each returns one ratio per freezable action (aligned with `FreezeDag.freezable`) whose mean is the budget,
with every action at most `max_ratio` and every chunk's mean at most `cap`: the same limits the LP obeys, so
the comparison isolates what knowing the schedule is worth. None looks at the schedule or at durations.

- uniform: every freezable action at the budget (TimelyFreeze's naive reference).
- apf-like: APF (Chen et al., 2021) freezes parameters once their updates stabilise, a property of each
  layer that the schedule does not see, for whole steps (every microbatch alike). Modelled as a per-chunk
  stability score drawn once from Gamma(2, 1) with a fixed seed, water-filled to the budget: chunk s gets
  min(k·u_s, cap, max_ratio) with k chosen so that the mean is the budget.
- autofreeze-like: AutoFreeze (Liu et al., 2021) freezes front layers first and moves back as they
  converge. Chunks are filled front to back, chunk 0 to min(cap, max_ratio) for every microbatch, then
  chunk 1, ..., the last one partly.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pipeplan.solver.freeze_dag import FreezeDag

APF_SEED = 0


def uniform_ratios(dag: FreezeDag, budget: float, cap: float, max_ratio: float) -> np.ndarray:
    return np.full(len(dag.freezable), min(budget, cap, max_ratio))


def apf_like_ratios(dag: FreezeDag, budget: float, cap: float, max_ratio: float) -> np.ndarray:
    stage = dag.freezable_stage
    chunks, per_action = np.unique(stage, return_inverse=True)
    score = np.random.default_rng(APF_SEED).gamma(2.0, 1.0, size=int(chunks.max()) + 1 if chunks.size else 0)
    u = score[chunks][per_action]  # (n_freezable,)
    top = min(cap, max_ratio)
    if budget <= 0 or u.size == 0:
        return np.zeros(len(dag.freezable))
    if budget >= top:
        return np.full(len(dag.freezable), top)
    lo, hi = 0.0, top / u.min()
    for _ in range(100):  # mean(min(k u, top)) is continuous and non-decreasing in k
        k = (lo + hi) / 2
        lo, hi = (k, hi) if np.minimum(k * u, top).mean() < budget else (lo, k)
    ratios: np.ndarray = np.minimum(hi * u, top)
    return ratios


def autofreeze_like_ratios(dag: FreezeDag, budget: float, cap: float, max_ratio: float) -> np.ndarray:
    stage = dag.freezable_stage
    top = min(cap, max_ratio)
    ratio = np.zeros(len(dag.freezable))
    left = budget * len(ratio)  # freeze-ratio units still to place
    for s in np.unique(stage):
        members = stage == s
        take = min(top, left / members.sum())
        ratio[members] = take
        left -= take * members.sum()
        if left <= 1e-12:
            break
    return ratio


BASELINES: dict[str, Callable[[FreezeDag, float, float, float], np.ndarray]] = {
    "uniform": uniform_ratios,
    "apf-like": apf_like_ratios,
    "autofreeze-like": autofreeze_like_ratios,
}
