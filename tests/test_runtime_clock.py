"""One clock across ranks (runtime/clock.py): NTP's estimate against known offsets, and a real 2-rank job
whose rank 1 reads a clock 5 s ahead and writes to another output folder (as another node would): aligned,
its timeline is causal, and rank 0's outputs reach the other "node". Inputs are checked on every rank."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from pipeplan.runtime.clock import ClockFit, OffsetSample, best_sample, ntp_offset, step_origins
from pipeplan.runtime.config import RunConfig
from pipeplan.runtime.launch import spawn
from pipeplan.sim.ir import Schedule

SKEW_S = 5.0


@pytest.mark.parametrize("there,back", [(1e-4, 1e-4), (3e-4, 1e-5), (1e-6, 2e-3)])
def test_ntp_offset_is_within_half_the_round_trip_of_the_truth(there, back):
    true_offset, service = 7.25, 5e-5  # rank 0's clock = this rank's + 7.25 s
    t1 = 100.0
    t2 = t1 + there + true_offset
    t3 = t2 + service
    t4 = t3 - true_offset + back
    s = ntp_offset(t1, t2, t3, t4)
    assert s.bound_s == pytest.approx((there + back) / 2)
    assert abs(s.offset_s - true_offset) <= s.bound_s + 1e-12
    assert s.offset_s == pytest.approx(true_offset + (there - back) / 2)  # the asymmetry is the only error


def test_the_minimum_delay_sample_wins_and_drift_is_linear():
    samples = [OffsetSample(1.0, 5e-3, 0.0), OffsetSample(1.2, 1e-4, 0.0), OffsetSample(0.9, 2e-3, 0.0)]
    assert best_sample(samples).offset_s == 1.2
    fit = ClockFit(OffsetSample(1.0, 1e-4, 10.0), OffsetSample(1.002, 3e-4, 110.0))  # 20 ppm drift
    assert fit.drift == pytest.approx(2e-5)
    assert fit.to_reference(60.0) == pytest.approx(60.0 + 1.001)
    assert fit.uncertainty_s == 3e-4
    # outside the job's two estimates the offset is the nearer one's: a resumed run's restored steps, timed
    # an hour before this job started, are not shifted by 20 ppm x 3600 s = 72 ms of extrapolated drift
    assert fit.offset_at(10.0 - 3600) == fit.start.offset_s
    assert fit.offset_at(110.0 + 3600) == pytest.approx(fit.end.offset_s)
    # ranks that left the barrier 3 ms apart on one clock: the late one's times shift by 3 ms
    assert step_origins([5.000, 5.003], [ClockFit(OffsetSample(0, 0, 0))] * 2) == pytest.approx([0.0, 0.003])


TINY2 = {"model.hidden": 32, "model.layers": 4, "model.ffn_hidden": 64, "model.seq_len": 16,
         "pipeline.stages": 2, "pipeline.microbatches": 4, "pipeline.schedule": "1f1b"}


def _job(rank: int, world: int, out: str) -> str:
    import torch

    from pipeplan.runtime.worker import check_inputs_everywhere, run_job
    from pipeplan.sim.errors import PipeplanError

    # rank 1 stands for a node that lacks the data file: every rank learns it, before any work
    missing = RunConfig(overrides=TINY2, data="/no/such/corpus.txt" if rank == 1 else "synthetic")
    try:
        check_inputs_everywhere(missing, rank, world)
        error = ""
    except PipeplanError as exc:
        error = str(exc)
    cfg = RunConfig(overrides=TINY2, data="synthetic", steps=3, timeout_s=60, clock_skew_s=SKEW_S,
                    out_dir=f"{out}/node{rank}")  # another output folder: another node's
    run_job(cfg, rank, world, torch.device("cpu"))
    return error


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("skewed")
    errors = spawn(_job, 2, str(out), timeout_s=240)
    return out, errors


@pytest.fixture(scope="module")
def skewed(job):
    return job[0] / "node0"


def test_every_rank_checks_the_inputs_and_names_the_one_that_lacks_them(job):
    _, errors = job
    assert errors[0] == errors[1] and errors[0].startswith("rank 1 on ") and "/no/such/corpus.txt" in errors[0]


def test_rank_0s_outputs_reach_the_other_node(job):
    out, _ = job
    node0, node1 = out / "node0", out / "node1"
    names = sorted(p.name for p in node0.iterdir())
    assert "summary.json" in names and sorted(p.name for p in node1.iterdir()) == names
    assert all((node0 / n).read_bytes() == (node1 / n).read_bytes() for n in names)


def test_a_skewed_clock_is_measured_and_removed(skewed):
    clock = json.loads((skewed / "summary.json").read_text())["clock"]
    assert clock["offset_s"][0] == 0.0
    assert abs(clock["offset_s"][1] + SKEW_S) <= clock["uncertainty_s"] + 1e-9  # rank 0 = rank 1 - 5 s
    assert 0 < clock["uncertainty_s"] < 0.05


def test_no_cross_rank_dependency_is_violated_beyond_the_uncertainty(skewed):
    summary = json.loads((skewed / "summary.json").read_text())
    clock = summary["clock"]
    assert clock["cross_rank_dependencies"] > 0 and clock["violations_beyond_uncertainty"] == 0
    # and independently, from the written timelines of every step
    sched = Schedule.read_csv(skewed / "schedule.csv")
    timelines = pd.read_csv(skewed / "timelines.csv")
    end = {(r.step, r.stage, r.kind != "F", r.microbatch): r.end_s for r in timelines.itertuples() if r.kind != "W"}
    checked = 0
    for r in timelines.itertuples():
        src = (r.stage - 1, False) if r.kind == "F" else (r.stage + 1, True) if r.kind in "BI" else None
        if src is None or not 0 <= src[0] < sched.num_stages or sched.stage_to_rank[src[0]] == r.rank:
            continue
        assert r.start_s >= end[(r.step, src[0], src[1], r.microbatch)] - clock["uncertainty_s"]
        checked += 1
    assert checked > 0
    assert summary["measured_makespan_s"] < 2.0  # not the 5 s skew
