"""`pipeplan run`: train the scenario's model with torch.distributed, one process per pipeline rank, executing
the same schedule the simulator uses, and write the measured step next to the simulator's prediction.

    pipeplan run                                            # tiny-cpu, 4 ranks (gloo), its 1f1b schedule
    pipeplan run scenarios/tiny-cpu.toml --schedule zbv --steps 20 --out out/zbv
    pipeplan run --freeze timelyfreeze --cap 0.5 --steps 30    # TimelyFreeze: monitor, solve the LP, ramp
    pipeplan run --costs out/profile/scenario.toml         # predict with profiled costs (pipeplan profile)
    # two nodes x 2 ranks: run on each node (node 0's address as the endpoint)
    pipeplan run SCEN.toml --nnodes 2 --nproc-per-node 2 --rdzv-endpoint node0:29500 --rdzv-id job1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pipeplan.analysis.commands.simulate import add_schedule_arguments, scenario_overrides
from pipeplan.analysis.console import busy
from pipeplan.analysis.outputs import add_force_argument, output_folder
from pipeplan.common.io import short_path
from pipeplan.common.units import GIB
from pipeplan.runtime.config import FREEZE_MODES, RunConfig
from pipeplan.sim.config import RECOMPUTE_POLICIES
from pipeplan.sim.errors import PipeplanError

if TYPE_CHECKING:
    from pipeplan.runtime.launch import Rendezvous
    from pipeplan.sim.config import Scenario

# runtime.data and runtime.launch import torch: they are imported where a job is launched, so that `run`,
# `profile` and `freeze-study --help` work without torch (tests/test_planning_ux.py); runtime.config does not.


class JobFailed(Exception):
    def __init__(self, code: int):
        super().__init__(f"the job exited with code {code}")
        self.code = code


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Scenario, schedule, device and rendezvous flags shared by `run` and `profile`."""
    add_schedule_arguments(parser, default_scenario="tiny-cpu")
    parser.add_argument("--microbatches", type=int, help="override pipeline.microbatches")
    parser.add_argument("--seed", type=int, default=0, help="weights, data and freezing draws (default 0)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: CUDA (NCCL) when available, else CPU (gloo)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--timeout-s", type=float, default=300.0,
                        help="a rank waiting longer than this on a peer fails instead of hanging (default 300)")
    parser.add_argument("--nproc-per-node", type=int, help="processes on this node (default: pipeline.stages / nnodes)")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    parser.add_argument("--node-rank", type=int, help="this node's rank (static rendezvous; node 0 writes outputs)")
    parser.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous (node 0) for multi-node jobs")
    parser.add_argument("--rdzv-id", default="pipeplan", help="job id shared by all nodes (default pipeplan)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser)
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--out", default="out/run", help="output folder (default: out/run)")
    add_force_argument(parser)
    parser.add_argument("--data", help="'synthetic', 'pydoc' (CPython's reference prose, train split), a text file "
                                       "(byte tokens); default: the Python stdlib sources")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument("--freeze", choices=FREEZE_MODES, default="none", help="freezing (default none)")
    parser.add_argument("--cap", type=float, help="freeze cap: mean ratio per stage (default: the scenario's)")
    parser.add_argument("--freeze-warmup", type=int, default=2, help="steps before freezing (default 2)")
    parser.add_argument("--freeze-monitor", type=int, default=8,
                        help="monitoring steps, half of each action's samples frozen (default 8)")
    parser.add_argument("--freeze-ramp", type=int, default=2,
                        help="steps over which the cap ramps up, the plan re-solved each step (default 2)")
    parser.add_argument("--freeze-redraw", type=int, default=5, help="re-draw frozen sets every K steps (default 5)")
    parser.add_argument("--recompute", choices=RECOMPUTE_POLICIES,
                        help="override memory.recompute (default: the scenario's)")
    parser.add_argument("--offload-activations", type=float, metavar="SHARE",
                        help="override memory.offload_activations: share of saved activations moved to host")
    parser.add_argument("--offload-optimizer", action="store_true",
                        help="optimizer state and master weights in host memory (memory.optimizer = dram)")
    parser.add_argument("--costs", help="explicit-costs scenario to predict with (pipeplan profile's scenario.toml)")
    parser.add_argument("--checkpoint-dir", help="save checkpoints here (at the end and every --checkpoint-every)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every N steps (default: end only)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--fail-rank", type=int, help=argparse.SUPPRESS)  # testing aid: failure propagation
    parser.add_argument("--fail-step", type=int, default=0, help=argparse.SUPPRESS)


def overrides(args: argparse.Namespace) -> dict[str, object]:
    out = scenario_overrides(args)
    if getattr(args, "microbatches", None) is not None:
        out["pipeline.microbatches"] = args.microbatches
    if getattr(args, "recompute", None):
        out["memory.recompute"] = args.recompute
    if getattr(args, "offload_activations", None) is not None:
        out["memory.offload_activations"] = args.offload_activations
    if getattr(args, "offload_optimizer", False):
        out["memory.optimizer"] = out["memory.master_weights"] = "dram"
    return out


def launch(cfg: RunConfig, rdzv: Rendezvous, poll: Callable[[], None] | None = None) -> int:
    """runtime.launch.launch, imported (with torch) only when a job starts."""
    from pipeplan.runtime.launch import launch as launch_torchrun

    return launch_torchrun(cfg, rdzv, poll=poll)


def rendezvous(args: argparse.Namespace, stages: int) -> Rendezvous:
    from pipeplan.runtime.launch import Rendezvous

    nproc = args.nproc_per_node or stages // max(1, args.nnodes)
    if nproc * args.nnodes != stages:
        raise PipeplanError(
            f"--nproc-per-node {nproc} x --nnodes {args.nnodes} = {nproc * args.nnodes} processes, but "
            f"pipeline.stages is {stages}; one process runs one pipeline rank"
        )
    return Rendezvous(nproc, args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id)


def launch_job(cfg: RunConfig, args: argparse.Namespace, out: str, poll: Callable[[], None] | None = None
               ) -> dict | None:
    """Validate here (bad input is one line, exit 2), launch, and move rank 0's files into `out`."""
    from pipeplan.runtime.data import NAMED_SOURCES
    from pipeplan.runtime.memory import run_memory
    from pipeplan.runtime.report import predict
    from pipeplan.runtime.train import load_run_scenario

    check_run_flags(cfg)
    check_launch_flags(args)
    scenario, schedule = load_run_scenario(cfg)
    if scenario.memory.plan and cfg.memory_choice is None:  # solve the memory MILP once, here; ranks reuse it
        from pipeplan.sim.costs import build_cost_table
        from pipeplan.solver.step import resolve_memory_plan

        costs = build_cost_table(scenario).with_microbatches(schedule.num_microbatches)
        cfg.memory_choice = resolve_memory_plan(scenario, costs, schedule).choice.to_dict()
    run_memory(scenario, schedule, cfg.choice())  # a memory plan the runtime can execute
    check_costs(cfg.costs)
    predict(cfg, scenario, schedule)  # --costs must describe this pipeline
    if cfg.data not in (None, *NAMED_SOURCES):
        check_data_file(cfg.data, scenario.model.seq_len if scenario.model else 0)
    rdzv = rendezvous(args, schedule.num_ranks)
    check_host_memory(scenario, cfg, rdzv.nproc_per_node / schedule.num_ranks)
    if cfg.resume:  # every rank's file, read here: a broken checkpoint is one line, not p tracebacks
        check_checkpoint(str(cfg.checkpoint_dir), range(schedule.num_ranks) if rdzv.nnodes == 1 else ())
    with output_folder(args, out) as stage:
        cfg.out_dir = str(stage)
        if poll is not None:  # the caller draws its own progress (one live display at a time)
            code = launch(cfg, rdzv, poll=poll)
        else:
            with busy(f"{'profiling' if cfg.profile else 'running'} {schedule.name} on {schedule.num_ranks} ranks, "
                      f"{cfg.steps} steps"):
                code = launch(cfg, rdzv)
        if code != 0:
            raise JobFailed(code)
        summary = stage / ("summary.json" if not cfg.profile else "profile.json")
        if not summary.exists():
            print(f"pipeplan: the job succeeded but no outputs reached this node's {out}; they are on the node "
                  "that ran rank 0", file=sys.stderr)
            return None
        if not cfg.profile:
            render_run(stage)
        return json.loads(summary.read_text())


def render_run(out: Path) -> None:
    """Draw what the runtime measured (its CSVs and summary.json): trace.json, gantt.png, memory.png,
    loss.png. Here, after the job, not inside rank 0: the runtime writes data, analysis draws it."""
    import pandas as pd

    from pipeplan.analysis.chrome_trace import chrome_trace
    from pipeplan.analysis.plots import gantt, memory_plot, save
    from pipeplan.common.io import atomic_write_json

    summary = json.loads((out / "summary.json").read_text())
    title = summary["title"]
    timeline = pd.read_csv(out / "timeline.csv")
    memory = pd.read_csv(out / "memory.csv")
    metrics = pd.read_csv(out / "metrics.csv")
    atomic_write_json(out / "trace.json", chrome_trace(timeline, memory, (), title))
    gantt(timeline, out / "gantt.png", title)
    memory_plot(memory, out / "memory.png", None, title)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(metrics["step"], metrics["loss"], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    save(fig, out / "loss.png")


MAX_THREADS = 1024
"""torch threads per rank: above any machine's core count."""
MAX_STEPS = 1_000_000
"""--steps: a million optimizer steps is weeks of a real job; 2**63 is a typo that would run forever."""
TIMEOUT_RANGE_S = (1.0, 7 * 24 * 3600.0)
"""--timeout-s: below a second a healthy collective times out; above a week timedelta and the stores overflow
or a lost peer is never noticed."""
MAX_DATA_BYTES = 256 * 2**20
"""--data: every rank holds the file as int64 tokens (8 bytes per byte), so 256 MiB is 2 GiB per rank."""


def check_run_flags(cfg: RunConfig) -> None:
    """Flags RunConfig's own checks let through: NaN and infinities, seeds numpy refuses, absurd threads, steps
    and timeouts, a checkpoint folder that cannot be one, a CUDA device that is not there."""
    import math

    for flag, value in (("--timeout-s", cfg.timeout_s), ("--lr", cfg.lr)):
        if not math.isfinite(value) or value < 0:
            raise PipeplanError(f"{flag}: {value} is not a finite number >= 0")
    lo, hi = TIMEOUT_RANGE_S
    if not lo <= cfg.timeout_s <= hi:
        raise PipeplanError(f"--timeout-s: {cfg.timeout_s:g} is outside {lo:g}..{hi:g} seconds")
    if not 0 <= cfg.seed < 2**32:
        raise PipeplanError(f"--seed: {cfg.seed} is outside 0..2**32-1")
    if cfg.threads > MAX_THREADS:
        raise PipeplanError(f"--threads: {cfg.threads} is above the limit {MAX_THREADS}")
    if cfg.steps > MAX_STEPS:
        raise PipeplanError(f"--steps: {cfg.steps} is above the limit {MAX_STEPS:,}")
    if cfg.checkpoint_every > MAX_STEPS:
        raise PipeplanError(f"--checkpoint-every: {cfg.checkpoint_every} is above the limit {MAX_STEPS:,}")
    if cfg.checkpoint_dir is not None:
        from pipeplan.common.io import check_output_folder

        check_output_folder(cfg.checkpoint_dir, "--checkpoint-dir")
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise PipeplanError("--device cuda: CUDA is not available here; use --device cpu (or auto)")


def check_launch_flags(args: argparse.Namespace) -> None:
    """The rendezvous flags: a node rank inside --nnodes (node 5 of 2 would wait for peers forever), counts >= 1,
    and an endpoint of the form HOST:PORT."""
    if args.nnodes < 1 or (args.nproc_per_node is not None and args.nproc_per_node < 1):
        raise PipeplanError("--nnodes and --nproc-per-node: must be >= 1")
    if args.node_rank is not None and not 0 <= args.node_rank < args.nnodes:
        raise PipeplanError(f"--node-rank: {args.node_rank} is outside 0..{args.nnodes - 1} (--nnodes {args.nnodes})")
    if args.rdzv_endpoint is not None:
        host, sep, port = args.rdzv_endpoint.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")  # an IPv6 address in brackets
        valid_host = bool(host) and all(c.isalnum() or c in ".-_:" for c in host)
        if not sep or not valid_host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise PipeplanError(f"--rdzv-endpoint {short_path(args.rdzv_endpoint, 60)}: give HOST:PORT with a port "
                                "in 1..65535 (node 0's address)")


def check_costs(costs: str | None) -> None:
    """--costs: an explicit-costs scenario (what `pipeplan profile` writes), not a model scenario."""
    if costs is None:
        return
    from pipeplan.sim.config import load_scenario

    if load_scenario(costs).costs is None:
        raise PipeplanError(f"--costs {short_path(costs, 60)}: a [model] scenario; give an explicit-costs scenario "
                            "(the scenario.toml pipeplan profile writes)")


def host_memory_available() -> float | None:
    """Bytes this machine can still give (MemAvailable of /proc/meminfo); None where that is not known."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(scenario: Scenario, cfg: RunConfig, local_share: float) -> None:
    """On the CPU every local rank keeps its model state in this machine's memory: fp32 weights (the runtime
    keeps fp32 masters; autocast lowers only the forwards), fp32 gradients and the optimizer's state. Refuse
    a run that cannot hold even that (an 8B scenario on a laptop) before launching ranks that the kernel's
    OOM killer would end minutes later with torchrun's wall of tracebacks."""
    import torch

    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return
    from pipeplan.sim.costs import build_cost_table

    state = build_cost_table(scenario).detail
    if state is None or scenario.model is None:
        return
    parts = state.state_bytes
    need = float((2 * parts["gradients"] + parts["optimizer"]).sum()) * local_share  # weights as many as grads
    free = host_memory_available()
    if free is not None and need > free:
        raise PipeplanError(
            f"{scenario.model.name} on the CPU: its ranks need at least {need / GIB:.1f} GiB (fp32 weights, "
            f"gradients, optimizer state), {free / GIB:.1f} GiB is free; run tiny-cpu here, or --device cuda")


def check_data_file(path: str, seq_len: int) -> None:
    """--data: a readable regular file (a device or fifo would be read forever, or block) of at least one
    sequence (seq_len + 2 bytes) and at most MAX_DATA_BYTES."""
    import stat

    try:
        info = Path(path).stat()
    except (OSError, ValueError):
        raise PipeplanError(f"--data {path[:80]}: file not found; give a text file, 'pydoc' or 'synthetic'") from None
    if not stat.S_ISREG(info.st_mode):
        raise PipeplanError(f"--data {path[:80]}: not a regular file; give a text file, 'pydoc' or 'synthetic'")
    if not os.access(path, os.R_OK):
        raise PipeplanError(f"--data {path[:80]}: not readable")
    if info.st_size < seq_len + 2:
        raise PipeplanError(f"--data {path[:80]}: {info.st_size} bytes, need at least seq_len + 2 = {seq_len + 2}")
    if info.st_size > MAX_DATA_BYTES:
        raise PipeplanError(f"--data {path[:80]}: {info.st_size:,} bytes, above the limit of {MAX_DATA_BYTES:,} "
                            "(each rank holds 8 bytes per byte of it)")


def check_checkpoint(root: str, ranks: range | tuple[()]) -> None:
    """--resume: the latest complete checkpoint exists and each rank's file loads (with the runtime's loader);
    PipeplanError naming the file if not, before any rank is launched."""
    import torch

    from pipeplan.runtime import checkpoint

    step = checkpoint.check_resumable(root, ranks)  # the marker names a step; this node's rank files are there
    for rank in ranks:
        try:
            state = checkpoint.load(root, rank, torch.device("cpu"))
            missing = checkpoint.missing_keys(state)
        except PipeplanError:
            raise
        except Exception as exc:  # truncated zip, bad pickle, refused global: all one line
            path = checkpoint.step_dir(root, step) / f"rank-{rank}.pt"
            raise PipeplanError(f"--resume: {short_path(path, 60)} cannot be loaded ({type(exc).__name__}); "
                                "the checkpoint is broken or was not written by pipeplan run") from None
        if missing:
            path = checkpoint.step_dir(root, step) / f"rank-{rank}.pt"
            raise PipeplanError(f"--resume: {short_path(path, 60)} lacks {', '.join(missing)}; it was not written by "
                                "pipeplan run")


def run(args: argparse.Namespace) -> int:
    cfg = RunConfig(
        scenario=args.scenario, overrides=overrides(args), schedule_csv=args.schedule_csv, steps=args.steps,
        data=args.data, seed=args.seed, lr=args.lr, freeze=args.freeze, freeze_cap=args.cap,
        freeze_warmup=args.freeze_warmup, freeze_monitor=args.freeze_monitor, freeze_ramp=args.freeze_ramp,
        freeze_redraw=args.freeze_redraw, costs=args.costs, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, resume=args.resume, device=args.device, timeout_s=args.timeout_s,
        threads=args.threads, fail_rank=args.fail_rank, fail_step=args.fail_step,
    )
    try:
        summary = launch_job(cfg, args, args.out)
    except JobFailed as exc:
        print(f"pipeplan run: {exc}; nothing was written to {args.out}")
        return exc.code
    if summary is not None:
        print_run_summary(summary)
        print(f"wrote {args.out}/: metrics.csv timeline.csv timelines.csv memory.csv schedule.csv summary.json "
              "trace.json gantt.png memory.png loss.png")
    return 0


PROFILE_HINT_ERROR = 0.25
"""A prediction from the scenario's own costs that misses the measured makespan by more than this share gets a
hint to profile: the scenario describes its [device], usually not the machine the run used."""


def print_run_summary(s: dict) -> None:
    from pipeplan.analysis.console import console

    err = s["makespan_rel_error"]
    console.print(
        f"{s['schedule']} p={s['stages']} m={s['microbatches']} v={s['virtual_stages']} on {s['device']}: "
        f"final loss {s['final_loss']:.4f} · step {s['step_time_s'] * 1e3:.1f} ms · "
        f"{s['tokens_per_s']:,.0f} tokens/s"
    )
    console.print(
        f"makespan measured {s['measured_makespan_s'] * 1e3:.2f} ms, predicted {s['predicted_makespan_s'] * 1e3:.2f} ms"
        f" ({'n/a' if err is None else f'{err:+.1%}'}; costs: {s['prediction_costs']})"
    )
    if s["prediction_costs"] == "scenario" and err is not None and abs(err) > PROFILE_HINT_ERROR:
        console.print("the scenario's device model is not this machine: `pipeplan profile` measures its costs, "
                      "`pipeplan run --costs out/profile/scenario.toml` predicts with them")
