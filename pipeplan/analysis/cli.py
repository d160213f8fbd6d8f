"""The `pipeplan` command line: a thin layer that parses flags, calls one library function, writes outputs.

    pipeplan simulate [SCENARIO] [--schedule NAME | --schedule-csv FILE] [--out DIR]
    pipeplan plan [SCENARIO] [--cap X | --sweep-cap] [--out DIR]
    pipeplan capacity [SCENARIO] [--policies P,...] [--out DIR]
    pipeplan sweep SCENARIO --grid KEY=V1,V2 [--grid ...] [--jobs N] [--out DIR]
    pipeplan report DIR [--force]
    pipeplan scenarios | init PATH | show [SCENARIO] [--set KEY=VALUE]
    pipeplan run [SCENARIO] [--schedule NAME] [--steps N] [--out DIR]
    pipeplan profile [SCENARIO] [--out DIR]
    pipeplan profile [SCENARIO] --gemm [--device cpu|cuda] [--dtype bf16|fp32] [--out DIR]
    pipeplan validate [--published CSV] [--out DIR]
    pipeplan freeze-study [SCENARIO] [--caps 0,0.3,0.6,0.9] [--tokens N] [--out DIR]
    pipeplan bench sim|plan|sweep [--out DIR]
    pipeplan lcp build|query|bench ...

Every subcommand lives in `analysis/commands/<name>.py` and is registered once, in COMMANDS below.
Bad input of any kind exits with code 2 and one line on stderr (at most MAX_ERROR_CHARS); no traceback.
Set PIPEPLAN_TRACEBACK=1 to see the traceback of an unexpected error instead.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading

RUNTIME_EXTRA = "pip install -c constraints.txt -e '.[runtime]' (or pip install 'pipeplan[runtime]')"

# name -> (module relative to pipeplan.analysis, with add_arguments(parser) and run(args) -> int, one-line help).
# Only the module of the command being run is imported, so `pipeplan simulate` never pays for torch.
COMMANDS: dict[str, tuple[str, str]] = {
    "simulate": (".commands.simulate", "simulate one training step: timeline, memory, bubbles, throughput"),
    "plan": (".commands.plan", "plan per-microbatch freeze ratios (TimelyFreeze LP), verified by simulation"),
    "capacity": (".commands.capacity", "per memory policy, the deepest model that fits HBM and its speed"),
    "sweep": (".commands.sweep", "what-if grid over scenario keys: ranked, Pareto plot, heatmap; resumable"),
    "search": (".commands.search", "the fastest configuration that fits N GPUs at a fixed global batch, proven by "
               "simulation"),
    "report": (".commands.report", "one readable page (HTML + Markdown) from any pipeplan output folder"),
    "validate": (".commands.validate", "predict published measurements (papers, torchtitan) and report errors"),
    "scenarios": (".commands.scenarios", "list the shipped scenarios (usable by name in every command)"),
    "init": (".commands.init", "write a commented scenario template that simulates as written"),
    "show": (".commands.show", "print a resolved scenario: costs per chunk, memory per rank, fits"),
    "bench": (".commands.bench", "benchmarks: simulator and planner speed, CSV + figures"),
    "lcp": (".commands.lcp", "exact top-k longest-common-prefix index: build, query, bench"),
    "run": (".commands.run", "execute a verified plan with torch.distributed and measure it"),
    "profile": (".commands.profile", "measure per-chunk F/I/W times here; write an explicit-costs scenario "
                "(--gemm: fit the GEMM efficiency curve)"),
    "freeze-study": (".commands.freeze_study",
                     "train once per freeze cap on real text: loss (train, held-out) and step time per cap"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (not usage + message) and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, one_line(f"{self.prog}: error: {message}") + "\n")


MAX_ERROR_CHARS = 400
"""An error line is cut to this length: inputs echoed in messages can be megabytes long, while the longest list
of what is allowed (capacity's policies, the shipped scenarios, a published CSV's columns) must still fit."""


def one_line(message: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`message` on one line, cut to `limit` characters (the cut marked with '...')."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    from pipeplan.analysis.version import pipeplan_version

    parser.add_argument("--version", action="version", version=f"pipeplan {pipeplan_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == only:
            try:
                module = importlib.import_module(module_name, "pipeplan.analysis")
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
    """Exception types that mean bad input: reported as one line with exit code 2."""
    from pipeplan.common.io import InputError, OutputError
    from pipeplan.sim.errors import PipeplanError

    lcp_errors = sys.modules.get("pipeplan.lcp.errors")  # only raised if lcp was imported; importing it costs torch
    return (PipeplanError, OutputError, InputError, *([lcp_errors.LCPError] if lcp_errors else []))


def describe_unexpected(exc: BaseException) -> str:
    """One line for an error no check anticipated: what kind of input causes it, and no traceback."""
    if isinstance(exc, RecursionError):
        return "input nested too deeply (a TOML or JSON value inside thousands of tables or lists)"
    if isinstance(exc, MemoryError):
        return "out of memory: the input asks for more than this machine holds; choose smaller sizes"
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{where}"
    return f"unexpected {type(exc).__name__}: {exc}; please report it with the command that caused it"


def check_outputs_first(args: argparse.Namespace) -> None:
    """Refuse a bad --out before any work: an empty path, a device or link, a file where a folder goes,
    /proc, or a folder holding another command's outputs (without --force)."""
    out = getattr(args, "out", None)
    if out is None:
        return
    from pipeplan.analysis.outputs import command_name
    from pipeplan.common.io import check_file_owner, check_folder_owner, check_output_file, check_output_folder

    if getattr(args, "lcp_command", None) in ("build", "query"):
        from pipeplan.analysis.commands.lcp import output_signature

        check_file_owner(check_output_file(out), *output_signature(args.lcp_command), bool(args.force))
        return
    check_folder_owner(check_output_folder(out), command_name(args), bool(getattr(args, "force", False)))


