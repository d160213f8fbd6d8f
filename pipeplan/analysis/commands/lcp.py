r"""`pipeplan lcp`: exact top-k longest-common-prefix retrieval — build an index, query it, benchmark it.

    pipeplan lcp build --input rows.npy --out rows.lcp
    pipeplan lcp query rows.lcp --queries q.npy -k 10 [--out hits.csv]
    pipeplan lcp bench [--n 1e4,1e5] [--batch 512] [--out out/lcp-bench]
    pipeplan lcp bench --n 1e4,1e5,1e6,5e6,2e7 --batch 4096 --scan-batch 4 --pairwise-max-n 1e5 --threads 1 \
        --out out/lcp-20m    # the N = 20M run of docs/lcp.md
    pipeplan lcp bench --preset paper --device cuda --out out/lcp-paper   # 20M × 256 uint16 tokens, top-1

Inputs: .npy (2-D integer array), .pt (tensor or {"seqs", "lengths"}), or text (one sequence per line).
"""

from __future__ import annotations

import argparse
import io
import math
import time

from pipeplan.common.units import GIB

HELP = "exact top-k longest-common-prefix retrieval: build, query and benchmark an LCP index"


def _count(text: str) -> int:
    """'1e6' or '20_000_000' -> int."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text[:40]!r}") from None
    if not math.isfinite(value) or value != int(value) or value < 1:
        raise argparse.ArgumentTypeError(f"not a positive whole number: {text[:40]!r}")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text[:40]} is more than {MAX_COUNT:,}")
    return int(value)


def _counts(text: str) -> tuple[int, ...]:
    return tuple(_count(part) for part in text.split(",") if part.strip())


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text[:40]!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"not a positive finite number of GiB: {text[:40]!r}")
    return value


MAX_LENGTH = 1 << 16  # tokens per generated row: far beyond the paper's 256
MAX_COUNT = 1 << 40  # any row count, batch or k beyond this is a typo (and is refused before allocation)
PRESET_NAMES = ("paper",)


QUERY_HEADER = "query,rank,id,lcp\n"
"""The first line of every CSV `pipeplan lcp query --out` writes."""


def output_signature(lcp_command: str) -> tuple[bytes, str]:
    """How the file `lcp build` or `lcp query` writes at --out begins, and what it is called: an existing
    --out file that begins otherwise is not replaced without --force (common.io.check_file_owner)."""
    if lcp_command == "build":
        from pipeplan.lcp.fileformat import MAGIC

        return MAGIC, "an LCP index"
    return QUERY_HEADER.encode(), "a query CSV (query,rank,id,lcp)"


def _examples(sub: str) -> str:
    """The lines of this module's docstring for `pipeplan lcp <sub>` (with their continuation lines), as that
    subcommand's --help epilog."""
    picked: list[str] = []
    for line in (__doc__ or "").splitlines():
        if line.strip().startswith(f"pipeplan lcp {sub} ") or (picked and picked[-1].endswith("\\")):
            picked.append(("  " if line.strip().startswith("pipeplan") else "      ") + line.strip())
    return "examples:\n" + "\n".join(picked)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipeplan.analysis.outputs import add_force_argument

    sub = parser.add_subparsers(dest="lcp_command", required=True, parser_class=type(parser))
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("build", help="index the rows of a file", description="Index the rows of a file.",
                       epilog=_examples("build"), formatter_class=raw)
    p.add_argument("--input", required=True, help="rows: .npy, .pt or text (one sequence per line)")
    p.add_argument("--out", required=True, help="index file to write (atomically)")
    p.add_argument("--device", default="cpu", help="torch device to build on (default: cpu)")
    p.add_argument("--force", action="store_true", help="replace --out even if it is not an LCP index")

    p = sub.add_parser("query", help="top-k rows by LCP for each query", description="Query an index.",
                       epilog=_examples("query"), formatter_class=raw)
    p.add_argument("index", help="index file written by `pipeplan lcp build`")
    p.add_argument("--queries", required=True, help="queries: .npy, .pt or text")
    p.add_argument("-k", type=int, default=10, help="results per query (default: 10)")
    p.add_argument("--device", default="cpu", help="torch device to query on (default: cpu)")
    p.add_argument("--out", help="CSV to write (query,rank,id,lcp); default: print to stdout")
    p.add_argument("--force", action="store_true", help="replace --out even if it is not a query CSV")

    p = sub.add_parser("bench", help="latency, memory and energy vs N", description="Benchmark sweep.",
                       epilog=_examples("bench"), formatter_class=raw)
    p.add_argument("--preset", choices=sorted(PRESET_NAMES), help="a named setting; other flags override it")
    p.add_argument("--n", type=_counts, help="row counts, e.g. 1e4,1e5,2e7 (default: 1e4,1e5)")
    p.add_argument("--length", type=_count, help=f"tokens per row (default: 32; at most {MAX_LENGTH})")
    p.add_argument("--dtype", help="token dtype of the generated rows (default: uint8)")
    p.add_argument("--rows", choices=("random", "identical"), help="random rows, or all identical (worst case)")
    p.add_argument("--data", help="tokens of the rows: uniform, zipf (skewed), text (docs/*.md bytewise) or a "
                   "file read bytewise (default: uniform)")  # fmt: skip
    p.add_argument("-k", "--k", type=_count, help="results per query (default: 10)")
    p.add_argument("--batch", type=_count, help="queries per timed call (default: 512)")
    p.add_argument("--scan-batch", type=_count, help="queries per full-scan call (default: 8)")
    p.add_argument("--marisa-batch", type=_count, help="queries per marisa-trie call (default: 256)")
    p.add_argument("--repeats", type=_count, help="timed calls per method (default: 5)")
    p.add_argument("--scan-repeats", type=_count, help="timed scan/pairwise calls (default: 2)")
    p.add_argument("--methods", help="comma list of index,numpy,numpy-loop,marisa,scan,trie,pairwise "
                   "(default: all but marisa)")  # fmt: skip
    p.add_argument("--trie-max-n", type=_count, help="skip the trie above this N (default: 1e6)")
    p.add_argument("--pairwise-max-n", type=_count, help="run pairwise above this N only to refuse (default: 3e4)")
    p.add_argument("--pairwise-budget-gib", type=_gib, help="pairwise memory budget (default: half of free)")
    p.add_argument("--device", help="cpu or cuda (default: cpu)")
    p.add_argument("--threads", type=_count, help="torch and numba CPU threads, >= 1 "
                   "(default: their choice; the compiled kernel runs on one thread either way)")  # fmt: skip
    p.add_argument("--reuse-out", action="store_true", default=None,
                   help="time the index writing into the previous call's result (topk's out=): no fresh "
                   "result pages per call (default: fresh results, as a plain call)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="data seed (default: 0)")
    p.add_argument("--out", default="out/lcp-bench", help="output folder (default: out/lcp-bench)")
    add_force_argument(p)


def run(args: argparse.Namespace) -> int:
    return {"build": _build, "query": _query, "bench": _bench}[args.lcp_command](args)


def _build(args: argparse.Namespace) -> int:
    from pipeplan.lcp import LCPIndex
    from pipeplan.lcp.inputs import load_rows

    seqs, lengths = load_rows(args.input)
    t0 = time.perf_counter()
    index = LCPIndex.build(seqs, lengths, device=args.device)
    build_s = time.perf_counter() - t0
    index.save(args.out)
    raw = seqs.numel() * seqs.element_size()
    print(
        f"indexed {index.n:,} rows × {index.length} {str(seqs.dtype)[6:]} tokens in {build_s:.2f} s: "
        f"{index.nbytes:,} bytes ({index.nbytes / max(raw, 1):.2f}× the raw rows) -> {args.out}"
    )
    return 0


def _query(args: argparse.Namespace) -> int:
    from pipeplan.common.io import atomic_write_text
    from pipeplan.lcp import LCPIndex
    from pipeplan.lcp.inputs import load_rows

    index = LCPIndex.load(args.index, device=args.device)
    queries, lengths = load_rows(args.queries)
    top = index.topk(queries, args.k, lengths)
    out = io.StringIO()
    out.write(QUERY_HEADER)
    for q, (row_ids, row_lcps) in enumerate(zip(top.ids.tolist(), top.lcps.tolist(), strict=True)):
        for rank, (i, lcp) in enumerate(zip(row_ids, row_lcps, strict=True), start=1):
            if i >= 0:
                out.write(f"{q},{rank},{i},{lcp}\n")
    if args.out:
        atomic_write_text(args.out, out.getvalue())
        print(f"wrote {len(queries)} queries × top-{args.k} to {args.out}")
    else:
        print(out.getvalue(), end="")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    import torch
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from pipeplan.analysis.lcp_plots import plot_latency, plot_memory
    from pipeplan.analysis.outputs import output_folder
    from pipeplan.lcp.bench import PRESETS, BenchConfig, run_bench
    from pipeplan.lcp.engine import set_threads
    from pipeplan.lcp.errors import LCPError

    defaults = {f.name: f.default for f in dataclasses.fields(BenchConfig) if f.name != "notes"}
    chosen = {**defaults, **(PRESETS[args.preset] if args.preset else {})}
    given = {
        "ns": args.n, "length": args.length, "dtype": args.dtype, "rows": args.rows, "data": args.data, "k": args.k,
        "batch": args.batch,
        "scan_batch": args.scan_batch, "marisa_batch": args.marisa_batch, "repeats": args.repeats,
        "scan_repeats": args.scan_repeats, "trie_max_n": args.trie_max_n, "pairwise_max_n": args.pairwise_max_n,
        "device": args.device, "seed": args.seed, "reuse_out": args.reuse_out,
        "methods": tuple(m.strip() for m in args.methods.split(",") if m.strip()) if args.methods else None,
        "pairwise_budget_bytes": int(args.pairwise_budget_gib * GIB) if args.pairwise_budget_gib else None,
    }  # fmt: skip
    chosen.update({key: value for key, value in given.items() if value is not None})
    if chosen["length"] > MAX_LENGTH:
        raise LCPError(f"--length {chosen['length']} is more than {MAX_LENGTH} tokens")
    cfg = BenchConfig(**chosen)
    numba_threads = None
    if args.threads:
        torch.set_num_threads(args.threads)
        numba_threads = set_threads(args.threads)  # the kernel itself is one thread whatever this says
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}")]
    with Progress(*columns, TimeElapsedColumn()) as bar:
        task = bar.add_task("lcp bench", total=len(cfg.ns) * len(cfg.methods))
        df = run_bench(cfg, lambda done, total, what: bar.update(task, completed=done, description=what))
    budget_bytes = df.attrs["pairwise_budget_bytes"]
    with output_folder(args) as stage:
        df.to_csv(stage / "bench.csv", index=False)
        plot_latency(df, stage / "latency.png")
        plot_memory(df, stage / "memory.png", budget_bytes=budget_bytes, batch=cfg.batch, length=cfg.length)
        meta = {
            "command": "pipeplan lcp bench",
            "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "numba_threads": numba_threads,
            "pairwise_budget_bytes": budget_bytes,
            "bandwidth": dataclasses.asdict(df.attrs["bandwidth"]),
            "notes": cfg.notes,
        }
        (stage / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    bw = df.attrs["bandwidth"]
    print(df.to_string(index=False))
    print(f"measured bandwidth ({cfg.device}, {torch.get_num_threads()} threads): read {bw.read_gbps:.2f} GB/s, "
          f"copy {bw.copy_gbps:.2f} GB/s")  # fmt: skip
    for note in cfg.notes:
        print(f"note: {note}")
    print(f"wrote {args.out}/: bench.csv latency.png memory.png meta.json")
    return 0
