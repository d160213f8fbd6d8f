"""Pipeline P2P buffers: what a rank's sends and receives hold in HBM (`pipeline.p2p_buffers`).

Two runtimes, two lifetimes:

    per-exchange    Megatron-LM (p2p_communication.py `_communicate` allocates each receive with torch.empty;
                    schedules.py `deallocate_output_tensor` frees a sent output's data) and pipeplan's runtime
                    (runtime/p2p.py): a received activation is the stage input that the activations already
                    count, a received gradient lives while the backward runs, a sent output goes with its send.
                    Nothing here.
    per-microbatch  torch.distributed.pipelining as torchtitan ran it (torch 1963fc8, December 2024; stage.py and
                    _backward.py in the stored pytorch sources of that year):
                    - `PipelineStage._prepare_forward_infra` makes one activation receive buffer per microbatch
                      (`args_recv_info[chunk_id]`, every stage but the first) and `_prepare_backward_infra` one
                      gradient receive buffer per microbatch (`grad_recv_info[mb_index]` from
                      `_create_grad_recv_info`, every stage but the last), all with `_make_tensor_from_meta`
                      (torch.empty), once, for the whole run;
                    - `forward_one_chunk` runs the stage on the activation buffer itself
                      (`_retrieve_recv_activations`), so the stage input the activations count lives in the buffer;
                    - `forward_one_chunk` appends every stage's output to `output_chunks` (the `if self.is_last`
                      guard came with torch PR #153383, May 2025), cleared only by `clear_runtime_states` at the
                      next `step()`: each microbatch's output stays from its forward to the step's end (the
                      boundary tensor; on the last stage the bf16 logits);
                    - `stage_backward` computes the input gradient with `torch.autograd.backward` into the
                      buffer's `.grad` (the buffer is a leaf that requires grad), and `stage_backward_input`
                      assigns `inp.grad = dinput`: each input gradient stays until `clear_runtime_states` (torch
                      PR #164329, October 2025, releases it right after the send).

Per chunk c of n, with B = e·b·s·h/SP the boundary tensor on one TP rank (SP: the sequence shard torch's
SequenceParallel / RowwiseParallel(output_layouts=Shard(1)) hands on), L = e·b·s·V/t the last chunk's logits
and m microbatches:

    static           m·B·[c > 0] + m·B·[c < n - 1]   allocated before the first forward, never freed
    input            B·[c > 0]                        per microbatch in flight: not an activation any more
    output           B·[c < n - 1] + L·[c = n - 1]    per microbatch, from its F to the step's end
    input gradient   B·[c > 0]                        per microbatch, from its B/I's end to the step's end

A hop between two chunks of one rank (V schedules) is counted alike: `_prepare_forward_infra` allocates without
looking at ranks, though torch's runtime then hands the local input over directly (a small over-count there).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pipeplan.sim.activations import boundary_bytes, logits_bytes
from pipeplan.sim.config import Scenario


@dataclass(frozen=True)
class P2PBuffers:
    """Per chunk: the P2P buffers' bytes (module docstring)."""

    static_bytes: np.ndarray  # allocated once, held for the whole run
    input_bytes: np.ndarray  # per microbatch: the stage input, which lives in a static buffer
    output_bytes: np.ndarray  # per microbatch: the stage output, from its forward to the step's end
    input_grad_bytes: np.ndarray  # per microbatch: the input gradient, from its backward's end to the step's end


def p2p_buffers(sc: Scenario) -> P2PBuffers:
    """Per chunk, what `pipeline.p2p_buffers` holds (the table in the module docstring); all zero for
    "per-exchange" and for a single chunk, which neither receives nor sends."""
    n = sc.num_chunks
    zero = np.zeros(n)
    if sc.pipeline.p2p_buffers == "per-exchange" or n == 1:
        return P2PBuffers(zero, zero.copy(), zero.copy(), zero.copy())
    b = boundary_bytes(sc)
    receives_activations = np.arange(n) > 0
    receives_gradients = np.arange(n) < n - 1
    mb = sc.pipeline.microbatches
    static = mb * b * (receives_activations.astype(float) + receives_gradients)
    held = np.where(receives_activations, b, 0.0)
    output = np.where(receives_gradients, b, logits_bytes(sc))
    return P2PBuffers(static, held, output, held.copy())
