"""The Python code is ruff-clean and ruff-formatted: ``ruff check`` and ``ruff format --check``
over python/, tests/, benchmarks/ and scripts/ with the repository's [tool.ruff] settings
(pyproject.toml), as CI runs them. A finding fails the test with ruff's own report."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.files import REPO

DIRS = ("python", "tests", "benchmarks", "scripts")


def _ruff() -> list[str]:
    """ruff as this interpreter's environment has it: the module, else the binary beside
    sys.executable, else the one on PATH; skipped (named) where none is installed."""
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    beside = Path(sys.executable).parent / "ruff"
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("ruff")
    if found:
        return [found]
    pytest.skip("ruff is not installed (pip install -e '.[test]' pins it)")


@pytest.mark.parametrize(
    "command", [["check", "--no-cache", "--output-format", "concise"], ["format", "--check", "--no-cache"]]
)
def test_ruff_is_clean(command: list[str]) -> None:
    dirs = [d for d in DIRS if (REPO / d).is_dir()]
    proc = subprocess.run([*_ruff(), *command, *dirs], cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:  # ruff's findings, as it prints them
        pytest.fail(f"ruff {' '.join(command)} {' '.join(dirs)}:\n{proc.stdout}{proc.stderr}", pytrace=False)
