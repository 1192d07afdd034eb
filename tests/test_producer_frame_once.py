"""The producer's function stands once in the traceback, the short error and the report's frames, in every mode.

A NaN born in a module's own code and passed on to a child in the same forward (``return self.fc2(torch.log(h))``)
is judged at the child's input under ``--full`` (and in the default mode here too), while that forward still runs:
its live frame is in the traceback. The replay that names the op gave the producer's frame (a stand-in holding the
line's locals) and it was appended after the live one: the short error said ``producer: Cell In[1], line 10`` twice,
the report listed ``forward`` twice under "Frames from your code to the producer", and ``%tb`` and pdb's ``where``
showed two ``Net.forward`` frames at the same line. (Found in a notebook session, hunt-c-s41.)
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from IPython.utils.capture import capture_output
from torch import nn

import nan_magic
from nan_magic.errors.frames import is_library_file, short_traceback

SETUP = """
import torch
from torch import nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8); self.fc2 = nn.Linear(8, 1)
    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.log(h.abs()))  # here
torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
"""
# Step 1's batch is all zeros and fc1's bias zeroed: h is exactly 0, log(0) = -inf, whatever the kernel.
LOOP = """for step in range(3):
    x = torch.randn(8, 4)
    if step == 1:
        x = torch.zeros(8, 4)
        with torch.no_grad(): model.fc1.bias.zero_()
    loss = (model(x) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""
MODES = {"default": "", "defer": "--defer", "full": "--full", "ops": "--ops", "ops+defer": "--ops --defer"}


def user_entries(tb: Any) -> list[tuple[str, int]]:
    entries = []
    while tb is not None:
        if not is_library_file(tb.tb_frame.f_code.co_filename):
            entries.append((tb.tb_frame.f_code.co_name, tb.tb_lineno))
        tb = tb.tb_next
    return entries


@pytest.mark.parametrize("mode", list(MODES))
def test_the_producers_forward_stands_once_in_a_cell(ip, mode: str) -> None:
    ip.run_cell(SETUP)
    with capture_output():
        ip.run_cell(f"%%nantrace {MODES[mode]}\n" + LOOP)
    report = ip.user_ns["_nan_report"]
    assert (report.step, report.op, report.source.line.endswith("# here")) == (1, "aten.log.default", True)
    entries = user_entries(sys.last_traceback)
    assert entries[-1] == ("forward", report.source.lineno), entries
    assert [name for name, _line in entries].count("forward") == 1, entries
    assert [frame.function for frame in report.frames].count("forward") == 1, report.frames
    error = sys.last_value
    short = short_traceback(error._headline(), error.__traceback__, report.source, error.producer_calls)
    assert sum(line.startswith("producer: ") for line in short) == 1, short
    # %debug opens at the line, with the value it read (h, all zeros)
    last = sys.last_traceback
    while last.tb_next is not None:
        last = last.tb_next
    assert bool((last.tb_frame.f_locals["h"] == 0).all())


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(torch.log(h.abs()))


class TwoLines(Net):
    """The log's line, then the child's call on the next: checked there (line +1), born here."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.log(self.fc1(x).abs())  # here
        return self.fc2(h)


class Twice(nn.Module):
    """Two modules of one class, one inside the other: the outer's live frame is another call (not merged)."""

    def __init__(self, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) if self.inner is None else self.inner(x)
        return torch.log(h.abs()) if self.inner is None else self.lin(h)


def test_the_producers_forward_stands_once_in_a_script() -> None:
    model = Net()
    with torch.no_grad():
        model.fc1.bias.zero_()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, mode="full"):
        model(torch.zeros(8, 4)).sum().backward()
    entries = user_entries(caught.value.__traceback__)
    assert [name for name, _line in entries].count("forward") == 1, entries
    assert [frame.function for frame in caught.value.report.frames].count("forward") == 1


@pytest.mark.parametrize("options", [{}, {"mode": "full"}, {"ops": True}], ids=["default", "full", "ops"])
def test_a_forward_checked_a_line_after_the_producer_stands_once(options: dict[str, Any]) -> None:
    model = TwoLines()
    with torch.no_grad():
        model.fc1.bias.zero_()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, **options):
        model(torch.zeros(8, 4)).sum().backward()
    report = caught.value.report
    assert report.source.line.endswith("# here"), report.source
    entries = user_entries(caught.value.__traceback__)
    assert [name for name, _line in entries].count("forward") == 1, entries
    assert entries[-1] == ("forward", report.source.lineno), entries
    assert [frame.function for frame in report.frames].count("forward") == 1, report.frames


def test_a_module_inside_one_of_its_class_keeps_both_frames() -> None:
    model = Twice(Twice())
    with torch.no_grad():
        model.inner.lin.weight.zero_()
        model.inner.lin.bias.zero_()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, mode="full"):
        model(torch.ones(2, 4))
    report = caught.value.report
    assert (report.module, report.op) == ("inner", "aten.log.default"), report.message
    entries = user_entries(caught.value.__traceback__)
    # the outer's call (at the line that called inner) and the inner's producing line: two calls, both shown
    assert [name for name, _line in entries].count("forward") == 2, entries


class Recursive(nn.Module):
    """A forward that calls itself on the same module: the live call (depth 1) and the producing one (depth 0) are
    two calls of one function with the same ``self``: both stay (review of hunt-c-s41)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, depth: int = 1) -> torch.Tensor:
        if depth == 0:
            return torch.log(x.abs())  # here
        h = self.forward(x, depth - 1)
        return self.lin(h)


def _recurse(x: torch.Tensor, layer: nn.Module, n: int) -> torch.Tensor:
    if n == 0:
        return torch.log(x.abs())  # here
    return layer(_recurse(x, layer, n - 1))


class CallsARecursion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _recurse(x, self.lin, 1)


@pytest.mark.parametrize("options", [{}, {"mode": "full"}, {"ops": True}], ids=["default", "full", "ops"])
@pytest.mark.parametrize(("make", "function", "argument"), [(Recursive, "forward", "depth"),
                                                            (CallsARecursion, "_recurse", "n")],
                         ids=["method", "function"])
def test_a_recursion_keeps_the_call_that_made_the_producing_one(
        make: type[nn.Module], function: str, argument: str, options: dict[str, Any]) -> None:
    model = make()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, **options):
        model(torch.zeros(2, 4))
    report = caught.value.report
    assert (report.op, report.source.line.endswith("# here")) == ("aten.log.default", True), report.message
    depths, tb = [], caught.value.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == function and not is_library_file(tb.tb_frame.f_code.co_filename):
            depths.append(tb.tb_frame.f_locals.get(argument))
        tb = tb.tb_next
    assert depths == [1, 0], depths
    assert [frame.function for frame in report.frames].count(function) == 2, report.frames
