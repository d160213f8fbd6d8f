"""`pipeplan search`: the fastest configuration that fits N GPUs at a fixed global batch, proven against the
event simulator (a vectorised screen of lower bounds, then branch and bound over simulations).

    pipeplan search llama2-70b-48l-pp8-tp8-a100 --set model.layers=80 --gpus 64 --global-batch 1024
    pipeplan search path/to/config.json --gpus 64 --global-batch 1024 --device A100-80GB --seq-len 4096
    pipeplan search tiny-cpu --gpus 8,16 --global-batch 32 --top 5 --jobs 2 --out out/search-tiny
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipeplan.sim.errors import PipeplanError

DEFAULT_SEQ_LEN = 4096
"""--seq-len for a Hugging Face config, which gives no training sequence length (max_position_embeddings is the
longest the model can take, not what it is trained on: Llama-3.1 would read 131,072)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipeplan.analysis.commands.simulate import add_set_argument
    from pipeplan.analysis.outputs import add_force_argument

    parser.add_argument("model", help="scenario TOML, a shipped scenario's name, or a Hugging Face config.json")
    parser.add_argument("--gpus", required=True, help="GPU count, or a comma list to compare (e.g. 32,64,128)")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step (fixed)")
    parser.add_argument("--device", help="device preset (pipeplan/sim/devices.toml), e.g. A100-80GB")
    parser.add_argument("--seq-len", type=int, help=f"sequence length (default: the scenario's; {DEFAULT_SEQ_LEN} "
                        "for a config.json)")
    parser.add_argument("--gpus-per-node", type=int, help="GPUs per node: TP stays within one (default 8)")
    parser.add_argument("--margin", type=float, help="HBM kept free, GiB (default: memory.hbm_margin_gib)")
    parser.add_argument("--top", type=int, default=10, help="rows of the console table (default 10)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes for the simulations (default 1)")
    add_set_argument(parser)
    parser.add_argument("--out", default="out/search", help="output folder (default: out/search)")
    add_force_argument(parser)


def parse_gpus(text: str) -> list[int]:
    """`64` or `32,64,128` -> GPU counts; anything else is one line naming --gpus."""
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PipeplanError(f"--gpus {text[:40]!r}: expected a GPU count or a comma list, e.g. 64 or 32,64") from None
    if not counts or any(not 1 <= c <= 1_048_576 for c in counts):
        raise PipeplanError(f"--gpus {text[:40]!r}: each count must be 1..1048576")
    return sorted(set(counts))


