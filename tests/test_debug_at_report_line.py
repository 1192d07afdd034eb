"""%debug opens at the line the report names, in every phase and mode (a real in-process IPython shell).

Round 18: a data event whose producer the loop's code ran (a batch normalised by a zero std before the
model call, a NaN label read by the loss) opened %debug at the line where the value reached a boundary
(the model call, ``loss.backward()``), not at the line the report names.
"""

from __future__ import annotations

import io
import sys
from unittest import mock

import pytest
from IPython.utils.capture import capture_output

SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
    def forward(self, x):
        h = self.lin(x)
        return h.abs().sqrt().sum(-1, keepdim=True)
model = Root()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def normalised(batch):
    centred = batch - batch.mean(0)
    return centred / batch.std(0)  # here
"""

LOOP = "for step in range(3):\n    x = torch.randn(8, 4); y = torch.rand(8, 1)\n"
TAIL = "    opt.zero_grad(); loss.backward(); opt.step()\n"
# Each cell's body after LOOP; the report's line is the one marked "# here".
CASES = {
    # data: the loop divides the batch by a zero std before the model call (was: the model call's line)
    "data-normalised-batch": (
        "    if step == 1:\n        x[:, 2] = 1.0\n"
        "    x = (x - x.mean(0)) / x.std(0)  # here\n"
        "    loss = ((model(x) - y) ** 2).mean()\n" + TAIL
    ),
    # data: the same in a helper the loop calls, returned before the model call
    "data-normalised-in-a-helper": (
        "    if step == 1:\n        x[:, 2] = 1.0\n"
        "    x = normalised(x)\n"
        "    loss = ((model(x) - y) ** 2).mean()\n" + TAIL
    ),
    # data: a NaN label, named at the line that read it (was: loss.backward()'s line)
    "data-label-read-by-the-loss": (
        "    if step == 1:\n        y[0] = float('nan')\n"
        "    out = model(x)\n"
        "    loss = nn.functional.mse_loss(out, y)  # here\n" + TAIL
    ),
    # forward, outside every module: log of a data tensor between the model call and the loss
    "loss-code-log-of-data": (
        "    out = model(x)\n"
        "    t = torch.log(y - 2 * (step == 1))  # here\n"
        "    loss = nn.functional.mse_loss(out, t)\n" + TAIL
    ),
    # forward, in a module: log of a negative value in the model's own code
    "forward-in-a-module": (
        "    if step == 1:\n        model.forward = lambda x: torch.log(model.lin(x) - 1e3)  # here\n"
        "    loss = model(x).mean()\n" + TAIL
    ),
    # optimizer: an infinite learning rate; the report names the step's line
    "optimizer-step": (
        "    loss = ((model(x) - y) ** 2).mean()\n"
        "    opt.zero_grad(); loss.backward()\n"
        "    if step == 1:\n        opt.param_groups[0]['lr'] = float('inf')\n"
        "    opt.step()  # here\n"
    ),
}
MODES = ["", "--ops", "--defer", "--full", "--ops --defer"]


def debug_where(ip) -> str:
    """What pdb's ``where`` prints after ``%debug`` (IPython's Pdb, bound to the stdin it first saw, dropped)."""
    ip.InteractiveTB.pdb = None
    with mock.patch("sys.stdin", io.StringIO("where\nq\n")), capture_output() as captured:
        ip.run_line_magic("debug", "")
    return captured.stdout


@pytest.mark.parametrize("options", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_debug_opens_at_the_reports_line(ip, case: str, options: str) -> None:
    ip.run_cell(SETUP)
    cell = f"%%nantrace model, opt {options}\n" + LOOP + CASES[case]
    with capture_output():
        ip.run_cell(cell)
    report = ip.user_ns["_nan_report"]
    assert (report.phase, report.step) == (case.split("-")[0].replace("loss", "forward"), 1)
    assert report.source is not None
    assert report.source.line.endswith("# here"), report.source
    tb = sys.last_traceback
    while tb.tb_next is not None:
        tb = tb.tb_next
    # The frame %debug opens, its line and the report's debug_frame: the report's line.
    assert (tb.tb_frame.f_code.co_name, tb.tb_lineno) == (report.source.function, report.source.lineno)
    assert report.debug_frame is not None and report.debug_frame.lineno == report.source.lineno
    where = debug_where(ip)
    current = [line for line in where.splitlines() if line.lstrip().startswith(("--->", "---->"))]
    assert current and "# here" in current[-1], where


def test_debug_opens_at_the_forward_line_of_a_backward_producer(ip) -> None:
    """Round 19: the forward line that made the failing autograd node, in a replay of the step's call."""
    ip.run_cell(SETUP)
    body = (
        "    if step == 1:\n        with torch.no_grad():\n"
        "            model.lin.weight.zero_(); model.lin.bias.zero_()\n"
        "    loss = ((model(x) - y) ** 2).mean()\n" + TAIL
    )
    with capture_output():
        ip.run_cell("%%nantrace model, opt\n" + LOOP + body)
    report = ip.user_ns["_nan_report"]
    assert report.phase == "backward"
    tb = sys.last_traceback
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_lineno == report.source.lineno and tb.tb_frame.f_code.co_name == report.source.function
    # pdb in the shell: ``p h`` prints the zeros that line read (in a replay of the step's call, as the report says)
    ip.InteractiveTB.pdb = None
    commands = iter(["p h.abs().max().item()", "where", "q"])
    # (the terminal's ipdb prompts through prompt_toolkit on a tty; its simple prompt reads ``input``)
    with mock.patch("IPython.terminal.debugger._use_simple_prompt", True), \
            mock.patch("builtins.input", lambda prompt="": next(commands)), capture_output() as captured:
        ip.run_line_magic("debug", "")
    assert "\n0.0\n" in captured.stdout, captured.stdout
    current = [line for line in captured.stdout.splitlines() if line.lstrip().startswith(("--->", "---->"))]
    assert current and "h.abs().sqrt()" in current[-1], captured.stdout
    assert any("%debug opens a replay of step 1's model call" in note for note in report.notes), report.notes
