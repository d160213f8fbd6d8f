"""A finished rank leaves without Python's interpreter teardown (runtime/launch.py): the teardown races a
gloo worker thread that is still dropping the last collective's tensors, and aborts the process."""

from __future__ import annotations

from pathlib import Path

from pipeplan.runtime.launch import spawn


def _last_call_is_a_broadcast(rank: int, world: int, out: str) -> int:
    import atexit

    import torch.distributed as dist

    atexit.register(lambda: Path(out, f"teardown-{rank}").write_text("ran"))  # runs only in a teardown
    objects = [{"files": b"x" * 4096}] if rank == 0 else [None]
    dist.broadcast_object_list(objects, src=0)
    return len(objects[0]["files"])


def test_spawned_ranks_return_their_results_and_skip_the_interpreter_teardown(tmp_path):
    assert spawn(_last_call_is_a_broadcast, 2, str(tmp_path), timeout_s=120) == [4096, 4096]
    assert list(tmp_path.iterdir()) == []
