"""Benchmark sweep: build time, per-query latency, throughput, memory and energy of every method over N.

Data: N random byte rows of `length` tokens (seeded). Queries: a random row's first r tokens (r uniform
in [0, L]) followed by random tokens, so the answers span every LCP. For each N and method:

* build_s — wall time of `build` (packing only, for the scan and pairwise baselines);
* p50_ms / p95_ms — per-query latency = (time of one batched `topk` call) / batch, over `repeats` calls
  (process CPU time on the CPU, so that other jobs on a shared machine do not count; wall time on CUDA;
  with `reuse_out` the index's timed calls write into one result tensor pair, topk's out=);
* queries_per_s — batch / median call time; index_bytes — what the method holds (pairwise: plus the
  [batch × N] matrix it materialises, int16); joules_per_query — from NVML / RAPL counters, else empty;
* bytes_per_query — the bytes a query touches (a model: lcp/touched.py; index, numpy and scan only) and
  bandwidth_share — bytes_per_query / p50 latency / the read bandwidth measured here (lcp/bandwidth.py).

Methods: the index (its compiled kernel on CPU when numba is installed, else its torch ops), the numpy
sorted baseline, marisa-trie (optional; timed on `marisa_batch`
queries: one Python walk each), the full scan, the paper's trie and pairwise materialisation.
`PRESETS["paper"]` is the paper's setting (arXiv 2602.04936): 20M rows of 256 16-bit tokens, top-1.
The memory a sweep needs is checked against the memory available before any row is generated.

The full scan does O(N) work per query, so it is timed on the first `scan_batch` queries (the CSV's batch
column says how many). Pairwise materialises the [batch × N] LCP matrix of the whole batch, or refuses
when it exceeds the memory budget: such a row has the bytes it needed and no timings. Every method's
answers on the scan's queries are checked against the scan, so only exact results are reported.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from pipeplan.lcp import touched
from pipeplan.lcp.bandwidth import measure_bandwidth
from pipeplan.lcp.baselines import FullScan, Pairwise, memory_budget_bytes, pairwise_bytes
from pipeplan.lcp.bytes_baselines import MarisaTrie, NumpyLoop, NumpySorted
from pipeplan.lcp.energy import EnergyMeter, open_meter
from pipeplan.lcp.errors import LCPError
from pipeplan.lcp.index import LCPIndex
from pipeplan.lcp.limits import check_fits
from pipeplan.lcp.tokens import DTYPE_NAMES, resolve_device, token_format
from pipeplan.lcp.trie import Trie

COLUMNS = [
    "method", "n", "length", "k", "batch", "build_s", "p50_ms", "p95_ms",
    "queries_per_s", "index_bytes", "joules_per_query", "bytes_per_query", "bandwidth_share",
]  # fmt: skip
METHOD_NAMES = ("index", "numpy", "numpy-loop", "marisa", "scan", "trie", "pairwise")
PRESETS: dict[str, dict[str, Any]] = {
    # arXiv 2602.04936's setting: 20M sequences of 256 16-bit tokens, top-1, p95 latency and energy
    "paper": {"ns": (20_000_000,), "length": 256, "dtype": "uint16", "k": 1, "methods": ("index", "scan"),
              "batch": 4096, "scan_batch": 4},
}  # fmt: skip


@dataclass(frozen=True)
class BenchConfig:
    """One sweep. Sizes in rows, lengths in tokens (bytes here), budgets in bytes."""

    ns: tuple[int, ...] = (10_000, 100_000)
    length: int = 32
    dtype: str = "uint8"  # token dtype of the generated rows
    rows: str = "random"  # "identical": every row equal (one tie set of N rows: the worst case)
    data: str = "uniform"  # tokens of random rows: "uniform", "zipf", "text" (docs/*.md) or a file's path
    k: int = 10
    batch: int = 512  # queries per timed call for the index, the trie and pairwise
    scan_batch: int = 8  # queries per timed call for the full scan and pairwise (O(N) each)
    repeats: int = 5  # timed calls per method and N (scan, pairwise: scan_repeats)
    scan_repeats: int = 2
    methods: tuple[str, ...] = ("index", "numpy", "scan", "trie", "pairwise")
    marisa_batch: int = 256  # queries per timed marisa call (a Python walk per query)
    trie_max_n: int = 1_000_000  # the trie holds O(N·L) nodes: skipped above this N
    pairwise_max_n: int = 30_000  # pairwise does batch × N work per call: above this N it runs only to refuse
    pairwise_budget_bytes: int | None = None  # None: half the available memory (90% free on CUDA)
    device: str = "cpu"
    seed: int = 0
    reuse_out: bool = False  # the index writes into its previous result (topk's out=), not recycled memory
    notes: list[str] = field(default_factory=list, compare=False)  # refusals and skips, filled by run

    def __post_init__(self) -> None:
        unknown = set(self.methods) - set(METHOD_NAMES)
        if unknown:
            raise LCPError(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHOD_NAMES)}")
        if not self.ns or min(self.ns) < 1:
            raise LCPError(f"ns must be positive row counts, got {self.ns}")
        if self.rows not in ("random", "identical"):
            raise LCPError(f"rows must be 'random' or 'identical', got {self.rows!r}")
        if self.data not in DATA_KINDS and not Path(self.data).is_file():
            raise LCPError(f"data must be {', '.join(DATA_KINDS)} or a readable file, got {self.data[:80]!r}")
        if self.data not in ("uniform", "zipf") and self.dtype != "uint8":
            raise LCPError(f"data {self.data[:80]!r} is read bytewise: dtype must be uint8, got {self.dtype}")
        if self.dtype not in DTYPE_NAMES:
            raise LCPError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPE_NAMES)}")
        for name in ("length", "k", "batch", "scan_batch", "repeats", "scan_repeats", "marisa_batch"):
            if getattr(self, name) < 1:
                raise LCPError(f"{name} must be >= 1, got {getattr(self, name)}")

    def bytes_needed(self) -> int:
        """Host memory the largest step needs: rows, queries, the index with its build temporaries, results.

        Per row: the tokens (L·b), the packed words twice (build), ~16 bytes of ids, adjacent LCPs and
        tree, and ~40 bytes of sort temporaries; the trie (when run) ~24 bytes per (row, token).
        """
        n, tok = max(self.ns), token_format(DTYPE_NAMES[self.dtype], self.length).bits // 8
        row = self.length * tok
        need = n * (3 * row + 64) + self.batch * (row + 48 * min(self.k, n))
        if "trie" in self.methods and n <= self.trie_max_n:
            need = max(need, n * (row + 24 * self.length))
        return need


DATA_KINDS = ("uniform", "zipf", "text")
ZIPF_SYMBOLS = 256  # zipf: tokens 0..255 (any dtype), ranked by a seeded permutation
ZIPF_EXPONENT = 1.0  # p(rank r) ∝ 1 / r: Zipf's law for word frequencies in natural text (Zipf 1949)


def text_bytes(data: str) -> np.ndarray:
    """The bytes `data` names: "text" is this project's docs (docs/*.md and README.md: real English and
    code, ~0.5 MB), anything else a file's path."""
    if data != "text":
        return np.fromfile(data, dtype=np.uint8)
    root = Path(__file__).resolve().parents[2]
    files = [*sorted((root / "docs").glob("*.md")), root / "README.md"]
    return np.frombuffer(b"\n".join(f.read_bytes() for f in files if f.is_file()), dtype=np.uint8)


