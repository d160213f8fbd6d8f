"""What one `pipeplan run` / `pipeplan profile` job does: the run's settings beyond the scenario.

The scenario (sim.config) says what is trained and how it is split and scheduled; `RunConfig` says for how
long, on what data, with which freezing, memory policy and checkpointing, and where results go. It travels
from the launcher to every worker as JSON. Validation happens at construction, naming the flag to change.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeplan.sim.errors import PipeplanError

if TYPE_CHECKING:
    from pipeplan.solver.memory_milp import MemoryChoice

FREEZE_MODES = ("none", "uniform", "timelyfreeze", "autofreeze", "apf")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class RunConfig:
    scenario: str | None = None
    """Scenario TOML with a [model] table; None: scenarios/tiny-cpu.toml."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Dotted scenario keys to replace, e.g. {"pipeline.schedule": "zbv", "pipeline.virtual_stages": 2}."""
    schedule_csv: str | None = None
    """Run this action order (torch action-string CSV) instead of generating pipeline.schedule."""
    steps: int = 10
    """Optimizer steps to run (in total, counting the steps a resumed checkpoint already did)."""
    data: str | None = None
    """'synthetic', a text file (byte-level tokens), or None: the Python standard library's sources."""
    seed: int = 0
    lr: float = 1e-3
    freeze: str = "none"
    """none | uniform (every freezable action at ratio `freeze_cap`) | timelyfreeze (the LP's ratios) |
    autofreeze (converged blocks front to back, up to `freeze_cap` of the parameters; runtime/autofreeze.py) |
    apf (stable scalars for adaptive periods, up to `freeze_cap` of them; runtime/apf.py)."""
    freeze_cap: float | None = None
    """Mean freeze ratio allowed per stage; None: the scenario's freeze.cap."""
    freeze_warmup: int = 2
    """Steps before any freezing (and before monitoring)."""
    freeze_monitor: int = 8  # 4 samples of each action frozen and 4 unfrozen (docs/runtime.md, "Freezing")
    """Monitoring steps, alternately unfrozen (w_max) and fully frozen (w_min); at least 2."""
    freeze_ramp: int = 2
    """Steps over which the cap rises linearly to freeze_cap, the LP re-solved for each step's cap."""
    freeze_redraw: int = 5
    """Draw new frozen parameter sets every this many steps (K)."""
    costs: str | None = None
    """Explicit-costs scenario (`pipeplan profile`'s output) the prediction simulates; None: the scenario."""
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    """Save model, optimizer, freezer, step and RNG every this many steps (0: only with --checkpoint-dir, at
    the end)."""
    resume: bool = False
    """Continue from the latest checkpoint in checkpoint_dir."""
    out_dir: str | None = None
    """Where the rank-0 worker writes its results (the launcher's staging folder)."""
    device: str = "auto"
    timeout_s: float = 300.0
    """Collective and P2P timeout: a rank waiting longer than this fails instead of hanging."""
    threads: int = 1
    """torch intra-op threads per rank."""
    profile: bool = False
    """Run every B as I then W and record both (pipeplan profile)."""
    validate: bool = False
    """Profile only: alternate plain steps (even) with profiled ones (odd) and report how well the costs
    measured on the profiled steps predict the plain steps: one job, so both see the same machine load."""
    memory_choice: dict[str, list] | None = None
    """With memory.plan = true: the memory MILP's choice, solved once on the launcher (MemoryChoice.to_dict)
    so that no rank solves it again; None: resolve it from the scenario."""
    progress_file: str | None = None
    """Rank 0 writes the number of steps done here after every step (a progress bar in the launcher reads it)."""
    fail_rank: int | None = None
    """Testing aid: this rank raises at the start of step `fail_step`."""
    fail_step: int = 0
    clock_skew_s: float = 0.0
    """Testing aid: seconds added to the host clock of every rank but 0, as another node's clock would be."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise PipeplanError(f"--steps: must be >= 1 (got {self.steps})")
        if self.freeze not in FREEZE_MODES:
            raise PipeplanError(f"--freeze: unknown mode {self.freeze!r}; allowed: {', '.join(FREEZE_MODES)}")
        if self.device not in DEVICES:
            raise PipeplanError(f"--device: unknown device {self.device!r}; allowed: {', '.join(DEVICES)}")
        if self.freeze_cap is not None and not 0 <= self.freeze_cap <= 1:
            raise PipeplanError(f"--cap: must lie in [0, 1] (got {self.freeze_cap})")
        if self.freeze != "none" and self.freeze_monitor < 2:
            raise PipeplanError(f"--freeze-monitor: needs >= 2 steps, one unfrozen and one frozen "
                                f"(got {self.freeze_monitor})")
        if min(self.freeze_warmup, self.freeze_ramp) < 0 or self.freeze_redraw < 1:
            raise PipeplanError("--freeze-warmup and --freeze-ramp must be >= 0, --freeze-redraw >= 1")
        if self.resume and not self.checkpoint_dir:
            raise PipeplanError("--resume: needs --checkpoint-dir DIR (where the checkpoints are)")
        if self.checkpoint_every < 0:
            raise PipeplanError(f"--checkpoint-every: must be >= 0 (got {self.checkpoint_every})")
        if self.validate and not self.profile:
            raise PipeplanError("--validate: only with pipeplan profile")
        if self.validate and self.steps < 4:
            raise PipeplanError(f"--validate: needs --steps >= 4, plain and profiled steps alternate "
                                f"(got {self.steps})")
        if self.timeout_s <= 0 or self.threads < 1:
            raise PipeplanError("--timeout-s must be > 0 and --threads >= 1")

    def choice(self) -> MemoryChoice | None:
        """The launcher's memory MILP choice, if it handed one over."""
        from pipeplan.solver.memory_milp import MemoryChoice

        return MemoryChoice.from_dict(self.memory_choice) if self.memory_choice is not None else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls(**json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        return cls.from_json(Path(path).read_text())
