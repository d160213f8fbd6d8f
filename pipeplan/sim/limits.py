"""Size limits, checked before any work: every input that could make pipeplan run for minutes, allocate
gigabytes or overflow to infinity is refused up front, with a message naming the field and its limit.

Each limit is far above what a real training job needs and low enough that the largest accepted input
still simulates in bounded time and memory (measured in docs/reliability.md):

- MAX_ACTIONS: pipeline.stages x virtual_stages x microbatches x 3 kinds (F, I, W) = 524,288. The largest
  schedule `pipeplan bench sim` times (interleaved-1f1b p=64 m=512 v=2, 196,608 actions with split backward)
  fits with room; at the limit (zb-h1, p=64, m=2,730: 524,160 actions) `simulate` took 69 s of CPU and
  3.3 GB here, most of it writing the trace and plots (docs/reliability.md).
- MAX_CHUNKS: stages x virtual_stages = 4,096 model chunks (e.g. 512 ranks x 8 virtual stages).
- MAX_LAYERS: 10,000 decoder layers (the deepest published LLMs have ~120-130).
- MAX_MODEL_DIM: 2**24 for hidden, ffn_hidden, heads, kv_heads, vocab, seq_len and micro_batch_size:
  above every shipped model (hidden 8,192, vocab 128,256, seq 8,192), and small enough that FLOPs and bytes
  stay far inside float64's range (b*s^2*h <= 2**96).
- MAX_PARALLEL: 2**20 for tp and dp (a million GPUs per dimension).
- MAX_SECONDS: 1e6 s for any explicit duration (11.6 days per action); MAX_BYTES: 2**60 (1 EiB) for any
  explicit size. Sums over all actions then stay finite (524,288 x 1e6 s = 5.2e11 s).
- MAX_SCHEDULE_CSV_BYTES: 16 MiB (a schedule at MAX_ACTIONS is ~6 MB); MAX_ID_DIGITS: 9 digits per
  stage or microbatch id, so a 5,000-digit number is refused before Python parses it.
- MAX_SWEEP_CONFIGS: 100,000 grid combinations; MAX_JOBS: 1,024 worker processes.

Tensor parallelism must split attention heads evenly: Megatron-LM's TransformerConfig refuses
`num_attention_heads % tensor_model_parallel_size != 0` (megatron/core/transformer/transformer_config.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from pipeplan.sim.errors import ScenarioError

if TYPE_CHECKING:
    from pipeplan.sim.config import Scenario
    from pipeplan.sim.costs import CostTable

class LimitError(ScenarioError, ValueError):
    """An input over a size limit. A ValueError too, so that pydantic validators report it as the field's
    error; elsewhere it is a PipeplanError (one line, exit 2)."""


ACTION_KINDS = 3  # F, I, W: the most actions a (stage, microbatch) pair has
MAX_ACTIONS = 2**19
MAX_CHUNKS = 4096
MAX_LAYERS = 10_000
MAX_MODEL_DIM = 2**24
MAX_PARALLEL = 2**20
MAX_SECONDS = 1e6
MAX_BYTES = float(2**60)
MAX_HBM_GIB = float(2**30)  # = MAX_BYTES
MAX_SCHEDULE_CSV_BYTES = 16 * 2**20
MAX_SCENARIO_BYTES = 16 * 2**20
"""A scenario TOML (or a model.config JSON) larger than this is refused before it is read: shipped ones are ~2 KB."""
MAX_NAME_CHARS = 200
"""model.name: it is printed in titles and tables (a 100,000-character name cost `plan` 59 s and 5.9 GB)."""
MAX_ID_DIGITS = 9
MAX_SWEEP_CONFIGS = 100_000
MAX_JOBS = 1024

_MODEL_DIMS = ("hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "seq_len")
_SECONDS_KEYS = ("forward_s", "backward_input_s", "backward_weight_s", "p2p_s")
_BYTES_KEYS = ("activation_bytes", "static_bytes", "checkpoint_bytes")


def check_pipeline_size(stages: int, virtual_stages: int, microbatches: int) -> None:
    """Refuse a pipeline with more chunks or actions than the limits (before any per-chunk work)."""
    chunks = stages * virtual_stages
    if chunks > MAX_CHUNKS:
        raise LimitError(
            f"pipeline.stages * pipeline.virtual_stages: {_num(chunks)} chunks; the limit is {MAX_CHUNKS:,}"
        )
    actions = chunks * microbatches * ACTION_KINDS
    if actions > MAX_ACTIONS:
        raise LimitError(
            f"pipeline.microbatches: stages * virtual_stages * microbatches * 3 = {_num(actions)} actions; "
            f"the limit is {MAX_ACTIONS:,} (use fewer microbatches or stages)"
        )


def check_schedule_size(stages: int, microbatches: int) -> None:
    """Refuse a schedule CSV naming more stages or microbatches than the limits allow."""
    if stages > MAX_CHUNKS:
        raise LimitError(f"schedule csv: names stage {_num(stages - 1)}; the limit is {MAX_CHUNKS:,} stages")
    if stages * microbatches * ACTION_KINDS > MAX_ACTIONS:
        raise LimitError(
            f"schedule csv: {_num(stages)} stages x {_num(microbatches)} microbatches x 3 is over the limit of "
            f"{MAX_ACTIONS:,} actions"
        )


def check_scenario_limits(sc: Scenario) -> None:
    """Every size and magnitude of a validated scenario within the limits above; ScenarioError if not."""
    p = sc.pipeline
    check_pipeline_size(p.stages, p.virtual_stages, p.microbatches)
    if sc.model is not None:
        _at_most("model.layers", sc.model.layers, MAX_LAYERS)
        for key in _MODEL_DIMS:
            _at_most(f"model.{key}", getattr(sc.model, key), MAX_MODEL_DIM)
        _at_most("training.micro_batch_size", sc.training.micro_batch_size, MAX_MODEL_DIM)
        _at_most("parallel.tp", sc.parallel.tp, MAX_PARALLEL)
        _at_most("parallel.dp", sc.parallel.dp, MAX_PARALLEL)
        if sc.model.heads % sc.parallel.tp:
            raise LimitError(
                f"parallel.tp: {sc.parallel.tp} does not divide model.heads ({sc.model.heads}); tensor "
                "parallelism splits the attention heads evenly across its ranks"
            )
    if sc.costs is not None:
        for key in _SECONDS_KEYS:
            _each_at_most(f"costs.{key}", getattr(sc.costs, key), MAX_SECONDS)
        for key in _BYTES_KEYS:
            _each_at_most(f"costs.{key}", getattr(sc.costs, key), MAX_BYTES)
        if sc.costs.hbm_gib is not None:
            _at_most("costs.hbm_gib", sc.costs.hbm_gib, MAX_HBM_GIB)
    for key in ("backward_min_s", "weight_min_s"):
        _each_at_most(f"freeze.{key}", getattr(sc.freeze, key), MAX_SECONDS)


def check_cost_table(costs: CostTable) -> CostTable:
    """A resolved cost table whose every duration and size is finite and within the limits.

    Model-derived costs are products of many inputs (a tiny peak_tflops, a huge vocab): the check names the
    quantity that overflowed rather than letting an infinite makespan reach the plots or the LP.
    """
    for key, limit in (("forward_s", MAX_SECONDS), ("backward_input_s", MAX_SECONDS),
                       ("backward_weight_s", MAX_SECONDS), ("activation_bytes", MAX_BYTES),
                       ("static_bytes", MAX_BYTES)):  # fmt: skip
        values = getattr(costs, key)
        worst = float(max(values, default=0.0, key=lambda x: x if math.isfinite(x) else math.inf))
        if not worst <= limit:
            raise LimitError(
                f"costs: a chunk's {key} comes to {_num(worst)} (limit {_num(limit)}); check the model sizes "
                "and the device figures (e.g. device.peak_tflops, device.efficiency)"
            )
    if not 0 <= costs.p2p_s <= MAX_SECONDS:
        raise LimitError(f"costs: p2p_s comes to {_num(costs.p2p_s)} (limit {_num(MAX_SECONDS)}); check "
                         "interconnect.p2p_gbps, p2p_latency_us, intra/inter_node_* and (with "
                         "parallel.p2p_scatter_gather) tp_gbps")
    return costs


def check_schedule_id(text: str, what: str) -> int:
    """A stage or microbatch id from a schedule CSV: at most MAX_ID_DIGITS digits."""
    if len(text) > MAX_ID_DIGITS:
        raise LimitError(
            f"schedule csv: {what} id {text[:12]}... has {len(text):,} digits; the limit is {MAX_ID_DIGITS}"
        )
    return int(text)


def _at_most(field: str, value: float, limit: float) -> None:
    if value > limit:
        raise LimitError(f"{field}: {_num(value)} is above the limit {_num(limit)}")


def _each_at_most(field: str, value: Any, limit: float) -> None:
    if value is None:
        return
    values = value if isinstance(value, list) else [value]
    worst = max(values, default=0.0)
    if worst > limit:
        raise LimitError(f"{field}: {_num(worst)} is above the limit {_num(limit)}")


def _num(x: float) -> str:
    """Short form of a number of any size (1e+18, not 1,000,000,000,000,000,000)."""
    if isinstance(x, int) and abs(x) < 10**12:
        return f"{x:,}"
    if isinstance(x, int) and abs(x).bit_length() > 1000:
        return f"about 2**{abs(x).bit_length() - 1}"
    return f"{float(x):.3g}" if math.isfinite(float(x)) else str(float(x))
