"""`pipeplan sweep --scheduler`: the same sweep on a Dask distributed cluster gives the same rows as local
processes, and resumes the same way. The cluster is a `distributed.LocalCluster` in this process (threads)."""

from __future__ import annotations

import pandas as pd
import pytest
from pipeplan.scenarios import scenario_path

from pipeplan.analysis.cli import main
from pipeplan.analysis.sweep import run_sweep
from pipeplan.sim.errors import PipeplanError

distributed = pytest.importorskip("distributed")

EIGHT_B = str(scenario_path("llama3-8b-pp4-h100"))
GRID = {"pipeline.schedule": ["1f1b", "zbv"], "pipeline.microbatches": [8, 16], "pipeline.virtual_stages": [1]}
SAME = ["config_id", "status", "reason", "tokens_per_s", "step_time_s", "max_peak_hbm_bytes", "fits"]


@pytest.fixture(scope="module")
def scheduler():
    with distributed.LocalCluster(processes=False, n_workers=1, threads_per_worker=2, dashboard_address=None) as c:
        yield c.scheduler_address


def _key(df: pd.DataFrame) -> pd.DataFrame:
    return df[SAME].sort_values("config_id").reset_index(drop=True)


def test_cluster_sweep_matches_local_and_resumes(tmp_path, scheduler):
    local = run_sweep(EIGHT_B, GRID, tmp_path / "local", jobs=1, plan_freeze=False)
    remote = run_sweep(EIGHT_B, GRID, tmp_path / "dask", jobs=1, plan_freeze=False, scheduler=scheduler)
    pd.testing.assert_frame_equal(_key(local), _key(remote))
    assert set(remote["status"]) == {"ok", "invalid"}  # zbv at an explicit v = 1 is invalid

    csv = tmp_path / "dask" / "sweep.csv"
    lines = csv.read_text().splitlines(keepends=True)
    csv.write_text("".join(lines[:-1]))  # one configuration lost, as after a crash
    seen = []
    again = run_sweep(EIGHT_B, GRID, tmp_path / "dask", jobs=1, plan_freeze=False, scheduler=scheduler,
                      progress=lambda done, total: seen.append((done, total)))
    assert seen == [(3, 4), (4, 4)]  # only the missing one was computed
    pd.testing.assert_frame_equal(_key(again), _key(local))


def test_unreachable_scheduler_is_one_line(tmp_path):
    with pytest.raises(PipeplanError, match=r"--scheduler tcp://127\.0\.0\.1:1"):
        run_sweep(EIGHT_B, GRID, tmp_path, jobs=1, plan_freeze=False, scheduler="tcp://127.0.0.1:1")


@pytest.mark.parametrize("address", ["nonsense", "foo://127.0.0.1:1", "tcp://host"])
def test_malformed_scheduler_address_is_one_line_and_writes_nothing(tmp_path, capfd, address):
    """A malformed address is refused before the folder is claimed, without Dask's Client.__del__ traceback."""
    out = tmp_path / "sw"
    assert main(["sweep", EIGHT_B, "--grid", "pipeline.microbatches=8,16", "--scheduler", address,
                 "--out", str(out)]) == 2
    err = capfd.readouterr().err
    assert err.startswith(f"pipeplan sweep: error: --scheduler {address}: not a Dask scheduler address")
    assert len(err.strip().splitlines()) == 1 and not out.exists()
