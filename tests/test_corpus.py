"""The held-out split shares no evaluation window with training (issue #44: 39 of 128 pydoc evaluation windows
occurred verbatim in the training split)."""

from __future__ import annotations

import numpy as np
import pytest

from pipeplan.runtime.corpus import heldout_windows, split, window_hashes
from pipeplan.runtime.data import TokenData, heldout_batches


def test_window_hashes_equal_for_equal_windows_only():
    data = np.frombuffer(b"abcabcabd" * 3, dtype=np.uint8)
    h = window_hashes(data, 3)
    windows = [bytes(data[i:i + 3]) for i in range(len(data) - 2)]
    for i, wi in enumerate(windows):
        for j, wj in enumerate(windows):
            assert (h[i] == h[j]) == (wi == wj)


@pytest.mark.parametrize("corpus", ["pydoc", "python"])
def test_no_heldout_evaluation_window_occurs_in_training(corpus):
    seq_len, b, count = 64, 4, 32
    train, _ = split(corpus)
    train_bytes = train.tobytes()
    batches = heldout_batches(256, seq_len, b, count, corpus=corpus)
    windows = [bytes(np.concatenate([x[r].numpy(), y[r, -1:].numpy()]).astype(np.uint8))
               for x, y in batches for r in range(b)]
    assert len(windows) == count * b and all(len(w) == seq_len + 1 for w in windows)
    assert [w for w in windows if w in train_bytes] == []  # exact substring search, not hashes
    assert len(set(windows)) == len(windows)  # and none evaluated twice


def test_the_old_split_leaked_and_the_new_one_drops_what_leaks():
    """pydoc's held-out documents hold windows that training has (repeated paragraphs): they are excluded."""
    held = heldout_windows("pydoc", 65)
    train = split("pydoc")[0].tobytes()
    n = len(held.data) - held.length + 1
    dropped = np.setdiff1d(np.arange(n), held.starts)
    assert len(held.starts) > 1000 and len(dropped) > 0
    sample = dropped[:: max(1, len(dropped) // 50)]
    leaked_or_repeated = [bytes(held.data[i:i + 65]) in train or
                          held.data[:i + 64].tobytes().find(bytes(held.data[i:i + 65])) < i for i in sample]
    assert all(leaked_or_repeated)


def test_the_training_data_is_the_training_split():
    data = TokenData("python", 256, 32, 2, seed=0)
    train = split("python")[0]
    assert len(data.corpus) == len(train)
    x, _ = data.microbatch(0, 0)
    assert bytes(x[0].numpy().astype(np.uint8)) in train.tobytes()
