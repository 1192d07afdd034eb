"""Where ``%debug`` opens, in every phase and mode: the report's line, with the locals that line read.

One table: phase (forward in a submodule's forward, forward in a helper the module calls, the loss code,
backward, the optimizer step, data) x mode (default, defer, full, ops, ops+defer). Each case asserts that the
traceback's last frame (what ``%debug`` and ``pdb.post_mortem`` open) is at the report's (function, line),
that ``report.debug_frame`` names it, and that a local the failing line reads holds the value it read there
(the zero a division divided by), in a real in-process IPython shell.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from IPython.utils.capture import capture_output

SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
def ratio(a, b):
    return a / b  # here
class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.gain = 1.0
        self.helper = False
    def forward(self, x):
        h = self.lin(x)
        z = h.abs().sum(-1, keepdim=True) * self.gain
        if self.helper:
            return ratio(h, z)
        return h / z  # here
class Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.out = nn.Linear(4, 1)
    def forward(self, x):
        return self.out(self.inner(x))
def rmse(out, y):
    gap = ((out - y) ** 2).mean()
    return gap.sqrt()  # here
class Sqrt(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
    def forward(self, x):
        h = self.lin(x)
        r = h.abs().sqrt()  # here
        return r.sum(-1, keepdim=True)
"""

LOOP = "for step in range(3):\n    x = torch.randn(8, 4); y = torch.rand(8, 1)\n"
TAIL = "    opt.zero_grad(); loss.backward(); opt.step()\n"
STEP = "    loss = ((model(x) - y) ** 2).mean()\n" + TAIL


def _zeros(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and bool((value == 0).all())


#: case -> (model made in the cell, the loop's body after LOOP, (local the line reads, what it held)).
CASES: dict[str, tuple[str, str, tuple[str, Callable[[Any], bool]]]] = {
    # forward: a submodule divides by a sum its gain zeroed
    "forward-in-a-submodule": ("Root()", "    if step == 1:\n        model.inner.gain = 0.0\n" + STEP, ("z", _zeros)),
    # forward: the same division in a helper function the submodule calls
    "forward-in-a-helper": (
        "Root()",
        "    model.inner.helper = True\n    if step == 1:\n        model.inner.gain = 0.0\n" + STEP,
        ("b", _zeros),
    ),
    # the loss code: divides the model's output by a zero the loop made
    "forward-loss-code": (
        "Root()",
        "    out = model(x)\n    denom = y * (step != 1)\n    loss = (out / denom).mean()  # here\n" + TAIL,
        ("denom", _zeros),
    ),
    # backward: sqrt at zero (weights zeroed): its gradient is infinite; the report names the forward line
    "backward": (
        "Sqrt()",
        "    if step == 1:\n        with torch.no_grad():\n"
        "            model.lin.weight.zero_(); model.lin.bias.zero_()\n" + STEP,
        ("h", _zeros),
    ),
    # backward in the loss code (a helper outside every module, as a loss function in another cell): the root of a
    # mean squared error that is 0 (the targets are the outputs) has an infinite gradient
    "backward-in-the-loss-code": (
        "Root()",
        "    out = model(x)\n    if step == 1:\n        y = out.detach()\n    gap = ((out - y) ** 2).mean()\n"
        "    loss = gap.sqrt()  # here\n" + TAIL,
        ("gap", _zeros),
    ),
    # backward in a loss helper the loop calls (its frame returned before backward ran)
    "backward-in-a-loss-helper": (
        "Root()",
        "    out = model(x)\n    if step == 1:\n        y = out.detach()\n    loss = rmse(out, y)\n" + TAIL,
        ("gap", _zeros),
    ),
    # the optimizer: an infinite learning rate, read by opt.step()
    "optimizer": (
        "Root()",
        "    loss = ((model(x) - y) ** 2).mean()\n    opt.zero_grad(); loss.backward()\n"
        "    if step == 1:\n        opt.param_groups[0]['lr'] = float('inf')\n    opt.step()  # here\n",
        ("opt", lambda opt: opt.param_groups[0]["lr"] == float("inf")),
    ),
    # data: the loop normalises the batch by a zero std
    "data": (
        "Root()",
        "    if step == 1:\n        x[:, 2] = 1.0\n    sd = x.std(0)\n    x = (x - x.mean(0)) / sd  # here\n" + STEP,
        ("sd", lambda sd: isinstance(sd, torch.Tensor) and float(sd[2]) == 0.0),
    ),
}
MODES = {"default": "", "defer": "--defer", "full": "--full", "ops": "--ops", "ops+defer": "--ops --defer"}
#: (case, mode) -> why %debug does not open at the report's line there (strict xfails).
KNOWN: dict[tuple[str, str], str] = {
    # The loss code's line in the loop is still running when backward judges it (the loop's own frame): %debug
    # opens there. A loss helper's frame has returned before backward runs: the recorder of the code outside the
    # models keeps it while its tensors are small (recorder.weaken) and claim_backward opens it at the node's forward
    # line. The op tracer (ops=True) notes each node's forward line but keeps no frame: %debug opens at
    # loss.backward(), as the report's "%debug opens in" says.
    **{
        ("backward-in-a-loss-helper", mode): "a backward producer in a loss helper that returned, under ops=True: "
        "%debug opens at loss.backward(), not at the helper's line (the op tracer's NodeSources keeps no frames)"
        for mode in ("ops", "ops+defer")
    },
}


def _params() -> list[Any]:
    params = []
    for case in CASES:
        for mode in MODES:
            why = KNOWN.get((case, mode))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            params.append(pytest.param(case, mode, marks=marks, id=f"{case}-{mode}"))
    return params


def last_entry(tb: Any) -> Any:
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb


@pytest.mark.parametrize(("case", "mode"), _params())
def test_debug_opens_at_the_reports_line_with_its_locals(ip, case: str, mode: str) -> None:
    model, body, (name, held) = CASES[case]
    ip.run_cell(SETUP + f"model = {model}\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    with capture_output():
        ip.run_cell(f"%%nantrace model, opt {MODES[mode]}\n" + LOOP + body)
    report = ip.user_ns["_nan_report"]
    assert (str(report.phase), report.step) == (case.split("-")[0], 1), report.message
    assert report.source is not None and report.source.line.endswith("# here"), report.source
    last = last_entry(sys.last_traceback)
    assert (last.tb_frame.f_code.co_name, last.tb_lineno) == (report.source.function, report.source.lineno)
    assert report.debug_frame is not None
    assert (report.debug_frame.function, report.debug_frame.lineno) == (report.source.function, report.source.lineno)
    local = last.tb_frame.f_locals.get(name)
    assert held(local), (name, local)
    # The report says so where the frame is a replay's (its locals the replay's): a backward producer's forward line
    # in every mode, a forward producer the step replay or the call's replay named; not the live frames of ops=True,
    # of the loop's code (loss, data) and of opt.step().
    replayed = case == "backward" or (case.startswith("forward-in-a") and mode in ("default", "defer", "full"))
    said = [note for note in report.notes if note.startswith("%debug opens a replay of ")]
    assert bool(said) == replayed, report.notes
