"""Chrome trace event JSON (opens in Perfetto / chrome://tracing): ranks as processes, actions as slices,
P2P transfers on a second track, the copy engines (offload d2h, prefetch h2d) on two more, HBM as a counter
track per rank."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd

from pipeplan.common.units import GIB

US = 1e6  # trace timestamps are microseconds


def chrome_trace(
    timeline: pd.DataFrame,
    memory: pd.DataFrame | None = None,
    transfers: Iterable[tuple[int, int, str, float, float]] = (),
    title: str = "pipeplan",
    copies: Iterable[Any] = (),
) -> dict[str, Any]:
    """`copies`: sim.engine.CopyRecord-like objects (rank, stream, what, action, stage, start_s, end_s)."""
    events: list[dict[str, Any]] = []
    for rank in sorted(timeline["rank"].unique()):
        r = int(rank)
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}})
        events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": "compute"}})
        events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 1, "args": {"name": "p2p send"}})
        events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 2, "args": {"name": "copy d2h"}})
        events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 3, "args": {"name": "copy h2d"}})
    for row in timeline.itertuples(index=False):
        events.append(
            {
                "name": f"{row.stage}{row.kind}{row.microbatch}",
                "cat": row.kind,
                "ph": "X",
                "pid": int(row.rank),
                "tid": 0,
                "ts": row.start_s * US,
                "dur": (row.end_s - row.start_s) * US,
                "args": {"stage": int(row.stage), "microbatch": int(row.microbatch), "kind": row.kind},
            }
        )
    for src, dst, action, start, end in transfers:
        events.append(
            {
                "name": f"{action} -> rank {dst}",
                "cat": "p2p",
                "ph": "X",
                "pid": int(src),
                "tid": 1,
                "ts": start * US,
                "dur": (end - start) * US,
            }
        )
    for c in copies:
        if c.end_s <= c.start_s:
            continue  # a chunk that moves nothing still takes its turn on the stream; no slice for it
        label = f"{c.what} {c.action}" if c.action is not None else f"optimizer step, stage {c.stage}"
        events.append(
            {
                "name": label,
                "cat": c.what,
                "ph": "X",
                "pid": int(c.rank),
                "tid": 2 if c.stream == "d2h" else 3,
                "ts": c.start_s * US,
                "dur": (c.end_s - c.start_s) * US,
            }
        )
    if memory is not None:
        for row in memory.itertuples(index=False):
            events.append(
                {
                    "name": "HBM",
                    "ph": "C",
                    "pid": int(row.rank),
                    "ts": row.time_s * US,
                    "args": {"GiB": row.hbm_bytes / GIB},
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title}}
