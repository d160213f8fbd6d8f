"""APF, Adaptive Parameter Freezing (Chen, Xu, Wang, Li, Li, Chen, Zhang, ICDCS 2021): freeze scalars that
have stopped moving, for periods that grow while they stay put.

The paper's rule, per scalar parameter, checked every `check_every` steps (its stability-check interval):

    Δ        the scalar's change since the previous check
    E, A     exponential moving averages (factor α) of Δ and of |Δ|
    P = |E| / A                       the effective perturbation: ~1 while the scalar drifts one way, ~0 while
                                      it only oscillates around a value
    stable   P < T_s
    period   L <- L + 1 if stable, L <- floor(L / 2) otherwise   (additive increase, multiplicative decrease)
    frozen   for the next L check intervals (L = 0: not frozen)
    T_s      halved whenever more than `tight` of the parameters are frozen (the adaptive threshold)

A frozen scalar keeps its value: the optimizer's update is rolled back after each step (APF rolls frozen
parameters back to their frozen value). Freezing saves compute only where a whole tensor is frozen: then it is
frozen for every microbatch (runtime/freeze.py), its W skipped and, on the first stage, its backward ended early;
a partly frozen tensor still computes its full weight gradient. `cap` bounds the frozen share of the scalars
(the most stable first) so that a study can compare methods at an equal frozen share. Every rank decides for
its own scalars; the threshold rule uses the whole model's frozen share (the trainer all-gathers the counts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

ALPHA = 0.99  # the moving averages' factor (the paper's setting)
THRESHOLD = 0.05  # the initial stability threshold T_s
TIGHT = 0.8  # T_s halves when more than this share of the scalars is frozen
CHECK_EVERY = 2  # steps between stability checks (our runs are tens of steps long)


@dataclass
class APF:
    cap: float
    alpha: float = ALPHA
    threshold: float = THRESHOLD
    tight: float = TIGHT
    check_every: int = CHECK_EVERY
    state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # name -> per-scalar tensors
    checks: int = 0

    def start(self, chunks: Mapping[int, nn.Module]) -> None:
        """Take the reference values (before the first step)."""
        for chunk in chunks.values():
            for name, p in chunk.named_parameters():
                w = p.detach().float().cpu()
                self.state[name] = {"ref": w.clone(), "E": torch.zeros_like(w), "A": torch.zeros_like(w),
                                    "period": torch.zeros_like(w, dtype=torch.int32),
                                    "wake": torch.zeros_like(w, dtype=torch.int32), "value": w.clone()}

    def frozen_mask(self, name: str) -> torch.Tensor:
        st = self.state[name]
        return st["wake"] > self.checks

    def roll_back(self, chunks: Mapping[int, nn.Module]) -> None:
        """After the optimizer step: frozen scalars return to their frozen value."""
        with torch.no_grad():
            for chunk in chunks.values():
                for name, p in chunk.named_parameters():
                    mask = self.frozen_mask(name)
                    if mask.any():
                        value = self.state[name]["value"].to(p.device, p.dtype)
                        p.copy_(torch.where(mask.to(p.device), value, p))

    def due(self, step: int) -> bool:
        return (step + 1) % self.check_every == 0

    def check(self, chunks: Mapping[int, nn.Module]) -> tuple[int, int]:
        """A stability check (vectorised per tensor): update E, A, P, the periods and the frozen sets; returns
        (frozen scalars, scalars) of this rank."""
        self.checks += 1
        frozen, total = 0, 0
        stability: list[tuple[str, torch.Tensor]] = []
        for chunk in chunks.values():
            for name, p in chunk.named_parameters():
                st = self.state[name]
                w = p.detach().float().cpu().clone()  # a copy: on the CPU .float().cpu() is the parameter
                active = st["wake"] < self.checks  # thawed by now: measured again
                delta = w - st["ref"]
                st["E"] = torch.where(active, self.alpha * st["E"] + (1 - self.alpha) * delta, st["E"])
                st["A"] = torch.where(active, self.alpha * st["A"] + (1 - self.alpha) * delta.abs(), st["A"])
                p_eff = st["E"].abs() / st["A"].clamp_min(1e-30)
                stable = p_eff < self.threshold
                st["period"] = torch.where(active, torch.where(stable, st["period"] + 1, st["period"] // 2),
                                           st["period"])
                st["wake"] = torch.where(active, self.checks + st["period"], st["wake"])
                st["value"] = torch.where(active, w, st["value"])
                st["ref"] = w
                stability.append((name, p_eff))
        self._apply_cap(stability)
        for st in self.state.values():
            m = st["wake"] > self.checks
            frozen += int(m.sum())
            total += m.numel()
        return frozen, total

    def _apply_cap(self, stability: list[tuple[str, torch.Tensor]]) -> None:
        """Thaw the least stable frozen scalars until at most `cap` of this rank's scalars are frozen."""
        masks = {n: self.state[n]["wake"] > self.checks for n, _ in stability}
        total = sum(m.numel() for m in masks.values())
        over = sum(int(m.sum()) for m in masks.values()) - int(self.cap * total)
        if over <= 0:
            return
        scores = torch.cat([torch.where(masks[n], p, torch.full_like(p, -1.0)).flatten() for n, p in stability])
        thaw = torch.zeros_like(scores, dtype=torch.bool)
        thaw[torch.topk(scores, over).indices] = True  # the highest effective perturbation among the frozen
        k = 0
        for n, p in stability:
            t = thaw[k: k + p.numel()].view_as(p)
            self.state[n]["wake"] = torch.where(t, torch.full_like(self.state[n]["wake"], self.checks),
                                                self.state[n]["wake"])
            k += p.numel()

    def adapt_threshold(self, frozen: int, total: int) -> None:
        """The whole model's frozen share (all ranks) -> halve T_s when it exceeds `tight`."""
        if total and frozen / total > self.tight:
            self.threshold /= 2.0

    def whole_tensors(self, names: list[str]) -> list[str]:
        """Of a chunk's parameter names, the tensors frozen entirely (their weight gradient can be skipped)."""
        return [n for n in names if n in self.state and bool(self.frozen_mask(n).all())]

    def frozen_share(self) -> float:
        total = sum(st["wake"].numel() for st in self.state.values())
        return sum(int((st["wake"] > self.checks).sum()) for st in self.state.values()) / max(total, 1)

    def state_dict(self) -> dict[str, Any]:
        return {"state": {n: dict(st) for n, st in self.state.items()}, "checks": self.checks,
                "threshold": self.threshold}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = {n: {k: v.cpu() for k, v in st.items()} for n, st in state["state"].items()}
        self.checks, self.threshold = state["checks"], state["threshold"]
