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

Mixed precision. Under autocast (bf16/fp16, on CPU and CUDA alike) the forward casts X and the fp32 master
weight to the autocast dtype, as nn.Linear does, and saves the cast copies: the matmuls of I and W then run
in the low precision with operands of one dtype, and W accumulates dW into the fp32 `.grad` (a custom
Function sees autocast's inputs uncast, so saving the originals would multiply a bf16 dY by fp32 tensors).

`enable_split_backward(module)` turns the module's `nn.Linear`s into `DeferrableLinear` in place (same
parameters, same names); outside a `WeightGradStore.capture()` they compute dW immediately, like nn.Linear.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from pipeplan.runtime.memory import note_cast_copy

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
        """The queued bytes, each storage once (wq, wk and wv queue one X three times), wherever they are."""
        seen: dict[int, int] = {}
        for x, grad_y, _ in self.pending:
            for t in (x, grad_y):
                seen[_storage(t)] = t.nbytes
        return sum(seen.values())

    @torch.no_grad()  # a queued X may be an input that requires grad: dW must not grow a graph from it
    def run(self) -> None:
        """The W pass: dW = dYᵀ X for every queued layer, accumulated into the weight's .grad (its dtype), in
        the reverse of I's order (the first layer first, as sim.graph.LayerCopy has W run: what I queued first,
        and an offloaded stash moves first, is needed last). A queued tensor may be a host copy
        (runtime/stash_offload.py): its `get()` brings it back."""
        for x, grad_y, weight in reversed(self.pending):
            x, grad_y = _on_device(x), _on_device(grad_y)
            dw = weight_grad(x, grad_y).to(weight.dtype)  # (out, in)
            if weight.grad is None:
                weight.grad = dw
            else:
                weight.grad += dw
        self.pending.clear()


def _storage(t) -> int:
    """A queued entry's identity: its storage (a device tensor), or the host copy standing in for one."""
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else id(t)


def _on_device(t) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t.get()


def weight_grad(x: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor:
    """dW = dYᵀ X over every leading dimension: x (..., in), grad_y (..., out) -> (out, in)."""
    return grad_y.reshape(-1, grad_y.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes linear layers in on this device type, or None when it is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


class _DeferrableLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        dtype = autocast_dtype(x.device.type)
        if dtype is not None:  # what autocast does for F.linear, made explicit so backward sees it
            x_c, weight_c = x.to(dtype), weight.to(dtype)
            note_cast_copy(x, x_c)  # a recomputed norm's output stays recomputable in its cast copy
            x = x_c
        else:
            weight_c = weight
        ctx.save_for_backward(x, weight_c)
        ctx.param = weight  # the Parameter itself: a saved tensor unpacks as another object (e.g. under hooks)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, weight_c)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight = ctx.saved_tensors  # both in the forward's compute dtype
        grad_y = grad_y.to(x.dtype)
        grad_x = grad_y.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            store: WeightGradStore | None = getattr(_active, "store", None)
            if store is not None:
                store.pending.append((x, grad_y, ctx.param))  # W runs it; the weight gets no grad now
            else:
                grad_w = weight_grad(x, grad_y).to(ctx.param.dtype)
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
