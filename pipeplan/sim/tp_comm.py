"""Tensor-parallel collectives of one layer per pass, and the time they add to it under each overlap mode.

Per microbatch of T tokens on a t-way TP group (sequence parallelism: each all-reduce is an all-gather (AG)
plus a reduce-scatter (RS) of the same bytes, Korthikanti et al. 2022 §4.2.2):

    pass  collective                          GEMMs it feeds or is fed by          the micro-pipeline pass
    F     AG of the attention input   ->      QKV (wq, wk, wv)                    fuses (AG -> mm)
    F     out-proj                    -> RS                                       fuses (mm -> RS)
    F     AG of the MLP input         ->      MLP up (w1, w3)                     fuses
    F     MLP down                    -> RS                                       fuses
    I     AG of out-proj's dY         ->      out-proj dX = dY Wo^T               fuses
    I     AG of down's dY             ->      down dX                             fuses
    I     QKV dX                      -> RS                                       fuses only from one GEMM
    I     MLP-up dX                   -> RS                                       fuses only from one GEMM
    W     Megatron (tp_style "megatron"): AG of the QKV and MLP-up input shards again for dW   (not fused)

Without sequence parallelism F and I each run two all-reduces, which the micro-pipeline pass never fuses.

Overlap modes (`parallel.tp_comm_overlap`):

- "none": every collective adds its ring time C (sim/comm.py) to its pass.
- "full": a pass takes max(GEMMs, collectives): an upper bound on what any overlap hides.
- "async-tp": torch's micro-pipeline TP, read from torch/_inductor/fx_passes/micro_pipeline_tp.py and
  torch/distributed/_symmetric_memory/__init__.py (the autumn-2024 versions, the first that also match
  aten._scaled_mm, i.e. Float8 linears). `micro_pipeline_tp_pass` runs on every post-grad graph, forward and
  backward alike (so on a full checkpoint's recomputation too), and rewrites two patterns only:
  `all_gather_tensor -> mm` whose gathered tensor is the GEMM's left operand (`_find_consumer_matmuls`), into
  fused_all_gather_matmul, and `reduce_scatter_tensor(mm)` whose input is a single mm's output with no other
  user (`fuse_matmul_reduce_scatter`: "if len(input_node.users) != 1: return"; `_find_producer_matmul`
  returns None for anything but a mm), into fused_matmul_reduce_scatter. In the backward of a layer written
  as torchtitan writes LLaMA (separate wq, wk, wv and w1, w3 reading one gathered input) the input gradient
  is a sum of GEMM outputs, so those two RS stay plain NCCL reduce-scatters, exposed; GPT's fused QKV and fc1
  give one GEMM each, so they fuse.

  A fused AG (`_pipelined_all_gather_and_consume`) multiplies the local shard first, while the peers' shards
  are copied (copy_ from peer-mapped buffers: cudaMemcpyAsync, the copy engines, not the SMs) on two
  alternating streams, each remote chunk multiplied once it lands. A fused RS
  (`_pipelined_produce_and_all2all`) computes the chunk each peer needs, one per step, while the previous one
  is pulled, and its own chunk last; then one kernel sums the t partials (`reduce_fn` over the stacked
  partials: reads e·M·N, writes e·M·N/t). So the GEMM runs as t GEMMs of M/t rows (G_t = t · gemm(M/t, N, K)
  on the device's GEMM curve), and the copies (the same ring bytes, time C) hide behind all chunks but one:

      fused pair time = max(G_t, C + G_t / t)   (+ the RS's reduction kernel)

  which is the lower bound of a two-resource pipeline (copy engines, SMs) whose first (AG: last) chunk cannot
  overlap. The pass then pays, instead of G + C, that time; unfused collectives still add C.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeplan.sim.activations import DTYPE_BYTES, gathered_bytes_per_element
from pipeplan.sim.comm import Link, all_gather_s, all_reduce_s
from pipeplan.sim.config import Scenario
from pipeplan.sim.roofline import DeviceSpec, gemm_s, memory_bound_s

Gemm = tuple[float, float, float]  # (M, N, K) of one GEMM on one TP rank, M the token (sequence) dimension


@dataclass(frozen=True)
class Collective:
    """One TP collective of a pass: its kind, the bytes of the whole (gathered) buffer, the GEMMs that read
    its result (AG) or produce its input (RS), and whether torch's micro-pipeline pass fuses it with them."""

    kind: str  # "all-gather", "reduce-scatter" or "all-reduce"
    nbytes: float
    gemms: tuple[Gemm, ...]
    fusable: bool


def column_parallel_consumers(sc: Scenario) -> tuple[int, int]:
    """How many GEMMs read the gathered attention input and the gathered MLP input: torchtitan's LLaMA has
    wq, wk, wv and w1, w3 (models/llama/model.py), Megatron's GPT one fused QKV and one fc1."""
    assert sc.model is not None
    return (1, 1) if sc.model.architecture == "gpt" else (3, 2)


def _dx(g: Gemm) -> Gemm:
    """The input-gradient GEMM of forward GEMM `g`: dX = dY W^T, M x N @ N x K."""
    return (g[0], g[2], g[1])


