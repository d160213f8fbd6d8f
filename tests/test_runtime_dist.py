"""The executor on real process groups (gloo, 2 ranks spawned once for the whole file): every schedule
against single-process training, the executed order against the IR, torch.distributed.pipelining's own
schedules on the same chunks, checkpoint/resume exactness, and TimelyFreeze's in-job LP."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeplan.runtime.config import RunConfig
from pipeplan.runtime.launch import spawn
from pipeplan.runtime.reference import reference_losses
from pipeplan.runtime.torch_pipelining import TORCH_CLASSES
from pipeplan.sim.errors import PipeplanError
from pipeplan.sim.schedules import build_schedule, schedule_names

RANKS, MICROBATCHES, STEPS = 2, 4, 2
TINY = {"model.hidden": 32, "model.layers": 4, "model.ffn_hidden": 64, "model.seq_len": 16,
        "pipeline.stages": RANKS, "pipeline.microbatches": MICROBATCHES}


TIMED = {"pipeline.order_timing": "costs", "pipeline.admission_cap": 4}  # where the two clocks differ


def runnable_schedules() -> list[tuple[str, int]]:
    """Every registered schedule, with the smallest virtual_stages it accepts at this size."""
    out = []
    for name in schedule_names():
        for v in (1, 2):
            try:
                build_schedule(name, RANKS, MICROBATCHES, v)
            except PipeplanError:
                continue
            out.append((name, v))
            break
    return out


def config(name: str, v: int, dtype: str = "fp32", overrides: dict | None = None, **kwargs) -> RunConfig:
    over = {**TINY, "pipeline.schedule": name, "pipeline.virtual_stages": v, "training.dtype": dtype,
            **(overrides or {})}
    return RunConfig(overrides=over, data="synthetic", timeout_s=60, **{"steps": STEPS, **kwargs})


def losses_by_step(histories) -> list[list[float]]:
    """Merge the ranks' per-microbatch losses (only the last stage's rank has them)."""
    steps = []
    for recs in zip(*histories, strict=True):
        merged = {k: v for r in recs for k, v in r.trace.losses.items()}
        steps.append([merged[mb] for mb in range(MICROBATCHES)])
    return steps


def _job(rank: int, world: int, ckpt_dir: str) -> dict:
    from pipeplan.runtime.data import TokenData
    from pipeplan.runtime.model import ModelArgs
    from pipeplan.runtime.stages import build_chunk, scenario_layer_ranges
    from pipeplan.runtime.torch_pipelining import build_torch_schedule, torch_step
    from pipeplan.runtime.train import Trainer, load_run_scenario

    cpu = torch.device("cpu")
    out: dict = {"runs": {}, "torch": {}}
    for name, v in runnable_schedules():
        trainer = Trainer(config(name, v), rank, world, cpu)
        out["runs"][name] = trainer.train()
        out["bf16"] = out.get("bf16", {})
        out["bf16"][name] = Trainer(config(name, v, "bf16"), rank, world, cpu).train()

        cfg = config(name, v)
        sc, sched = load_run_scenario(cfg)
        stages = [s for s in range(sched.num_stages) if sched.stage_to_rank[s] == rank]
        data = TokenData(cfg.data, sc.model.vocab, sc.model.seq_len, sc.training.micro_batch_size, cfg.seed)
        for how in ("csv", "own") if name in TORCH_CLASSES else ("csv",):
            ranges = scenario_layer_ranges(sc)
            chunks = {s: build_chunk(ModelArgs.from_scenario(sc.model), s, ranges, cpu) for s in stages}
            opt = torch.optim.Adam([p for c in chunks.values() for p in c.parameters()], lr=cfg.lr)
            ts = build_torch_schedule(sched, chunks, cpu, how)
            per_step = []
            for step in range(STEPS):
                per_step.append(torch_step(ts, sched, stages, data.step(step, MICROBATCHES), cpu))
                opt.step()
                opt.zero_grad()
            out["torch"][(name, how)] = per_step

    # chronos' order built on the step's costs (pipeline.order_timing): the runtime resolves the same order
    out["timed"] = Trainer(config("chronos", 2, overrides=TIMED), rank, world, cpu).train()

    # checkpoint/resume, with freezing on (its draws and RNG are part of the state) and split backward
    frz = {"freeze": "uniform", "freeze_cap": 0.5, "freeze_warmup": 0, "freeze_monitor": 2, "freeze_ramp": 1,
           "freeze_redraw": 1}
    out["straight"] = Trainer(config("zb-h1", 1, steps=6, **frz), rank, world, cpu).train()
    Trainer(config("zb-h1", 1, steps=3, checkpoint_dir=ckpt_dir, **frz), rank, world, cpu).train()
    out["resumed"] = Trainer(config("zb-h1", 1, steps=6, checkpoint_dir=ckpt_dir, resume=True, **frz),
                             rank, world, cpu).train()

    tf = Trainer(config("1f1b", 1, steps=5, freeze="timelyfreeze", freeze_cap=0.5, freeze_warmup=1,
                        freeze_monitor=2, freeze_ramp=0), rank, world, cpu)
    out["timelyfreeze"] = (tf.train(), tf.freezer.plan, tf.freezer.planned_makespan_s)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn(_job, RANKS, str(tmp_path_factory.mktemp("ckpt")), timeout_s=300)


@pytest.fixture(scope="module")
def reference():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = {name: reference_losses(config(name, v)) for name, v in runnable_schedules()}
        ref["bf16"] = reference_losses(config("1f1b", 1, "bf16"))  # the model and data of every schedule
        return ref
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("name", [n for n, _ in runnable_schedules()])
def test_every_schedule_matches_single_process_training(name, results, reference):
    got = losses_by_step([r["runs"][name] for r in results])
    np.testing.assert_allclose(got, reference[name], rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", [n for n, _ in runnable_schedules()])
def test_every_schedule_in_bf16_matches_the_single_process_bf16_reference(name, results, reference):
    """bf16 autocast over fp32 master weights, on the CPU (split backward included: zb-h1, zbv, v-half,
    chronos). Tolerance rtol 1e-6, as in fp32, and why it holds: bf16 changes the kernels' operand dtype, not
    the order of any sum; each stage runs its microbatches' backwards in the same order in every schedule
    and accumulates gradients in fp32, so the losses equal the reference's (measured: bit for bit)."""
    got = np.asarray(losses_by_step([r["bf16"][name] for r in results]))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, reference["bf16"], rtol=1e-6, atol=0)
    # and it did run in bf16: not the fp32 losses, but within bf16's rounding of them (2^-8 relative)
    fp32 = np.asarray(reference[name])
    assert not np.array_equal(got, fp32)
    np.testing.assert_allclose(got, fp32, rtol=2.0**-8)


