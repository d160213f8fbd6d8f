"""pipeplan's version, for --version and the manifest of every output folder (cheap to import)."""

from __future__ import annotations

from functools import cache
from pathlib import Path


@cache
def pipeplan_version() -> str:
    """The installed distribution's version, else pyproject.toml's (a source checkout), else 'unknown'."""
    import importlib.metadata
    import tomllib

    try:
        return importlib.metadata.version("pipeplan")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        with (Path(__file__).resolve().parents[2] / "pyproject.toml").open("rb") as f:
            return str(tomllib.load(f)["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"
