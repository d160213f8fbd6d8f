"""Context parallelism (`parallel.cp`): each sequence split over cp ranks, attention exchanging K and V.

What a context-parallel rank does is what a data-parallel rank of the same scenario at seq_len / cp does, with
two differences, so the costs are built from that local scenario (`local_scenario`) and then corrected:

- Attention. Each rank's s / cp queries attend to all s keys (causal, load-balanced: Megatron-Core and torch both
  split the sequence into 2 cp chunks and give rank r chunks r and 2cp - 1 - r, so every rank does the same
  work), cp times the causal attention of an s / cp sequence: the attention core's forward and backward are
  multiplied by cp (`attention_extra_s`).
- K and V move between the cp ranks (`kv_exchange_s`), over the link of a group of cp ranks tp apart (the rank
  order of torchtitan's device mesh, [pp, dp_replicate, dp_shard, cp, tp], and of Megatron-Core's
  tp-cp-ep-dp-pp): within a node while tp x cp <= gpus_per_node.
  p2p-ring (Megatron-Core's `AttnFuncWithCPAndKVP2P`, Transformer Engine attention.py): cp - 1 steps, each
  sending the held K/V chunk to the next rank while computing attention on it; a step costs
  max(transfer, attention of one chunk). The backward passes K/V and their gradients: twice the bytes per step.
  all-gather (torch.distributed.tensor.experimental._attention at torch 1963fc8, torchtitan's Dec 2024
  benchmark: `_ContextParallelOptions.rotate_method = ALL_GATHER`, `convert_to_f32 = True`): one all-gather
  of K/V issued before the first (local) chunk and waited after it; in the backward the same all-gather, and
  the K/V gradients reduce-scattered in fp32 after the last chunk, exposed.
Everything else follows the local scenario: the sequence-proportional activations, GEMMs, element-wise work
and boundary tensors shrink by cp; the weights are shared by the cp ranks, so gradients reduce over dp x cp
and ZeRO/FSDP shards over dp x cp (torchtitan's dp_shard_cp mesh, Megatron-Core's data-parallel group with
CP), which the local scenario's dp x cp data parallelism is.
"""

from __future__ import annotations

from dataclasses import replace

from pipeplan.sim.activations import DTYPE_BYTES
from pipeplan.sim.comm import Link, Links, all_gather_s, build_links
from pipeplan.sim.config import Scenario
from pipeplan.sim.cost_model import ChunkCosts, device_spec, model_chunk_costs
from pipeplan.sim.errors import ScenarioError
from pipeplan.sim.layer_ops import FLASH_BACKWARD, attention_core_s, layer_flops
from pipeplan.sim.roofline import DeviceSpec

FP32_BYTES = 4  # torch's context_parallel upcasts the K/V gradients before reducing them (convert_to_f32)


def check_context_parallel(sc: Scenario) -> None:
    """cp > 1 needs flash attention and a sequence that splits into 2 cp equal chunks."""
    cp, m = sc.parallel.cp, sc.model
    if cp == 1 or m is None:
        return
    if sc.training.attention != "flash":
        raise ScenarioError("parallel.cp: context parallelism needs training.attention = 'flash' (ring attention "
                            "merges flash attention's partial outputs by their log-sum-exp)")
    if m.seq_len % (2 * cp):
        raise ScenarioError(f"parallel.cp: model.seq_len {m.seq_len} must divide into 2 x cp = {2 * cp} equal "
                            "chunks (load-balanced causal split); pick a cp or seq_len that divides")


def local_scenario(sc: Scenario) -> Scenario:
    """What one context-parallel rank computes: seq_len / cp, with the cp ranks as more data parallelism."""
    assert sc.model is not None
    cp = sc.parallel.cp
    model = sc.model.model_copy(update={"seq_len": sc.model.seq_len // cp})
    parallel = sc.parallel.model_copy(update={"dp": sc.parallel.dp * cp, "cp": 1})
    return sc.model_copy(update={"model": model, "parallel": parallel})


def cp_link(sc: Scenario, links: Links) -> Link:
    """The link of a context-parallel group: cp ranks tp apart."""
    return links.for_ranks([c * sc.parallel.tp for c in range(sc.parallel.cp)])


def kv_chunk_bytes(sc: Scenario) -> float:
    """K and V of one rank's s / cp tokens on one TP rank (kv heads shard over TP, at least one per rank)."""
    m, tr, t = sc.model, sc.training, sc.parallel.tp
    assert m is not None
    d = m.hidden // m.heads
    kv_heads_per_rank = max(m.kv_heads / t, 1.0)
    return 2 * DTYPE_BYTES[tr.dtype] * tr.micro_batch_size * (m.seq_len // sc.parallel.cp) * kv_heads_per_rank * d


def attention_extra_s(local: Scenario, dev: DeviceSpec, cp: int) -> tuple[float, float]:
    """(F, I) attention time one layer adds over the local scenario's: (cp - 1) x its causal s / cp core."""
    attn_f, attn_i = attention_core_s(local, dev)
    return (cp - 1) * attn_f, (cp - 1) * attn_i


def kv_exchange_s(sc: Scenario, local: Scenario, dev: DeviceSpec, links: Links) -> tuple[float, float]:
    """(F, I) exposed time of one layer's K/V exchange, per `parallel.cp_comm` (module docstring)."""
    cp = sc.parallel.cp
    link = cp_link(sc, links)
    chunk = kv_chunk_bytes(sc)
    step_f, step_i = attention_core_s(local, dev)  # one chunk's attention: the work a transfer hides behind
    if sc.parallel.cp_comm == "p2p-ring":
        hop = link.transfer_s(chunk)
        return (cp - 1) * max(0.0, hop - step_f), (cp - 1) * max(0.0, 2 * hop - step_i)
    gather = all_gather_s(cp * chunk, cp, link)
    grads = all_gather_s(cp * chunk * FP32_BYTES / DTYPE_BYTES[sc.training.dtype], cp, link)
    return max(0.0, gather - step_f), max(0.0, gather - step_i) + grads


def context_parallel_costs(sc: Scenario) -> ChunkCosts:
    """The chunk costs of a cp > 1 scenario: the local scenario's, plus per layer the attention over the other
    ranks' keys and the exposed K/V exchange, on F and I (and on the recomputed forward)."""
    check_context_parallel(sc)
    local = local_scenario(sc)
    costs = model_chunk_costs(local)
    dev = device_spec(sc)
    attn_f, attn_i = attention_extra_s(local, dev, sc.parallel.cp)
    comm_f, comm_i = kv_exchange_s(sc, local, dev, build_links(sc, sc.device.resolved()))
    layers = costs.detail.layers
    # the model FLOPs of the other ranks' keys too (MFU): (cp - 1) local attention cores, forward and backward
    assert sc.model is not None
    extra_flops = sc.parallel.tp * sc.model.layers * (sc.parallel.cp - 1) * layer_flops(local).attention_forward
    detail = replace(costs.detail,
                     layer_forward_s=costs.detail.layer_forward_s + attn_f + comm_f,
                     attention_forward_s=costs.detail.attention_forward_s + attn_f + comm_f,
                     op_recompute_s=(costs.detail.op_recompute_s + comm_f
                                     if costs.detail.op_recompute_s is not None else None))
    return replace(costs,
                   forward_s=costs.forward_s + layers * (attn_f + comm_f),
                   backward_input_s=costs.backward_input_s + layers * (attn_i + comm_i),
                   flops_per_microbatch=costs.flops_per_microbatch + extra_flops * (1 + FLASH_BACKWARD),
                   detail=detail)
