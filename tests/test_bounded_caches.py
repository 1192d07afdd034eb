"""The engine's caches by code object stay bounded when the user's code is compiled again at every step.

A model called from ``eval``'d or ``exec``'d code (a notebook cell re-run, a generated loop) makes a new code object
each time; the caches by id hold each code object they met so that its id is not reused, so they start again past
``CODES_KEPT`` entries. (A review of session 36 measured 0.55 KiB a step growing without bound.)
"""

from __future__ import annotations

import torch
from torch import nn

import nan_magic
from nan_magic.errors import frames
from nan_magic.localize.ops import sources
from nan_magic.localize.replay.tiered import step_keeping


def test_a_model_called_from_code_compiled_each_step_leaves_the_caches_bounded() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(8, 4)
    steps = frames.CODES_KEPT + 200
    with nan_magic.watch(model, opt) as w:
        for step in range(steps):
            # (a new code object each step, as a re-run cell's)
            out = eval(compile("model(x)", f"<ipython-input-{step}-x>", "eval"), {"model": model, "x": x})
            loss = out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert w.report is None
    assert len(step_keeping._WALKED) <= frames.CODES_KEPT
    assert len(frames._LIBRARY_CODE) <= frames.CODES_KEPT
    assert len(sources.PASSED_OVER) <= frames.CODES_KEPT
