"""One pipeline rank's training job: build its chunks, then step — freeze, execute, optimise, checkpoint.

The rank's chunks come from the scenario's model and the schedule's stage placement; everything a step
measured stays on the rank (`StepRecord`) until the job ends, when rank 0 gathers it (runtime/worker.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipeplan.common.io import atomic_write_text
from pipeplan.runtime import checkpoint
from pipeplan.runtime.config import RunConfig
from pipeplan.runtime.data import TokenData
from pipeplan.runtime.executor import PipelineExecutor, StepTrace, device_peak_bytes
from pipeplan.runtime.freeze import FreezePhases, Freezer
from pipeplan.runtime.memory import apply_policy, run_memory
from pipeplan.runtime.model import ModelArgs
from pipeplan.runtime.optim import HostOffloadOptimizer, build_optimizer
from pipeplan.runtime.p2p import P2P, shares_gpus
from pipeplan.runtime.split_backward import enable_split_backward
from pipeplan.runtime.stages import build_chunk, check_ranks_hold_parameters, scenario_layer_ranges
from pipeplan.scenarios import scenario_path
from pipeplan.sim.config import Scenario, load_scenario
from pipeplan.sim.errors import PipeplanError
from pipeplan.sim.ir import Schedule
from pipeplan.sim.step import resolve_schedule

DEFAULT_SCENARIO = "tiny-cpu"
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""training.dtype -> the autocast dtype of the forwards, on every device (None: plain fp32)."""


def load_run_scenario(cfg: RunConfig) -> tuple[Scenario, Schedule]:
    """The scenario (tiny-cpu unless given) and the schedule it runs; PipeplanError if it has no model."""
    path = cfg.scenario or str(scenario_path(DEFAULT_SCENARIO))
    sc = load_scenario(path, cfg.overrides)
    if sc.model is None:
        raise PipeplanError(
            f"scenario {path}: has explicit [costs] but no [model]; `pipeplan run` needs a model to train "
            "(give the explicit-costs scenario to --costs for the prediction instead)"
        )
    # what pipeplan's executor does not do: its prediction (runtime/report.py) would describe another runtime
    if sc.pipeline.p2p_buffers != "per-exchange":
        raise PipeplanError(
            f"pipeline.p2p_buffers: '{sc.pipeline.p2p_buffers}' describes torch.distributed.pipelining; `pipeplan run` "
            "allocates each message and frees it after use (runtime/p2p.py): use 'per-exchange'"
        )
    if sc.training.optimizer_post_validation:
        raise PipeplanError(
            "training.optimizer_post_validation: `pipeplan run` ends every step with a barrier before the "
            "optimizer step; use false"
        )
    schedule = resolve_schedule(sc, cfg.schedule_csv)
    check_ranks_hold_parameters(scenario_layer_ranges(sc), schedule.stage_to_rank)
    return sc, schedule


@dataclass
class StepRecord:
    step: int
    phase: str
    step_time_s: float  # this rank: barrier exit to optimizer step done
    trace: StepTrace
    freeze_ratio: float = 0.0  # mean realized frozen share of this rank's (stage, mb) pairs
    cpu_time_s: float = 0.0  # this process's CPU time over the same span (all its threads): the work done,
    #                          which other jobs on a shared machine do not inflate the way they do wall time

    def to_plain(self) -> dict:
        return {"step": self.step, "phase": self.phase, "step_time_s": self.step_time_s,
                "trace": self.trace.to_plain(), "freeze_ratio": self.freeze_ratio, "cpu_time_s": self.cpu_time_s}

    @classmethod
    def from_plain(cls, d: dict) -> StepRecord:
        return cls(**{**d, "trace": StepTrace.from_plain(d["trace"])})


