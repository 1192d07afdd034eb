"""What a user debugging a NaN in a notebook saw go wrong (session 23's walk), each through a real IPython shell.

The walk's notebooks are in tests/notebooks/user23/ (split training cells, ``%nanwatch on``, NaNs in forward,
loss code, backward, the optimizer step and the data, interrupts); each defect found there has its test here,
in the cheap in-process shell of the ``ip`` fixture (conftest.py).
"""

from __future__ import annotations

import re
import sys
from typing import Any
from unittest import mock

import pytest
from IPython.utils.capture import capture_output

SETUP = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
"""

LOOP = """
for step in range(3):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

#: Where a real interrupt landed in the walk (kernel interrupts at random points of a watched step): below a
#: hook's entry, in the checks it calls, whose frames are not marked hidden (only the entry is).
DEEP_IN_A_HOOK = [
    "nan_magic.hot.checks.early.EarlyWarnings.observe_batch",  # forward pre-hook > record_data > _judge_data > here
    "nan_magic.hot.checks.optim.OptimizerChecks._gradient_norms",  # optimizer pre-hook > on_step_pre > here
]


def traceback_shown(ip: Any, cell: str) -> str:
    """The traceback IPython shows for the cell's KeyboardInterrupt, without colours."""
    with capture_output():
        result = ip.run_cell(cell)
    assert isinstance(result.error_in_exec, KeyboardInterrupt), result.error_in_exec
    lines = ip.InteractiveTB.structured_traceback(sys.last_type, sys.last_value, sys.last_traceback)
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(lines))


@pytest.mark.parametrize("armed", ["%%nantrace\n", "%nanwatch on\n"])
@pytest.mark.parametrize("inside", DEEP_IN_A_HOOK)
def test_an_interrupt_deep_in_a_hook_shows_no_frame_of_ours(ip: Any, inside: str, armed: str) -> None:
    """The user pressed stop during a watched step; the traceback named nan_magic's files (early.py:255 in
    _constant_feature, optim.py:198 in _gradient_norms) as if nan_magic had failed. Now it ends at the user's
    line and torch's call of the hook."""
    ip.run_cell(SETUP)
    held = armed.startswith("%nanwatch")
    if held:
        ip.run_cell("%nanwatch on")
    try:
        with mock.patch(inside, side_effect=KeyboardInterrupt):
            text = traceback_shown(ip, ("" if held else armed) + LOOP)
    finally:
        ip.run_line_magic("nanwatch", "off")
    ours = [line for line in text.splitlines() if "nan_magic" in line and line.startswith("File ")]
    assert not ours, text
    assert "loss = nn.functional.cross_entropy(model(x), y)" in text or "opt.step()" in text, text
    # What it stopped in stays the same model: nothing of the watch is left on it.
    assert not ip.user_ns["model"][0]._forward_pre_hooks and not ip.user_ns["model"]._forward_hooks
