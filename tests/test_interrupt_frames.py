"""An interrupt (Ctrl-C, the kernel's interrupt) under %%nantrace: the traceback IPython shows has no frame of ours.

The watch's hooks run inside the user's step (a module call, backward, the optimizer step): a KeyboardInterrupt
that lands while one runs passes through its frame. Their entry points set ``__tracebackhide__``, which IPython's
traceback formatter (ultratb: 9.x here, 7.34 in Colab's stack, the same rule) skips, saying "[... skipping hidden 1
frame]"; the frame the interrupt landed in is always shown, by IPython's rule (here a mock's, standing in for it).
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

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x, stop=False):
        h = self.a(x)
        if stop:
            raise KeyboardInterrupt  # the user pressed Ctrl-C while their own code ran
        return self.b(h)

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(3, 4)
"""

LOOP = """
for step in range(3):
    loss = model(x, stop={stop}).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""

#: Where an interrupt lands inside the watch: a call inside the forward pre-hook (every module call), inside the
#: wrapped backward's start, inside the optimizer's pre-hook and post-hook.
INSIDE = [
    "nan_magic.hot.kept.step_log.StepLog.new_call",
    "nan_magic.hot.checks.backward.gradient_checks.is_checkable",
    "nan_magic.hot.checks.optimizer.step_checks.OptimizerChecks.on_step_pre",
    "nan_magic.hot.checks.optimizer.step_checks.OptimizerChecks.on_step_post",
]


def shown(ip: Any, cell: str) -> str:
    """What IPython shows for the cell's error: its formatted traceback, without colours."""
    with capture_output():
        result = ip.run_cell(cell)
    assert isinstance(result.error_in_exec, KeyboardInterrupt), result.error_in_exec
    lines = ip.InteractiveTB.structured_traceback(sys.last_type, sys.last_value, sys.last_traceback)
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(lines))


@pytest.mark.parametrize("options", ["", " --full", " --ops", " --defer"])
@pytest.mark.parametrize("inside", INSIDE)
def test_an_interrupt_inside_a_watch_hook_shows_none_of_our_frames(ip: Any, options: str, inside: str) -> None:
    ip.run_cell(SETUP)
    with mock.patch(inside, side_effect=KeyboardInterrupt):
        text = shown(ip, "%%nantrace" + options + LOOP.format(stop="False"))
    ours = [line for line in text.splitlines() if "nan_magic" in line and line.startswith("File ")]
    assert not ours, text
    if inside.endswith("gradient_checks.is_checkable"):
        # The backward's patch runs its callbacks with no Python frame of its own (patches/registry.py SelfGated):
        # the traceback ends at the user's backward() line, nothing of ours hidden or shown.
        assert text.rstrip().endswith("KeyboardInterrupt:") and "----> 4     opt.zero_grad(); loss.backward()" in text
    else:
        assert "[... skipping hidden" in text, text  # the hook's frame was there, and hidden
    assert "loss = model(x, stop=False).mean()" in text or "loss.backward()" in text or "opt.step()" in text, text


@pytest.mark.parametrize("options", ["", " --full", " --ops", " --defer"])
def test_an_interrupt_in_the_users_forward_shows_the_users_frames(ip: Any, options: str) -> None:
    ip.run_cell(SETUP)
    text = shown(ip, "%%nantrace" + options + LOOP.format(stop="step == 1"))
    assert not [line for line in text.splitlines() if "nan_magic" in line and line.startswith("File ")], text
    assert "raise KeyboardInterrupt  # the user pressed Ctrl-C" in text, text
