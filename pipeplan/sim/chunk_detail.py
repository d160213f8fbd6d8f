"""Per-chunk detail behind a cost table: layer costs, model-state parts and host tiers (what memory policies
need beyond the step's durations). Its own module so that sim/costs.py and sim/cost_model.py both import it
without importing each other."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Host tiers of a step that names no device (explicit [costs]): a model-derived step takes its preset's figures
# (sim/devices.toml). The host link is PCIe Gen4 x16, one direction: 32 GB/s (the A100 preset's host_link_gbps,
# half the datasheet's 64 GB/s bidirectional). NVMe: 3 GB/s, a round figure under the A100 preset's 3.25 GB/s
# per GPU (one ~6.5 GB/s PCIe Gen4 U.2 drive shared by two GPUs, devices.toml); neither is fitted to any case.
EXPLICIT_HOST_LINK_BPS = 32e9
EXPLICIT_NVME_BPS = 3e9


@dataclass(frozen=True)
class ChunkDetail:
    """What memory policies need beyond the step costs: per-chunk layer costs, model-state parts, host tiers."""

    layers: np.ndarray  # layers in each chunk
    layer_activation_bytes: np.ndarray  # per layer and microbatch, no recomputation
    layer_checkpoint_bytes: np.ndarray  # per layer and microbatch under full recomputation (its input)
    layer_forward_s: np.ndarray  # what recomputing a whole layer redoes (less the norms B/I already redoes)
    attention_activation_bytes: np.ndarray  # per layer: what selective recomputation drops
    attention_forward_s: np.ndarray  # per layer: what selective recomputation redoes
    state_bytes: dict[str, np.ndarray]  # per chunk: weights, gradients, master_weights, optimizer
    host_link_bps: float = EXPLICIT_HOST_LINK_BPS  # per direction, one copy engine each way
    dram_bytes: float = math.inf
    dram_bps: float = EXPLICIT_HOST_LINK_BPS  # bounded by the host link
    nvme_bytes: float = math.inf
    nvme_bps: float = EXPLICIT_NVME_BPS
    weight_stash_bytes: np.ndarray | None = None  # per chunk and microbatch: kept from I until W (split backward)
    backward_transient_bytes: np.ndarray | None = None  # per chunk: working set while B/I runs (the loss)
    step_transient_bytes: np.ndarray | None = None  # per chunk: what the optimizer step allocates while it runs
    op_checkpoint_bytes: np.ndarray | None = None  # per layer: what op-level selective checkpointing keeps
    op_recompute_s: np.ndarray | None = None  # per layer: what op-level selective checkpointing redoes
    forward_retained_bytes: np.ndarray | None = None  # per chunk and microbatch: held from F's start to the step's end
    backward_retained_bytes: np.ndarray | None = None  # per chunk and microbatch: held from B/I's end to the step's end
    # per chunk: seconds B's communication bound adds over its compute (ZeRO-3), which recomputation fills first
    backward_comm_slack_s: np.ndarray | None = None
    # per layer: the norm outputs memory.recompute_norms keeps out of layer_activation_bytes; a layer recomputed
    # whole or op-level materialises them again while its backward runs
    layer_norm_output_bytes: np.ndarray | None = None

    @property
    def recompute_working_bytes(self) -> np.ndarray:
        """Per layer: what a layer recomputed whole or op-level holds while its backward runs."""
        norms = self.layer_norm_output_bytes
        return self.layer_activation_bytes if norms is None else self.layer_activation_bytes + norms
