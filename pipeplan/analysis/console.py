"""Short human-readable tables on the console (rich)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pipeplan.common.units import GIB

if TYPE_CHECKING:
    from rich.progress import Progress, ProgressColumn

console = Console(width=None if sys.stdout.isatty() else 160)  # logs and pipes get full tables


@contextmanager
def busy(what: str) -> Iterator[None]:
    """A spinner with the elapsed time for work of unknown length (ranks training, an LP with its baselines);
    gone when it ends, and never drawn into logs or pipes."""
    from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

    with transient_bar(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()) as bar:
        bar.add_task(what, total=None)
        yield


def transient_bar(*columns: ProgressColumn | str) -> Progress:
    """A progress bar that is gone when it ends, drawn only on a terminal: in a log or a pipe it would leave an
    empty line behind, which breaks a bad input's one-line message."""
    from rich.progress import Progress

    return Progress(*columns, console=console, transient=True, disable=not console.is_terminal)


def gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def step_differs(summary: dict[str, Any], spec: str = ".6g") -> bool:
    """Whether the step (what tokens/s counts: the tails after the pipeline, or with optimizer post-validation
    the longest rank span) and the pipeline's makespan (what the bubble is of) print differently at `spec`: only
    then are both shown. A summary without step_time_s (older outputs) has its step equal to the makespan."""
    makespan = summary["makespan_s"]
    return format(float(summary.get("step_time_s", makespan)), spec) != format(float(makespan), spec)


def fit_line(summary: dict[str, Any], peak_key: str = "peak_hbm_bytes") -> str:
    """One line that answers "does it fit?": the tightest rank's peak HBM against capacity (and margin)."""
    peaks = summary[peak_key]
    peak = max(peaks) if isinstance(peaks, list) else peaks
    limit = summary.get("hbm_limit_bytes")
    cap = summary.get("hbm_capacity_bytes")
    rank = summary.get("tightest_rank")
    if limit is None:
        return f"fits: no HBM capacity set to check against (costs.hbm_gib) · peak HBM {gib(peak)} GiB"
    of = f"{gib(limit)} GiB" + (f" (capacity {gib(cap)} - margin)" if cap and cap - limit > 1 else "")
    if summary.get("fits", True):
        return f"[bold green]fits[/]: peak HBM {gib(peak)} GiB of {of}, rank {rank} tightest"
    return (f"[bold red]DOES NOT FIT[/]: rank {rank} needs {gib(peak)} GiB of {of}, "
            f"{gib(summary['over_capacity_bytes'])} GiB over")


def print_simulation(summary: dict[str, Any], title: str) -> None:
    console.print(fit_line(summary))
    cap = summary.get("hbm_capacity_bytes")
    t = Table(title=escape(title), show_header=True, header_style="bold")  # the title holds model.name
    t.add_column("rank", justify="right")
    t.add_column("peak activations (GiB)", justify="right")
    t.add_column("peak HBM (GiB)" + (f" of {gib(cap)}" if cap else ""), justify="right")
    for r, (a, h) in enumerate(zip(summary["peak_activation_bytes"], summary["peak_hbm_bytes"], strict=True)):
        over = cap is not None and h > (summary.get("hbm_limit_bytes") or cap) + 1e-6
        t.add_row(str(r), gib(a), f"[red]{gib(h)}[/]" if over else gib(h))
    console.print(t)
    line = f"makespan {summary['makespan_s']:.6g} s · "
    if step_differs(summary):
        line += f"step {summary['step_time_s']:.6g} s · "
    line += (
        f"bubble {summary['bubble_ratio']:.1%} · "
        f"{summary['actions']} actions simulated in {summary['sim_wall_s'] * 1e3:.1f} ms"
    )
    if "tokens_per_s" in summary:
        line += f" · {summary['tokens_per_s']:,.0f} tokens/s · MFU {summary['mfu']:.1%}"
    console.print(line)
    if summary["oom"]:
        d = summary["oom_detail"]
        console.print(
            f"[bold red]OOM[/]: rank {d['rank']} exceeds HBM by {gib(d['excess_bytes'])} GiB at "
            f"t={d['time_s']:.4g} s ({d['action']}); ranks over capacity: {d['ranks']}"
        )
