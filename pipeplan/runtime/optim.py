"""Optimizers by name, and optimizer-state offload: state and an fp32 weight copy in host memory."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pipeplan.runtime.streams import CopyStream

OPTIMIZERS: dict[str, Callable[[list, float], torch.optim.Optimizer]] = {
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
}


class HostOffloadOptimizer:
    """Steps on host copies: gradients go down to the host, the update runs there, weights come back.

    The device holds only the weights and their gradients; Adam's moments and the fp32 master copy live in
    host memory — the ZeRO-Offload split of work. Every copy goes through a copy stream
    (runtime/streams.py): on CUDA a side stream with pinned host buffers, so the gradient downloads are
    asynchronous DMA issued all at once (one wait before the host reads them, not one per tensor) and the
    weight uploads run while the host returns to the loop; the compute stream waits for them before the
    next forward. On the CPU the same calls run inline.
    """

    def __init__(self, params: Iterable[nn.Parameter], make: Callable[[list], torch.optim.Optimizer],
                 stream: CopyStream | None = None):
        self.params = list(params)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.stream = stream or CopyStream(device)
        self.host = [nn.Parameter(self._host_copy(p.detach().float())) for p in self.params]
        self.grads = [self.stream.host_empty(p.shape, torch.float32) for p in self.params]  # download buffers
        self.inner = make(self.host)
        self.uploaded: torch.cuda.Event | None = None  # the last weight upload

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        h = self.stream.host_empty(t.shape, torch.float32)
        h.copy_(t)
        return h

    @torch.no_grad()
    def step(self) -> None:
        self.stream.wait_for_compute()  # the backward that made the gradients has run
        with self.stream.use():
            for p, h, g in zip(self.params, self.host, self.grads, strict=True):
                if p.grad is None:
                    h.grad = None
                    continue
                g.copy_(p.grad, non_blocking=True)
                h.grad = g
        self.stream.synchronize()  # the host reads them next
        self.inner.step()
        with self.stream.use():
            for p, h in zip(self.params, self.host, strict=True):
                p.copy_(h, non_blocking=True)
        self.uploaded = self.stream.record()
        CopyStream.wait(self.uploaded)  # the compute stream uses the weights only after the upload

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "host": [h.detach().clone() for h in self.host]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        for h, saved in zip(self.host, state["host"], strict=True):
            h.copy_(saved)


def build_optimizer(params: list[nn.Parameter], name: str, lr: float, offload: bool = False):
    make = OPTIMIZERS[name]
    return HostOffloadOptimizer(params, lambda ps: make(ps, lr)) if offload else make(params, lr)
