"""The Triton kernel (lcp/gpu.py, lcp/gpu_kernel.py) against brute force, run by Triton's interpreter on CPU
tensors (TRITON_INTERPRET=1), so its answers are known before it meets a GPU; skipped without triton.

Small inputs: the interpreter runs each program's vectors through numpy, ~1e4 times slower than a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeplan.lcp import LCPError, LCPIndex
from tests.test_lcp_index import DTYPES, brute_force, random_case, torch_brute_force

pytest.importorskip("triton")
# Triton decides at decoration time whether a function is interpreted, its own library's (tl.sort's) at
# its import: the cases below run in a fresh process started with TRITON_INTERPRET=1 by the first test
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.usefixtures("one_torch_thread")
in_interpreter = pytest.mark.skipif(not INTERPRETED, reason="run by test_cases_in_the_interpreter")


@pytest.mark.skipif(INTERPRETED, reason="this is the process it starts")
def test_cases_in_the_interpreter():
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-x", str(Path(__file__).resolve())]
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    passed = [line for line in run.stdout.splitlines() if line.startswith("PASSED ")]
    assert len(passed) >= 15 and "FAILED" not in run.stdout, run.stdout[-2000:]  # every interpreted case ran


def triton_index(rows, lengths=None):
    index = LCPIndex.build(rows, lengths)
    index.engine = "triton"
    return index


def check(index, rows, lengths, queries, qls, k):
    want = torch_brute_force(rows, lengths, queries, qls, k)
    got = index.topk(queries, k, qls)
    assert torch.equal(got.lcps, want[1]), (got.lcps, want[1])
    assert torch.equal(got.ids, want[0]), (got.ids, want[0])


@in_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_variable_lengths(dtype):
    g = torch.Generator().manual_seed(3)
    rows, lengths, queries, qls = random_case(g, 300, 7, 3, dtype=dtype, variable=True, batch=2)
    index = triton_index(rows, lengths)
    for k in (1, 5, 40):
        check(index, rows, lengths, queries, qls, k)


@in_interpreter
@pytest.mark.parametrize(("k", "batch"), [(1, 3), (3, 3), (100, 2), (1024, 1)])
def test_tie_ranges_through_every_tree_level(k, batch):
    """A two-letter alphabet over 5,000 rows: S_{d*} spans whole nodes of every level (offsets and ids) and
    partial blocks on both sides of S_{d*+1}, wider than the kernel's direct read (k)."""
    g = torch.Generator().manual_seed(11)
    rows, lengths, queries, qls = random_case(g, 5000, 12, 2, batch=batch)
    check(triton_index(rows), rows, lengths, queries, qls, k)


@in_interpreter
def test_identical_rows_k_past_n_and_short_queries():
    rows = torch.full((150, 4), 7, dtype=torch.uint8)
    lengths = torch.full((150,), 4)
    index = triton_index(rows)
    queries = torch.tensor([[7, 7, 7, 7], [7, 1, 0, 0], [9, 9, 9, 9]], dtype=torch.uint8)
    for qls, ks in ((torch.tensor([4, 2, 4]), (1, 160)), (torch.tensor([0, 1, 3]), (150,))):
        for k in ks:
            check(index, rows, lengths, queries, qls, k)


@in_interpreter
def test_matches_pure_python_brute_force_and_1d():
    g = torch.Generator().manual_seed(5)
    rows, lengths, queries, qls = random_case(g, 90, 5, 4, variable=True, batch=2, query_len=8)
    index = triton_index(rows, lengths)
    want_ids, want_lcps = brute_force(rows.tolist(), lengths.tolist(), queries.tolist(), qls.tolist(), 9)
    got = index.topk(queries, 9, qls)
    assert torch.equal(got.ids, want_ids) and torch.equal(got.lcps, want_lcps)
    one = index.topk(queries[0], 9, int(qls[0]))
    assert torch.equal(one.ids, want_ids[0])


