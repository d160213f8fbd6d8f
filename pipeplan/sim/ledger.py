"""Per-rank memory during a simulated step: the HBM ledger (static states, live activations, weights away),
the host tiers it moves bytes to, and what each action allocates and frees (the residency rules).

Every change is recorded as (rank, time_s, hbm_bytes, static_hbm, activation_hbm, dram, nvme); peaks and the
moments HBM runs over capacity are kept, not raised (docs/simulator.md, Memory).
"""

from __future__ import annotations

from pipeplan.sim.ir import BACKWARD_KINDS, Action, Kind
from pipeplan.sim.memory_plan import MemoryPlan, or_zeros
from pipeplan.sim.results import MemoryRecord, OOMEvent, PeakMoment

OPTIMIZER_STEP = "optimizer step"  # PeakMoment.during for a peak in the optimizer step


class HostLedger:
    """Bytes per rank in host DRAM and on NVMe, with their peaks."""

    def __init__(self, dram: list[float], nvme: list[float]):
        self.dram, self.nvme = dram, nvme
        self.peak_dram, self.peak_nvme = list(dram), list(nvme)

    def move(self, rank: int, nvme: bool, delta: float) -> None:
        """`delta` bytes arrive on (or, negative, leave) the rank's NVMe or DRAM."""
        if nvme:
            self.nvme[rank] += delta
        else:
            self.dram[rank] += delta

    def note_peaks(self, rank: int) -> None:
        if self.dram[rank] > self.peak_dram[rank]:
            self.peak_dram[rank] = self.dram[rank]
        if self.nvme[rank] > self.peak_nvme[rank]:
            self.peak_nvme[rank] = self.nvme[rank]


class HbmLedger:
    """HBM per rank = static bytes - weights away + live bytes; every change logged, peaks and overruns kept.
    Per-rank counters are Python lists: the hot path touches them once per action, and list items are several
    times cheaper to read and update than NumPy scalars."""

    def __init__(self, static: list[float], away: list[float], host: HostLedger, capacity_bytes: float):
        self.static, self.away, self.host, self.capacity = static, away, host, capacity_bytes
        n = len(static)
        self.live = [0.0] * n
        self.peak_act = [0.0] * n
        self.peak_hbm = [s - a for s, a in zip(static, away, strict=True)]
        self.peak_moment: list[tuple[float, str, float, float]] = [(0.0, "start", 0.0, h) for h in self.peak_hbm]
        self.log: list[MemoryRecord] = []
        self.oom: list[OOMEvent] = []
        for r in range(n):
            self.record(r, 0.0)

    def record(self, rank: int, at: float, during: str = "") -> None:
        """Log the rank's state now; `during` names what allocated last, for the peak's moment."""
        static, live = self.static[rank] - self.away[rank], self.live[rank]  # offloaded weights are not in HBM
        dram, nvme = self.host.dram[rank], self.host.nvme[rank]
        hbm = static + live
        self.log.append((rank, at, hbm, static, live, dram, nvme))
        if hbm > self.peak_hbm[rank]:
            self.peak_hbm[rank] = hbm
            self.peak_moment[rank] = (at, during, live, static)
        self.host.note_peaks(rank)

    def allocate(self, rank: int, delta: float, at: float, action: Action, grew: bool = False) -> None:
        """Live bytes change by `delta` for `action` (`grew`: something else, e.g. returning weights, grew HBM)."""
        self.live[rank] += delta
        grew = grew or delta > 0
        self.record(rank, at, str(action) if grew else "")
        if grew:
            self.peak_act[rank] = max(self.peak_act[rank], self.live[rank])
            hbm = self.static[rank] - self.away[rank] + self.live[rank]
            if hbm > self.capacity:
                self.oom.append(OOMEvent(rank, at, str(action), float(hbm), self.capacity))

    def weights_leave(self, rank: int, nbytes: float, at: float) -> None:
        """Offloaded weights leave HBM (the host keeps their copy, so nothing moves)."""
        self.away[rank] += nbytes
        self.record(rank, at)


class Residency:
    """What each action keeps in HBM (MemoryPlan), as per-node changes: F allocates its kept activations (and
    what it leaves until the step's end) when it starts; B or I frees its F's when it ends, an I keeping its W
    stash until W; B/I hold their working set while they run; the optimizer step holds its transient and
    returning weights. None: the node changes nothing then (no record)."""

    def __init__(self, mem: MemoryPlan, actions: tuple[Action, ...], forward_of: list[int], n_stages: int,
                 step_transient: list[float], step_weights: list[float]):
        kept = [float(mem.kept_bytes[a.stage]) for a in actions]
        transient = mem.transient_bytes.tolist()
        stash = or_zeros(mem.stash_bytes, n_stages).tolist()
        # what a forward / a backward leaves behind until the step ends (torch pipelining's stage outputs and
        # input gradients, sim/p2p_buffers.py)
        self.f_left = or_zeros(mem.forward_retained_bytes, n_stages).tolist()
        self.b_left = or_zeros(mem.backward_retained_bytes, n_stages).tolist()
        self.at_start: list[float | None] = [None] * len(actions)  # per node: HBM change as it starts
        self.at_end: list[float | None] = [None] * len(actions)  # and as it ends
        for i, a in enumerate(actions):
            s = a.stage
            if a.kind is Kind.F:
                self.at_start[i] = kept[i] + self.f_left[s]
            elif a.kind in BACKWARD_KINDS:
                if transient[s] > 0:
                    self.at_start[i] = float(transient[s])
                # a split backward's I keeps what its W needs (inputs of the weight GEMMs, output gradients)
                self.at_end[i] = (stash[s] if a.kind is Kind.I else 0.0) + self.b_left[s] - kept[forward_of[i]] \
                    - float(transient[s])
            elif a.kind is Kind.W and stash[s]:
                self.at_end[i] = -stash[s]
        self.step_transient, self.step_weights = step_transient, step_weights

    def optimizer_step(self, hbm: HbmLedger, rank: int, last: float, end: float) -> None:
        """From the rank's last action to `end`: the step's transient memory, with the offloaded weights a GPU
        optimizer brings back to update (MemoryPlan.step_weight_bytes; a host optimizer updates its own copy)."""
        back = self.step_weights[rank]
        if self.step_transient[rank] or back:
            hbm.live[rank] += self.step_transient[rank]
            hbm.away[rank] -= back
            hbm.record(rank, last, OPTIMIZER_STEP)
            hbm.live[rank] -= self.step_transient[rank]
            hbm.away[rank] += back
            hbm.record(rank, end)

    def peaks(self, hbm: HbmLedger) -> list[PeakMoment]:
        """Per rank: when its HBM peak happens and what is live then."""
        out = []
        for r, (at, during, live, static) in enumerate(hbm.peak_moment):
            step = during == OPTIMIZER_STEP
            out.append(PeakMoment(r, at, during, static, self._left_behind(live, r) if step else live,
                                  self.step_transient[r] if step else 0.0))
        return out

    def _left_behind(self, live: float, rank: int) -> float:
        """Of `live` during the optimizer step, what the forwards and backwards left (MemoryPlan's
        forward_retained_bytes and backward_retained_bytes), not the step's own working memory; 0 where nothing
        is left (no float residue of the activations' frees)."""
        return max(live - self.step_transient[rank], 0.0) if any(self.f_left) or any(self.b_left) else 0.0
