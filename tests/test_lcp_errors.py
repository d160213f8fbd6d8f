"""Bad input to the LCP index raises LCPError with a message that says what is wrong — and loses nothing."""

from __future__ import annotations

import hashlib
import os
import struct

import pytest
import torch

from pipeplan.lcp import LCPError, LCPIndex
from pipeplan.lcp.baselines import FullScan, Pairwise
from pipeplan.lcp.fileformat import MAGIC, write_index_file
from pipeplan.lcp.inputs import load_rows
from pipeplan.lcp.trie import Trie

ROWS = torch.tensor([[1, 2, 3], [1, 2, 4], [9, 9, 9]], dtype=torch.uint8)

pytestmark = pytest.mark.usefixtures("one_torch_thread")



@pytest.fixture
def index():
    return LCPIndex.build(ROWS)


@pytest.fixture
def saved(tmp_path, index):
    path = tmp_path / "rows.lcp"
    index.save(path)
    return path


@pytest.mark.parametrize(
    "seqs, lengths, message",
    [
        (torch.tensor([1, 2, 3]), None, "rank 2"),
        (torch.zeros((2, 3, 4), dtype=torch.uint8), None, "rank 2"),
        (torch.zeros((2, 3)), None, "dtype torch.float32"),
        (torch.zeros((2, 3), dtype=torch.bool), None, "dtype torch.bool"),
        (torch.zeros((2, 3), dtype=torch.uint64), None, "dtype torch.uint64"),
        ("abc", None, "must be a torch.Tensor"),  # lists and numpy arrays are taken by LCPIndex (test_lcp_travel.py)
        (torch.zeros((0, 3), dtype=torch.uint8), None, "zero sequences"),
        (ROWS, torch.tensor([3, 3, 4]), r"lengths must lie in \[0, 3\]"),
        (ROWS, torch.tensor([3, -1, 0]), r"lengths must lie in \[0, 3\]"),
        (ROWS, torch.tensor([3, 3]), "1-D integer tensor of 3 entries"),
        (ROWS, torch.tensor([3.0, 3.0, 3.0]), "integer dtype"),
    ],
)
def test_bad_build_input(seqs, lengths, message):
    for method in (LCPIndex, FullScan, Trie):
        with pytest.raises(LCPError, match=message):
            method.build(seqs, lengths)


@pytest.mark.parametrize("k", [0, -3, 2.5, "10", True, None])
def test_bad_k(index, k):
    with pytest.raises(LCPError, match="k must be a positive integer"):
        index.topk(ROWS, k)


@pytest.mark.parametrize(
    "queries, query_lengths, message",
    [
        (torch.zeros((1, 2, 3), dtype=torch.uint8), None, "queries must have rank 2"),  # 1-D: one query
        (torch.zeros((2, 3), dtype=torch.float64), None, "queries has dtype torch.float64"),
        (ROWS, torch.tensor([1, 2, 9]), r"query_lengths must lie in \[0, 3\]"),
        (ROWS, torch.tensor([[1, 2, 3]]), "query_lengths must be a 1-D"),
    ],
)
def test_bad_queries(index, queries, query_lengths, message):
    with pytest.raises(LCPError, match=message):
        index.topk(queries, 2, query_lengths)


def test_index_still_answers_after_bad_queries(index):
    want = index.topk(ROWS, 2)
    with pytest.raises(LCPError):
        index.topk(torch.zeros(3), 2)
    got = index.topk(ROWS, 2)
    assert torch.equal(got.ids, want.ids) and got.ids.tolist() == [[0, 1], [1, 0], [2, 0]]


def test_roundtrip_then_every_corruption_is_caught(saved):
    good = saved.read_bytes()
    assert LCPIndex.load(saved).topk(ROWS, 1).ids.tolist() == [[0], [1], [2]]
    cases = {
        "truncated": good[:-5],
        "trailing bytes": good + b"\0",
        "payload byte flipped": good[:-3] + bytes([good[-3] ^ 1]) + good[-2:],
        "header byte flipped": good[:60] + bytes([good[60] ^ 1]) + good[61:],
        "foreign": b"\x89PNG\r\n\x1a\n" + good[8:],
        "empty": b"",
        "future version": good[:8] + struct.pack("<I", 99) + good[12:],
    }
    for what, data in cases.items():
        saved.write_bytes(data)
        with pytest.raises(LCPError) as info:
            LCPIndex.load(saved)
        assert str(saved) in str(info.value), what
        assert saved.read_bytes() == data, f"{what}: load must not modify the file"


def test_valid_checksum_but_not_an_index_is_rejected(tmp_path, index):
    path = tmp_path / "forged.lcp"
    meta = {"kind": "lcp-index", "n": 3, "length": 3, "dtype": "uint8"}
    forged = {
        "ids are not a permutation": {"words": index.words, "ids": torch.tensor([0, 0, 2], dtype=torch.int32)},
        "rows are not in sorted order": {"words": index.words.flip(0), "ids": index.ids},
        "do not match n=3": {"words": index.words[:2], "ids": index.ids},
    }
    for message, arrays in forged.items():
        write_index_file(path, meta, arrays)
        with pytest.raises(LCPError, match=f"not a valid LCP index.*{message}"):
            LCPIndex.load(path)
    write_index_file(path, {**meta, "dtype": "float32"}, {"words": index.words, "ids": index.ids})
    with pytest.raises(LCPError, match="not a valid LCP index"):
        LCPIndex.load(path)


