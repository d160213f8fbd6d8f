"""Shipped scenarios (TOML). `scenario_path(name)` finds one by file stem, e.g. "tiny-cpu"."""

from pathlib import Path

SCENARIO_DIR = Path(__file__).parent


def scenario_path(name: str) -> Path:
    return SCENARIO_DIR / f"{name}.toml"


def scenario_names() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))
