"""`pipeplan bench NAME`: speed benchmarks that write a tidy CSV and a figure; figures go into docs/benchmarks.md.

    pipeplan bench sim --sizes 4x8,8x32          # needs torch (its dry run is the reference)
    pipeplan bench plan --sizes 4x16,8x32
    pipeplan bench sweep --jobs 2
    pipeplan bench search --questions tiny,8b-h100,70b-a100 --screen-only
"""

from __future__ import annotations

import argparse
import importlib

# name -> module exposing add_arguments(parser) and run(args, out_dir) -> str (a one-line summary)
BENCHES: dict[str, tuple[str, str]] = {
    "sim": (".bench.sim", "simulator speed vs torch's dry run, interleaved-1f1b up to p=64 m=512 v=2"),
    "sweep": (".bench.sweep", "1,000 sweep configurations of the 8B scenario, parallel workers"),
    "plan": (".bench.plan", "freeze-LP build+solve time vs TimelyFreeze's scipy formulation"),
    "search": (".bench.search", "search: the screen per candidate and the whole answer, per question"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from pipeplan.analysis.outputs import add_force_argument

    sub = parser.add_subparsers(dest="bench", required=True, parser_class=type(parser), metavar="BENCH")
    for name, (module_name, help_text) in BENCHES.items():
        examples = [f"  {ln.strip()}" for ln in (__doc__ or "").splitlines()
                    if ln.strip().startswith(f"pipeplan bench {name} ")]
        p = sub.add_parser(name, help=help_text, description=help_text, epilog="\n".join(["examples:", *examples]),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--out", default=f"out/bench-{name}", help=f"output folder (default: out/bench-{name})")
        add_force_argument(p)
        module = importlib.import_module(module_name, "pipeplan.analysis")
        module.add_arguments(p)
        p.set_defaults(_bench=module.run)


def run(args: argparse.Namespace) -> int:
    from pipeplan.analysis.outputs import output_folder
    from pipeplan.common.io import MANIFEST

    with output_folder(args) as stage:
        line = args._bench(args, stage)
        written = sorted(p.name for p in stage.iterdir() if p.name != MANIFEST)
    print(line)
    print(f"wrote {args.out}/: {' '.join(written)}")
    return 0
