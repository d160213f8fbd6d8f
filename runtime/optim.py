"""Optimizers by name, and optimizer-state offload: state and an fp32 weight copy in host memory."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

OPTIMIZERS: dict[str, Callable[[list, float], torch.optim.Optimizer]] = {
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
}


class HostOffloadOptimizer:
    """Steps on host copies: gradients go down to the host, the update runs there, weights come back.

    The device holds only the weights and their gradients; Adam's moments and the fp32 master copy live in
    (pinned, on CUDA) host memory — the ZeRO-Offload split of work.
    """

    def __init__(self, params: Iterable[nn.Parameter], make: Callable[[list], torch.optim.Optimizer]):
        self.params = list(params)
        pin = any(p.is_cuda for p in self.params)
        self.host = [nn.Parameter(p.detach().to("cpu", torch.float32, copy=True)) for p in self.params]
        if pin:
            self.host = [nn.Parameter(h.detach().pin_memory()) for h in self.host]
        self.inner = make(self.host)

    @torch.no_grad()
    def step(self) -> None:
        for p, h in zip(self.params, self.host, strict=True):
            h.grad = None if p.grad is None else p.grad.to("cpu", torch.float32)
        self.inner.step()
        for p, h in zip(self.params, self.host, strict=True):
            p.copy_(h, non_blocking=True)

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
