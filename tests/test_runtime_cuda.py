"""CUDA paths (CUDA events, pinned-memory offload with prefetch on a side stream, NCCL P2P, bf16 on the GPU,
resume on the device): run only where CUDA is (.ci/gpu-checks runs them on the device machine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeplan.runtime.executor import PipelineExecutor
from pipeplan.runtime.launch import spawn
from pipeplan.runtime.memory import apply_policy
from pipeplan.runtime.p2p import P2P
from pipeplan.runtime.reference import reference_losses
from pipeplan.runtime.stages import build_model
from pipeplan.sim.schedules import build_schedule
from tests.test_runtime_dist import config, losses_by_step, runnable_schedules
from tests.test_runtime_model import ARGS, batches, reference_grads

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason=f"NCCL P2P needs 2 GPUs; this machine has {torch.cuda.device_count()}")


@cuda
@pytest.mark.parametrize("policy,offload", [("none", 0.0), ("full", 0.0), ("selective", 0.0), ("selective-op", 0.0),
                                           ("none", 1.0)])
def test_cuda_executor_matches_cpu_training(policy, offload):
    dev = torch.device("cuda", 0)
    m = 2
    data = batches(m)
    sched = build_schedule("1f1b", 1, m, 1)
    chunk = apply_policy(build_model(ARGS, dev), policy)
    p2p = P2P(sched, 0, (2, ARGS.seq_len, ARGS.dim), torch.float32, dev)
    trace = PipelineExecutor(sched, 0, {0: chunk}, p2p, dev, offload_share=offload).run_step(data)
    expected = reference_grads(build_model(ARGS), data)
    for n, p in chunk.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), expected[n], rtol=1e-4, atol=1e-5, msg=n)
    assert trace.peak_device_bytes and trace.peak_device_bytes > 0
    assert all(e >= s >= 0 for _, s, e in trace.actions)  # CUDA event times
    if offload:  # every offloaded byte came back by prefetch on the copy stream, ahead of its backward
        assert trace.offloaded_bytes > 0 and trace.prefetched_bytes == trace.offloaded_bytes


def _nccl_job(rank: int, world: int, cfgs) -> list:
    from pipeplan.runtime.train import Trainer

    return [Trainer(cfg, rank, world, torch.device("cuda", rank)).train() for cfg in cfgs]


@two_gpus
def test_nccl_pipeline_matches_single_process_training():
    cfgs = [config("1f1b", 1, device="cuda"), config("zbv", 2, device="cuda"), config("zb-h1", 1, device="cuda")]
    results = spawn(_nccl_job, 2, cfgs, timeout_s=240, backend="nccl")
    for k, cfg in enumerate(cfgs):
        got = losses_by_step([r[k] for r in results])
        np.testing.assert_allclose(got, reference_losses(cfg), rtol=1e-4)


def _shared_gpu_job(rank: int, world: int, cfgs) -> list:
    from pipeplan.runtime.train import Trainer

    return [Trainer(cfg, rank, world, torch.device("cuda", 0)).train() for cfg in cfgs]


@cuda
def test_ranks_sharing_one_gpu_match_single_process_training():
    # NCCL refuses two ranks on one device: gloo, with every P2P message staged through host memory
    cfgs = [config("1f1b", 1, device="cuda"), config("zbv", 2, device="cuda")]
    results = spawn(_shared_gpu_job, 2, cfgs, timeout_s=240, backend="gloo")
    for k, cfg in enumerate(cfgs):
        got = losses_by_step([r[k] for r in results])
        np.testing.assert_allclose(got, reference_losses(cfg), rtol=1e-4)


def _bf16_job(rank: int, world: int, device_of) -> dict:
    from pipeplan.runtime.train import Trainer

    dev = device_of(rank)
    return {name: Trainer(config(name, v, "bf16", device="cuda"), rank, world, dev).train()
            for name, v in runnable_schedules()}


def _shared(rank: int) -> torch.device:
    return torch.device("cuda", 0)


@cuda
def test_every_schedule_in_bf16_on_the_gpu_matches_the_bf16_reference():
    """The crash of issue #13 (split backward in bf16) on the device: every schedule, two ranks sharing
    GPU 0 (gloo, P2P via host). GPU bf16 kernels may reduce in another order than the CPU's and than each
    other at different shapes, so the tolerance is bf16's unit roundoff, 2^-8 relative."""
    results = spawn(_bf16_job, 2, _shared, timeout_s=300, backend="gloo")
    ref = reference_losses(config("1f1b", 1, "bf16", device="cuda"), "cuda")
    for name, _ in runnable_schedules():
        got = np.asarray(losses_by_step([r[name] for r in results]))
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, ref, rtol=2.0**-8, err_msg=name)


def _resume_job(rank: int, world: int, ckpt: str) -> tuple:
    from pipeplan.runtime.train import Trainer

    dev = torch.device("cuda", 0)
    frz = {"freeze": "uniform", "freeze_cap": 0.5, "freeze_warmup": 0, "freeze_monitor": 2, "freeze_ramp": 1}
    straight = Trainer(config("zb-h1", 1, steps=5, device="cuda", **frz), rank, world, dev).train()
    Trainer(config("zb-h1", 1, steps=3, device="cuda", checkpoint_dir=ckpt, **frz), rank, world, dev).train()
    resumed = Trainer(config("zb-h1", 1, steps=5, device="cuda", checkpoint_dir=ckpt, resume=True, **frz),
                      rank, world, dev).train()
    return straight, resumed


@cuda
def test_resume_on_the_device_reproduces_the_uninterrupted_run(tmp_path):
    """The other crash of issue #13: RNG and generator states restored from a checkpoint on CUDA. rtol
    1e-4, not bit-equality: CUDA's embedding backward accumulates with atomics, in no fixed order."""
    results = spawn(_resume_job, 2, str(tmp_path), timeout_s=300, backend="gloo")
    straight = losses_by_step([r[0] for r in results])
    resumed = losses_by_step([r[1] for r in results])
    np.testing.assert_allclose(resumed, straight, rtol=1e-4)
