"""Split the decoder into pipeline chunks exactly as the simulator placed them (torchtitan's way: build, then
prune).

The model has L layers and the pipeline p * v chunks (stages of the schedule IR, in model order). How many
layers each chunk holds is not decided here: `sim.cost_model.chunk_layers` is the one placement rule (even,
uneven counts that do not divide, Megatron's embedding/loss accounting, "balanced", or the scenario's own
`pipeline.layers_per_stage`), so the runtime trains exactly the plan the simulator predicted. Chunk c holds the
next counts[c] layers; chunk 0 also the token embedding and the last chunk the final norm and the LM head.
A chunk is built on the meta device, pruned, then materialised on its device and initialised, so no rank ever
allocates the whole model.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import torch

from pipeplan.runtime.model import ModelArgs, Transformer
from pipeplan.sim.config import Scenario
from pipeplan.sim.cost_model import chunk_layers
from pipeplan.sim.errors import PipeplanError


def layer_ranges(counts: Sequence[int]) -> list[range]:
    """Global layer indices of each chunk, given its layer count: consecutive, in model order."""
    ends = list(accumulate(counts))
    return [range(end - n, end) for n, end in zip(counts, ends, strict=True)]


def scenario_layer_ranges(sc: Scenario) -> list[range]:
    """The layers of each chunk of a model-derived scenario, as the simulator placed them."""
    return layer_ranges(chunk_layers(sc))


def check_ranks_hold_parameters(ranges: Sequence[range], stage_to_rank: Sequence[int]) -> None:
    """Refuse a split that leaves a rank without parameters (only empty middle chunks): it would have nothing
    to train, and no optimizer accepts an empty parameter list. The simulator can still plan it."""
    last = len(ranges) - 1
    for rank in sorted(set(stage_to_rank)):
        chunks = [c for c, r in enumerate(stage_to_rank) if r == rank]
        if all(len(ranges[c]) == 0 and 0 < c < last for c in chunks):
            raise PipeplanError(
                f"pipeline.layers_per_stage: rank {rank} would hold only empty chunks {chunks} and no parameters; "
                "`pipeplan run` needs a layer (or the embedding or LM head) on every rank"
            )


def build_chunk(args: ModelArgs, stage: int, ranges: Sequence[range], device: torch.device | str = "cpu",
                seed: int = 0) -> Transformer:
    """Chunk `stage` of the split `ranges` (one range per chunk), with the full model's parameter names and
    initial values."""
    if [i for r in ranges for i in r] != list(range(args.n_layers)):
        raise ValueError(f"layer ranges {[(r.start, r.stop) for r in ranges]} do not cover {args.n_layers} layers "
                         "in order")
    with torch.device("meta"):
        chunk = Transformer(args)
    keep = {str(i) for i in ranges[stage]}
    for name in list(chunk.layers):
        if name not in keep:
            del chunk.layers[name]
    if stage > 0:
        chunk.tok_embeddings = None
    if stage < len(ranges) - 1:
        chunk.norm = None
        chunk.output = None
    chunk.to_empty(device=device)
    chunk.init_weights(seed)
    return chunk


def build_model(args: ModelArgs, device: torch.device | str = "cpu", seed: int = 0) -> Transformer:
    """The whole model in one piece (single-process reference training)."""
    return build_chunk(args, 0, [range(args.n_layers)], device, seed)