@dataclass
class Trainer:
    cfg: RunConfig
    rank: int
    world: int
    device: torch.device
    history: list[StepRecord] = field(default_factory=list)
    now: Callable[[], float] = time.perf_counter
    """The host clock the steps are timed on (tests skew it to stand for another node's clock)."""

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.scenario, self.schedule = load_run_scenario(cfg)
        sched = self.schedule
        if sched.num_ranks != self.world:
            raise PipeplanError(
                f"pipeline.stages is {sched.num_ranks} but the job has {self.world} processes; launch one "
                "process per pipeline rank (--nproc-per-node x --nnodes = pipeline.stages)"
            )
        m = self.scenario.model
        assert m is not None  # load_run_scenario refuses explicit [costs]
        self.args = ModelArgs.from_scenario(m)
        self.stages = [s for s in range(sched.num_stages) if sched.stage_to_rank[s] == self.rank]
        self.layer_ranges = scenario_layer_ranges(self.scenario)  # the simulator's placement, chunk by chunk
        self.chunks = {s: build_chunk(self.args, s, self.layer_ranges, self.device, cfg.seed) for s in self.stages}
        self.memory = run_memory(self.scenario, sched, cfg.choice())
        self.policies = self.memory.labels
        for s, chunk in self.chunks.items():
            if sched.uses_split_backward or cfg.profile:
                enable_split_backward(chunk)
            apply_policy(chunk, self.memory.chunks[s])
        params = [p for c in self.chunks.values() for p in c.parameters()]
        self.optimizer = build_optimizer(params, self.scenario.training.optimizer, cfg.lr,
                                         self.memory.states_on_host[self.rank])
        b = self.scenario.training.micro_batch_size
        needs_data = 0 in self.stages or sched.num_stages - 1 in self.stages
        self.data = TokenData(cfg.data, m.vocab, m.seq_len, b, cfg.seed) if needs_data else None
        self.tokens_per_step = b * m.seq_len * sched.num_microbatches
        p2p = P2P(sched, self.rank, (b, m.seq_len, m.hidden), torch.float32, self.device,
                  via_host=shares_gpus(self.device))
        self.executor = PipelineExecutor(sched, self.rank, self.chunks, p2p, self.device,
                                         offload_share={s: self.memory.chunks[s].offload_share for s in self.stages},
                                         profile_backward=cfg.profile,
                                         autocast_dtype=AUTOCAST[self.scenario.training.dtype], now=self.now,
                                         offload_weights=self.memory.weights_offloaded
                                         if self.memory.offloads_weights else None,
                                         prefetch_lookahead=self.scenario.memory.prefetch_lookahead,
                                         offload_stash={s: self.memory.stash_shares[s] for s in self.stages}
                                         if self.memory.stash_shares else 0.0)
        cap = cfg.freeze_cap if cfg.freeze_cap is not None else self.scenario.freeze.cap
        phases = FreezePhases(cfg.freeze, cap, cfg.freeze_warmup, cfg.freeze_monitor, cfg.freeze_ramp,
                              cfg.freeze_redraw, self.scenario.freeze.max_ratio)
        self.freezer = Freezer.build(phases, sched, self.chunks, cfg.seed, self.rank)
        if self.freezer.apf is not None:
            self.freezer.apf.start(self.chunks)
        self.start_step = 0
        if cfg.resume:
            assert cfg.checkpoint_dir is not None  # RunConfig refuses resume without it
            self.load_state_dict(checkpoint.load(cfg.checkpoint_dir, self.rank, self.device))

    # ---- the loop ------------------------------------------------------------------------------
    def train(self) -> list[StepRecord]:
        cfg = self.cfg
        for step in range(self.start_step, cfg.steps):
            if cfg.fail_rank == self.rank and cfg.fail_step == step:
                raise RuntimeError(f"injected failure on rank {self.rank} at step {step} (--fail-rank)")
            self.history.append(self.step(step))
            if self.rank == 0 and cfg.progress_file:
                atomic_write_text(cfg.progress_file, f"{step + 1}\n")
            if step in self.freezer.phases.solve_steps:  # end of monitoring, and each ramp step
                self.solve_freeze_plan(self.freezer.phases.cap_at(step + 1))
            auto = self.freezer.auto
            if auto is not None and auto.due(step, self.freezer.phases.warmup):  # AutoFreeze's evaluation
                gathered: list = [None] * self.world
                dist.all_gather_object(gathered, auto.local(self.chunks))
                auto.decide(gathered, step)
            apf = self.freezer.apf
            if apf is not None and step >= self.freezer.phases.warmup and apf.due(step):  # APF's check
                counts: list = [None] * self.world
                dist.all_gather_object(counts, apf.check(self.chunks))
                apf.adapt_threshold(sum(f for f, _ in counts), sum(t for _, t in counts))
            last = step == cfg.steps - 1
            if cfg.checkpoint_dir and ((cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0) or last):
                checkpoint.save(cfg.checkpoint_dir, step + 1, self.rank, self.state_dict())
        return self.history

    def step(self, step: int) -> StepRecord:
        frozen = self.freezer.frozen(step)
        profiled = self.cfg.profile and (not self.cfg.validate or step % 2 == 1)
        self.executor.profile_backward = profiled
        phase = ("profile" if profiled else "plain") if self.cfg.profile else self.freezer.phases.phase(step)
        batches = self.data.step(step, self.schedule.num_microbatches) if self.data is not None else None
        dist.barrier()
        t0, cpu0 = self.now(), time.process_time()
        trace = self.executor.run_step(batches, frozen)
        if self.freezer.auto is not None:
            self.freezer.auto.observe(self.chunks)  # the step's gradient norms, before the optimizer's
        self.optimizer.step()
        if self.freezer.apf is not None:
            self.freezer.apf.roll_back(self.chunks)  # frozen scalars keep their value
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        trace.peak_device_bytes = device_peak_bytes(self.device)  # since run_step's reset: the optimizer's included
        record = StepRecord(step, phase, self.now() - t0, trace, self.freezer.realized_ratio(),
                            time.process_time() - cpu0)
        self.freezer.observe(step, trace)
        return record

    def solve_freeze_plan(self, cap: float) -> None:
        """Gather every rank's monitoring, solve on rank 0 for `cap` (the solver's LP), broadcast the plan."""
        measurements: list = [None] * self.world
        dist.all_gather_object(measurements, {k: dict(v) for k, v in self.freezer.durations.items()})
        box: list[Any] = [None]
        if self.rank == 0:
            self.freezer.solve(measurements, cap)
            box = [(self.freezer.plan, self.freezer.planned_makespan_s, self.freezer.unfrozen_makespan_s)]
        dist.broadcast_object_list(box, src=0)
        if self.rank != 0:
            self.freezer.plan_cap, self.freezer.plan_version = cap, self.freezer.plan_version + 1
        self.freezer.plan, self.freezer.planned_makespan_s, self.freezer.unfrozen_makespan_s = box[0]

    def memory_info(self) -> dict:
        """Static bytes of this rank: weights and gradients on the device, optimizer state (and, offloaded,
        the fp32 master copy) on the device or in host memory."""
        per_stage = {s: 2.0 * sum(p.numel() * p.element_size() for p in c.parameters())
                     for s, c in self.chunks.items()}  # weights and their gradients
        opt = self.optimizer
        offloaded = isinstance(opt, HostOffloadOptimizer)
        inner = opt.inner if offloaded else opt
        state = sum(t.numel() * t.element_size() for st in inner.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
        host = state + sum(h.numel() * h.element_size() for h in opt.host) if offloaded else 0
        total = sum(per_stage.values()) or 1.0
        if not offloaded:  # optimizer state split over chunks in proportion to their weights
            per_stage = {s: b + state * b / total for s, b in per_stage.items()}
        return {"static_bytes": float(sum(per_stage.values())), "static_bytes_per_stage": per_stage,
                "static_host_bytes": float(host)}

    # ---- checkpoint (runtime/checkpoint.py: "device" tensors map to the device, "host" ones stay on the CPU)
    def state_dict(self) -> dict:
        host = {
            "rng": torch.get_rng_state(),
            "freezer": self.freezer.state_dict(),
            "history": [r.to_plain() for r in self.history],
        }
        if self.device.type == "cuda":
            host["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return {
            "step": self.history[-1].step + 1 if self.history else self.start_step,
            "device": {"chunks": {s: c.state_dict() for s, c in self.chunks.items()},
                       "optimizer": self.optimizer.state_dict()},
            "host": host,
        }

    def load_state_dict(self, state: dict) -> None:
        for s, chunk in self.chunks.items():
            chunk.load_state_dict(state["device"]["chunks"][s])
        self.optimizer.load_state_dict(state["device"]["optimizer"])
        host = state["host"]
        self.freezer.load_state_dict(host["freezer"])
        torch.set_rng_state(host["rng"])
        if "cuda_rng" in host and self.device.type == "cuda":
            torch.cuda.set_rng_state(host["cuda_rng"], self.device)
        self.history = [StepRecord.from_plain(r) for r in host["history"]]
        self.start_step = state["step"]
