"""Split the decoder into pipeline chunks exactly as the scenario says (torchtitan's way: build, then prune).

The model has L layers and the pipeline p * v chunks (stages of the schedule IR); chunk s holds layers
[s L / (p v), (s + 1) L / (p v)), chunk 0 also the token embedding and the last chunk the final norm and the
LM head. The chunk is built on the meta device, pruned, then materialised on its device and initialised, so
no rank ever allocates the whole model.
"""

from __future__ import annotations

import torch

from runtime.model import ModelArgs, Transformer


def layer_range(stage: int, num_stages: int, n_layers: int) -> range:
    """Global indices of the layers chunk `stage` holds."""
    per = n_layers // num_stages
    return range(stage * per, (stage + 1) * per)


def build_chunk(args: ModelArgs, stage: int, num_stages: int, device: torch.device | str = "cpu",
                seed: int = 0) -> Transformer:
    """Chunk `stage` of `num_stages`, with the full model's parameter names and initial values."""
    if args.n_layers % num_stages:
        raise ValueError(f"{args.n_layers} layers do not split into {num_stages} chunks")
    with torch.device("meta"):
        chunk = Transformer(args)
    keep = {str(i) for i in layer_range(stage, num_stages, args.n_layers)}
    for name in list(chunk.layers):
        if name not in keep:
            del chunk.layers[name]
    if stage > 0:
        chunk.tok_embeddings = None
    if stage < num_stages - 1:
        chunk.norm = None
        chunk.output = None
    chunk.to_empty(device=device)
    chunk.init_weights(seed)
    return chunk


def build_model(args: ModelArgs, device: torch.device | str = "cpu", seed: int = 0) -> Transformer:
    """The whole model in one piece (single-process reference training)."""
    return build_chunk(args, 0, 1, device, seed)
