"""The configuration space `pipeplan search` explores, as numpy arrays: one entry per candidate.

For a fixed GPU count N and global batch B: TP within a node (dividing the heads), PP, DP with N = TP·PP·DP,
every schedule at each virtual-stage count it takes, the micro-batch size with B fixed (microbatches
m = B / (DP · mbs)), recomputation, activation offload, the optimizer's tier and the ZeRO stage. Only
combinations every layer of pipeplan accepts are generated (the schedule's own size rule included), so the
screen never sees an invalid candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeplan.sim.config import Scenario
from pipeplan.sim.errors import PipeplanError

SCHEDULE_CHUNKS: dict[str, tuple[int, ...]] = {
    "gpipe": (1,), "1f1b": (1,), "zb-h1": (1,), "zb-2p": (1,), "interleaved-1f1b": (2, 3, 4),
    "zbv": (2,), "v-half": (2,), "chronos": (2, 4),
}
"""Each schedule and the virtual-stage counts searched (docs/schedules.md: zbv and v-half take exactly 2)."""
RECOMPUTE = ("none", "selective", "selective-op", "full")
"""Recomputation policies searched; "chronos" needs a keep-everything simulation per candidate to decide."""
OFFLOAD = (0.0, 0.25, 0.5, 1.0)
"""Shares of each kept activation offloaded to DRAM."""
OPTIMIZER_TIERS = ("hbm", "dram")
ZERO = (0, 1, 2, 3)
MAX_MICRO_BATCH = 16

KEYS = ("parallel.tp", "pipeline.stages", "parallel.dp", "pipeline.schedule", "pipeline.virtual_stages",
        "training.micro_batch_size", "pipeline.microbatches", "memory.recompute", "memory.offload_activations",
        "memory.optimizer", "parallel.zero")
"""Scenario keys a candidate sets: search.csv's configuration columns, named as sweep.csv's grid keys."""


@dataclass(frozen=True)
class SpaceOptions:
    """What the search varies; tests narrow it to spaces small enough to simulate exhaustively."""

    schedules: dict[str, tuple[int, ...]] = field(default_factory=lambda: dict(SCHEDULE_CHUNKS))
    recompute: tuple[str, ...] = RECOMPUTE
    offload: tuple[float, ...] = OFFLOAD
    optimizer: tuple[str, ...] = OPTIMIZER_TIERS
    zero: tuple[int, ...] = ZERO
    max_micro_batch: int = MAX_MICRO_BATCH
    tp: tuple[int, ...] | None = None  # None: every divisor of gpus_per_node that divides the heads
    stages: tuple[int, ...] | None = None  # None: every divisor of N / TP up to the layer count


@dataclass(frozen=True)
class Space:
    """Candidates as parallel arrays (integer codes for strings, see `names`)."""

    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    schedule: np.ndarray  # index into names["schedule"]
    v: np.ndarray
    mbs: np.ndarray
    m: np.ndarray
    recompute: np.ndarray  # index into names["recompute"]
    offload: np.ndarray
    optimizer: np.ndarray  # index into names["optimizer"]
    zero: np.ndarray
    names: dict[str, tuple[str, ...]]

    def __len__(self) -> int:
        return len(self.tp)

    def overrides(self, i: int) -> dict[str, Any]:
        """Candidate i as dotted scenario keys (KEYS)."""
        return {
            "parallel.tp": int(self.tp[i]), "pipeline.stages": int(self.pp[i]), "parallel.dp": int(self.dp[i]),
            "pipeline.schedule": self.names["schedule"][self.schedule[i]],
            "pipeline.virtual_stages": int(self.v[i]), "training.micro_batch_size": int(self.mbs[i]),
            "pipeline.microbatches": int(self.m[i]), "memory.recompute": self.names["recompute"][self.recompute[i]],
            "memory.offload_activations": float(self.offload[i]),
            "memory.optimizer": self.names["optimizer"][self.optimizer[i]], "parallel.zero": int(self.zero[i]),
        }


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def build_space(sc: Scenario, gpus: int, global_batch: int, options: SpaceOptions | None = None) -> Space:
    """Every valid candidate for `gpus` GPUs and `global_batch` sequences per step on the scenario's model."""
    from pipeplan.sim.schedules import SCHEDULES, schedule_names

    schedule_names()  # registers the built-in schedules
    opt = options or SpaceOptions()
    if sc.model is None:
        raise PipeplanError("search: needs a [model] scenario (explicit [costs] fix TP, PP and the micro-batch)")
    node = sc.parallel.gpus_per_node
    layers = sc.model.layers
    tps = opt.tp or tuple(t for t in divisors(node) if sc.model.heads % t == 0)
    sched_names = tuple(opt.schedules)
    rows: list[tuple[int, ...]] = []
    for tp in tps:
        if gpus % tp:
            continue
        for pp in opt.stages or tuple(divisors(gpus // tp)):
            if (gpus // tp) % pp:
                continue
            dp = gpus // (tp * pp)
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            for mbs in (b for b in divisors(per_replica) if b <= opt.max_micro_batch):
                m = per_replica // mbs
                for si, name in enumerate(sched_names):
                    for v in opt.schedules[name]:
                        if pp * v > layers or (pp == 1 and name != "1f1b") or (pp == 1 and v > 1):
                            continue  # one stage: no pipeline, one schedule (1f1b runs F then B)
                        if SCHEDULES[name].check(pp, m, v):
                            continue
                        for zero in opt.zero:
                            if dp == 1 and zero:
                                continue  # nothing to shard over
                            rows.append((tp, pp, dp, si, v, mbs, m, zero))
    if not rows:
        raise PipeplanError(f"--gpus {gpus} --global-batch {global_batch}: no configuration divides them "
                            f"(TP within a node of {node} dividing {sc.model.heads} heads, DP dividing the batch)")
    base = np.asarray(rows, dtype=np.int64)
    rc = np.arange(len(opt.recompute))
    off = np.asarray(opt.offload, dtype=float)
    tier = np.arange(len(opt.optimizer))
    # the product with the memory options, candidate-major so candidates of one base stay together
    n_mem = len(rc) * len(off) * len(tier)
    grid = np.stack(np.meshgrid(rc, np.arange(len(off)), tier, indexing="ij"), -1).reshape(-1, 3)
    idx = np.repeat(np.arange(len(base)), n_mem)
    mem = np.tile(grid, (len(base), 1))
    b = base[idx]
    return Space(tp=b[:, 0], pp=b[:, 1], dp=b[:, 2], schedule=b[:, 3], v=b[:, 4], mbs=b[:, 5], m=b[:, 6],
                 zero=b[:, 7], recompute=mem[:, 0], offload=off[mem[:, 1]], optimizer=mem[:, 2],
                 names={"schedule": sched_names, "recompute": tuple(opt.recompute), "optimizer": tuple(opt.optimizer)})
