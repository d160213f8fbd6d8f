"""Shipped scenarios (TOML). `scenario_path(name)` finds one by file stem, e.g. "tiny-cpu"; every command that
reads a scenario also takes such a name (sim.config.resolve_scenario_path)."""

from pathlib import Path

SCENARIO_DIR = Path(__file__).parent


def scenario_path(name: str) -> Path:
    return SCENARIO_DIR / f"{name}.toml"


def scenario_names() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))


def scenario_description(name: str) -> str:
    """The first comment line of a shipped scenario: what it is and where its numbers come from."""
    for line in scenario_path(name).read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return ""
