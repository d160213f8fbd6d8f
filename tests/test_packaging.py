"""The distribution installs under the one `pipeplan` namespace and its package list matches the folders."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def test_every_package_folder_is_installed_under_pipeplan():
    setuptools = _pyproject()["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pipeplan").rglob("__init__.py")}
    folders |= {"pipeplan.scenarios"}  # the repository's scenarios/ folder, mapped by package-dir
    assert listed == folders
    assert all(name == "pipeplan" or name.startswith("pipeplan.") for name in listed)
    assert setuptools["package-dir"] == {"pipeplan.scenarios": "scenarios"}


def test_no_generic_top_level_name_is_importable_from_outside_the_checkout(tmp_path):
    """Run from a folder with its own `common/` (the shadowing case): pipeplan's modules still resolve."""
    import subprocess
    import sys

    (tmp_path / "common").mkdir()
    (tmp_path / "common" / "__init__.py").write_text("")
    code = ("import importlib.util as u, pipeplan.analysis.cli, pipeplan.scenarios as s\n"
            "print(u.find_spec('sim') is None, u.find_spec('solver') is None, s.scenario_path('tiny-cpu').is_file())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "True", "True"]


def test_the_cli_entry_point_is_namespaced():
    assert _pyproject()["project"]["scripts"] == {"pipeplan": "pipeplan.analysis.cli:main"}
