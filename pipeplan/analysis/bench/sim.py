"""Simulator speed: pipeplan's SimPy engine against torch's unit-step dry run on interleaved-1f1b.

torch's `_simulate_comms_compute` steps every rank in lock-step over the schedule with SEND/RECV actions
inserted (`_add_send_recv`); it models neither time nor memory. pipeplan models durations, FIFO links and
HBM. Both are timed on the same schedule; the dry run is skipped above `--torch-max-actions`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pandas as pd

SIZES = [(4, 8), (8, 32), (16, 64), (32, 128), (32, 256), (64, 512)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=",".join(f"{p}x{m}" for p, m in SIZES),
                        help="comma-separated PxM pipeline sizes (default: %(default)s)")
    parser.add_argument("--virtual-stages", type=int, default=2,
                        help="chunks per rank of the interleaved-1f1b schedule timed (default: %(default)s)")
    parser.add_argument("--torch-max-actions", type=int, default=40_000,
                        help="skip torch's dry run above this many actions (default: %(default)s)")


def torch_dry_run_s(schedule) -> float:
    """Wall time of torch's own dry run of the same schedule (comms inserted first, not timed)."""
    from torch.distributed.pipelining.schedules import _add_send_recv, _simulate_comms_compute

    s2r = schedule.stage_to_rank
    order = _add_send_recv(schedule.to_torch(), stage_to_rank=lambda s: s2r[s], num_stages=schedule.num_stages)
    t0 = time.perf_counter()
    _simulate_comms_compute(order, lambda s: s2r[s], schedule.num_stages)
    return time.perf_counter() - t0


def _parse_sizes(text: str) -> list[tuple[int, int]]:
    from pipeplan.sim.errors import PipeplanError

    try:
        return [(int(p), int(m)) for p, m in (s.lower().split("x") for s in text.split(","))]
    except ValueError:
        raise PipeplanError(f"--sizes: {text!r}; expected comma-separated PxM, e.g. 4x8,32x256") from None


def run(args: argparse.Namespace, out_dir: Path) -> str:
    import matplotlib.pyplot as plt
    import numpy as np
    from rich.progress import track

    from pipeplan.analysis.plots import save
    from pipeplan.sim.costs import CostTable
    from pipeplan.sim.engine import simulate
    from pipeplan.sim.schedules import build_schedule

    v = args.virtual_stages
    rows = []
    for p, m in track(_parse_sizes(args.sizes), description="bench sim"):
        sched = build_schedule("interleaved-1f1b", p, m, v)
        n = p * v
        costs = CostTable(p, v, m, np.full(n, 1.0), np.full(n, 1.0), np.full(n, 1.0), np.full(n, 1.0),
                          np.zeros(n), p2p_s=0.05)
        res = simulate(sched, costs)
        torch_s = torch_dry_run_s(sched) if sched.num_actions <= args.torch_max_actions else float("nan")
        rows.append({
            "schedule": "interleaved-1f1b", "p": p, "m": m, "v": v, "actions": sched.num_actions,
            "sim_wall_s": res.sim_wall_s, "actions_per_s": sched.num_actions / res.sim_wall_s,
            "torch_dry_run_s": torch_s, "speedup_vs_torch": torch_s / res.sim_wall_s,
        })
    df = pd.DataFrame(rows)
    (out_dir / "bench_sim.csv").write_text(df.to_csv(index=False))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(df["actions"], df["sim_wall_s"], "o-", label="pipeplan (SimPy, timed + memory)")
    ok = df.dropna(subset=["torch_dry_run_s"])
    ax.loglog(ok["actions"], ok["torch_dry_run_s"], "s--", label="torch _simulate_comms_compute")
    ax.set_xlabel("actions")
    ax.set_ylabel("wall time (s)")
    ax.legend()
    ax.set_title(f"interleaved-1f1b, v={v}")
    save(fig, out_dir / "bench_sim.png")
    big = df.iloc[-1]
    return f"largest: {int(big.actions)} actions in {big.sim_wall_s:.2f} s ({big.actions_per_s:,.0f} actions/s)"
