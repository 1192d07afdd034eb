"""A user's own error under the watch (a shape mismatch, not a NaN) shows and debugs as unwatched: at their line.

The watch's dispatch mode passes each op of the loop's code on (the outside recorder; every op under ops=True): a
shape mismatch is raised from inside it, and its traceback went on below the user's line into nan_magic's frames
(and torch's way into a dispatch mode). IPython shows a traceback's last frame even where it is hidden, and
``%debug`` opened it: nan_magic's ``__torch_dispatch__``, not the user's line (round 21, all five modes).
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from IPython.utils.capture import capture_output

from nan_magic.locations import function_name

MODES = {"default": "", "defer": "--defer", "full": "--full", "ops": "--ops", "ops+defer": "--ops --defer"}
SETUP = (
    "import torch\nfrom torch import nn\n"
    "class Twice(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.lin = nn.Linear(4, 4)\n"
    "    def forward(self, x):\n"
    "        return self.lin(x) @ torch.randn(3, 3)  # the user's own mistake\n"
    "net = nn.Linear(4, 1)\nopt = torch.optim.SGD(net.parameters(), lr=0.1)\ntwice = Twice()\n"
)
#: case -> (the watched cell, the function and line the error stops at, unwatched).
CASES = {
    "loop-code": (
        "%%nantrace net opt {flags}\nx = torch.randn(2, 4)\ny = net(x)\nz = y @ torch.randn(3, 3)",
        "<module>",
        4,
    ),
    "model-code": ("%%nantrace twice {flags}\ny = twice(torch.randn(2, 4))", "forward", 8),
}


def last_entry(tb: Any) -> Any:
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_a_users_shape_mismatch_stops_at_their_line_as_unwatched(ip, case: str, mode: str) -> None:
    ip.run_cell(SETUP)
    cell, function, line = CASES[case]
    with capture_output() as captured:
        ip.run_cell(cell.format(flags=MODES[mode]))
    assert type(sys.last_value) is RuntimeError and "cannot be multiplied" in str(sys.last_value)
    last = last_entry(sys.last_traceback)  # what %debug opens
    assert (function_name(last.tb_frame.f_code.co_name), last.tb_lineno) == (function, line)
    shown = captured.stdout + captured.stderr
    assert "nan_magic" not in shown and "_ops.py" not in shown and "eval_frame.py" not in shown, shown
    assert "skipping hidden" not in shown, shown


#: How the cell is watched -> (the cell around the loop code's mistake, the line the error stops at).
ARMED = {
    "%nanwatch on": ("x = torch.randn(2, 4)\ny = net(x)\n\nz = y @ torch.randn(3, 3)", 4),  # (the cell after the on)
    "with watch": (
        "import nan_magic\nwith nan_magic.watch(net, opt):\n    y = net(torch.randn(2, 4))\n"
        "    z = y @ torch.randn(3, 3)",
        4,
    ),
}


@pytest.mark.parametrize("armed", ARMED)
def test_so_it_does_under_nanwatch_on_and_a_plain_with_block(ip, armed: str) -> None:
    ip.run_cell(SETUP)
    cell, line = ARMED[armed]
    try:
        with capture_output() as captured:
            if armed == "%nanwatch on":
                ip.run_cell("%nanwatch on net opt")
            ip.run_cell(cell)
    finally:
        with capture_output():
            ip.run_line_magic("nanwatch", "off")
    assert type(sys.last_value) is RuntimeError and "cannot be multiplied" in str(sys.last_value)
    last = last_entry(sys.last_traceback)
    assert (function_name(last.tb_frame.f_code.co_name), last.tb_lineno) == ("<module>", line)
    shown = captured.stdout + captured.stderr
    assert "nan_magic/" not in shown and "skipping hidden" not in shown, shown
    assert "showtraceback" not in vars(ip)  # the shell as it was