def layer_collectives(sc: Scenario, gemms: list[Gemm]) -> dict[str, list[Collective]]:
    """The TP collectives of one layer per pass ("F", "I", "W"), from its forward GEMMs (QKV, out-proj, MLP
    up, MLP down as (M, N, K), sim/layer_ops.py `_gemms`)."""
    m, tr, par = sc.model, sc.training, sc.parallel
    assert m is not None
    out: dict[str, list[Collective]] = {"F": [], "I": [], "W": []}
    if par.tp <= 1:
        return out
    e = DTYPE_BYTES[tr.dtype]
    elements = tr.micro_batch_size * m.seq_len * m.hidden
    qkv, proj, up, down = gemms
    if not par.sequence_parallel:
        ar = e * elements
        out["F"] = [Collective("all-reduce", ar, (proj,), False), Collective("all-reduce", ar, (down,), False)]
        out["I"] = [Collective("all-reduce", ar, (_dx(qkv),), False), Collective("all-reduce", ar, (_dx(up),), False)]
        return out
    ag = gathered_bytes_per_element(sc) * elements
    rs = e * elements
    attn_in, mlp_in = column_parallel_consumers(sc)
    out["F"] = [
        Collective("all-gather", ag, (qkv,), True),
        Collective("reduce-scatter", rs, (proj,), True),
        Collective("all-gather", ag, (up,), True),
        Collective("reduce-scatter", rs, (down,), True),
    ]
    out["I"] = [
        Collective("all-gather", ag, (_dx(proj),), True),
        Collective("all-gather", ag, (_dx(down),), True),
        Collective("reduce-scatter", rs, (_dx(qkv),), attn_in == 1),
        Collective("reduce-scatter", rs, (_dx(up),), mlp_in == 1),
    ]
    if par.tp_style == "megatron":  # layers.py: backward all-gathers the saved shard again for dW
        out["W"] = [Collective("all-gather", e * elements, (), False) for _ in range(2)]
    return out


def head_collectives(sc: Scenario, head: Gemm) -> dict[str, list[Collective]]:
    """The TP collectives of the LM head ("F", "I", "W", around its GEMM `head`) and of the embedding ("EF",
    "EI"), all on the e-byte residual stream (neither is Float8: torchtitan converts only the layers' linears).

    Embedding (Megatron's VocabParallelEmbedding, torchtitan's RowwiseParallel(input_layouts=Replicate(),
    output_layouts=Shard(1))): each rank looks up its vocabulary shard and the partial sums are all-reduced, or
    with SP reduce-scattered, whose backward all-gathers dY (a lookup: nothing to fuse). LM head (a column-parallel
    linear, torchtitan's ColwiseParallel(input_layouts=Shard(1))): with SP its input is all-gathered before the
    GEMM and dX reduce-scattered after dX = dY Wᵀ; without SP the forward needs nothing and dX is all-reduced
    (copy_to_tensor_model_parallel_region's backward). Megatron re-gathers the SP input for dW, as in the layers.
    The vocabulary-parallel loss's all-reduces move 4 bytes per token (max, sum of exp, target logit): left out,
    three orders of magnitude below these."""
    m, tr, par = sc.model, sc.training, sc.parallel
    assert m is not None
    out: dict[str, list[Collective]] = {"F": [], "I": [], "W": [], "EF": [], "EI": []}
    if par.tp <= 1:
        return out
    stream = DTYPE_BYTES[tr.dtype] * tr.micro_batch_size * m.seq_len * m.hidden
    if not par.sequence_parallel:
        out["EF"] = [Collective("all-reduce", stream, (), False)]
        out["I"] = [Collective("all-reduce", stream, (_dx(head),), False)]
        return out
    out["EF"] = [Collective("reduce-scatter", stream, (), False)]
    out["EI"] = [Collective("all-gather", stream, (), False)]
    out["F"] = [Collective("all-gather", stream, (head,), True)]
    out["I"] = [Collective("reduce-scatter", stream, (_dx(head),), True)]
    if par.tp_style == "megatron":
        out["W"] = [Collective("all-gather", stream, (), False)]
    return out


def collective_s(c: Collective, t: int, link: Link) -> float:
    """Ring time of one collective on its own (sim/comm.py)."""
    return all_reduce_s(c.nbytes, t, link) if c.kind == "all-reduce" else all_gather_s(c.nbytes, t, link)


def fused_pair_s(c: Collective, t: int, link: Link, gemm_e: int, dev: DeviceSpec, out_e: int) -> float:
    """Time of a fused AG -> GEMM or GEMM -> RS: the GEMMs decomposed into t row chunks, the copies hidden
    behind all chunks but one, plus the RS's reduction of the t stacked partials."""
    decomposed = sum(t * gemm_s(mm / t, n, k, gemm_e, dev) for mm, n, k in c.gemms)
    pair = max(decomposed, collective_s(c, t, link) + decomposed / t)
    if c.kind == "reduce-scatter":
        pair += sum(memory_bound_s(out_e * mm * n * (1 + 1 / t), dev) for mm, n, _ in c.gemms)
    return pair


def pass_with_comm_s(sc: Scenario, gemm_s_total: float, collectives: list[Collective], link: Link,
                     gemm_e: int, dev: DeviceSpec) -> float:
    """A pass's GEMM time with its TP collectives, under `parallel.tp_comm_overlap`."""
    t, mode = sc.parallel.tp, sc.parallel.tp_comm_overlap
    comm = sum(collective_s(c, t, link) for c in collectives)
    if mode == "none":
        return gemm_s_total + comm
    if mode == "full":
        return max(gemm_s_total, comm)
    out_e = DTYPE_BYTES[sc.training.dtype]
    total = gemm_s_total
    for c in collectives:
        if c.fusable:
            total += fused_pair_s(c, t, link, gemm_e, dev, out_e) - sum(gemm_s(mm, n, k, gemm_e, dev)
                                                                         for mm, n, k in c.gemms)
        else:
            total += collective_s(c, t, link)
    return total
