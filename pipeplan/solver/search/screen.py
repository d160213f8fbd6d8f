"""The analytical screen: for every candidate at once, a lower bound on its simulated step time and on its
peak HBM, from the cost model's own per-layer functions (sim.cost_model, sim.layer_ops, sim.overheads).

Both are bounds on what the event simulator reports, not estimates, so pruning on them loses nothing:

- time: the simulator runs one action at a time per rank, so its step is at least the busiest rank's work,
  which is at least the mean over ranks: m · (L · (F + I + W + recomputation per layer) + embedding + LM head)
  / PP. ZeRO-3's parameter traffic, P2P waits, bubbles and the step's tail only add to it.
- memory: every rank holds at least v chunks of floor(L / (PP·v)) layers, whose model states in HBM and
  runtime buffers are static; at its peak the busiest rank also holds `inflight_lower_bound` chunk-activations
  of at least that many layers each (the share not offloaded).

The per-layer quantities depend on (TP, micro-batch size) only, the state bytes on (DP, ZeRO, tier), so the
cost model runs once per distinct pair and numpy broadcasts the rest over the whole space.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeplan.sim.config import Scenario
from pipeplan.solver.search.space import Space

if TYPE_CHECKING:
    from pipeplan.sim.cost_model import LayerCosts
    from pipeplan.sim.layer_ops import LayerTimes

LB_SAFETY = 1.0 - 1e-9
V_SHAPED = ("zbv", "v-half", "chronos")
"""Schedules in V placement: chunk 0 and the last chunk on rank 0 (sim.schedules.v_placement)."""
"""Float sums taken in another order differ in the last bits: bounds are scaled by this to stay below."""


@dataclass(frozen=True)
class Screen:
    """Per candidate: lower bounds on step time (s) and peak HBM (bytes); the HBM limit (capacity - margin)."""

    step_lb_s: np.ndarray
    hbm_lb_bytes: np.ndarray
    hbm_limit_bytes: float


def variant(sc: Scenario, overrides: dict[str, Any]) -> Scenario:
    """`sc` with dotted keys replaced, without re-validating (the search space only makes valid values); for
    calling the cost model's functions on a candidate's sizes."""
    tables: dict[str, dict[str, Any]] = {}
    for key, value in overrides.items():
        table, leaf = key.split(".")
        tables.setdefault(table, {})[leaf] = value
    return sc.model_copy(update={t: getattr(sc, t).model_copy(update=u) for t, u in tables.items()})


def inflight_lower_bound(name: str, p: np.ndarray, v: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Chunk-activations the most loaded rank holds at once, at least, under schedule `name` (forwards done whose
    backward has not started). tests/test_search.py checks each against the built schedules' orders."""
    one = np.minimum(p, m)
    rules: dict[str, np.ndarray] = {
        "gpipe": m * v,
        "1f1b": one, "zb-h1": one, "zb-2p": one,
        "interleaved-1f1b": one * v,
        "zbv": 2 * one,
        "v-half": np.minimum(2 * m, np.where(p >= 2, 2 * ((p + 2) // 2), 2)),  # its cap (docs/schedules.md)
        "chronos": v,
    }
    return rules.get(name, np.ones_like(p))


def kept_layer_bytes(lc: LayerCosts, op_bytes: float, policy: str) -> float:
    """One layer's activation bytes kept from F to B under a recomputation policy (sim.memory.activation_arrays)."""
    return {"none": lc.activation_bytes, "full": lc.checkpoint_bytes,
            "selective": lc.activation_bytes - lc.attention_activation_bytes, "selective-op": op_bytes}[policy]


def recompute_layer_s(lt: LayerTimes, policy: str) -> float:
    """One layer's recomputation time under a policy (sim.cost_model's ChunkDetail)."""
    return {"none": 0.0, "full": lt.forward_s - lt.norm_recompute_s, "selective": lt.attention_forward_s,
            "selective-op": lt.op_recompute_s}[policy]


def screen(sc: Scenario, space: Space) -> Screen:
    """Lower bounds for every candidate of `space` (see the module docstring)."""
    from pipeplan.sim.activations import boundary_bytes
    from pipeplan.sim.comm import build_links, tp_link
    from pipeplan.sim.cost_model import (
        device_spec,
        embedding_params,
        layer_costs,
        p2p_transfer_s,
        state_bytes_per_param,
    )
    from pipeplan.sim.layer_ops import head_times, layer_times, op_checkpoint_bytes
    from pipeplan.sim.memory import GIB
    from pipeplan.sim.overheads import runtime_bytes

    assert sc.model is not None
    n = len(space)
    layers = sc.model.layers
    dev = sc.device.resolved()
    frag = 1.0 / (1.0 - sc.memory.fragmentation)
    rc_names = space.names["recompute"]

    # per (TP, micro-batch size): one layer's work and kept bytes per policy, the embedding and LM head's work
    work = np.zeros(n)  # all chunks' work per microbatch
    layer_work = np.zeros(n)
    head_work = np.zeros(n)  # final norm, LM head and loss (last chunk)
    emb_work = np.zeros(n)  # embedding (first chunk)
    kept = np.zeros(n)
    logits = np.zeros(n)  # the fp32 logits the loss keeps per microbatch (last chunk; Korthikanti 4.1)
    layer_params = np.zeros(n)
    layer_f, layer_b, hop, emb_f, emb_b = (np.zeros(n) for _ in range(5))  # for the pipeline's fill and drain
    emb_params = np.zeros(n)
    head_params = np.zeros(n)
    pair = space.tp * 100_000 + space.mbs
    for key in np.unique(pair):
        sel = pair == key
        t, b = int(key // 100_000), int(key % 100_000)
        v = variant(sc, {"parallel.tp": t, "training.micro_batch_size": b})
        spec = device_spec(v)
        link = tp_link(v, build_links(v, dev))
        lt, head, lc = layer_times(v, spec, link), head_times(v, spec, link), layer_costs(v)
        op = op_checkpoint_bytes(v)
        fixed = head.forward_s + head.backward_input_s + head.backward_weight_s + head.embedding_forward_s \
            + head.embedding_backward_s
        base = lt.forward_s + lt.backward_input_s + lt.backward_weight_s
        buffer = boundary_bytes(v) if sc.pipeline.p2p_buffers == "per-microbatch" else 0.0
        for ri, name in enumerate(rc_names):
            s = sel & (space.recompute == ri)
            layer_work[s] = base + recompute_layer_s(lt, name)
            work[s] = layers * layer_work[s] + fixed
            kept[s] = kept_layer_bytes(lc, op, name) * frag - buffer * frag / max(layers, 1)
        head_work[sel] = head.forward_s + head.backward_input_s + head.backward_weight_s
        emb_work[sel] = head.embedding_forward_s + head.embedding_backward_s
        layer_params[sel] = lc.params
        layer_f[sel] = lt.forward_s
        layer_b[sel] = lt.backward_input_s + lt.backward_weight_s
        hop[sel] = p2p_transfer_s(v, build_links(v, dev))
        emb_f[sel] = head.embedding_forward_s
        emb_b[sel] = head.embedding_backward_s
        logits[sel] = 4 * b * sc.model.seq_len * sc.model.vocab / t * frag
        for single in (True, False):
            s = sel & (((space.pp * space.v) == 1) == single)
            emb_params[s], head_params[s] = embedding_params(
                variant(v, {"pipeline.stages": 1 if single else 2, "pipeline.virtual_stages": 1}))

    # per (TP, PP, DP, ZeRO, optimizer tier): model-state bytes per parameter in HBM, the runtime's buffers
    key5 = np.stack([space.tp, space.pp, space.dp, space.zero, space.optimizer], 1)
    uniq, inv = np.unique(key5, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    per_key_param, per_key_runtime = np.zeros(len(uniq)), np.zeros(len(uniq))
    for k, (t, p, d, z, tier) in enumerate(uniq):
        v = variant(sc, {"parallel.tp": int(t), "pipeline.stages": int(p), "parallel.dp": int(d),
                         "parallel.zero": int(z), "memory.optimizer": space.names["optimizer"][tier]})
        parts = state_bytes_per_param(v)
        hbm = parts["weights"] + parts["gradients"]
        if v.memory.optimizer == "hbm":
            hbm += parts["master_weights"] + parts["optimizer"]
        per_key_param[k] = hbm
        per_key_runtime[k] = runtime_bytes(v, dev, 0.0)

    per_param, runtime = per_key_param[inv], per_key_runtime[inv]
    chunk_layers = layers // (space.pp * space.v)
    if sc.pipeline.layers_per_stage != "even":
        chunk_layers = np.zeros(n, dtype=np.int64)  # a given or balanced split can leave a chunk with none
    else:
        chunk_layers = np.maximum(chunk_layers - int(sc.pipeline.account_for_embedding)
                                  - int(sc.pipeline.account_for_loss), 0)
    rank_layers = space.v * chunk_layers  # decoder layers every rank holds, at least
    static = rank_layers * layer_params * per_param + runtime
    inflight = np.ones(n)
    v_shaped = np.zeros(n, dtype=bool)  # the first and last chunks on one rank (V placement, or one rank)
    no_split = np.zeros(n, dtype=bool)  # schedules whose backward is one B action
    for si, name in enumerate(space.names["schedule"]):
        s = space.schedule == si
        inflight[s] = inflight_lower_bound(name, space.pp[s], space.v[s], space.m[s])
        v_shaped[s] = name in V_SHAPED
        no_split[s] = name in ("gpipe", "1f1b", "interleaved-1f1b")
    v_shaped |= space.pp == 1
    held = 1.0 - space.offload
    act = inflight * chunk_layers * np.maximum(kept, 0.0) * held
    # the rank of the last chunk also holds the LM head's states and, for a microbatch in flight, its logits
    last_rank = static + head_params * per_param + np.where(v_shaped, emb_params * per_param, 0.0) \
        + held * (logits + chunk_layers * np.maximum(kept, 0.0))
    hbm_lb = np.maximum(static + act, last_rank)
    hbm = dev["hbm_gib"] * GIB - sc.memory.margin_bytes(dev["hbm_gib"] * GIB)
    # time: the mean rank's work, and the work of the ranks holding the LM head and the embedding
    per_rank = rank_layers * layer_work
    step_lb = space.m * np.maximum.reduce([
        work / space.pp,
        per_rank + head_work + np.where(v_shaped, emb_work, 0.0),
        per_rank + emb_work,
    ])
    # offloaded activations leave over the host link one copy at a time per rank (sim.engine's copy stream)
    step_lb = np.maximum(step_lb, space.m * rank_layers * np.maximum(kept, 0.0) * space.offload
                         / (dev["host_link_gbps"] * 1e9))
    if not sc.training.optimizer_post_validation:
        # the rank holding chunk p-1 starts once microbatch 0 has gone forward through chunks 0..p-2; without
        # a split backward (gpipe, 1f1b at v = 1) the backward of its last microbatch then goes back through them
        fill = emb_f + (space.pp - 1) * (chunk_layers * layer_f + hop)
        drain = np.where(no_split & (space.v == 1), emb_b + (space.pp - 1) * (chunk_layers * layer_b + hop), 0.0)
        step_lb = np.maximum(step_lb, fill + space.m * per_rank + drain)
    return Screen(step_lb_s=step_lb * LB_SAFETY, hbm_lb_bytes=hbm_lb * LB_SAFETY, hbm_limit_bytes=hbm)