def make_data(
    n: int, length: int, batch: int, seed: int, dtype: str = "uint8", identical: bool = False,
    data: str = "uniform",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [n, length], queries [batch, length]), queries sharing random prefixes with random rows.

    data: "uniform" tokens over the whole dtype; "zipf" tokens of 256 symbols with Zipf-distributed
    frequencies (skewed: long shared prefixes, large tie ranges); "text" or a path: windows of L bytes
    at seeded random offsets of a real text (repeats included), queries windows at other offsets.
    identical: every row is row 0, so every query ties with all N rows at its LCP (the worst case).
    """
    fmt = token_format(DTYPE_NAMES[dtype], length)
    g = torch.Generator().manual_seed(seed)

    weights = 1.0 / torch.arange(1, ZIPF_SYMBOLS + 1, dtype=torch.float64) ** ZIPF_EXPONENT
    cdf = (weights.cumsum(0) / weights.sum()).contiguous()  # P(rank <= r)
    symbol = torch.randperm(ZIPF_SYMBOLS, generator=g) if data == "zipf" else None  # which token has which rank

    def tokens(shape: tuple[int, int]) -> torch.Tensor:
        """Uniform tokens over the whole dtype (random bytes, reinterpreted: no int64 temporary), or Zipf's."""
        if symbol is not None:  # inverse CDF of uniform floats, 2^20 rows at a time (no int64 [n, L])
            out = torch.empty(shape, dtype=fmt.dtype)
            for s in range(0, shape[0], 1 << 20):
                m = min(shape[0], s + (1 << 20)) - s
                ranks = torch.searchsorted(cdf, torch.rand((m, shape[1]), dtype=torch.float64, generator=g))
                out[s : s + m] = symbol[ranks.clamp(max=ZIPF_SYMBOLS - 1)].to(fmt.dtype)
            return out
        raw = torch.randint(0, 256, (shape[0], shape[1] * (fmt.bits // 8)), dtype=torch.uint8, generator=g)
        return raw.to(fmt.dtype) if fmt.bits == 8 else raw.view(fmt.dtype)

    if data not in ("uniform", "zipf"):
        text = text_bytes(data)
        if len(text) < length:
            raise LCPError(f"data {data[:80]!r} has {len(text)} bytes, fewer than --length {length}")
        at = torch.randint(0, len(text) - length + 1, (n + batch,), generator=g).numpy()
        windows = np.lib.stride_tricks.sliding_window_view(text, length)  # a view: no copy of the text
        return torch.from_numpy(windows[at[:n]]), torch.from_numpy(windows[at[n:]])
    rows = tokens((n, length))
    if identical:
        rows = rows[:1].expand(n, length).contiguous()
    src = torch.randint(0, n, (batch,), generator=g)
    keep = torch.randint(0, length + 1, (batch, 1), generator=g) > torch.arange(length)  # (batch, L)
    return rows, torch.where(keep, rows[src], tokens((batch, length)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> Callable[[], float]:
    """CPU time of this process on the CPU (what the work cost, even when other jobs share the cores);
    wall time around synchronised calls on CUDA."""
    return time.process_time if device.type == "cpu" else time.perf_counter


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    now = clock(device)
    _sync(device)
    t0 = now()
    out = fn()
    _sync(device)
    return out, now() - t0


def _measure(
    method: Any,
    queries: torch.Tensor,
    k: int,
    repeats: int,
    device: torch.device,
    meter: EnergyMeter | None,
    reuse_out: bool = False,
) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, float | None]]:
    """Time `repeats` batched calls (after one warm-up call); per-query figures. reuse_out (the index):
    every timed call writes into the result of an untimed first full call (topk's out=)."""
    if not isinstance(method, Pairwise):
        method.topk(queries[: min(16, len(queries))], k)  # warm-up: allocator, lazy init
    call = functools.partial(method.topk, queries, k)
    if reuse_out:
        call = functools.partial(call, out=method.topk(queries, k))
    times = []
    e0 = meter.joules() if meter else None
    for _ in range(repeats):
        out, dt = _timed(call, device)
        times.append(dt)
    joules = (meter.joules() - e0) / (repeats * len(queries)) if meter and e0 is not None else None
    per_query_ms = np.array(times) * 1e3 / len(queries)
    return out, {
        "p50_ms": float(np.percentile(per_query_ms, 50)),
        "p95_ms": float(np.percentile(per_query_ms, 95)),
        "queries_per_s": len(queries) / float(np.median(times)),
        "joules_per_query": joules,
    }


def _build(name: str, data: torch.Tensor, device: torch.device, k: int, budget: int) -> Any:
    if name == "index":
        return LCPIndex.build(data, device=device)
    if name == "numpy":
        return NumpySorted.build(data.cpu())
    if name == "numpy-loop":
        return NumpyLoop.build(data.cpu())
    if name == "marisa":
        return MarisaTrie.build(data.cpu())
    if name == "scan":
        return FullScan.build(data, device=device)
    if name == "trie":
        return Trie.build(data, device=device, k_max=k)
    return Pairwise.build(data, device=device, budget_bytes=budget)


def _check(name: str, got: Any, ref: Any) -> None:
    m = ref.ids.shape[0]
    if not (torch.equal(got.ids[:m].cpu(), ref.ids.cpu()) and torch.equal(got.lcps[:m].cpu(), ref.lcps.cpu())):
        raise RuntimeError(f"{name} disagrees with the full scan: the benchmark stops rather than report it")


def run_bench(cfg: BenchConfig, progress: Callable[[int, int, str], None] | None = None) -> pd.DataFrame:
    """Run the sweep; one row per (N, method) that ran or was refused.

    `progress(done, total, what)` is called before each (N, method) step and once more when all are done.
    """
    device = resolve_device(cfg.device, torch.device("cpu"))
    check_fits(f"--n {max(cfg.ns)} × --length {cfg.length} ({cfg.dtype}) with --batch {cfg.batch}", cfg.bytes_needed())
    if "marisa" in cfg.methods:
        MarisaTrie.build(torch.zeros((1, 1), dtype=torch.uint8))  # fails now, in one line, if not installed
    bandwidth = measure_bandwidth(device)
    meter = open_meter(device)
    budget = cfg.pairwise_budget_bytes or memory_budget_bytes(device)
    rows: list[dict[str, Any]] = []
    total, done = len(cfg.ns) * len(cfg.methods), 0
    for n in sorted(cfg.ns):
        data, queries = make_data(
            n, cfg.length, cfg.batch, cfg.seed, cfg.dtype, cfg.rows == "identical", cfg.data
        )
        data, queries = data.to(device), queries.to(device)
        small = queries[: cfg.scan_batch]
        reference, index_sizes = None, None
        order = {"scan": 0, "index": 1}  # the scan first (the reference), then the index (tie sizes)
        for name in sorted(cfg.methods, key=lambda m: order.get(m, 2)):
            base = {"method": name, "n": n, "length": cfg.length, "k": cfg.k}
            if progress:
                progress(done, total, f"N={n:,} {name}")
            done += 1
            if name == "trie" and n > cfg.trie_max_n:
                cfg.notes.append(f"trie skipped at N={n} (> trie_max_n={cfg.trie_max_n})")
                continue
            fits = pairwise_bytes(len(queries), n, cfg.length) <= budget
            if name == "pairwise" and fits and n > cfg.pairwise_max_n:  # too slow to run, not refused
                cfg.notes.append(f"pairwise skipped at N={n} (> pairwise_max_n={cfg.pairwise_max_n})")
                continue
            build = functools.partial(_build, name, data, device, cfg.k, budget)
            method, build_s = _timed(build, device)
            timed = {"scan": small, "marisa": queries[: max(cfg.marisa_batch, cfg.scan_batch)]}.get(name, queries)
            repeats = cfg.scan_repeats if name in ("scan", "pairwise") else cfg.repeats
            try:
                out, stats = _measure(method, timed, cfg.k, repeats, device, meter, cfg.reuse_out and name == "index")
            except LCPError as exc:  # pairwise: the [batch × N] matrix does not fit the budget
                cfg.notes.append(f"N={n} {name}: {exc}")
                rows.append({**base, "batch": len(timed), "index_bytes": method.bytes_needed(len(timed))})
                del method
                continue
            if name == "scan":
                reference = out
            elif reference is not None:
                _check(name, out, reference)
            held = method.nbytes + (method.bytes_needed(len(timed)) if name == "pairwise" else 0)
            moved = _bytes_per_query(name, method, timed, cfg.k, n, index_sizes)
            if name == "index":
                at = method.explain(timed, cfg.k)
                index_sizes = (at.hi - at.lo).cpu()
            share = moved / (stats["p50_ms"] * 1e-3) / (bandwidth.read_gbps * 1e9) if moved else None
            rows.append({**base, "batch": len(timed), "build_s": build_s, **stats, "index_bytes": held,
                         "bytes_per_query": moved, "bandwidth_share": share})  # fmt: skip
            del method
    if progress:
        progress(total, total, "done")
    df = pd.DataFrame(rows, columns=COLUMNS)
    df.attrs["pairwise_budget_bytes"] = budget  # the budget the refusals were judged against
    df.attrs["bandwidth"] = bandwidth
    return df


def _bytes_per_query(name: str, method: Any, queries: torch.Tensor, k: int, n: int, sizes: Any) -> float | None:
    """The bytes-touched model (lcp/touched.py) for the methods it covers, else None."""
    if name == "index":
        model = touched.kernel_bytes if method.engine == "numba" else touched.index_bytes
        return model(method, queries, k)
    if name == "scan":
        return touched.scan_bytes(n, method.fmt.words)
    if name == "numpy" and sizes is not None:
        return touched.numpy_bytes(n, method.rows.shape[1], k, sizes[: len(queries)])
    return None

