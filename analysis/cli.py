"""The `pipeplan` command line: a thin layer that parses flags, calls one library function, writes outputs.

    pipeplan simulate [SCENARIO] [--schedule NAME | --schedule-csv FILE] [--out DIR]
    pipeplan plan [SCENARIO] [--cap X | --sweep-cap] [--out DIR]
    pipeplan capacity [SCENARIO] [--policies P,...] [--out DIR]
    pipeplan sweep SCENARIO --grid KEY=V1,V2 [--grid ...] [--jobs N] [--out DIR]
    pipeplan report DIR
    pipeplan scenarios | init PATH | show [SCENARIO] [--set KEY=VALUE]
    pipeplan run [SCENARIO] [--schedule NAME] [--steps N] [--out DIR]
    pipeplan profile [SCENARIO] [--out DIR]
    pipeplan validate [--published CSV] [--out DIR]
    pipeplan freeze-study [SCENARIO] --caps 0,0.3,0.6,0.9 --tokens N [--out DIR]
    pipeplan bench sim|plan|sweep [--out DIR]
    pipeplan lcp build|query|bench ...

Every subcommand lives in `analysis/commands/<name>.py` and is registered once, in COMMANDS below.
Bad input of any kind exits with code 2 and one line on stderr; no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

RUNTIME_EXTRA = "pip install -c constraints.txt -e '.[runtime]' (or pip install 'pipeplan[runtime]')"

# name -> (module with add_arguments(parser) and run(args) -> int, one-line help). Only the module of the
# command being run is imported, so `pipeplan simulate` never pays for torch.
COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("analysis.commands.simulate", "simulate one training step: timeline, memory, bubbles, throughput"),
    "plan": ("analysis.commands.plan", "plan per-microbatch freeze ratios (TimelyFreeze LP), verified by simulation"),
    "capacity": ("analysis.commands.capacity", "per memory policy, the deepest model that fits HBM and its speed"),
    "sweep": ("analysis.commands.sweep", "what-if grid over scenario keys: ranked, Pareto plot, heatmap; resumable"),
    "report": ("analysis.commands.report", "one readable page (HTML + Markdown) from any pipeplan output folder"),
    "validate": ("analysis.commands.validate", "predict published measurements (papers, torchtitan) and report errors"),
    "scenarios": ("analysis.commands.scenarios", "list the shipped scenarios (usable by name in every command)"),
    "init": ("analysis.commands.init", "write a commented scenario template that simulates as written"),
    "show": ("analysis.commands.show", "print a resolved scenario: costs per chunk, memory per rank, fits"),
    "bench": ("analysis.commands.bench", "benchmarks: simulator and planner speed, CSV + figures"),
    "lcp": ("analysis.commands.lcp", "exact top-k longest-common-prefix index: build, query, bench"),
    "run": ("analysis.commands.run", "execute a verified plan with torch.distributed and measure it"),
    "profile": ("analysis.commands.profile", "measure per-chunk F/I/W times here; write an explicit-costs scenario"),
    "freeze-study": ("analysis.commands.freeze_study",
                     "train once per freeze cap on real text: loss (train, held-out) and step time per cap"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (not usage + message) and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("pipeplan")
    except PackageNotFoundError:
        return "unknown (not installed)"


def examples(module_doc: str | None) -> str | None:
    """The command lines in a command module's docstring (indented `pipeplan ...` lines), for its --help."""
    lines: list[str] = []
    for ln in (module_doc or "").splitlines():
        if ln.strip().startswith(("pipeplan ", "# ")) or (lines and lines[-1].endswith("\\")):
            lines.append(ln.strip() if not (lines and lines[-1].endswith("\\")) else "    " + ln.strip())
    return ("examples:\n" + "\n".join(f"  {ln}" for ln in lines)) if lines else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser, with the flags of command `only` loaded; the others are listed but not imported."""
    parser = OneLineParser(prog="pipeplan", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"pipeplan {version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == only:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                exit_missing(name, exc)
            module.add_arguments(p)
            p.epilog = examples(module.__doc__)
            p.set_defaults(_run=module.run)
    return parser


def exit_missing(command: str, exc: ModuleNotFoundError) -> None:
    """A command whose optional dependency is not installed: one line naming the extra, exit 2."""
    if (exc.name or "").split(".")[0] != "torch":
        raise exc
    print(f"pipeplan {command}: error: needs torch, which is not installed; install pipeplan[runtime]: "
          f"{RUNTIME_EXTRA}", file=sys.stderr)
    sys.exit(2)


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input: reported as one line with exit code 2. LCPError counts only once
    lcp is loaded (importing the lcp package imports torch, which torch-free commands must not)."""
    from sim.errors import PipeplanError

    lcp_errors = sys.modules.get("lcp.errors")
    return (PipeplanError, lcp_errors.LCPError) if lcp_errors is not None else (PipeplanError,)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(only=chosen).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ModuleNotFoundError as exc:
        exit_missing(args.command, exc)
        raise
    except user_errors() as exc:
        print(f"pipeplan {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pipeplan {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
