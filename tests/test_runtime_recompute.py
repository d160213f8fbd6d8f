"""The runtime runs exactly the recomputation the cost model priced (issue #12: "can I then run exactly that
plan?"). Per policy, the bytes a decoder layer keeps for its backward, metered the way the executor meters a
forward, equal the cost model's per-layer count for the same shapes (sim/activations.py, sim/layer_ops.py);
and on a real pipeline (gloo, 2 ranks, 1F1B and the V-shaped ZBV, whose split backward runs the linear layers
as a custom autograd Function) every policy's losses and gradients equal no recomputation's, bit for bit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from pipeplan.scenarios import scenario_path

from pipeplan.runtime.config import RunConfig
from pipeplan.runtime.launch import spawn
from pipeplan.runtime.memory import RECOMPUTE_WRAPPERS, ChunkMemory, SavedTensors, apply_policy, param_storages
from pipeplan.runtime.model import ModelArgs
from pipeplan.runtime.stages import build_chunk, layer_ranges
from pipeplan.sim.activations import DTYPE_BYTES, layer_memory
from pipeplan.sim.config import load_scenario
from pipeplan.sim.layer_ops import op_checkpoint_bytes
from pipeplan.sim.memory import RECOMPUTE

POLICIES = ("none", "selective", "selective-op", "full")
# (hidden, heads, kv_heads, ffn_hidden, seq_len, micro_batch_size): GQA and plain multi-head attention
SHAPES = [(128, 4, 2, 352, 64, 2), (64, 8, 8, 96, 32, 3)]


def shape_scenario(shape, **extra):
    h, a, kv, f, s, b = shape
    return load_scenario(scenario_path("tiny-cpu"), {
        "model.hidden": h, "model.heads": a, "model.kv_heads": kv, "model.ffn_hidden": f, "model.seq_len": s,
        "training.micro_batch_size": b, "training.dtype": "fp32", "training.attention": "flash",
        "training.compile": True, "parallel.tp": 1, **extra})


def kept_per_layer(sc, policy: str | ChunkMemory, layers: int = 2) -> float:
    """Bytes the executor's meter counts for one forward of a middle chunk of `layers` layers, per layer.
    A middle chunk (no embedding, no LM head) holds only decoder layers, so the count is layers x one layer's."""
    args = replace(ModelArgs.from_scenario(sc.model), n_layers=layers + 2)
    chunk = apply_policy(build_chunk(args, 1, layer_ranges([1, layers, 1])), policy)
    torch.manual_seed(0)
    x = torch.randn(sc.training.micro_batch_size, sc.model.seq_len, sc.model.hidden, requires_grad=True)
    meter = SavedTensors(param_storages(chunk))
    with meter:
        chunk(x).sum().backward()  # the backward runs after the meter closed, as in the executor
    return meter.device_bytes / layers


def test_every_simulated_policy_runs():
    """"chronos" resolves per chunk to full or none (sim.memory); every other name needs a runtime rule."""
    assert set(RECOMPUTE) - {"chronos"} == set(RECOMPUTE_WRAPPERS) == set(POLICIES)


