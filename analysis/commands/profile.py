"""`pipeplan profile`: measure per-chunk F/I/W times, activation bytes and P2P time on this hardware and
write them as an explicit-costs scenario that `pipeplan simulate` and `pipeplan run --costs` read.

    pipeplan profile                                         # tiny-cpu as it runs (4 ranks, 1f1b)
    pipeplan profile --schedule zbv --out out/profile-v2
    pipeplan profile --validate --steps 20       # + how well it predicts plain steps of the same job
    pipeplan simulate out/profile/scenario.toml --schedule gpipe   # predict from the measured costs
"""

from __future__ import annotations

import argparse

from analysis.commands.run import JobFailed, add_launch_arguments, launch_job, overrides
from analysis.outputs import add_force_argument
from runtime.config import RunConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser)
    parser.add_argument("--steps", type=int, default=6, help="steps to measure; the first is dropped (default 6)")
    parser.add_argument("--out", default="out/profile", help="output folder (default: out/profile)")
    add_force_argument(parser)
    parser.add_argument("--validate", action="store_true",
                        help="alternate plain and profiled steps; report how well the profile predicts the plain ones")


def run(args: argparse.Namespace) -> int:
    cfg = RunConfig(scenario=args.scenario, overrides=overrides(args), schedule_csv=args.schedule_csv,
                    steps=args.steps, data="synthetic", seed=args.seed, device=args.device, timeout_s=args.timeout_s,
                    threads=args.threads, profile=True, validate=args.validate)
    try:
        profile = launch_job(cfg, args, args.out)
    except JobFailed as exc:
        print(f"pipeplan profile: {exc}; nothing was written to {args.out}")
        return exc.code
    if profile is not None:
        from analysis.console import console

        for k in ("forward_s", "backward_input_s", "backward_weight_s"):
            console.print(f"{k:>18}: " + " ".join(f"{v * 1e3:7.3f}" for v in profile[k]) + "  ms per chunk")
        console.print(f"{'activation_bytes':>18}: " + " ".join(f"{v / 2**20:7.3f}" for v in profile["activation_bytes"])
                      + "  MiB per chunk")
        console.print(f"{'p2p_s':>18}: {profile['p2p_s'] * 1e6:.1f} us (ping-pong "
                      f"{(profile['ping_pong_s'] or 0) * 1e6:.1f} us); per-action overhead "
                      f"{profile['overhead_s'] * 1e3:.3f} ms")
        if "validation" in profile:
            v = profile["validation"]
            console.print(f"validation: plain steps' makespan {v['measured_makespan_s'] * 1e3:.2f} ms, simulated "
                          f"from this profile {v['predicted_makespan_s'] * 1e3:.2f} ms "
                          f"({v['makespan_rel_error']:+.1%})")
    print(f"wrote {args.out}/: scenario.toml profile.json timelines.csv")
    return 0
