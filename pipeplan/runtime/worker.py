"""Worker entry point: one process per pipeline rank, started by torch's elastic launcher (torchrun).

`pipeplan run` writes a RunConfig as JSON and launches this module; by hand (after writing the JSON, e.g.
with `RunConfig(...).save("run.json")`):

    # one process (a 1-stage pipeline: pipeline.stages = 1)
    torchrun --standalone --nproc-per-node 1 -m pipeplan.runtime.worker run.json
    # several processes on this machine, one per pipeline rank (gloo on CPU, NCCL on CUDA)
    torchrun --standalone --nproc-per-node 4 -m pipeplan.runtime.worker run.json
    # several nodes (2 x 4 ranks): the same line on each node, node 0's address as the endpoint
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint node0:29500 \
        --rdzv-id job42 -m pipeplan.runtime.worker run.json

Rank 0 gathers every rank's measurements and writes the results into `RunConfig.out_dir`; on a multi-node
job it then sends the files to one rank of every other node, which writes them into that node's
`out_dir`, so every node's `pipeplan run` ends with the outputs in its `--out` (none exits 0 with an empty
folder). Inputs are checked on every rank before any work (`--data` readable, the `--resume` checkpoint's
files present): a node that lacks them fails the job with one message naming the rank and host. Before and
after training every rank's clock is compared with rank 0's (runtime/clock.py), so the timelines are on
one clock. Any rank's exception is recorded by torchelastic (@record) and makes the launcher stop every
rank and exit non-zero; collectives and P2P time out after `timeout_s`, so a lost peer can never hang the job.
A rank that finished leaves without Python's interpreter teardown (runtime/launch.py says why).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from pipeplan.runtime.config import RunConfig


def resolve_device(name: str, local_rank: int) -> torch.device:
    """CPU, or the node's GPU local_rank (modulo the GPUs there: more ranks than GPUs share them)."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from pipeplan.sim.errors import PipeplanError

            raise PipeplanError("--device cuda: CUDA is not available here; use --device cpu")
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def choose_backend(device: torch.device, local_world: int) -> str:
    """NCCL with one GPU per rank; gloo on the CPU, and when ranks share GPUs (NCCL refuses two ranks on
    one device), with P2P staged through host memory (runtime/p2p.py)."""
    if device.type == "cuda" and local_world <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def init_distributed(cfg: RunConfig) -> tuple[int, int, torch.device]:
    """Join the job's process group (env:// from torchrun): gloo on the CPU, NCCL on CUDA."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(cfg.threads)
    backend = choose_backend(device, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout_s), **kwargs)
    return rank, world, device


def input_problem(cfg: RunConfig, rank: int) -> str | None:
    """What this rank cannot read of the job's inputs, as one line, or None."""
    from pipeplan.runtime import checkpoint
    from pipeplan.runtime.data import NAMED_SOURCES
    from pipeplan.sim.errors import PipeplanError

    if cfg.data not in (None, *NAMED_SOURCES) and not Path(cfg.data).is_file():
        return f"--data {cfg.data}: file not found (every node needs it at this path)"
    if cfg.resume:
        assert cfg.checkpoint_dir is not None  # RunConfig refuses resume without it
        try:
            checkpoint.check_resumable(cfg.checkpoint_dir, [rank])
        except PipeplanError as exc:
            return str(exc)
    return None


def check_inputs_everywhere(cfg: RunConfig, rank: int, world: int) -> list[tuple[str, str]]:
    """Every rank checks its inputs; all learn every rank's (host, out_dir). Raises on any rank's problem."""
    from pipeplan.sim.errors import PipeplanError

    mine = (socket.gethostname(), cfg.out_dir or "", input_problem(cfg, rank))
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    bad = [f"rank {r} on {host}: {problem}" for r, (host, _out, problem) in enumerate(every) if problem]
    if bad:
        raise PipeplanError("; ".join(bad))
    return [(host, out) for host, out, _ in every]


def host_clock(cfg: RunConfig, rank: int):
    """The host clock; with the `clock_skew_s` testing aid, ranks but 0 read it shifted, like another node."""
    if cfg.clock_skew_s and rank != 0:
        return lambda: time.perf_counter() + cfg.clock_skew_s
    return time.perf_counter


def share_outputs(cfg: RunConfig, rank: int, places: list[tuple[str, str]]) -> None:
    """Copy rank 0's output files to one rank on every other node (or other output folder)."""
    others = {place for place in places if place != places[0]}
    if not others:
        return
    files: list = [None]
    if rank == 0 and cfg.out_dir:
        root = Path(cfg.out_dir)
        files = [{str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}]
    dist.broadcast_object_list(files, src=0)
    writer = {place: r for r, place in reversed(list(enumerate(places)))}  # lowest rank per place
    if writer.get(places[rank]) == rank and places[rank] != places[0] and places[rank][1]:
        root = Path(places[rank][1])
        for name, data in (files[0] or {}).items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(data)
        print(f"pipeplan: rank 0 ran on {places[0][0]}; its outputs were copied to this node ({places[rank][0]})",
              flush=True)


def run_job(cfg: RunConfig, rank: int, world: int, device: torch.device) -> None:
    """Train (or profile), gather every rank's records on rank 0, write the results there, share them."""
    from pipeplan.runtime.clock import ClockFit, clock_group, estimate_offset
    from pipeplan.runtime.report import write_profile, write_run
    from pipeplan.runtime.train import Trainer

    places = check_inputs_everywhere(cfg, rank, world)
    now = host_clock(cfg, rank)
    trainer = Trainer(cfg, rank, world, device, now=now)
    group = clock_group()
    start = estimate_offset(rank, world, group, now)
    history = trainer.train()
    clock = ClockFit(start, estimate_offset(rank, world, group, now))
    info = {"rank": rank, "history": history, "device": str(device), "backend": dist.get_backend(),
            "clock": clock, **trainer.memory_info()}
    if cfg.profile:
        from pipeplan.runtime.profile import measure_p2p

        info["p2p_s"] = measure_p2p(trainer.executor.p2p.shape, torch.float32, device, rank, world)
    gathered: list | None = [None] * world if rank == 0 else None
    dist.gather_object(info, gathered, dst=0)
    if gathered is not None and cfg.out_dir:  # rank 0
        extra = {"planned_makespan_s": trainer.freezer.planned_makespan_s, "plan": trainer.freezer.plan,
                 "unfrozen_makespan_s": trainer.freezer.unfrozen_makespan_s,
                 "policies": trainer.policies,
                 "offload_shares": [c.offload_share for c in trainer.memory.chunks],
                 "stash_offload_shares": trainer.memory.stash_shares or [0.0] * len(trainer.memory.chunks),
                 "states_on_host": trainer.memory.states_on_host}
        (write_profile if cfg.profile else write_run)(cfg, trainer.scenario, trainer.schedule, gathered, extra)
    dist.barrier()
    share_outputs(cfg, rank, places)


@record
def main(argv: list[str] | None = None) -> int:
    from pipeplan.runtime.lifeline import PARENT_ENV, die_with_parent

    parent = os.environ.get(PARENT_ENV)
    if parent:  # started by pipeplan run's agent (not by hand): die with it, so no rank outlives the command
        die_with_parent(expected_parent=int(parent))
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pipeplan.runtime.worker RUN_CONFIG.json (started by torchrun)", file=sys.stderr)
        return 2
    cfg = RunConfig.load(argv[0])
    rank, world, device = init_distributed(cfg)
    try:
        run_job(cfg, rank, world, device)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from pipeplan.runtime.launch import exit_without_teardown

    exit_without_teardown(main() or 0)  # torch's @record types the result int | None
