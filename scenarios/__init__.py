"""Shipped scenarios (TOML). `scenario_path(name)` finds one by file stem, e.g. "tiny-cpu"; every command that
reads a scenario also takes such a name (sim.config.resolve_scenario_path)."""

from pathlib import Path

SCENARIO_DIR = Path(__file__).parent


def scenario_path(name: str) -> Path:
    return SCENARIO_DIR / f"{name}.toml"


def scenario_names() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))


def scenario_description(name: str) -> str:
    """The first sentence of a shipped scenario's opening comment: what it is and where its numbers come from.

    A sentence may wrap over several comment lines; it ends at a full stop followed by a space or the end of
    the comment (so "arXiv 2503.03182" does not end it)."""
    words: list[str] = []
    for line in scenario_path(name).read_text().splitlines():
        if not line.startswith("#"):
            break
        words += line.lstrip("#").split()
    text = " ".join(words)
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]
