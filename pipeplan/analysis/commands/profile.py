"""`pipeplan profile`: measure per-chunk F/I/W times, activation bytes and P2P time on this hardware and
write them as an explicit-costs scenario that `pipeplan simulate` and `pipeplan run --costs` read.

    pipeplan profile                                         # tiny-cpu as it runs (4 ranks, 1f1b)
    pipeplan profile --schedule zbv --out out/profile-v2
    pipeplan profile --validate --steps 20       # + how well it predicts plain steps of the same job
    pipeplan simulate out/profile/scenario.toml --schedule gpipe   # predict from the measured costs
    pipeplan profile --gemm --device cpu --dtype fp32 --max-dim 512 --out out/gemm   # fit the GEMM curve
    pipeplan profile scenarios/llama3-8b-pp4-h100.toml --gemm --device cuda --dtype bf16 --out out/gemm-h100
"""

from __future__ import annotations

import argparse

from pipeplan.analysis.commands.run import JobFailed, add_launch_arguments, launch_job, overrides
from pipeplan.analysis.outputs import add_force_argument
from pipeplan.runtime.config import RunConfig

MAX_GEMM_DIM = 65536
"""--max-dim: a 65,536-cube GEMM is 5.6e14 FLOPs, minutes even on an H100; 1e9 would never end."""
MAX_REPEATS = 1000
"""--repeats: timed samples per GEMM; the median of 7 is already stable to a few per cent."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser)
    parser.add_argument("--steps", type=int, default=6, help="steps to measure; the first is dropped (default 6)")
    parser.add_argument("--out", help="output folder (default: out/profile, with --gemm out/profile-gemm)")
    add_force_argument(parser)
    parser.add_argument("--validate", action="store_true",
                        help="alternate plain and profiled steps; report how well the profile predicts the plain ones")
    gemm = parser.add_argument_group("GEMM curve (--gemm): time GEMMs here and fit sim/roofline.py's curve")
    gemm.add_argument("--gemm", action="store_true",
                      help="time the scenario's GEMMs and a size sweep, fit gemm_efficiency and hbm_gbps, write "
                           "gemm.csv, gemm.png, gemm.json and a [device] table (device.toml)")
    gemm.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="GEMM operand dtype (default bf16)")
    gemm.add_argument("--max-dim", type=int,
                      help="largest square GEMM of the sweep; the scenario's GEMMs up to as many FLOPs "
                           "(default: 16384 on CUDA, 1024 on the CPU)")
    gemm.add_argument("--peak-tflops", type=float,
                      help="peak to fit the efficiency against (default: the recognised GPU's datasheet bf16 "
                           "peak, else the best measured GEMM)")
    gemm.add_argument("--sm-count", type=int,
                      help="SMs for wave quantisation (default: the device's; CPU: 1, no quantisation)")
    gemm.add_argument("--repeats", type=int, default=7, help="timed samples per GEMM, median taken (default 7)")


def run(args: argparse.Namespace) -> int:
    if args.gemm:
        return run_gemm(args)
    args.out = args.out or "out/profile"
    cfg = RunConfig(scenario=args.scenario, overrides=overrides(args), schedule_csv=args.schedule_csv,
                    steps=args.steps, data="synthetic", seed=args.seed, device=args.device, timeout_s=args.timeout_s,
                    threads=args.threads, profile=True, validate=args.validate)
    try:
        profile = launch_job(cfg, args, args.out)
    except JobFailed as exc:
        print(f"pipeplan profile: {exc}; nothing was written to {args.out}")
        return exc.code
    if profile is not None:
        from pipeplan.analysis.console import console

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


def run_gemm(args: argparse.Namespace) -> int:
    """Time GEMMs on one device (no pipeline job), fit the curve, write the outputs, print the fit."""
    import torch

    from pipeplan.analysis.console import busy, console
    from pipeplan.analysis.gemm_outputs import write_gemm_profile
    from pipeplan.analysis.outputs import output_folder
    from pipeplan.runtime.gemm_bench import profile_gemms
    from pipeplan.runtime.train import DEFAULT_SCENARIO
    from pipeplan.scenarios import scenario_path
    from pipeplan.sim.config import load_scenario
    from pipeplan.sim.errors import PipeplanError

    args.out = args.out or "out/profile-gemm"
    if args.validate:
        raise PipeplanError("--validate: checks a pipeline profile; --gemm validates its fit itself (rms log error)")
    for flag, value in (("--peak-tflops", args.peak_tflops), ("--sm-count", args.sm_count),
                        ("--repeats", args.repeats), ("--threads", args.threads)):
        if value is not None and value <= 0:
            raise PipeplanError(f"{flag}: must be > 0 (got {value})")
    for flag, value, limit in (("--max-dim", args.max_dim, MAX_GEMM_DIM), ("--repeats", args.repeats, MAX_REPEATS)):
        if value is not None and value > limit:
            raise PipeplanError(f"{flag}: {value} is above the limit {limit:,}")
    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    if device == "cuda" and not torch.cuda.is_available():
        raise PipeplanError("--device cuda: torch sees no CUDA device here; use --device cpu")
    sc = load_scenario(args.scenario or str(scenario_path(DEFAULT_SCENARIO)), overrides(args))
    if sc.model is None:
        raise PipeplanError("profile --gemm: the scenario has explicit [costs] and no [model] to take GEMM shapes from")
    max_dim = args.max_dim if args.max_dim is not None else (16384 if device == "cuda" else 1024)
    torch.set_num_threads(args.threads)  # as one rank of `pipeplan run` computes (and no spinning on a busy box)
    with busy(f"timing GEMMs on {device} ({args.dtype})"):
        prof = profile_gemms(sc, torch.device(device), args.dtype, max_dim, args.peak_tflops, args.sm_count,
                             args.repeats)
    with output_folder(args) as folder:
        df = write_gemm_profile(prof, folder)
    f = prof.fit
    console.print(f"{len(df)} GEMMs on {prof.device_name} ({prof.dtype}), best {df.tflops.max():.3g} TFLOP/s; "
                  f"peak {f.peak_tflops:.4g} TFLOP/s from {prof.peak_source}")
    console.print(f"fit: gemm_efficiency {f.gemm_efficiency:.4f}, hbm_gbps {f.hbm_gbps:.4g}, sm_count {f.sm_count} "
                  f"({f.compute_bound} of {len(df)} compute-bound)")
    holdout = ("" if prof.holdout_rms_log_error is None else
               f"; the scenario's GEMMs from a fit to the sweep alone: {prof.holdout_rms_log_error:.3f}")
    console.print(f"rms log error {f.rms_log_error:.3f} (max {f.max_log_error:.3f}){holdout}")
    print(f"wrote {args.out}/: gemm.csv gemm.png gemm.json device.toml")
    return 0