class Terminated(BaseException):
    """SIGTERM (what `timeout` and job schedulers send) arrived: unwind like Ctrl-C, so staged outputs are
    discarded and started processes stopped, then exit 143 (128 + 15)."""


def _on_sigterm(signum: int, frame: object) -> None:
    if os.getpid() != _MAIN_PID[0]:  # a forked child (a sweep's worker): die as it would have
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise Terminated


_MAIN_PID = [0]


def lock_outputs(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """Own --out while the command runs (common.io.output_lock): a second command writing there is refused."""
    out = getattr(args, "out", None)
    if out is None:
        return contextlib.nullcontext()
    from pipeplan.common.io import output_lock

    return output_lock(out, args.command)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(only=chosen).parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        return _dispatch(args)
    _MAIN_PID[0] = os.getpid()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _dispatch(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _dispatch(args: argparse.Namespace) -> int:
    """Run the chosen command; every error becomes one line and an exit code (module docstring)."""
    prefix = f"pipeplan {args.command}: error: "
    try:
        check_outputs_first(args)
        with lock_outputs(args):
            return int(args._run(args) or 0)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "torch":
            exit_missing(args.command, exc)
        if os.environ.get("PIPEPLAN_TRACEBACK"):
            raise
        print(one_line(prefix + describe_unexpected(exc)), file=sys.stderr)
        return 2
    except user_errors() as exc:
        print(one_line(f"{prefix}{exc}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pipeplan {args.command}: interrupted; nothing was written", file=sys.stderr)
        return 130
    except Terminated:
        print(f"pipeplan {args.command}: terminated (SIGTERM); nothing was written", file=sys.stderr)
        return 143
    except Exception as exc:  # every error is one line: an unanticipated one too (PIPEPLAN_TRACEBACK=1: raise)
        if os.environ.get("PIPEPLAN_TRACEBACK"):
            raise
        print(one_line(prefix + describe_unexpected(exc)), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
