"""Session 25's walk notebooks (tests/notebooks/nb25/), executed by nbclient in a real kernel, deferred mode.

attention_tqdm.ipynb: a padded batch under tqdm, a warmup-cosine schedule and gradient clipping; a fully padded row
at step 7. Under ipykernel (IPython 9) ``%tb`` gave the replayed frames' return lines and the deferred check's
``opt.step()``, which the in-process shell does not show (its cells are not ``.py`` files). watch_eval_backward.ipynb:
``%nanwatch on --defer`` across a train cell, an eval cell and a second train cell, a hand-written LayerNorm whose
sqrt has an infinite derivative on a zeroed sample. The other three (a training function called from another cell,
an Adam step with eps=0 and a batch standardised by a zero std, an exp gate under a growing learning rate) are walk
inputs; what they found is tested in-process in test_nb25.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from jupyter_support import cell_text, named_cell, run_copy

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

WALK = Path(__file__).parent / "notebooks" / "nb25"


def run(name: str, tmp_path: Path) -> Any:
    return run_copy(WALK, name, tmp_path)


def arrows(text: str) -> list[str]:
    """The current lines a traceback marks (``---> 14 attn = ...``), as their numbers."""
    return [line.split()[1] for line in text.splitlines() if re.match(r"\s*-+> \d", line)]


def test_the_attention_notebook_deferred(tmp_path: Path) -> None:
    nb = run("attention_tqdm.ipynb", tmp_path)
    train = cell_text(named_cell(nb, "train"))
    assert "forward step 7: blocks.0.attn (Attention)" in train and "step  6  loss" in train, train
    assert "Cell In[4], line 4\n    logits = model(ids, pad)" in train, train
    assert "Cell In[2], line 40, in forward\n    x = block(x, pad)" in train, train
    # %tb: the same lines, to the producer's (was: 9 for opt.step(), 42 and 28 for the frames' return lines)
    assert arrows(cell_text(named_cell(nb, "tb"))) == ["4", "40", "27", "14"]
    summary = cell_text(named_cell(nb, "summary"))
    assert "forward 'blocks.0.attn' Attention aten._softmax.default 7" in summary, summary
    assert "FIX mask True 1.16" in summary, summary  # verified, with the step's own loss (the deferred check's)
    debug = cell_text(named_cell(nb, "debug"))
    assert "(14)forward()" in debug.splitlines()[0] and "torch.Size([8, 4, 10, 10])" in debug, debug
    assert cell_text(named_cell(nb, "hooks")).split() == ["0", "0", "0"]


def test_the_nanwatch_on_notebook_deferred(tmp_path: Path) -> None:
    nb = run("watch_eval_backward.ipynb", tmp_path)
    assert cell_text(named_cell(nb, "eval")).startswith("val acc")
    summary = cell_text(named_cell(nb, "summary"))
    # One run across the cells: epoch 1's four steps, the eval cell none, then the second step of epoch 2.
    assert summary.startswith("backward 'norm' Norm aten.div.Tensor 5"), summary
    assert "FIX eps True" in summary, summary
    debug = cell_text(named_cell(nb, "debug"))
    assert "(9)forward()" in debug.splitlines()[0] and "tensor(0.)" in debug, debug
    assert cell_text(named_cell(nb, "hooks")).split() == ["0", "0", "0"]
