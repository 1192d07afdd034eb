"""Execute the notebooks in notebooks/ in place, so they are committed with their outputs.

A reader on GitHub or nbviewer then sees the report without running anything.
Run through ``scripts/execute-notebooks [NOTEBOOK ...]``. The result is made
deterministic so that re-running it on unchanged code changes no byte that
matters in a diff: no timing metadata, and the random ids (widget models,
the static report's element id) renumbered in order of appearance.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from jupyter_support import isolated_env  # noqa: E402  (tests/ holds the shared set-up)

#: ipywidgets model ids (uuid4 hex) and the static report's element id.
MODEL_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")  # also inside "IPY_MODEL_<id>"
STATIC_ID = re.compile(r"nan-magic-[0-9a-f]{12}")


def execute(path: Path) -> int:
    """Execute ``path`` in a fresh kernel, write it back; return its size in bytes."""
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="nan-magic-nb-") as scratch:
        client = NotebookClient(
            nb, timeout=600, kernel_name="python3", record_timing=False,
            resources={"metadata": {"path": str(path.parent)}},
        )
        client.execute(env=isolated_env(Path(scratch)))
    text = renumber(nbformat.writes(nb))
    path.write_text(text, encoding="utf-8")
    return len(text.encode("utf-8"))


def renumber(text: str) -> str:
    """Replace each random id by a counter, the same id by the same number."""
    text = _renumber(MODEL_ID, "{:032x}", text)
    return _renumber(STATIC_ID, "nan-magic-{:012x}", text)


def _renumber(pattern: re.Pattern[str], form: str, text: str) -> str:
    seen: dict[str, str] = {}

    def number(match: re.Match[str]) -> str:
        return seen.setdefault(match.group(0), form.format(len(seen) + 1))

    return pattern.sub(number, text)


def main(argv: list[str]) -> int:
    paths = [Path(arg) for arg in argv] or sorted((REPO / "notebooks").glob("*.ipynb"))
    for path in paths:
        size = execute(path)
        print(f"execute-notebooks: {path.name}: {size / 1024:.0f} KB with outputs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
