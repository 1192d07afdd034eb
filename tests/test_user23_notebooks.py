"""Two of session 23's walk notebooks (tests/notebooks/user23/), executed by nbclient in a real kernel.

forward_split.ipynb: model, loss helper and loop in cells of their own, an RMS norm without eps; the short error,
``%debug`` at the producing line with that line's locals, the model left without hooks, the loop re-run after the
fix. interrupts.ipynb: real SIGINTs (the kernel's stop button) at points of watched AdamW steps, under
``%%nantrace`` and ``%nanwatch on``: no traceback names a file of nan_magic, and nothing of the watch is left on
the model after each. The other three (loss code under ``%nanwatch on``, backward and optimizer steps, a NaN
stored in a TensorDataset) are walk inputs; what they found is tested in-process in test_user23.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from jupyter_support import cell_text, named_cell, run_copy

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

WALK = Path(__file__).parent / "notebooks" / "user23"


def run(name: str, tmp_path: Path) -> Any:
    return run_copy(WALK, name, tmp_path)


def test_the_split_training_notebook(tmp_path: Path) -> None:
    nb = run("forward_split.ipynb", tmp_path)
    (error,) = [output for output in named_cell(nb, "loop").outputs if output.output_type == "error"]
    assert error.ename == "NonFiniteError"
    shown = cell_text(named_cell(nb, "loop"))
    assert "producer: Cell In[2], line 8, in forward\n    normed = x / var.sqrt()" in shown, shown
    assert "Cell In[2], line 21, in forward\n    h = self.norm(h)" in shown, shown
    assert "forward 'norm' Scale aten.div.Tensor 0" in cell_text(named_cell(nb, "summary"))
    debug = cell_text(named_cell(nb, "debug"))
    assert debug.startswith("> ") and "(8)forward()" in debug.splitlines()[0], debug
    assert "tensor(0.)" in debug and "torch.Size([32, 16])" in debug  # var.min() and x.shape, as the line ran
    assert cell_text(named_cell(nb, "hooks")).split() == ["OrderedDict()"] * 3
    assert cell_text(named_cell(nb, "loop_again")).startswith("done 19 ")


def test_the_interrupts_notebook(tmp_path: Path) -> None:
    nb = run("interrupts.ipynb", tmp_path)
    clean = cell_text(named_cell(nb, "before")).strip()
    names = ("intr0", "intr1", "intr2", "intr3", "won0", "won1")  # %%nantrace cells; cells under %nanwatch on
    interrupted = [named_cell(nb, name) for name in names]
    for cell in interrupted:
        (error,) = [output for output in cell.outputs if output.output_type == "error"]
        assert error.ename == "KeyboardInterrupt"
        shown = cell_text(cell)
        assert not [line for line in shown.splitlines() if "nan_magic" in line and line.startswith("File ")], shown
    for name in ("after0", "after1", "after2", "after3"):
        steps, state = cell_text(named_cell(nb, name)).strip().split(" ", 1)
        assert int(steps) > 0 and state == clean, state
    assert cell_text(named_cell(nb, "off")).strip().endswith(clean)
