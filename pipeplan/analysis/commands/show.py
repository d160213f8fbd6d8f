"""`pipeplan show SCENARIO`: the scenario as pipeplan resolves it — defaults filled in, the device preset
applied, costs per chunk, memory per rank from one simulated step, and whether it fits.

    pipeplan show llama3-8b-pp4-h100
    pipeplan show my.toml --set pipeline.schedule=zbv --set training.micro_batch_size=2
"""

from __future__ import annotations

import argparse

from pipeplan.analysis.commands.simulate import add_schedule_arguments, scenario_overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_schedule_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from pipeplan.analysis.console import console, fit_line, gib, step_differs
    from pipeplan.sim.config import load_scenario, resolve_scenario_path
    from pipeplan.sim.costs import build_cost_table
    from pipeplan.sim.trace import simulation_summary
    from pipeplan.solver.step import simulate_with_memory_policy

    sc = load_scenario(args.scenario, scenario_overrides(args))
    costs = build_cost_table(sc)
    result, _extra = simulate_with_memory_policy(sc, args.schedule_csv)
    summary = simulation_summary(result)
    p = sc.pipeline
    console.print(f"[bold]{escape(str(resolve_scenario_path(args.scenario)))}[/]")  # a path is never markup
    console.print(fit_line(summary))
    per_rank = "1 chunk" if p.virtual_stages == 1 else f"{p.virtual_stages} chunks"
    console.print(f"pipeline: {p.schedule}, {p.stages} stages x {per_rank} per rank = "
                  f"{sc.num_chunks} chunks, {p.microbatches} microbatches"
                  + (f", P2P buffers {p.p2p_buffers}" if p.p2p_buffers != "per-exchange" else "")
                  + (", optimizer post-validation (no end-of-step barrier)"
                     if sc.training.optimizer_post_validation else ""))
    if sc.model is not None:
        m, t, par = sc.model, sc.training, sc.parallel
        console.print(f"model: {escape(m.name)}, {m.layers} layers, hidden {m.hidden}, ffn {m.ffn_hidden}, "
                      f"heads {m.heads} (kv {m.kv_heads}), vocab {m.vocab}, seq_len {m.seq_len}")
        console.print(f"training: micro_batch_size {t.micro_batch_size}, {t.dtype}, {t.optimizer}"
                      f"{' (distributed)' if t.distributed_optimizer else ''} · parallel: tp {par.tp}, dp {par.dp}")
        dev = sc.device.resolved()
        console.print(f"device: {sc.device.preset}: " + ", ".join(f"{k} {v:g}" for k, v in dev.items()))
    mem = sc.memory
    margin_gib = mem.margin_bytes(costs.hbm_bytes) / 2**30
    console.print(f"memory: recompute {mem.recompute}, offload_activations {mem.offload_activations:g} "
                  f"({mem.activations_tier}), optimizer in {mem.optimizer}, margin {margin_gib:g} GiB"
                  + (", planned by the MILP" if mem.plan else ""))
    t = Table(title="costs per chunk (one microbatch)", header_style="bold")
    unit = "ms" if float(costs.forward_s.max()) < 1 else "s"
    scale = 1e3 if unit == "ms" else 1.0
    for col in ("chunk", "rank", f"forward ({unit})", f"backward input ({unit})", f"backward weight ({unit})",
                "activations (GiB)", "static (GiB)"):
        t.add_column(col, justify="right")
    for c in range(costs.num_chunks):
        t.add_row(str(c), str(result.schedule.stage_to_rank[c]), f"{costs.forward_s[c] * scale:.4g}",
                  f"{costs.backward_input_s[c] * scale:.4g}", f"{costs.backward_weight_s[c] * scale:.4g}",
                  gib(costs.activation_bytes[c]), gib(costs.static_bytes[c]))
    console.print(t)
    console.print(f"p2p per transfer: {costs.p2p_s * 1e3:.4g} ms")
    r = Table(title="memory per rank (one simulated step)", header_style="bold")
    for col in ("rank", "static (GiB)", "peak activations (GiB)", "peak HBM (GiB)"):
        r.add_column(col, justify="right")
    for k, (s, a, h) in enumerate(zip(summary["static_bytes"], summary["peak_activation_bytes"],
                                      summary["peak_hbm_bytes"], strict=True)):
        r.add_row(str(k), gib(s), gib(a), gib(h))
    console.print(r)
    # the step as tokens/s counts it (tails; with optimizer post-validation the longest rank span), then the
    # pipeline's makespan, over which the bubble is measured
    line = f"step {summary['step_time_s']:.6g} s"
    if step_differs(summary):
        line += f" (makespan {summary['makespan_s']:.6g} s)"
    line += f" · bubble {summary['bubble_ratio']:.1%}"
    if "tokens_per_s" in summary:
        line += f" · {summary['tokens_per_s']:,.0f} tokens/s · MFU {summary['mfu']:.1%}"
    console.print(line)
    return 0
