"""pipeplan: plan, simulate and run pipeline-parallel training.

One namespace for the whole distribution, so that nothing installs generic top-level names. The layers, each
importing only those below it: `pipeplan.analysis` (CLI, reports) -> `pipeplan.runtime` (torch.distributed)
-> `pipeplan.solver` (HiGHS) -> `pipeplan.sim` (cost model, schedules, simulator) -> `pipeplan.common`;
`pipeplan.lcp` stands apart; `pipeplan.scenarios` holds the shipped TOML scenarios (the repository's
top-level `scenarios/` folder). Importing this package imports none of them.
"""

__all__: list[str] = []
