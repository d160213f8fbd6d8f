"""One clock for all ranks: each rank's host clock mapped onto rank 0's, with a stated uncertainty.

Every rank times its actions on its own monotonic clock (CPU) or CUDA events anchored to it, and starts a
step when it leaves a barrier; ranks leave a barrier milliseconds apart under load, and on different nodes
their clocks differ by an arbitrary offset and drift apart. So timelines are only comparable across ranks
once mapped onto one clock, rank 0's.

Estimate (NTP's, RFC 5905 §8, with Cristian's minimum-delay filter). Rank r and rank 0 exchange ROUNDS
ping-pongs over the process group (a gloo group: CPU tensors, so the times are host times on CUDA too):

    r: t1 = now();  send t1          0: t2 = now() on receipt;  t3 = now();  send (t2, t3)
    r: t4 = now() on receipt

    offset θ = ((t2 - t1) + (t3 - t4)) / 2          (rank 0's clock minus rank r's)
    delay  δ = (t4 - t1) - (t3 - t2)                (the round trip's time on the wire)

Whatever the split of δ between the two directions, the true offset lies in θ ± δ/2; the round with the
smallest δ gives the tightest bound, and its δ/2 is the uncertainty. Done at the job's start and end, the
two offsets give a linear drift model (offset at time t interpolated between them, held at the nearer
estimate outside them: a resumed run's restored steps are not extrapolated back to); the stated
uncertainty is the larger of the two bounds. Ranks on one host share one monotonic clock, so there the
estimate is ~0 ± tens of microseconds and what alignment fixes is the barrier-exit skew.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

ROUNDS = 16  # ping-pongs per rank and estimate: the minimum delay among them is the filter
Now = Callable[[], float]


@dataclass(frozen=True)
class OffsetSample:
    """One estimate of rank 0's clock minus this rank's, at local time `at_s`, within ± `bound_s`."""

    offset_s: float
    bound_s: float
    at_s: float


def ntp_offset(t1: float, t2: float, t3: float, t4: float) -> OffsetSample:
    """NTP's offset and half-delay from one exchange (t1, t4 on this rank's clock; t2, t3 on rank 0's)."""
    delay = max((t4 - t1) - (t3 - t2), 0.0)
    return OffsetSample(((t2 - t1) + (t3 - t4)) / 2, delay / 2, (t1 + t4) / 2)


def best_sample(samples: Sequence[OffsetSample]) -> OffsetSample:
    """The minimum-delay exchange: its offset has the tightest bound."""
    return min(samples, key=lambda s: s.bound_s)


@dataclass(frozen=True)
class ClockFit:
    """This rank's clock mapped to rank 0's: offset(t) linear between the start and end estimates."""

    start: OffsetSample
    end: OffsetSample | None = None

    @property
    def uncertainty_s(self) -> float:
        return max(self.start.bound_s, self.end.bound_s if self.end is not None else 0.0)

    @property
    def drift(self) -> float:
        """Seconds of offset change per second (0 with one estimate)."""
        if self.end is None or self.end.at_s == self.start.at_s:
            return 0.0
        return (self.end.offset_s - self.start.offset_s) / (self.end.at_s - self.start.at_s)

    def offset_at(self, t: float) -> float:
        """Interpolated between the two estimates, never extrapolated: a time before the start (a resumed
        run's restored steps, timed by an earlier job) or after the end takes the nearer estimate's offset,
        since a drift fitted over this job says nothing about another job's span."""
        end = self.end.at_s if self.end is not None else self.start.at_s
        t = min(max(t, self.start.at_s), max(end, self.start.at_s))
        return self.start.offset_s + self.drift * (t - self.start.at_s)

    def to_reference(self, t: float) -> float:
        """Local time t as rank 0's time."""
        return t + self.offset_at(t)


IDENTITY = ClockFit(OffsetSample(0.0, 0.0, 0.0))


def estimate_offset(rank: int, world: int, group: dist.ProcessGroup | None = None, now: Now = time.perf_counter,
                    rounds: int = ROUNDS) -> OffsetSample:
    """Run the ping-pongs (every rank calls this; rank 0 serves rank 1, then 2, ...); rank 0 gets (0, 0)."""
    buf = torch.zeros(2, dtype=torch.float64)

    def peer(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    if rank == 0:
        for r in range(1, world):
            for _ in range(rounds):
                dist.recv(buf, peer(r), group=group)
                t2 = now()
                buf[0] = t2
                buf[1] = now()  # t3, as late as possible before the send
                dist.send(buf, peer(r), group=group)
        return OffsetSample(0.0, 0.0, now())
    samples = []
    for _ in range(rounds):
        t1 = now()
        buf[0] = t1
        dist.send(buf, peer(0), group=group)
        dist.recv(buf, peer(0), group=group)
        t4 = now()
        samples.append(ntp_offset(t1, float(buf[0]), float(buf[1]), t4))
    return best_sample(samples)


def clock_group() -> dist.ProcessGroup | None:
    """A gloo group for the ping-pongs when the job's group is not gloo (NCCL: CPU tensors need gloo)."""
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


# ---- aligning measured traces ---------------------------------------------------------------------------
def step_origins(t0s: Sequence[float], fits: Sequence[ClockFit]) -> list[float]:
    """Per rank, where its step start (local host time t0) falls after the step's common origin, which is
    the earliest rank's start on rank 0's clock."""
    starts = [fit.to_reference(t0) for t0, fit in zip(t0s, fits, strict=True)]
    origin = min(starts)
    return [s - origin for s in starts]


def rank_shifts(ranks: Sequence[dict], index: int) -> list[float]:
    """Per rank of a job's gathered results (runtime/worker.py: "history", "clock"), how far its step
    `index` started after the step's common origin; add it to the rank's step-relative times."""
    t0s = [r["history"][index].trace.t0_s for r in ranks]
    return step_origins(t0s, [r.get("clock") or IDENTITY for r in ranks])


def aligned_actions(ranks: Sequence[dict], index: int) -> list[list[tuple]]:
    """Every rank's (action, start, end) of step `index`, on the common clock."""
    shifts = rank_shifts(ranks, index)
    return [[(a, s + sh, e + sh) for a, s, e in r["history"][index].trace.actions]
            for r, sh in zip(ranks, shifts, strict=True)]
