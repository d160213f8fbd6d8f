"""Split backward for the zero-bubble schedules: I computes input gradients now, W the weight gradients later.

For a chunk y = f(x; θ), a plain `backward` does both. The weight gradient of a linear layer Y = X Wᵀ is
dW = dYᵀ X, which needs nothing but the layer's input X and output gradient dY; so during I every linear
layer computes dX = dY W as usual and, instead of dW, queues the pair (X, dY) on the chunk-microbatch's
`WeightGradStore`. W later runs the queued matmuls and accumulates into `.grad`. No part of the backward
runs twice (unlike calling `torch.autograd.grad` once for inputs and again for weights), and I frees the
autograd graph: what W still needs is exactly the queued pairs (the zero-bubble papers' accounting).
Non-linear parameters (RMSNorm gains, the embedding) are cheap and get their gradients during I.

A frozen weight (requires_grad False when the forward ran) has no gradient edge, so neither pass computes
its dW: freezing skips real work (runtime/freeze.py).

`enable_split_backward(module)` turns the module's `nn.Linear`s into `DeferrableLinear` in place (same
parameters, same names); outside a `WeightGradStore.capture()` they compute dW immediately, like nn.Linear.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

_active = threading.local()


class WeightGradStore:
    """Deferred weight-gradient matmuls of one chunk-microbatch: filled by I, run by W."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, torch.Tensor, nn.Parameter]] = []

    @contextmanager
    def capture(self):
        prev = getattr(_active, "store", None)
        _active.store = self
        try:
            yield self
        finally:
            _active.store = prev

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes + g.nbytes for x, g, _ in self.pending)

    def run(self) -> None:
        """The W pass: dW = dYᵀ X for every queued layer, accumulated into the weight's .grad."""
        for x, grad_y, weight in self.pending:
            dw = grad_y.reshape(-1, grad_y.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))  # (out, in)
            if weight.grad is None:
                weight.grad = dw
            else:
                weight.grad += dw
        self.pending.clear()


class _DeferrableLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.param = weight  # the Parameter itself: a saved tensor unpacks as another object (e.g. under hooks)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_y.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            store: WeightGradStore | None = getattr(_active, "store", None)
            if store is not None:
                store.pending.append((x, grad_y, ctx.param))  # W runs it; the weight gets no grad now
            else:
                grad_w = grad_y.reshape(-1, grad_y.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
        return grad_x, grad_w


class DeferrableLinear(nn.Linear):
    """nn.Linear (no bias) whose weight gradient can be deferred to a WeightGradStore."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DeferrableLinearFn.apply(x, self.weight)


def enable_split_backward(module: nn.Module) -> nn.Module:
    for sub in module.modules():
        if type(sub) is nn.Linear:
            if sub.bias is not None:
                raise ValueError("split backward supports bias-free linear layers only")
            sub.__class__ = DeferrableLinear
    return module