def base_scenario(args: argparse.Namespace) -> tuple[dict[str, Any], str, str | None]:
    """The raw scenario every candidate starts from (file or config.json, then the flags), its name, folder."""
    import tomllib

    from pipeplan.analysis.commands.simulate import scenario_overrides
    from pipeplan.sim.config import resolve_scenario_path, set_dotted

    if args.model.endswith(".json"):
        path = Path(args.model)
        if not path.is_file():
            raise PipeplanError(f"model {args.model}: no such config.json")
        raw: dict[str, Any] = {"pipeline": {"stages": 1, "microbatches": 1},
                               "model": {"config": str(path.resolve()), "seq_len": args.seq_len or DEFAULT_SEQ_LEN}}
        source, folder = str(path), str(path.resolve().parent)
    else:
        spath = resolve_scenario_path(args.model)
        try:
            raw = tomllib.loads(spath.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise PipeplanError(f"scenario {spath}: not a readable TOML file ({str(exc)[:80]})") from None
        source, folder = str(spath), str(spath.parent)
    flags = scenario_overrides(args)
    if args.device:
        flags["device.preset"] = args.device
    if args.seq_len is not None:
        flags["model.seq_len"] = args.seq_len
    if args.gpus_per_node is not None:
        flags["parallel.gpus_per_node"] = args.gpus_per_node
    if args.margin is not None:
        flags["memory.hbm_margin_gib"] = args.margin
    flags["memory.plan"] = False  # the search chooses the memory policy itself
    for key, value in flags.items():
        set_dotted(raw, key, value)
    return raw, source, folder


def run(args: argparse.Namespace) -> int:
    import pandas as pd
    from rich.progress import Progress

    from pipeplan.analysis.console import console
    from pipeplan.analysis.outputs import output_folder
    from pipeplan.common.io import atomic_write_text
    from pipeplan.sim.config import parse_scenario
    from pipeplan.sim.limits import MAX_JOBS
    from pipeplan.solver.search.run import search
    from pipeplan.solver.search.space import build_space

    counts = parse_gpus(args.gpus)
    if not 1 <= args.global_batch <= 1_048_576:
        raise PipeplanError(f"--global-batch: {args.global_batch}; must be 1..1048576")
    if not 1 <= args.jobs <= MAX_JOBS:
        raise PipeplanError(f"--jobs: {args.jobs}; must be 1..{MAX_JOBS}")
    if args.top < 1:
        raise PipeplanError(f"--top: {args.top}; must be >= 1")
    if args.seq_len is not None and args.seq_len < 1:
        raise PipeplanError(f"--seq-len: {args.seq_len}; must be >= 1")
    if args.margin is not None and args.margin < 0:
        raise PipeplanError(f"--margin: {args.margin}; must be >= 0 GiB")
    raw, source, folder = base_scenario(args)
    args.scenario = args.model  # pipeplan.json names what was searched
    sc = parse_scenario(raw, source=source, base_dir=Path(folder) if folder else None)
    spaces = {n: build_space(sc, n, args.global_batch) for n in counts}  # bad sizes: one line, before any work
    frames, pruned_rows, summary = [], [], {"model": args.model, "global_batch": args.global_batch, "answers": []}
    with output_folder(args) as out, Progress(console=console, transient=True) as bar:
        for n, space in spaces.items():
            task = bar.add_task(f"search {n} GPUs ({len(space):,} candidates)", total=None)
            result = search(raw, source, folder, sc, space, jobs=args.jobs,
                            progress=lambda done, total, msg, t=task, n=n: bar.update(
                                t, completed=done, total=total, description=f"search {n} GPUs {msg}"))
            frames.append(result.rows)
            pruned_rows += [{"gpus": n, "reason": k, "count": v} for k, v in sorted(result.pruned.items())]
            pruned_rows.append({"gpus": n, "reason": "simulated", "count": len(result.rows)})
            summary["answers"].append({"gpus": n, "candidates": result.candidates,
                                       "screen_wall_s": result.screen_wall_s, "simulated": len(result.rows)})
        rows = pd.concat([f for f in frames if len(f)], ignore_index=True) if any(len(f) for f in frames) \
            else pd.DataFrame()
        atomic_write_text(out / "search.csv", rows.to_csv(index=False))
        atomic_write_text(out / "pruned.csv", pd.DataFrame(pruned_rows).to_csv(index=False))
        import json

        atomic_write_text(out / "search.json", json.dumps(summary, indent=2) + "\n")
    print_top(rows, args.top)
    print(f"wrote {args.out}/: search.csv pruned.csv search.json")
    return 0


def print_top(rows, top: int) -> None:
    """The fastest fitting candidates per GPU count, and a plain line when none fits."""
    from rich.table import Table

    from pipeplan.analysis.console import console

    if not len(rows):
        console.print("no candidate was simulated")
        return
    for n, group in rows.groupby("gpus", sort=True):
        ok = group[group["fits"].astype(bool)]
        if not len(ok):
            console.print(f"{n} GPUs: nothing fits (closest over by "
                          f"{group['over_capacity_bytes'].min() / 2**30:.1f} GiB)")
            continue
        table = Table(title=f"{n} GPUs, global batch {int(ok.iloc[0]['global_batch'])}: fastest that fit")
        for col in ("#", "TP", "PP", "DP", "schedule", "v", "mbs", "m", "recompute", "offload", "optimizer",
                    "ZeRO", "tokens/s/GPU", "step s", "MFU", "peak GiB", "headroom GiB"):
            table.add_column(col, justify="left" if col in ("schedule", "recompute", "optimizer") else "right")
        for k, (_, r) in enumerate(ok.head(top).iterrows(), 1):
            table.add_row(str(k), *(str(r[c]) for c in (
                "parallel.tp", "pipeline.stages", "parallel.dp", "pipeline.schedule", "pipeline.virtual_stages",
                "training.micro_batch_size", "pipeline.microbatches", "memory.recompute",
                "memory.offload_activations", "memory.optimizer", "parallel.zero")),
                f"{r['tokens_per_s_per_gpu']:,.0f}", f"{r['step_time_s']:.3g}",
                f"{r['mfu']:.1%}" if r["mfu"] == r["mfu"] else "—", f"{r['peak_hbm_gib']:.1f}",
                f"{r['headroom_gib']:.1f}")
        console.print(table)