@in_interpreter
def test_k_past_the_kernel_takes_the_torch_ops_and_engine_choice():
    g = torch.Generator().manual_seed(2)
    rows, lengths, queries, qls = random_case(g, 1500, 6, 2, batch=1)
    index = triton_index(rows)
    assert index.engine == "triton"
    check(index, rows, lengths, queries, qls, 1100)  # > 1024: the torch ops answer
    with pytest.raises(LCPError, match="engine must be"):
        index.engine = "cuda"


@in_interpreter
def test_one_launch_per_batch(monkeypatch):
    """O(1) launches: a batch of any size is one kernel launch (the grid: one program per query)."""
    from pipeplan.lcp import gpu

    grids = []
    real = gpu._kernel

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            grids.append(grid)
            return self.kernel[grid]

    monkeypatch.setattr(gpu, "_kernel", lambda interpret: Spy(real(interpret)))
    g = torch.Generator().manual_seed(9)
    rows, lengths, queries, qls = random_case(g, 200, 6, 3, batch=7)
    index = triton_index(rows)
    for b in (1, 7):
        grids.clear()
        check(index, rows, lengths, queries[:b], qls[:b], 4)
        assert grids == [(b,)]


@pytest.mark.skipif(INTERPRETED, reason="compiles the kernel, which the interpreter does not")
@pytest.mark.parametrize(("kb", "has_lens"), [(16, True), (1024, False)])
def test_kernel_compiles_for_sm90_without_a_gpu(kb, has_lens):
    """The kernel is valid Triton, not only interpretable: compiled ahead of time to a cubin for an H100
    (sm_90) by Triton's own compiler and bundled ptxas, no GPU needed (skipped where ptxas is missing)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pipeplan.lcp import gpu_kernel

    ptrs = ["cols:i64", "lens:u8", "ids:i32", "lev1:u8", "lev2:u8", "lev3:i16", "lev4:i16", "id_rows:i32",
            "id_starts:i64", "qws:i64", "qlens:i64", "scratch:i64", "out_lcps:i64", "out_ids:i64"]  # fmt: skip
    sig = {name: f"*{t}" for name, t in (p.split(":") for p in ptrs)}
    sig |= dict.fromkeys(("n", "W", "L", "k", "kk"), "i64")
    const = {"T": 8, "bits": 8, "HAS_LENS": has_lens, "KB": kb}
    sig |= dict.fromkeys(const, "constexpr")
    try:
        compiled = triton.compile(ASTSource(gpu_kernel.topk_kernel, sig, const), target=GPUTarget("cuda", 90, 32))
    except Exception as exc:  # no ptxas here: nothing to learn
        if "ptxas" in str(exc).lower():
            pytest.skip(f"no ptxas: {str(exc)[:80]}")
        raise
    assert "cubin" in compiled.asm and len(compiled.asm["cubin"]) > 1000


@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs CUDA (compiled kernel)")
@pytest.mark.parametrize("variable", [False, True])
def test_cuda_kernel_matches_the_cpu_index(variable):
    """On a GPU the compiled kernel answers as the CPU index does: random bytes and a two-letter alphabet
    (tie ranges through the tree), k from 1 to 1024 and past N, one launch per batch."""
    g = torch.Generator().manual_seed(17)
    for n, alphabet in ((20_000, 256), (20_000, 2), (300, 3)):
        rows, lengths, queries, qls = random_case(g, n, 24, alphabet, variable=variable, batch=257)
        cpu = LCPIndex.build(rows, lengths if variable else None)
        gpu_index = cpu.to("cuda")
        assert gpu_index.engine == "triton"
        for k in (1, 10, 100, 1024):
            want = cpu.topk(queries, k, qls)
            got = gpu_index.topk(queries.cuda(), k, qls.cuda())
            assert torch.equal(got.ids.cpu(), want.ids) and torch.equal(got.lcps.cpu(), want.lcps), (n, alphabet, k)
