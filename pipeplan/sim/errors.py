"""User-facing errors: the CLI turns each into one line on stderr and exit code 2."""


class PipeplanError(Exception):
    """Bad input (scenario, flags, files) or an impossible request; the message names the field and the fix."""


class ScenarioError(PipeplanError):
    """A scenario file that is missing, not TOML, or fails validation."""


class ScheduleError(PipeplanError):
    """A schedule that is malformed, incomplete or cannot be generated for the given sizes."""
