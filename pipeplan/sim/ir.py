"""Schedule IR: per-rank ordered lists of actions, in torch.distributed.pipelining's action-string format.

An action is (stage, kind, microbatch) with kind F (forward), B (full backward), I (backward for inputs)
or W (backward for weights); `str(Action(1, Kind.F, 0)) == "1F0"`, exactly torch's `_Action` repr. A
schedule's CSV has one row per rank, e.g. `0F0,0F1,0B0,...`, as written by torch's `_dump_csv` and read by
its `_load_csv`; empty cells (torch's idle steps) are ignored on read.

torch's `_PipelineScheduleRuntime._dump_csv` writes by default the `compute_comms` format, the same rows with
the runtime's communication and bookkeeping cells between the compute actions. Reading it keeps the
compute actions in their order and drops what the simulator derives or prices elsewhere:
    SEND_F, RECV_F, SEND_B, RECV_B   the P2P transfers: the engine derives every one from the data
                                     dependencies (sim.graph) and times it on its FIFO link (p2p_s)
    UNSHARD, RESHARD                 FSDP's parameter all-gather and free for a stage: no-ops without FSDP;
                                     with ZeRO-3 the cost model prices the gathers per pass (sim.costs)
    REDUCE_GRAD                      the stage's gradient reduction after its last backward: the optimizer
                                     step's data-parallel tail prices it (sim/data_parallel.py)
    (aFm;bBn)OVERLAP_F_B             DualPipe's forward of one stage overlapped with a backward of another:
                                     read as its sub-actions in that order, run one after the other (the
                                     engine has one compute stream per rank, so the overlap's gain is not
                                     modelled; the step is an upper bound on what the overlap achieves)
"""

from __future__ import annotations

import csv
import io
import re
import stat
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from pipeplan.sim.errors import ScheduleError

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _Action


class Kind(StrEnum):
    F = "F"
    B = "B"
    I = "I"  # torch's name for backward-input
    W = "W"


BACKWARD_KINDS = (Kind.B, Kind.I)  # consume the output gradient; free the forward's activations
GRADIENT_KINDS = (Kind.B, Kind.W)  # finish a microbatch's weight gradient (what freezing skips)
_ACTION_RE = re.compile(r"^(\d+)([FBIW])(\d+)$")
# torch's compute_comms cells that carry no compute of their own (module docstring)
_COMMS_RE = re.compile(r"^\d+(?:(?:SEND_F|RECV_F|SEND_B|RECV_B)\d+|UNSHARD|RESHARD|REDUCE_GRAD)$")
_OVERLAP_RE = re.compile(r"^\((.*)\)OVERLAP_F_B$")
FORMATS = "torch's _dump_csv, format 'compute_only' or 'compute_comms'"


@dataclass(frozen=True, slots=True, order=True)
class Action:
    stage: int
    kind: Kind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse torch's compact form `<stage><F|B|I|W><microbatch>`; anything else is a ScheduleError."""
        from pipeplan.sim.limits import check_schedule_id

        m = _ACTION_RE.match(text.strip())
        if not m:
            shown = text.strip() if len(text.strip()) <= 24 else text.strip()[:21] + "..."
            raise ScheduleError(f"schedule action {shown!r}: expected <stage><F|B|I|W><microbatch>, e.g. 0F3 "
                                f"({FORMATS})")
        stage, microbatch = check_schedule_id(m.group(1), "stage"), check_schedule_id(m.group(3), "microbatch")
        return cls(stage, Kind(m.group(2)), microbatch)

    @classmethod
    def parse_cell(cls, text: str) -> tuple[Action, ...]:
        """The compute actions of one CSV cell: one for `0F3`, none for a compute_comms transfer or
        bookkeeping cell (`0SEND_F3`, `0UNSHARD`, `0REDUCE_GRAD`), the sub-actions of an `OVERLAP_F_B`
        (module docstring); anything else is a ScheduleError naming the formats that load."""
        cell = text.strip()
        if _COMMS_RE.match(cell):
            return ()
        overlap = _OVERLAP_RE.match(cell)
        if overlap:
            return tuple(cls.parse(sub) for sub in overlap.group(1).split(";") if sub.strip())
        return (cls.parse(cell),)


