"""Planner errors: each is a PipeplanError, so the CLI reports it as one line and exits with code 2."""

from pipeplan.sim.errors import PipeplanError


class FreezeInputError(PipeplanError):
    """Freeze settings that contradict the costs or the rest of the scenario (w_min > w_max, ...)."""


class SolverError(PipeplanError):
    """HiGHS did not reach an optimal solution (time limit, numerical trouble, unbounded model)."""


class SolverTimeoutError(SolverError):
    """HiGHS ran into its wall-clock safety net: nothing is known about the model (neither fit nor no fit)."""


class InfeasibleError(SolverError):
    """The LP has no feasible point: the constraints contradict each other."""


class VerificationError(SolverError):
    """The simulator disagrees with the LP about the planned step: a bug in the planner, not bad input."""