@pytest.mark.parametrize("shape", SHAPES)
def test_each_policy_keeps_the_cost_models_bytes_per_layer(shape):
    sc = shape_scenario(shape)
    e = DTYPE_BYTES[sc.training.dtype]
    tokens, h = sc.training.micro_batch_size * sc.model.seq_len, sc.model.hidden
    mem = layer_memory(sc)
    kept = {p: kept_per_layer(sc, p) for p in POLICIES}
    # full: the layer input, e·sbh
    assert kept["full"] == mem.checkpoint == e * tokens * h
    # selective-op: the input, wq's, wv's, w1's and w2's outputs, flash attention's output and log-sum-exp
    assert kept["selective-op"] == op_checkpoint_bytes(sc)
    # selective drops the attention core's tensors only: with flash attention the fp32 log-sum-exp, 4·a·s·b
    assert kept["none"] - kept["selective"] == mem.attention_core == 4 * sc.model.heads * tokens
    # none: the fused count (training.compile = true) plus what this eager RMSNorm, x * rsqrt(mean(x²)) * g,
    # saves besides: x·rsqrt (e·sbh) and rsqrt (e·sb) for each of the layer's two norms. The cost model's eager
    # count (compile = false) describes torchtitan's model instead (fp32 copies, complex RoPE, repeat_kv).
    unfused_norms = 2 * (e * tokens * h + e * tokens)
    assert kept["none"] == mem.activation + unfused_norms
    assert kept["full"] < kept["selective-op"] < kept["selective"] < kept["none"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("policy", ["none", "selective"])
def test_recomputed_norms_keep_the_cost_models_bytes_per_layer(shape, policy):
    """memory.recompute_norms: the layer keeps neither norm's output (nor what this eager norm saves inside), so
    it keeps exactly the cost model's count with the norm outputs (2·e·sbh) taken off."""
    sc, norms = shape_scenario(shape), shape_scenario(shape, **{"memory.recompute_norms": True})
    e = DTYPE_BYTES[sc.training.dtype]
    tokens, h = sc.training.micro_batch_size * sc.model.seq_len, sc.model.hidden
    core = layer_memory(sc).attention_core if policy == "selective" else 0.0
    kept = kept_per_layer(sc, ChunkMemory(policy, 0.0, norms=True))
    assert layer_memory(norms).activation == layer_memory(sc).activation - 2 * e * tokens * h
    assert kept == layer_memory(norms).activation - core


# ---- the same numbers on a pipeline, bit for bit ------------------------------------------------------------
RANKS, MICROBATCHES, STEPS = 2, 4, 2
TINY = {"model.hidden": 32, "model.layers": 4, "model.ffn_hidden": 64, "model.seq_len": 16,
        "pipeline.stages": RANKS, "pipeline.microbatches": MICROBATCHES, "training.dtype": "fp32"}
SCHEDULES = {"1f1b": 1, "zbv": 2}


def train_recording_gradients(cfg: RunConfig, rank: int, world: int):
    """Train `cfg` on this rank; per step the losses, the gradients the optimizer stepped with, and the bytes
    each forward saved."""
    from pipeplan.runtime.train import Trainer

    trainer = Trainer(cfg, rank, world, torch.device("cpu"))
    grads: list[dict[str, torch.Tensor]] = []
    step = trainer.optimizer.step

    def recorded_step(*args, **kwargs):
        grads.append({n: p.grad.clone() for c in trainer.chunks.values() for n, p in c.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = recorded_step
    history = trainer.train()
    return [r.trace.losses for r in history], grads, [r.trace.activation_bytes for r in history]


# every policy, and the norms recomputed beside keep-everything and selective (memory.recompute_norms)
VARIANTS = {**{p: {"memory.recompute": p} for p in POLICIES},
            **{f"{p}+norms": {"memory.recompute": p, "memory.recompute_norms": True} for p in ("none", "selective")}}


def _job(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, v in SCHEDULES.items():
        for variant, overrides in VARIANTS.items():
            cfg = RunConfig(overrides={**TINY, "pipeline.schedule": name, "pipeline.virtual_stages": v,
                                       **overrides}, data="synthetic", timeout_s=60, steps=STEPS)
            out[(name, variant)] = train_recording_gradients(cfg, rank, world)
    return out


@pytest.fixture(scope="module")
def results():
    return spawn(_job, RANKS, timeout_s=300)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("policy", [p for p in VARIANTS if p != "none"])
def test_recomputation_gives_no_recomputations_losses_and_gradients_exactly(name, policy, results):
    for rank in results:
        losses, grads, activation = rank[(name, policy)]
        base_losses, base_grads, base_activation = rank[(name, "none")]
        assert losses == base_losses  # per step, per microbatch: the same floats
        assert len(grads) == STEPS and grads[0]
        for got, want in zip(grads, base_grads, strict=True):
            assert got.keys() == want.keys()
            assert [n for n in want if not torch.equal(got[n], want[n])] == []
        # and it kept fewer bytes on every chunk it ran
        for stage, per_mb in activation[0].items():
            assert max(per_mb) < max(base_activation[0][stage])


def _zbv_one_rank(policy: str, offload_weights: list[bool] | None):
    """Two steps of ZBV on one rank (both chunks of the V), split backward on: losses and gradients."""
    from pipeplan.runtime.executor import PipelineExecutor
    from pipeplan.runtime.p2p import P2P
    from pipeplan.runtime.split_backward import enable_split_backward
    from pipeplan.sim.schedules import build_schedule
    from tests.test_runtime_model import ARGS, batches

    cpu = torch.device("cpu")
    sched = build_schedule("zbv", 1, 4, 2)
    chunks = {s: apply_policy(enable_split_backward(build_chunk(ARGS, s, layer_ranges([2, 2]), cpu)), policy)
              for s in range(2)}
    p2p = P2P(sched, 0, (2, ARGS.seq_len, ARGS.dim), torch.float32, cpu)
    ex = PipelineExecutor(sched, 0, chunks, p2p, cpu, offload_weights=offload_weights, prefetch_lookahead=1)
    losses = [ex.run_step(batches(4, step)).losses for step in range(2)]
    return losses, {(s, n): p.grad.clone() for s, c in chunks.items() for n, p in c.named_parameters()}


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "none"])
def test_recomputation_under_weight_offload_is_bit_identical(policy, one_torch_thread):
    """The recomputation runs while the chunk's weights are back on the device (runtime/weight_offload.py):
    with every chunk's weights leaving between uses, still no recomputation's numbers."""
    base_losses, base_grads = _zbv_one_rank("none", None)
    losses, grads = _zbv_one_rank(policy, [True, True])
    assert losses == base_losses
    assert [k for k in base_grads if not torch.equal(grads[k], base_grads[k])] == []
