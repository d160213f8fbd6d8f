"""Search speed: the analytical screen per candidate (vectorised, whole space at once) and the whole answer
(screen + branch and bound over simulations) for one question per row of --questions."""

from __future__ import annotations

import argparse
import time
import tomllib
from pathlib import Path

import pandas as pd

QUESTIONS = {
    "8b-h100": ("llama3-8b-pp4-h100", {}, 16, 64),
    "70b-a100": ("llama2-70b-48l-pp8-tp8-a100", {"model.layers": 80}, 64, 1024),
    "tiny": ("tiny-cpu", {}, 8, 32),
}
"""name -> (scenario, overrides, GPUs, global batch). 70b-a100 is issue #42's question (Llama-2-70B shape, seq
4,096, 64 A100-80GB, batch 1,024)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--questions", default="tiny,8b-h100",
                        help=f"comma list of {', '.join(QUESTIONS)} (default: tiny,8b-h100)")
    parser.add_argument("--screen-only", action="store_true", help="time the screen alone (no simulation)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes for the simulations (default 1)")


def run(args: argparse.Namespace, out_dir: Path) -> str:
    from pipeplan.common.io import atomic_write_text
    from pipeplan.sim.config import parse_scenario, resolve_scenario_path, set_dotted
    from pipeplan.sim.errors import PipeplanError
    from pipeplan.solver.search.run import search, winner
    from pipeplan.solver.search.screen import screen
    from pipeplan.solver.search.space import build_space

    rows = []
    for name in [q.strip() for q in args.questions.split(",") if q.strip()]:
        if name not in QUESTIONS:
            raise PipeplanError(f"--questions {name!r}: allowed: {', '.join(QUESTIONS)}")
        scenario, overrides, gpus, batch = QUESTIONS[name]
        path = resolve_scenario_path(scenario)
        raw = tomllib.loads(path.read_text())
        for k, v in overrides.items():
            set_dotted(raw, k, v)
        sc = parse_scenario(raw, str(path), path.parent)
        t0 = time.perf_counter()
        space = build_space(sc, gpus, batch)
        t1 = time.perf_counter()
        screen(sc, space)
        t2 = time.perf_counter()
        row = {"question": name, "gpus": gpus, "global_batch": batch, "candidates": len(space),
               "space_s": t1 - t0, "screen_s": t2 - t1, "screen_us_per_candidate": 1e6 * (t2 - t1) / len(space)}
        if not args.screen_only:
            t3 = time.perf_counter()
            result = search(raw, str(path), str(path.parent), sc, space, jobs=args.jobs)
            best = winner(result)
            row |= {"search_wall_s": time.perf_counter() - t3 + (t2 - t0), "simulated": len(result.rows),
                    "winner_tokens_per_s_per_gpu": None if best is None else best["tokens_per_s_per_gpu"],
                    "jobs": args.jobs}
        rows.append(row)
    df = pd.DataFrame(rows)
    atomic_write_text(out_dir / "bench_search.csv", df.to_csv(index=False))
    return "; ".join(f"{r['question']}: {r['candidates']:,} candidates, screen {r['screen_us_per_candidate']:.1f} "
                     f"us/candidate" + (f", answer in {r['search_wall_s']:.1f} s" if "search_wall_s" in r else "")
                     for r in rows)
