"""Lexicographic order of packed rows on the device: one stable sort on the first word, then stable LSD
passes over the remaining keys restricted to the rows that still tie (for random data: almost none).

Every pass is a stable sort starting from the original row order, so identical rows stay in id order.
"""

from __future__ import annotations

import torch


def lex_order(words: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """Permutation [N] int64 sorting rows of words [N, W] (then lengths [N]) ascending, ties by row id."""
    keys = [words[:, j] for j in range(words.shape[1])]
    if lengths is not None:
        keys.append(lengths)
    order = torch.sort(keys[0], stable=True).indices
    if len(keys) == 1 or order.numel() < 2:
        return order
    first = keys[0].index_select(0, order)
    tied = first[1:] == first[:-1]  # (N-1,) position i ties with i+1
    if not bool(tied.any()):
        return order
    in_tie = torch.zeros_like(first, dtype=torch.bool)
    in_tie[1:] |= tied
    in_tie[:-1] |= tied
    sub = in_tie.nonzero().squeeze(1)  # sorted positions that need more keys, ascending
    group = torch.cat([first.new_zeros(1), (~tied).cumsum(0)])[sub]  # tie group of each, non-decreasing
    items = order[sub]
    perm = torch.arange(sub.numel(), device=words.device)
    for key in reversed(keys[1:]):  # least significant key first
        perm = perm[torch.sort(key.index_select(0, items[perm]), stable=True).indices]
    perm = perm[torch.sort(group[perm], stable=True).indices]  # the first word's group is most significant
    order[sub] = items[perm]
    return order
