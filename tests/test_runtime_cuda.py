"""CUDA paths (CUDA events, pinned-memory offload on a side stream, NCCL P2P): run only where CUDA is."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.executor import PipelineExecutor
from runtime.launch import spawn
from runtime.memory import apply_policy
from runtime.p2p import P2P
from runtime.reference import reference_losses
from runtime.stages import build_model
from sim.schedules import build_schedule
from tests.test_runtime_dist import config, losses_by_step
from tests.test_runtime_model import ARGS, batches, reference_grads

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@cuda
@pytest.mark.parametrize("policy,offload", [("none", 0.0), ("full", 0.0), ("none", 1.0)])
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
    if offload:
        assert trace.offloaded_bytes > 0 and trace.peak_activation_bytes == 0


def _nccl_job(rank: int, world: int, cfgs) -> list:
    from runtime.train import Trainer

    return [Trainer(cfg, rank, world, torch.device("cuda", rank)).train() for cfg in cfgs]


@two_gpus
def test_nccl_pipeline_matches_single_process_training():
    cfgs = [config("1f1b", 1, device="cuda"), config("zbv", 2, device="cuda"), config("zb-h1", 1, device="cuda")]
    results = spawn(_nccl_job, 2, cfgs, timeout_s=240, backend="nccl")
    for k, cfg in enumerate(cfgs):
        got = losses_by_step([r[k] for r in results])
        np.testing.assert_allclose(got, reference_losses(cfg), rtol=1e-4)


def _shared_gpu_job(rank: int, world: int, cfgs) -> list:
    from runtime.train import Trainer

    return [Trainer(cfg, rank, world, torch.device("cuda", 0)).train() for cfg in cfgs]


@cuda
def test_ranks_sharing_one_gpu_match_single_process_training():
    # NCCL refuses two ranks on one device: gloo, with every P2P message staged through host memory
    cfgs = [config("1f1b", 1, device="cuda"), config("zbv", 2, device="cuda")]
    results = spawn(_shared_gpu_job, 2, cfgs, timeout_s=240, backend="gloo")
    for k, cfg in enumerate(cfgs):
        got = losses_by_step([r[k] for r in results])
        np.testing.assert_allclose(got, reference_losses(cfg), rtol=1e-4)
