"""How many decoder layers each model chunk holds: even, balanced, or given.

A pipeline of p stages with v virtual stages has p*v chunks. Megatron-LM places the embedding on the first chunk
and the LM head + loss on the last; its `--account-for-embedding-in-pipeline-split` and
`--account-for-loss-in-pipeline-split` count each as one layer, so those chunks take one decoder layer fewer.

    even      slots = layers (+1 embedding, +1 loss when accounted) spread as evenly as possible; when they do
              not divide, the chunks carrying extra work (last, then first, then inwards) get the smaller count.
              126 layers over 8 x 2 chunks: fourteen chunks of 8 and two of 7.
    balanced  water-filling: each layer goes to the chunk whose time after taking it is least, so the slowest
              chunk (embedding, LM head and loss included) is as fast as it can be.
    [n, ...]  one count per chunk.
"""

from __future__ import annotations

import heapq

from pipeplan.sim.config import PipelineConfig


def heavy_first_order(chunks: int) -> list[int]:
    """Chunks in the order that should give up a layer first: last, first, second to last, second, ..."""
    order, lo, hi = [], 0, chunks - 1
    while lo <= hi:
        order.append(hi)
        if lo != hi:
            order.append(lo)
        lo, hi = lo + 1, hi - 1
    return order


def even_split(layers: int, chunks: int, embedding_slot: bool = False, loss_slot: bool = False) -> list[int]:
    """Decoder layers per chunk when layer slots (plus the accounted embedding/loss) are spread evenly."""
    slots = layers + int(embedding_slot) + int(loss_slot)
    base, extra = divmod(slots, chunks)
    counts = [base + 1] * chunks
    for c in heavy_first_order(chunks)[: chunks - extra]:
        counts[c] -= 1
    if embedding_slot:
        counts[0] -= 1
    if loss_slot:
        counts[-1] -= 1
    if min(counts) < 0:  # a chunk holding only the embedding or loss cannot give up a layer it does not have
        raise ValueError(f"cannot place {layers} layers on {chunks} chunks with embedding/loss accounted")
    return counts


def balanced_split(layers: int, layer_s: float, extra_s: list[float]) -> list[int]:
    """Minimise the slowest chunk's time n_c * layer_s + extra_s[c] (greedy water-filling is optimal here:
    identical layers, so the chunk with the least time after one more layer always takes it)."""
    counts = [0] * len(extra_s)
    heap = [(extra_s[c] + layer_s, c) for c in range(len(extra_s))]
    heapq.heapify(heap)
    for _ in range(layers):
        _, c = heapq.heappop(heap)
        counts[c] += 1
        heapq.heappush(heap, (extra_s[c] + (counts[c] + 1) * layer_s, c))
    return counts


def layers_per_chunk(p: PipelineConfig, layers: int, layer_s: float, extra_s: list[float]) -> list[int]:
    """The scenario's split; `layer_s` (one layer's F+B) and `extra_s` (per chunk) drive "balanced"."""
    chunks = p.stages * p.virtual_stages
    split = p.layers_per_stage
    if isinstance(split, list):
        return list(split)
    if split == "balanced":
        return balanced_split(layers, layer_s, extra_s)
    return even_split(layers, chunks, p.account_for_embedding, p.account_for_loss)
