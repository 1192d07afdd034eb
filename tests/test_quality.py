"""The tree stays typed and lint-clean (DESIGN.md: typed, mypy clean)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    path = Path(sys.executable).with_name(name)
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: ./scripts/setup installs it with the test extra")
    return found


def test_ruff_is_clean() -> None:
    paths = ["nan_magic", "tests", "benchmarks", "examples"]
    result = subprocess.run([_tool("ruff"), "check", *paths], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_is_clean() -> None:
    result = subprocess.run([_tool("mypy"), "nan_magic"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
