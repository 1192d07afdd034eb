"""Colab as it ships: dependency floors its runtime satisfies, its cell names (IPython 7).

These run in every environment. The tests that need Colab's own stack (IPython
7.34, ipywidgets 7.7, ipykernel 5.5) are in test_colab_env.py and run in
.venv-colab (scripts/setup-colab-env), which scripts/test runs too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from nan_magic.locations import name_location

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]

#: What Colab's runtime ships: google-colab pins IPython and ipykernel, ipywidgets is 7.7.x,
#: jupyter-client and traitlets are the newest below the bounds ipykernel 5 needs there.
#: Every dependency of the package must accept these as they are.
COLAB_SHIPS = {
    "ipython": "7.34.0",
    "ipywidgets": "7.7.1",
    "ipykernel": "5.5.6",
    "jupyter-client": "7.4.9",
    "traitlets": "5.9.0",
    "pandas": "2.2.2",
    "matplotlib": "3.10.0",
    "pillow": "11.0.0",
    "jinja2": "3.1.4",
}


def _requirements(extra: str | None = None) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return [Requirement(line) for line in listed]


def test_every_dependency_accepts_what_colab_ships() -> None:
    requirements = {req.name.lower(): req for req in _requirements()}
    assert {"ipython", "ipywidgets", "pandas", "matplotlib", "torch"} <= set(requirements)
    for name, requirement in requirements.items():
        if name in COLAB_SHIPS:
            assert requirement.specifier.contains(COLAB_SHIPS[name]), (
                f"{requirement} would upgrade Colab's {name} {COLAB_SHIPS[name]}"
            )


def test_the_colab_test_extra_accepts_colabs_pins() -> None:
    # The `test` extra asks for ipykernel 6 and JupyterLab 4; the Colab environment's must not.
    for requirement in _requirements("test-colab"):
        name = requirement.name.lower()
        assert name not in COLAB_SHIPS or requirement.specifier.contains(COLAB_SHIPS[name]), requirement


def test_ipython7_cell_files_are_named_as_cells() -> None:
    # IPython 7 compiles cell 2 into "<ipython-input-2-88efa2196d22>"; IPython 8+ says "Cell In[2]".
    assert name_location("<ipython-input-2-88efa2196d22>", 11) == "Cell In[2], line 11"
    assert name_location("<ipython-input-15-0123456789ab>", 1) == "Cell In[15], line 1"
    assert name_location("<ipython-input-x>", 3) == "<ipython-input-x>:3"
    assert name_location("<string>", 3) == "<string>:3"


def test_the_colab_environment_passed() -> None:
    """scripts/test runs Colab's stack first (.venv-colab); its result fails the main run too."""
    result = os.environ.get("NAN_MAGIC_COLAB_RESULT")
    if not result:
        pytest.skip("the Colab environment's run is scripts/test's (NAN_MAGIC_COLAB_RESULT unset)")
    status, _, summary = Path(result).read_text().partition("\n")
    assert status == "exit 0", (
        f"the tests in .venv-colab failed ({status}): {summary.strip()}; see test-artifacts/colab-env.log"
    )
