"""The runtime's device-dependent paths, exercised on the CPU by construction: checkpoints that cross
devices, the copy stream's ordering, the host optimizer, the memory peak taken after the optimizer step."""

from __future__ import annotations

import pytest
import torch

from pipeplan.runtime import checkpoint
from pipeplan.runtime.config import RunConfig
from pipeplan.runtime.optim import HostOffloadOptimizer
from pipeplan.runtime.streams import CopyStream

ONE_STAGE = {"model.hidden": 32, "model.layers": 2, "model.ffn_hidden": 64, "model.seq_len": 16,
             "pipeline.stages": 1, "pipeline.microbatches": 2, "pipeline.schedule": "zb-h1"}


def trainer(**kwargs):
    from pipeplan.runtime.train import Trainer

    frz = {"freeze": "uniform", "freeze_cap": 0.5, "freeze_warmup": 0, "freeze_ramp": 0}
    cfg = RunConfig(overrides=ONE_STAGE, data="synthetic", timeout_s=30, **{**frz, **kwargs})
    return Trainer(cfg, 0, 1, torch.device("cpu"))


def test_checkpoint_loads_onto_another_device_with_host_state_on_the_cpu(world_of_one, tmp_path):
    t = trainer(steps=3, checkpoint_dir=str(tmp_path))
    t.train()
    # the CUDA bug, reproduced: an RNG state mapped off the CPU is refused
    with pytest.raises(TypeError, match=r"RNG state must be a torch\.ByteTensor"):
        torch.set_rng_state(torch.get_rng_state().to("meta"))
    state = checkpoint.load(tmp_path, 0, "meta")  # saved on the CPU, mapped onto another device
    weights = state["device"]["chunks"][0]
    assert weights and all(v.device.type == "meta" for v in weights.values())
    # the optimizer's state stays on the CPU; Adam's load_state_dict moves the moments to their parameters'
    # device and keeps the (non-capturable) step counters on the CPU, as torch does (issue #44)
    saved = state["device"]["optimizer"]["state"]
    assert all(v.device.type == "cpu" for s in saved.values() for v in s.values())
    params = [torch.nn.Parameter(v.to("meta")) for v in weights.values()]
    adam = torch.optim.Adam(params, lr=1e-3)
    adam.load_state_dict(state["device"]["optimizer"])
    loaded = list(adam.state.values())
    assert loaded and all(s["exp_avg"].device.type == "meta" and s["step"].device.type == "cpu" for s in loaded)
    host = state["host"]
    assert host["rng"].device.type == "cpu" and host["rng"].dtype == torch.uint8
    assert host["freezer"]["gen"].device.type == "cpu" and host["freezer"]["gen"].dtype == torch.uint8
    torch.set_rng_state(host["rng"])  # what crashed on CUDA resume
    torch.Generator().set_state(host["freezer"]["gen"])
    assert [r["step"] for r in host["history"]] == [0, 1, 2]


def test_checkpoints_hold_no_pickled_objects(world_of_one, tmp_path):
    saved = trainer(steps=2, checkpoint_dir=str(tmp_path)).train()
    path = checkpoint.step_dir(tmp_path, 2) / "rank-0.pt"
    torch.load(path, weights_only=True)  # raises on anything but tensors and plain containers
    resumed = trainer(steps=3, checkpoint_dir=str(tmp_path), resume=True)
    assert resumed.start_step == 2
    assert resumed.history == saved  # the records survive as plain data, actions and all


class RecordingStream(CopyStream):
    """The CPU copy stream, logging the protocol's calls in order."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.log: list[str] = []

    def wait_for_compute(self):
        self.log.append("wait_for_compute")

    def use(self):
        self.log.append("copy")
        return super().use()

    def synchronize(self):
        self.log.append("synchronize")

    def record(self):
        self.log.append("record")
        return super().record()


def test_host_optimizer_copies_through_the_stream_and_matches_adam():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    stream = RecordingStream()
    host = HostOffloadOptimizer(a.parameters(), lambda ps: torch.optim.Adam(ps, lr=1e-2), stream)
    plain = torch.optim.Adam(b.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(5, 8)
        for m, opt in ((a, host), (b, plain)):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    # per step: wait for the backward, download every gradient at once, one host wait, upload, an event
    assert stream.log == ["wait_for_compute", "copy", "synchronize", "copy", "record"] * 3


def test_the_executor_records_the_device_peak_of_its_step(monkeypatch):
    """PipelineExecutor.run_step alone (no Trainer) reports the allocator's peak (issue #44)."""
    import pipeplan.runtime.executor
    from pipeplan.runtime.stages import build_model
    from tests.test_runtime_model import ARGS, batches, one_rank_executor

    calls = []
    monkeypatch.setattr(pipeplan.runtime.executor, "reset_device_peak", lambda device: calls.append("reset"))
    monkeypatch.setattr(pipeplan.runtime.executor, "device_peak_bytes", lambda device: calls.append("read") or 99)
    trace = one_rank_executor(build_model(ARGS), 2).run_step(batches(2))
    assert trace.peak_device_bytes == 99 and calls == ["reset", "read"]


def test_the_device_peak_is_read_after_the_optimizer_step(world_of_one, monkeypatch):
    import pipeplan.runtime.train

    t = trainer(steps=2)
    seen = []
    monkeypatch.setattr(pipeplan.runtime.train, "device_peak_bytes",
                        lambda device: seen.append(len(t.optimizer.state)) or 1234)
    history = t.train()
    assert seen and all(n > 0 for n in seen)  # Adam had already stepped (its state exists) when read
    assert all(r.trace.peak_device_bytes == 1234 for r in history)
