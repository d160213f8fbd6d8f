"""Start the workers: torch's elastic launcher for `pipeplan run`/`profile`, `spawn` for tests and scripts.

`launch` builds the torchrun command line (one process per pipeline rank on this node) and waits for it:

    single node    --standalone                                  (a private rendezvous on a free port)
    multi-node     --nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id ID
                   (or, with --node-rank R: --rdzv-backend static, so node 0 holds global rank 0)

The agent runs in a session of its own (so a Ctrl-C in the terminal reaches only the launcher) through
runtime/lifeline.py, bound to the launcher by a parent-death signal, and each worker is bound to the agent the
same way: when the launcher stops, for any reason (Ctrl-C, SIGTERM, SIGKILL, an error), it kills the agent and
the kernel kills the workers; no rank outlives the command.

torchrun runs with --max-restarts 0: when any worker fails, the agent stops the others on its node and
exits non-zero with the failing rank's error (recorded by @record in runtime/worker.py); workers on other
nodes see their peer's connection drop, or time out after `timeout_s`, and fail too.

`spawn(fn, nprocs, *args)` runs `fn(rank, world, *args)` in `nprocs` fresh processes joined in a gloo
(or NCCL) group, with a deadline: the whole group is killed if it runs past it.

A rank that finished leaves with `exit_without_teardown`, never through Python's interpreter shutdown: a
gloo worker thread drops its last reference to a finished collective's tensors just after the collective
returns, and that drop takes the GIL; if the main thread is finalizing the interpreter by then, the
worker thread is made to exit inside a C++ destructor and the process aborts (SIGABRT, "terminate called
without an active exception", about 1 run in 20 of a 2-rank job whose last call is a broadcast). The job
is done and its files are closed, so nothing is lost by skipping the teardown.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from pipeplan.runtime.config import RunConfig
from pipeplan.runtime.lifeline import PARENT_ENV

POLL_S = 0.5


@dataclass(frozen=True)
class Rendezvous:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "pipeplan"

    def torchrun_args(self) -> list[str]:
        args = ["--nproc-per-node", str(self.nproc_per_node), "--max-restarts", "0", "--monitor-interval", "0.2"]
        if self.nnodes == 1 and self.rdzv_endpoint is None:
            return ["--standalone", *args]
        if self.rdzv_endpoint is None:
            from pipeplan.sim.errors import PipeplanError

            raise PipeplanError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
        args = ["--nnodes", str(self.nnodes), *args, "--rdzv-endpoint", self.rdzv_endpoint, "--rdzv-id", self.rdzv_id]
        if self.node_rank is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            args += ["--rdzv-backend", "static", "--node-rank", str(self.node_rank), "--master-addr", host,
                     "--master-port", port]
        else:
            args += ["--rdzv-backend", "c10d"]
        return args


def torchrun_command(config_path: str | Path, rdzv: Rendezvous) -> list[str]:
    return [sys.executable, "-m", "pipeplan.runtime.lifeline", *rdzv.torchrun_args(), "-m", "pipeplan.runtime.worker",
            str(config_path)]


def launch(cfg: RunConfig, rdzv: Rendezvous, wall_timeout_s: float | None = None,
           poll: Callable[[], None] | None = None) -> int:
    """Write the config, run torchrun, return its exit code (workers inherit stdout and stderr); `poll`
    is called about twice a second while it runs (a progress bar reading `cfg.progress_file`)."""
    with tempfile.TemporaryDirectory(prefix="pipeplan-run-") as tmp:
        path = Path(tmp) / "run.json"
        cfg.save(path)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(cfg.threads))
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
        env[PARENT_ENV] = str(os.getpid())
        deadline = None if wall_timeout_s is None else time.monotonic() + wall_timeout_s
        with subprocess.Popen(torchrun_command(path, rdzv), env=env, start_new_session=True) as proc:
            try:
                while True:
                    try:
                        return proc.wait(timeout=POLL_S)
                    except subprocess.TimeoutExpired:
                        if deadline is not None and time.monotonic() > deadline:
                            stop(proc)
                            print(f"pipeplan: the job ran past {wall_timeout_s} s and was stopped", file=sys.stderr)
                            return 124
                        if poll is not None:
                            poll()
            except BaseException:  # Ctrl-C, SIGTERM (cli.py raises Terminated), an error in `poll`
                stop(proc)
                raise


def stop(proc: subprocess.Popen) -> None:
    """Kill the agent and its process group; the workers die with it (their parent-death signal, lifeline.py).
    SIGKILL, not SIGTERM: a terminated agent prints a traceback per rank, and a stop has nothing to save."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def exit_without_teardown(code: int) -> None:
    """End this rank's process now with `code`, after flushing stdout and stderr (see module docstring)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---- spawn: in-process launching for tests and scripts -----------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(rank: int, fn: Callable, world: int, port: int, result_dir: str, timeout_s: float,
                 backend: str, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kwargs)
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(result_dir) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()
    exit_without_teardown(0)


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float = 120.0,
          backend: str = "gloo") -> list[Any]:
    """Run fn(rank, world, *args) on `nprocs` ranks (gloo; or NCCL, one GPU per rank); their return values,
    by rank. A rank that raises fails the call (torch.multiprocessing.ProcessRaisedException); past
    `timeout_s` all are killed."""
    from torch.multiprocessing.spawn import start_processes

    with tempfile.TemporaryDirectory(prefix="pipeplan-spawn-") as tmp:
        ctx = start_processes(_spawn_entry, args=(fn, nprocs, free_port(), tmp, timeout_s, backend, args),
                                 nprocs=nprocs, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"spawn: {nprocs} ranks ran past {timeout_s} s and were killed")
        return [torch.load(Path(tmp) / f"{r}.pt", weights_only=False) for r in range(nprocs)]
