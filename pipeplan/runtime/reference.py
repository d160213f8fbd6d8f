"""Single-process training of the same model on the same data: the ground truth pipelines must reproduce.

Per step: for each microbatch, forward, loss / m, backward (gradients accumulate); then one optimizer step.
Without freezing, every pipeline schedule computes the same sums (up to float rounding order). The forward
runs under the scenario's training.dtype exactly as the pipeline's does (bf16/fp16 autocast over fp32
master weights, runtime/executor.py), so a bf16 pipeline has a bf16 reference.
"""

from __future__ import annotations

import torch

from pipeplan.runtime.config import RunConfig
from pipeplan.runtime.data import TokenData
from pipeplan.runtime.executor import autocast
from pipeplan.runtime.model import ModelArgs, cross_entropy
from pipeplan.runtime.optim import build_optimizer
from pipeplan.runtime.stages import build_model
from pipeplan.runtime.train import AUTOCAST, load_run_scenario


def reference_losses(cfg: RunConfig, device: torch.device | str = "cpu") -> list[list[float]]:
    """Per step, the loss of every microbatch."""
    sc, sched = load_run_scenario(cfg)
    m, b = sc.model, sc.training.micro_batch_size
    assert m is not None  # load_run_scenario refuses explicit [costs]
    model = build_model(ModelArgs.from_scenario(m), device, cfg.seed)
    opt = build_optimizer(list(model.parameters()), sc.training.optimizer, cfg.lr)
    data = TokenData(cfg.data, m.vocab, m.seq_len, b, cfg.seed)
    n = sched.num_microbatches
    dtype = AUTOCAST[sc.training.dtype]
    device = torch.device(device)
    out = []
    for step in range(cfg.steps):
        losses = []
        for inputs, labels in data.step(step, n):
            with autocast(device, dtype):
                loss = cross_entropy(model(inputs.to(device)), labels.to(device))
            (loss / n).backward()
            losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(losses)
    return out
