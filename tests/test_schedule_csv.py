"""The schedule CSV is torch.distributed.pipelining's: one row of action strings per rank."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed.pipelining import schedules as ts

from pipeplan.sim.errors import ScheduleError
from pipeplan.sim.ir import Schedule
from pipeplan.sim.schedules import SCHEDULES, build_schedule, schedule_names

GENERATED = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("zb-h1", 1),
             ("zbv", 2)]  # fmt: skip
SIZES = [(1, 1), (1, 3), (2, 4), (3, 3), (4, 8), (4, 2), (3, 7)]  # (ranks, microbatches)


def generated() -> list[Schedule]:
    schedule_names()  # registers the built-ins
    return [
        build_schedule(name, p, m, v)
        for name, v in GENERATED
        for p, m in SIZES
        if SCHEDULES[name].check(p, m, v) is None
    ]


def stand_in_stages(p: int, num_stages: int, local: int) -> list[SimpleNamespace]:
    # What torch's schedule classes read from a stage; no process group or model needed.
    return [
        SimpleNamespace(num_stages=num_stages, group_size=p, group_rank=0, stage_index=i, submod=None)
        for i in range(local)
    ]


def test_generated_schedules_round_trip():
    for sched in generated():
        text = sched.to_csv_text()
        assert Schedule.from_csv_text(text) == sched
        assert Schedule.from_csv_text(text, name=sched.name).name == sched.name


def test_csv_cells_are_torch_action_strings():
    for sched in generated():
        rows = sched.to_csv_text().splitlines()
        assert len(rows) == sched.num_ranks
        expected = sched.to_torch()
        for rank, row in enumerate(rows):
            assert [ts._Action.from_str(cell) for cell in row.split(",")] == expected[rank]


def test_torch_loads_our_csv(tmp_path: Path):
    cases = [("zbv", 4, 8, 2), ("interleaved-1f1b", 4, 8, 2), ("1f1b", 3, 5, 1), ("zb-h1", 2, 3, 1)]
    for name, p, m, v in cases:
        sched = build_schedule(name, p, m, v)
        path = tmp_path / f"{name}.csv"
        sched.write_csv(path)
        runtime = ts._PipelineScheduleRuntime(stand_in_stages(p, p * v, v), m)
        runtime._load_csv(str(path))  # validates, infers stage -> rank, and lowers to sends and receives
        assert runtime.pipeline_order == sched.to_torch()
        assert tuple(runtime.stage_index_to_group_rank[s] for s in range(p * v)) == sched.stage_to_rank
        assert Schedule.read_csv(path, num_microbatches=m) == sched


def test_we_load_torch_written_csv_with_idle_steps(tmp_path: Path):
    # torch pads its orders with idle steps (None), written as empty cells; reading skips them.
    for p, m in [(4, 8), (3, 2)]:
        torch_zbv = ts.ScheduleZBVZeroBubble(stand_in_stages(p, 2 * p, 2), m)
        path = tmp_path / f"zbv-{p}-{m}.csv"
        torch_zbv._dump_csv(str(path), format="compute_only")
        assert ",," in path.read_text()
        assert Schedule.read_csv(path) == build_schedule("zbv", p, m, 2)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", r"no rows"),
        ("\n\n", r"no rows"),
        ("0F0,0B0\n2F0,2B0\n", r"stages \[1\] have no actions"),
        ("0F0,0F0,0B0\n", r"action 0F0 appears more than once"),
        ("0F0,0X1,0B0\n", r"'0X1': expected <stage><F\|B\|I\|W><microbatch>"),
        ("0F0,F0,0B0\n", r"'F0': expected"),
        ("0F0,0W0,0I0\n", r"0W0 comes before its backward-input 0I0"),
        ("0B0,0F0\n", r"0B0 comes before its forward 0F0"),
        ("0F0,0B0,1F0,1B0\n1F1,1B1\n", r"stage 1 appears on rank 0 and rank 1"),
        ("0F0,0F1,0B0\n", r"stage 0 microbatch 1 needs either 0B1 or both 0I1 and 0W1"),
        ("0F0,0I0,0B0\n", r"needs either 0B0 or both 0I0 and 0W0"),
        ("0F1,0B1\n", r"stage 0 has no forward for microbatch 0"),
    ],
)
def test_bad_csv_is_a_schedule_error(text: str, message: str):
    with pytest.raises(ScheduleError, match=message):
        Schedule.from_csv_text(text)


def test_csv_microbatches_must_match_the_scenario():
    with pytest.raises(ScheduleError, match="has 2 microbatches, the scenario says 4"):
        Schedule.from_csv_text(build_schedule("1f1b", 2, 2).to_csv_text(), num_microbatches=4)


def test_torch_comms_cells_carry_no_compute():
    assert Schedule.from_csv_text("0UNSHARD,0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD,0RESHARD\n") == \
        Schedule.from_csv_text("0F0,0B0\n")


def test_unreadable_csv_names_the_flag(tmp_path: Path):
    with pytest.raises(ScheduleError, match=r"--schedule-csv .*missing\.csv: cannot read"):
        Schedule.read_csv(tmp_path / "missing.csv")


def torch_schedules():
    """torch 2.13's schedule classes that write a compute_comms CSV, with the sizes they take."""
    multi = [ts.ScheduleInterleaved1F1B, ts.ScheduleLoopedBFS, ts.ScheduleInterleavedZeroBubble]
    cases = [(cls, p, m, v) for cls in multi for p, m in [(2, 4), (4, 8), (3, 5)] for v in (1, 2)]
    cases += [(cls, p, m, 2) for cls in (ts.ScheduleZBVZeroBubble, ts.ScheduleDualPipeV)
              for p, m in [(2, 4), (4, 8), (3, 6)]]
    return cases


@pytest.mark.parametrize(("cls", "p", "m", "v"), torch_schedules(),
                         ids=lambda x: x.__name__ if isinstance(x, type) else str(x))
def test_we_load_torch_compute_comms_csv(cls, p, m, v, tmp_path: Path):
    """torch's default `_dump_csv` format: transfers, UNSHARD/RESHARD and REDUCE_GRAD cells drop out, an
    OVERLAP_F_B reads as its sub-actions; the compute order is torch's own, and the engine runs it."""
    from pipeplan.sim.engine import simulate
    from tests.conftest import make_costs

    sched = cls(stand_in_stages(p, p * v, v), m)
    comms, only = tmp_path / "comms.csv", tmp_path / "only.csv"
    sched._dump_csv(str(comms))  # torch's default: compute_comms
    text = comms.read_text()
    assert "UNSHARD" in text and "SEND_F" in text
    read = Schedule.read_csv(comms, num_microbatches=m)
    expected = [[a for x in sched.pipeline_order[r] if x is not None
                 for a in (x.sub_actions or (x,))] for r in range(p)]
    assert [[str(a) for a in row] for row in read.ranks] == [[str(a) for a in row] for row in expected]
    if "OVERLAP_F_B" not in text:
        sched._dump_csv(str(only), format="compute_only")
        assert Schedule.read_csv(only) == read
    res = simulate(read, make_costs(p, v, m))
    assert res.makespan_s > 0 and len(res.kind) == sum(map(len, read.ranks))


def test_an_unsupported_torch_cell_names_the_formats_that_load():
    with pytest.raises(ScheduleError, match=r"'0X1': expected .*compute_only' or 'compute_comms'"):
        Schedule.from_csv_text("0F0,0X1,0B0\n")
