"""`pipeplan init PATH`: write a commented scenario template that simulates as written; edit it from there.

    pipeplan init my-model.toml && pipeplan simulate my-model.toml
    pipeplan init my-what-if.toml --costs        # explicit per-chunk costs instead of a model
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeplan.sim.errors import PipeplanError

MODEL_TEMPLATE = '''# A pipeplan scenario: one training step of a LLaMA-style model on a pipeline of GPUs.
# Every key is optional unless marked "required"; units are in the names (_gib, _gbps, _us).
# Check it with: pipeplan show THIS_FILE   ·   simulate it: pipeplan simulate THIS_FILE

[pipeline]
stages = 4                 # required: pipeline ranks (GPUs per pipeline, times tp below)
microbatches = 8           # required: microbatches per step per pipeline replica
schedule = "1f1b"          # {schedules}
# virtual_stages = 1       # chunks per rank; default: the schedule's ({multi_chunk})

[model]                    # Meta Llama 3 8B (config.json of meta-llama/Meta-Llama-3-8B)
name = "llama3-8b"
layers = 32                # must divide by stages x virtual_stages
hidden = 4096
ffn_hidden = 14336         # SwiGLU inner size
heads = 32
kv_heads = 8               # grouped-query attention
vocab = 128256
seq_len = 8192

[training]
micro_batch_size = 1       # sequences per microbatch
dtype = "bf16"             # {dtypes}
optimizer = "adam"         # adam | sgd
distributed_optimizer = false   # ZeRO-1: shard master weights and optimizer state over dp

[parallel]
tp = 1                     # tensor-parallel GPUs per pipeline rank
dp = 1                     # pipeline replicas (data parallel)

[device]
preset = "H100-SXM-80GB"   # {presets}
# hbm_gib = 79.6           # override any preset figure: peak_tflops, efficiency, hbm_gib, hbm_gbps, ...

[interconnect]
p2p_gbps = 50.0            # per direction between adjacent ranks (400 Gb/s InfiniBand NDR)
p2p_latency_us = 10.0
tp_gbps = 450.0            # inside a tensor-parallel group (NVLink)

[memory]
recompute = "selective-op" # {recompute}; torchtitan's 8B default
                           # (op-level selective checkpointing); with "none" rank 0 needs ~87 GiB of 80
offload_activations = 0.0  # share of saved activations moved to host memory between forward and backward
# hbm_margin_gib = 4.0     # HBM kept free, GiB; default 5% of capacity, the memory model's error (docs/memory.md)

[freeze]
cap = 0.9                  # pipeplan plan: the largest mean freeze ratio per stage
'''

COSTS_TEMPLATE = '''# A pipeplan scenario with explicit per-chunk costs,
# for schedule what-ifs without a model or for measured (pipeplan profile) costs.
# Check it with: pipeplan show THIS_FILE   ·   simulate it: pipeplan simulate THIS_FILE

[pipeline]
stages = 4                 # required: pipeline ranks
microbatches = 8           # required
schedule = "1f1b"          # {schedules}
# virtual_stages = 1       # chunks per rank; default: what the schedule takes

[costs]                    # per chunk (stages x virtual_stages): a scalar, or a list with one value per chunk
forward_s = 1.0            # required
backward_input_s = 1.0     # required; a full backward takes backward_input_s + backward_weight_s
backward_weight_s = 1.0    # required
activation_bytes = 1.0     # required: held from a chunk's forward until its backward
p2p_s = 0.0                # one activation or gradient between two ranks
static_bytes = 0.0         # weights, gradients and optimizer state of each chunk
# hbm_gib = 80.0           # capacity per rank; omitted: unbounded (nothing is checked)
'''


def template(costs: bool) -> str:
    """The template with its lists of names read from the registries (schedules, presets, policies, dtypes)."""
    from typing import get_args

    from pipeplan.sim.config import RECOMPUTE_POLICIES, TrainingConfig
    from pipeplan.sim.devices import load_presets
    from pipeplan.sim.schedules import SCHEDULES, schedule_names

    chunks: dict[int, list[str]] = {}
    for name in schedule_names():
        if SCHEDULES[name].virtual_stages > 1:
            chunks.setdefault(SCHEDULES[name].virtual_stages, []).append(name)
    names = {
        "schedules": " | ".join(schedule_names()),
        "multi_chunk": "; ".join(f"{', '.join(n)}: {v}" for v, n in chunks.items()) + "; others: 1",
        "dtypes": " | ".join(get_args(TrainingConfig.model_fields["dtype"].annotation)),
        "presets": " | ".join(load_presets()),
        "recompute": " | ".join(RECOMPUTE_POLICIES),
    }
    return (COSTS_TEMPLATE if costs else MODEL_TEMPLATE).format(**names)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="where to write the template (.toml); an existing file is not overwritten")
    parser.add_argument("--costs", action="store_true", help="explicit per-chunk costs instead of a model")


def run(args: argparse.Namespace) -> int:
    from pipeplan.common.io import atomic_write_text

    path = Path(args.path)
    if path.exists():
        raise PipeplanError(f"init {path}: already exists; give a new path")
    if not path.parent.is_dir():
        raise PipeplanError(f"init {path}: folder {path.parent} does not exist")
    atomic_write_text(path, template(args.costs))
    print(f"wrote {path}; next: pipeplan show {path}  ·  pipeplan simulate {path}")
    return 0