def test_malformed_header_and_missing_file(tmp_path):
    header = b"not json"
    blob = MAGIC + struct.pack("<IIQ", 1, len(header), 0) + hashlib.sha256(header).digest() + header
    (tmp_path / "bad.lcp").write_bytes(blob)
    with pytest.raises(LCPError, match="malformed header"):
        LCPIndex.load(tmp_path / "bad.lcp")
    with pytest.raises(LCPError, match="cannot read index file"):
        LCPIndex.load(tmp_path / "missing.lcp")
    # a pickle is never unpickled: a torch.save file is just a foreign file
    torch.save({"words": torch.zeros(3)}, tmp_path / "pickle.lcp")
    with pytest.raises(LCPError, match="bad magic"):
        LCPIndex.load(tmp_path / "pickle.lcp")


def test_failed_save_keeps_the_old_file(saved, index, monkeypatch):
    before = saved.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)  # the write fails after the bytes went to the temporary file
    with pytest.raises(OSError, match="disk full"):
        LCPIndex.build(ROWS[:2]).save(saved)
    monkeypatch.undo()
    assert saved.read_bytes() == before
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]  # no temporary left behind
    assert LCPIndex.load(saved).n == 3


def test_pairwise_refuses_naming_the_bytes():
    pairwise = Pairwise.build(ROWS, budget_bytes=10)
    with pytest.raises(LCPError, match=r"needs 18 bytes .* budget is 10 bytes"):
        pairwise.topk(ROWS, 2)  # a 3×3 int16 matrix
    assert Pairwise.build(ROWS, budget_bytes=18).topk(ROWS, 1).ids.tolist() == [[0], [1], [2]]


def test_trie_limits():
    with pytest.raises(LCPError, match="k_max >= 5"):
        Trie.build(ROWS, k_max=4).topk(ROWS, 5)
    with pytest.raises(LCPError, match="tokens up to 32 bits"):
        Trie.build(ROWS.to(torch.int64))


def test_unknown_or_absent_device():
    with pytest.raises(LCPError, match="unknown device 'tpu9'"):
        LCPIndex.build(ROWS, device="tpu9")
    if not torch.cuda.is_available():
        for method in (LCPIndex, FullScan, Trie):
            with pytest.raises(LCPError, match="CUDA is not available"):
                method.build(ROWS, device="cuda")


def _sealed(meta_json: bytes, payload: bytes = b"") -> bytes:
    """An index file with a valid checksum around any header."""
    digest = hashlib.sha256(meta_json + payload).digest()
    return MAGIC + struct.pack("<IIQ", 1, len(meta_json), len(payload)) + digest + meta_json + payload


@pytest.mark.parametrize(
    "header, message",
    [
        (b'{"meta": [1, 2], "arrays": {}}', "malformed header"),
        (b"[]", "malformed header"),
        (b'{"meta": {"kind": "lcp-index", "n": Infinity, "length": 3, "dtype": "uint8"}, "arrays": {}}', "n must"),
        (b'{"meta": {"kind": "lcp-index", "n": 3.0, "length": 3, "dtype": "uint8"}, "arrays": {}}', "n must"),
        (b'{"meta": {}, "arrays": {"words": {"dtype": "int64", "shape": [1e308, 1], "offset": 0}}}', "array axis"),
        (b'{"meta": {}, "arrays": {"words": {"dtype": "int64", "shape": [4294967296, 4294967296], "offset": 0}}}',
         "runs past the payload"),
        (b'{"meta": {}, "arrays": {"words": {"dtype": "int64", "shape": [1], "offset": -8}}}', "array offset"),
        (b"[" * 100_000 + b"]" * 100_000, "header"),
        (b'{"meta": {"kind": "lcp-index", "n": 1, "length": 1, "dtype": ["uint8"]}, "arrays": {}}', "dtype"),
    ],
)
def test_forged_headers_with_valid_checksums_are_refused(tmp_path, header, message):
    path = tmp_path / "forged.lcp"
    path.write_bytes(_sealed(header))
    with pytest.raises(LCPError, match=message):
        LCPIndex.load(path)


def test_devices_and_pipes_are_never_read_whole(tmp_path):
    with pytest.raises(LCPError, match="not a regular file"):
        LCPIndex.load("/dev/zero")
    with pytest.raises(LCPError, match="not a regular file"):
        load_rows("/dev/zero")


def test_pickles_that_weights_only_refuses_are_one_line(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"seqs": ROWS, "why": os.getcwd}, path)  # a function: weights_only=True refuses it
    with pytest.raises(LCPError, match="cannot read") as info:
        load_rows(path)
    assert "\n" not in str(info.value) and len(str(info.value)) < 300


def test_meta_device_and_huge_k_are_refused_before_work(index):
    with pytest.raises(LCPError, match="device 'meta' is not supported"):
        LCPIndex.build(ROWS, device="meta")
    with pytest.raises(LCPError, match=r"k = 1000000000000 for 3 queries .* needs about"):
        index.topk(ROWS, 10**12)
