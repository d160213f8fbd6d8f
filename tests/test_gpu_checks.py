""".ci/gpu-checks fits its budget and finds the project's interpreter (issue #44: its step limits added up to
2,140 s against a 520 s budget, so the TimelyFreeze step never ran; the CPU rehearsal exited 1 unless the
project's Python came first on PATH)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "gpu-checks"


def dry_run(tmp_path, **env) -> list[list[str]]:
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "DRY": "1",
                               "OUT": str(tmp_path / "out"), **env})
    assert proc.returncode == 0, proc.stderr
    return [line.split(",") for line in proc.stdout.splitlines()]


def test_every_step_fits_the_budget_down_to_the_timelyfreeze_run(tmp_path):
    rows = dry_run(tmp_path)
    steps = {name: int(limit) for name, limit in (r for r in rows if r[0] != "interpreter")}
    budget = int(re.search(r"BUDGET=\$\{BUDGET:-(\d+)\}", SCRIPT.read_text()).group(1))
    assert sum(steps.values()) <= budget, steps
    assert list(steps)[-1] == "freeze-timelyfreeze" and min(steps.values()) >= 20  # step() skips under 20 s


def test_the_rehearsal_uses_the_checkouts_venv_whatever_is_on_path(tmp_path):
    (interpreter,) = [r for r in dry_run(tmp_path) if r[0] == "interpreter"]
    if (ROOT / ".venv" / "bin" / "python").exists():
        assert interpreter[1] == str(ROOT / ".venv" / "bin" / "python") and interpreter[2] == "ok"
    assert dry_run(tmp_path, PYTHON="/bin/false")[0][1] == "/bin/false"  # $PYTHON first