@pytest.mark.parametrize("name,v", runnable_schedules())
def test_each_rank_executes_exactly_the_ir_order(name, v, results):
    sched = build_schedule(name, RANKS, MICROBATCHES, v)
    for rank, r in enumerate(results):
        for record in r["runs"][name]:
            assert [a for a, _, _ in record.trace.actions] == list(sched.ranks[rank])
            starts = [s for _, s, _ in record.trace.actions]
            assert starts == sorted(starts)


@pytest.mark.parametrize("name", [n for n, _ in runnable_schedules()])
def test_torch_pipelining_gives_the_same_losses(name, results, reference):
    hows = ("csv", "own") if name in TORCH_CLASSES else ("csv",)
    for how in hows:
        got = [a or b for a, b in zip(*(r["torch"][(name, how)] for r in results), strict=True)]
        np.testing.assert_allclose(got, reference[name], rtol=1e-6, atol=0, err_msg=how)


def test_chronos_timed_on_the_step_s_costs_runs_its_own_order_to_the_same_losses(results, reference):
    """pipeline.order_timing = "costs" reaches the runtime through the scenario: each rank executes the order
    the list scheduler built on this tiny model's cost table (not the unit-cost one), and training is unchanged."""
    from pipeplan.runtime.train import load_run_scenario

    sched = load_run_scenario(config("chronos", 2, overrides=TIMED))[1]
    assert sched.ranks != build_schedule("chronos", RANKS, MICROBATCHES, 2, admission_cap=4).ranks
    for rank, r in enumerate(results):
        for record in r["timed"]:
            assert [a for a, _, _ in record.trace.actions] == list(sched.ranks[rank])
    np.testing.assert_allclose(losses_by_step([r["timed"] for r in results]), reference["chronos"], rtol=1e-6, atol=0)


def test_resumed_run_reproduces_the_uninterrupted_losses_exactly(results):
    straight = losses_by_step([r["straight"] for r in results])
    resumed = losses_by_step([r["resumed"] for r in results])
    assert [rec.step for rec in results[0]["resumed"]] == list(range(6))
    assert resumed == straight
    assert [rec.phase for rec in results[0]["straight"]] == [
        "monitor", "monitor", "ramp", "steady", "steady", "steady"]


def test_timelyfreeze_solves_its_lp_inside_the_job(results):
    history, plan, planned = results[0]["timelyfreeze"]
    assert [rec.phase for rec in history] == ["warmup", "monitor", "monitor", "steady", "steady"]
    assert set(plan) == {(s, mb) for s in range(RANKS) for mb in range(MICROBATCHES)}
    assert all(0.0 <= r <= 1.0 for r in plan.values())
    for s in range(RANKS):  # the cap holds per stage
        assert np.mean([plan[(s, mb)] for mb in range(MICROBATCHES)]) <= 0.5 + 1e-6
    assert planned is not None and planned > 0
    assert results[1]["timelyfreeze"][1] == plan  # every rank got rank 0's plan
    assert history[1].freeze_ratio == history[2].freeze_ratio == 0.5  # monitoring: half the microbatches each
