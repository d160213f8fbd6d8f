"""Checkpoint and resume: each rank saves its chunks, optimizer, freezer, step, RNG and measured history.

    DIR/step-000004/rank-0.pt ... rank-{p-1}.pt     one file per rank, written atomically
    DIR/latest                                      "4": written by rank 0 once every rank has saved

A checkpoint is complete only when `latest` names it, so a job killed mid-save resumes from the previous
one. Data is a function of (seed, step), so resuming at step k reads what the uninterrupted run read, and a
resumed run reproduces the uninterrupted run's losses exactly.

A rank's state has two parts (runtime/train.py's `Trainer.state_dict`):

    "device"   chunks and optimizer: loaded with map_location="cpu" (the saving device may not exist
               here); the chunks are then moved to the loading rank's device, whatever device saved them
               (a CUDA checkpoint resumes on the CPU and the other way round). The optimizer state stays
               on the CPU for torch's Optimizer.load_state_dict to place by its parameters: the moments on
               their device, a non-capturable Adam's `step` counters on the CPU, where torch keeps them
               (on the GPU every step would read them back, a sync per parameter)
    "host"     the CPU RNG state, the CUDA RNG state, the freezer's generator state and plain records:
               always on the CPU, since torch.set_rng_state and Generator.set_state take only a CPU
               ByteTensor (a GPU-mapped RNG state is what "RNG state must be a torch.ByteTensor" means)

Files load with `weights_only=True`: tensors and primitive containers only, no arbitrary pickled objects
(the history is saved as plain dicts for that reason).

Multi-node jobs: every rank writes its own file and rank 0 writes `latest` after a barrier, so the
checkpoint directory must be one shared filesystem (NFS, Lustre, ...) mounted at the same path on every
node; on node-local disks each node would hold only its ranks' files and rank 0's `latest` would name a
checkpoint other nodes cannot read. `check_resumable` checks, on every node, that the files are there.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeplan.common.io import InputError, atomic_file, atomic_write_text, read_input_bytes, short_path
from pipeplan.sim.errors import PipeplanError

MAX_MARKER_BYTES = 64
"""`latest` holds one step number and a newline."""


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def save(root: str | Path, step: int, rank: int, state: dict) -> None:
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{rank}.pt"
    with atomic_file(path) as f:  # a unique temporary, created exclusively: never a planted link followed
        torch.save(state, f)
    dist.barrier()
    if rank == 0:
        atomic_write_text(Path(root) / "latest", f"{step}\n")
    dist.barrier()


def latest_step(root: str | Path) -> int:
    """The step the `latest` marker names; PipeplanError if there is none or it holds no step number."""
    marker = Path(root) / "latest"
    if not marker.exists() and not marker.is_symlink():
        raise PipeplanError(f"--resume: no complete checkpoint in {short_path(root)} (no 'latest' file)")
    try:  # a fifo is refused before it is opened: it would wait for a writer forever
        return int(read_input_bytes(marker, MAX_MARKER_BYTES, "--resume").decode(errors="replace").strip())
    except InputError as exc:
        raise PipeplanError(str(exc)) from None
    except ValueError:
        raise PipeplanError(f"--resume: {short_path(marker)} does not hold a step number; the checkpoint is broken") \
            from None


def check_resumable(root: str | Path, ranks: Iterable[int] | None = None) -> int:
    """The latest complete step; PipeplanError naming what is missing (no `latest`, or a rank's file)."""
    step = latest_step(root)
    for rank in ranks if ranks is not None else ():
        path = step_dir(root, step) / f"rank-{rank}.pt"
        if not path.exists():
            raise PipeplanError(f"--resume: {short_path(path)} is missing on this node; the checkpoint directory "
                                "must be a filesystem every node shares, written with as many ranks as this job has")
    return step


def load(root: str | Path, rank: int, device: torch.device | str) -> dict:
    """Rank's latest state: the chunks on `device`, the optimizer's state and "host" tensors on the CPU (module
    docstring: the optimizer's load_state_dict places its state)."""
    step = check_resumable(root, [rank])
    path = step_dir(root, step) / f"rank-{rank}.pt"
    if not path.is_file():  # a fifo or device would block torch.load, or be read forever
        raise PipeplanError(f"--resume: {short_path(path)} is not a regular file; the checkpoint is broken")
    # map everything to the CPU first (the saving device may not exist here), then the chunks over
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not missing_keys(state):  # a file pipeplan did not write comes back as read: the caller names what it lacks
        state["device"]["chunks"] = tree_to(state["device"]["chunks"], torch.device(device))
    return state


STATE_KEYS = {"step": int, "device": {"chunks": dict, "optimizer": dict},
              "host": {"rng": torch.Tensor, "freezer": dict, "history": list}}
"""What runtime/train.py's Trainer.state_dict saves and load_state_dict reads: key -> type, or nested keys."""


def missing_keys(state: Any, keys: dict = STATE_KEYS, prefix: str = "") -> list[str]:
    """The dotted keys of STATE_KEYS that `state` lacks or holds with another type (a file that loads but was
    not written by pipeplan run)."""
    if not isinstance(state, dict):
        return [prefix.rstrip(".") or "a dict of state"]
    out: list[str] = []
    for key, want in keys.items():
        if key not in state:
            out.append(prefix + key)
        elif isinstance(want, dict):
            out += missing_keys(state[key], want, f"{prefix}{key}.")
        elif not isinstance(state[key], want) or isinstance(state[key], bool):
            out.append(f"{prefix}{key} ({want.__name__})")
    return out


def tree_to(tree: Any, device: torch.device) -> Any:
    """Every tensor in a nest of dicts, lists and tuples, moved to `device`."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: tree_to(v, device) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(tree_to(v, device) for v in tree)
    return tree
