"""Processes that die with their parent: no rank may outlive the `pipeplan run` that started it.

The chain is launcher (`pipeplan run`) -> torchrun's agent -> one worker per rank, and torchrun starts each
worker in its own session, so neither a signal to the launcher's process group nor the agent's death reaches
the workers by itself. Linux's parent-death signal does (prctl(2), PR_SET_PDEATHSIG): the agent is started
through this module's `__main__`, which asks for SIGKILL when the launcher dies, and each worker asks the same
about the agent (`die_with_parent`, first thing in runtime/worker.py's main). The setting survives exec.

    python -m pipeplan.runtime.lifeline ARGS...    # = python -m torch.distributed.run ARGS..., bound to its parent
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PARENT_ENV = "PIPEPLAN_PARENT_PID"
"""Set by the agent for its workers: the pid their parent must have, checked after the prctl call (a parent that
died before the call would otherwise go unnoticed: the worker is already re-parented)."""


def die_with_parent(sig: int = signal.SIGKILL, expected_parent: int | None = None) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies; exit at once if the parent is already
    gone (not `expected_parent`). False where the platform has no such signal (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(128 + int(sig))  # orphaned before the call: do what the signal would have done
    return True


def main() -> None:
    """Run torchrun's agent bound to the launcher, telling its workers the agent's pid."""
    launcher = int(os.environ.get(PARENT_ENV, "0")) or None
    die_with_parent(signal.SIGKILL, launcher)
    os.environ[PARENT_ENV] = str(os.getpid())  # what the workers' parent must be
    sys.argv = ["torch.distributed.run", *sys.argv[1:]]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