@dataclass(frozen=True)
class Schedule:
    """A complete pipeline schedule: `ranks[r]` is the order in which rank r runs its actions.

    Equality ignores `name`: two schedules are equal when they run the same actions in the same order.
    """

    name: str = field(compare=False)
    num_stages: int  # model chunks in the whole pipeline = ranks * virtual_stages
    num_microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    stage_to_rank: tuple[int, ...]

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_actions(self) -> int:
        return sum(len(r) for r in self.ranks)

    @property
    def virtual_stages(self) -> int:
        return self.num_stages // self.num_ranks

    @property
    def uses_split_backward(self) -> bool:
        return any(a.kind is Kind.I for r in self.ranks for a in r)

    def validate(self) -> Schedule:
        """Check completeness and per-rank order; raise ScheduleError naming the first problem."""
        n_s, n_m = self.num_stages, self.num_microbatches
        if len(self.stage_to_rank) != n_s:
            raise ScheduleError(f"schedule: stage_to_rank has {len(self.stage_to_rank)} entries, need {n_s}")
        seen: set[Action] = set()
        for rank, actions in enumerate(self.ranks):
            for a in actions:
                if not 0 <= a.stage < n_s:
                    raise ScheduleError(
                        f"schedule rank {rank}: action {a} names stage {a.stage}; allowed 0..{n_s - 1}"
                    )
                if not 0 <= a.microbatch < n_m:
                    raise ScheduleError(
                        f"schedule rank {rank}: action {a} names microbatch {a.microbatch}; "
                        f"allowed 0..{n_m - 1}"
                    )
                if self.stage_to_rank[a.stage] != rank:
                    raise ScheduleError(
                        f"schedule rank {rank}: action {a} belongs to stage {a.stage}, "
                        f"which runs on rank {self.stage_to_rank[a.stage]}"
                    )
                if a in seen:
                    raise ScheduleError(f"schedule rank {rank}: action {a} appears more than once")
                if a.kind is Kind.W and Action(a.stage, Kind.I, a.microbatch) not in seen:
                    raise ScheduleError(
                        f"schedule rank {rank}: {a} comes before its backward-input {a.stage}I{a.microbatch}"
                    )
                if a.kind in BACKWARD_KINDS and Action(a.stage, Kind.F, a.microbatch) not in seen:
                    raise ScheduleError(
                        f"schedule rank {rank}: {a} comes before its forward {a.stage}F{a.microbatch}"
                    )
                seen.add(a)
        for s in range(n_s):
            for mb in range(n_m):
                if Action(s, Kind.F, mb) not in seen:
                    raise ScheduleError(f"schedule: stage {s} has no forward for microbatch {mb} ({s}F{mb})")
                has_b = Action(s, Kind.B, mb) in seen
                has_i = Action(s, Kind.I, mb) in seen
                has_w = Action(s, Kind.W, mb) in seen
                if has_b == has_i or has_i != has_w:
                    raise ScheduleError(
                        f"schedule: stage {s} microbatch {mb} needs either {s}B{mb} "
                        f"or both {s}I{mb} and {s}W{mb}"
                    )
        return self

    # ---- torch's action-string CSV -------------------------------------------------------------
    def to_csv_text(self) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        for actions in self.ranks:
            writer.writerow([str(a) for a in actions])
        return buf.getvalue()

    @classmethod
    def from_csv_text(cls, text: str, name: str = "csv", num_microbatches: int | None = None) -> Schedule:
        """Read torch's one-row-per-rank CSV, compute_only or compute_comms (module docstring); the stage->rank
        mapping is read from where stages appear."""
        from pipeplan.sim.limits import MAX_ACTIONS, check_schedule_size

        try:
            rows = [[c for c in row if c.strip()] for row in csv.reader(io.StringIO(text))]
        except csv.Error as exc:
            raise ScheduleError(f"schedule csv: not a CSV of actions ({exc})") from None
        while rows and not rows[-1]:
            rows.pop()
        if not rows:
            raise ScheduleError("schedule csv: no rows; expected one row of actions per rank")
        if sum(map(len, rows)) > MAX_ACTIONS:
            raise ScheduleError(f"schedule csv: {sum(map(len, rows)):,} actions; the limit is {MAX_ACTIONS:,}")
        ranks = tuple(tuple(a for c in row for a in Action.parse_cell(c)) for row in rows)
        top_stage = max((a.stage for r in ranks for a in r), default=0)
        top_mb = max((a.microbatch for r in ranks for a in r), default=0)
        check_schedule_size(top_stage + 1, top_mb + 1)  # before any list of that many stages
        stage_rank: dict[int, int] = {}
        for r, actions in enumerate(ranks):
            for a in actions:
                if stage_rank.setdefault(a.stage, r) != r:
                    raise ScheduleError(
                        f"schedule csv: stage {a.stage} appears on rank {stage_rank[a.stage]} and rank {r}"
                    )
        n_stages = max(stage_rank) + 1
        missing = [s for s in range(n_stages) if s not in stage_rank]
        if missing:
            raise ScheduleError(
                f"schedule csv: stages {missing} have no actions; every stage 0..{n_stages - 1} needs some"
            )
        n_mb = max(a.microbatch for r in ranks for a in r) + 1
        sched = cls(name, n_stages, n_mb, ranks, tuple(stage_rank[s] for s in range(n_stages)))
        sched.validate()
        if num_microbatches is not None and n_mb != num_microbatches:
            raise ScheduleError(f"schedule csv: has {n_mb} microbatches, the scenario says {num_microbatches}")
        return sched

    def write_csv(self, path: str | Path) -> None:
        from pipeplan.common.io import atomic_write_text

        atomic_write_text(path, self.to_csv_text())

    @classmethod
    def read_csv(cls, path: str | Path, num_microbatches: int | None = None) -> Schedule:
        from pipeplan.sim.limits import MAX_SCHEDULE_CSV_BYTES

        p = Path(path)
        shown = str(path) if len(str(path)) <= 80 else "..." + str(path)[-77:]  # the file name, not its folders
        if not str(path).strip():
            raise ScheduleError("--schedule-csv: empty path; give a CSV file")
        try:
            if not stat.S_ISREG(p.stat().st_mode):  # before open: opening a fifo would wait for a writer
                raise ScheduleError(f"--schedule-csv {shown}: not a regular file; give a CSV file")
            with p.open("rb") as f:
                data = f.read(MAX_SCHEDULE_CSV_BYTES + 1)
        except OSError as exc:
            raise ScheduleError(f"--schedule-csv {shown}: cannot read ({exc.strerror})") from None
        if len(data) > MAX_SCHEDULE_CSV_BYTES:
            raise ScheduleError(f"--schedule-csv {shown}: larger than the limit of {MAX_SCHEDULE_CSV_BYTES:,} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ScheduleError(f"--schedule-csv {shown}: not UTF-8 text; give torch's action CSV") from None
        return cls.from_csv_text(text, name=p.stem, num_microbatches=num_microbatches)

    def to_torch(self) -> dict[int, list[_Action]]:
        """The same order as torch `_Action`s, for `_validate_schedule` and torch's schedule runtime."""
        from torch.distributed.pipelining.schedules import _Action, _ComputationType

        return {
            r: [_Action(a.stage, _ComputationType(a.kind.value), a.microbatch) for a in actions]
            for r, actions in enumerate(self.ranks)
        }
