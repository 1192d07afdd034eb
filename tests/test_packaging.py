"""The engine stays light, the package is typed, the README's commands exist."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_does_not_pull_the_notebook_stack() -> None:
    code = (
        "import sys, nan_magic; "
        "print(' '.join(m for m in ('IPython', 'ipywidgets', 'pandas', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_public_surface() -> None:
    import nan_magic

    for name in ("watch", "NonFiniteError", "Report", "Phase", "WatchConfig", "load_ipython_extension"):
        assert hasattr(nan_magic, name)
    assert issubclass(nan_magic.NonFiniteError, FloatingPointError)
    assert (ROOT / "nan_magic" / "py.typed").exists()


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/test" in ci and "./scripts/test" in readme
    assert "./scripts/demo" in readme


def test_the_demo_blows_up_and_writes_its_reports(tmp_path) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_blowup.py"), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "producer    blocks.0.attn (NaiveAttention)" in out.stdout
    assert "op          aten.exp.default" in out.stdout
    assert "train_blowup.py:" in out.stdout  # the line of the overflowing exp
    import json

    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["module"], report["phase"], report["op"]) == ("blocks.0.attn", "forward", "aten.exp.default")
    assert "<table" in (tmp_path / "report.html").read_text()
