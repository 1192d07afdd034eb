"""The magics through a real in-process IPython shell."""

from __future__ import annotations

import io
import sys
from unittest import mock

import pytest
from conftest import global_hook_counts
from IPython.utils.capture import capture_output

SETUP = """
import torch
from torch import nn

class LogLayer(nn.Module):
    def forward(self, x):
        h = x * 1.0
        return torch.log(h)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.log = LogLayer()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.encoder(x)
        h = self.log(h)
        return self.head(h)

torch.manual_seed(0)
model = Net()
other = nn.Linear(3, 3)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(5, 4)
steps_run = 0
"""

TRAIN = """
for step in range(10):
    steps_run += 1
    loss = model(x).abs().mean()
    opt.zero_grad(); loss.backward(); opt.step()
"""


@pytest.fixture
def ns(ip):
    ip.run_cell(SETUP)
    for name in ("_nan_report", "rep"):
        ip.user_ns.pop(name, None)
    yield ip.user_ns
    ip.run_line_magic("nanwatch", "off")


def debug_session(ip, commands: str) -> str:
    """Run %debug with scripted pdb commands; returns what pdb printed.

    IPython keeps one Pdb per shell, bound to the stdin it first saw: drop it
    so that this session reads the scripted commands.
    """
    ip.InteractiveTB.pdb = None
    with mock.patch("sys.stdin", io.StringIO(commands)), capture_output() as captured:
        ip.run_line_magic("debug", "")
    return captured.stdout


def run(ip, cell: str):
    with capture_output() as captured:
        result = ip.run_cell(cell)
    return result, captured


def test_nantrace_stops_at_the_first_nonfinite_and_stores_the_report(ip, ns) -> None:
    result, captured = run(ip, "%%nantrace\n" + TRAIN)
    from nan_magic import NonFiniteError

    assert isinstance(result.error_in_exec, NonFiniteError)
    assert ns["steps_run"] == 1  # stopped inside the first step
    report = ns["_nan_report"]
    assert (report.phase, report.model, report.module, report.module_type) == ("forward", "model", "log", "LogLayer")
    assert report.step == 0 and report.nan > 0
    # the report opens under the error: displayed after the cell, as text and HTML
    assert any("log (LogLayer)" in out.data.get("text/plain", "") for out in captured.outputs)
    assert any("text/html" in out.data for out in captured.outputs)


def test_traceback_is_short_and_ends_in_the_users_frame(ip, ns) -> None:
    run(ip, "%%nantrace model\n" + TRAIN)
    tb = sys.last_traceback
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame
    # the line that called the producing module, inside the user's Net.forward
    assert frame.f_code.co_name == "forward"
    assert frame.f_locals["self"].__class__.__name__ == "Net"
    assert "h" in frame.f_locals
    assert ns["_nan_report"].debug_frame.line == "h = self.log(h)"


def test_debug_opens_in_the_producing_frame(ip, ns) -> None:
    run(ip, "%%nantrace model\n" + TRAIN)
    printed = debug_session(ip, "p type(self).__name__\np tuple(h.shape)\nq\n")
    assert "'Net'" in printed
    assert "(5, 8)" in printed


def test_output_option_names_the_variable(ip, ns) -> None:
    run(ip, "%%nantrace model opt -o rep\n" + TRAIN)
    assert ns["rep"].module == "log"
    assert "_nan_report" not in ns


def test_last_expression_is_displayed_and_healthy_cells_run_normally(ip, ns) -> None:
    result, _ = run(ip, "%%nantrace other\ny = other(torch.ones(1, 3))\ny.shape[1] + 1")
    assert result.error_in_exec is None
    assert result.result == 4
    assert "_nan_report" not in ns


def test_auto_discovery_watches_top_level_modules_once(ip, ns) -> None:
    from nan_magic.magics import _discover

    labels, values = _discover(ns)
    assert "model" in labels and "other" in labels and "opt" in labels
    # the submodules of model are not separate targets
    assert all(value is not ns["model"].encoder for value in values)


def test_warn_mode_lets_the_cell_finish(ip, ns) -> None:
    with pytest.warns(RuntimeWarning):
        result, _ = run(ip, "%%nantrace model --warn\n" + TRAIN)
    assert result.error_in_exec is None
    assert ns["steps_run"] == 10
    assert ns["_nan_report"].module == "log"


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        ("%%nantrace modle\nsteps_run = 99", "cannot evaluate target 'modle'"),
        ("%%nantrace x\nsteps_run = 99", "cannot watch x (torch.Tensor)"),
        ("%%nantrace --frobnicate\nsteps_run = 99", "unrecognized arguments: --frobnicate"),
        ("%%nantrace --kinds zero\nsteps_run = 99", "kinds must be a non-empty subset"),
        ("%%nantrace -o 1bad\nsteps_run = 99", "-o needs a Python identifier"),
        ("%%nantrace model\n   \n", "the cell is empty"),
        ("%nanwatch on modle", "cannot evaluate target 'modle'"),
        ("%nanwatch off now", "%nanwatch off takes no arguments"),
    ],
)
def test_bad_input_is_a_one_line_usage_error_and_nothing_runs(ip, ns, cell, message) -> None:
    from IPython.core.error import UsageError

    before = global_hook_counts()
    result, _ = run(ip, cell)
    error = result.error_in_exec
    assert isinstance(error, UsageError), error
    assert message in str(error) and "\n" not in str(error)
    assert ns["steps_run"] == 0
    assert global_hook_counts() == before


def test_nanwatch_arms_only_the_rest_of_the_cell(ip, ns) -> None:
    before = global_hook_counts()
    result, _ = run(ip, "y = model(x)\n%nanwatch model\n" + TRAIN)
    from nan_magic import NonFiniteError

    assert isinstance(result.error_in_exec, NonFiniteError)
    assert ns["_nan_report"].module == "log"
    assert global_hook_counts() == before  # disarmed when the cell ended
    # its traceback was trimmed too: %debug would open in Net.forward
    tb = sys.last_traceback
    while tb.tb_next is not None:
        tb = tb.tb_next
    assert tb.tb_frame.f_code.co_name == "forward"
    result, _ = run(ip, "y = model(x)")
    assert result.error_in_exec is None  # the next cell is not watched


def test_nanwatch_on_watches_every_cell_until_off(ip, ns) -> None:
    before = global_hook_counts()
    _, captured = run(ip, "%nanwatch on model")
    assert "watching every cell" in captured.stdout
    assert global_hook_counts() == before  # nothing attached between cells
    result, _ = run(ip, "y = model(x)")
    assert result.error_in_exec is not None
    _, status = run(ip, "%nanwatch status")
    assert "on for every cell" in status.stdout and "last report" in status.stdout
    run(ip, "%nanwatch off")
    result, _ = run(ip, "y = model(x)")
    assert result.error_in_exec is None
    _, status = run(ip, "%nanwatch status")
    assert "nan_magic: off" in status.stdout
    assert global_hook_counts() == before


def test_help_is_real_help_with_an_example(ip) -> None:
    magic = ip.find_cell_magic("nantrace")
    doc = magic.__doc__
    assert "Example" in doc and "%%nantrace model opt" in doc
    for option in ("--include", "--exclude", "--types", "--warn", "--ops", "-o"):
        assert option in doc
    assert "%nanwatch on" in ip.find_line_magic("nanwatch").__doc__


def test_unload_removes_magics_and_events(ip) -> None:
    shell = ip
    shell.run_line_magic("unload_ext", "nan_magic")
    assert shell.find_cell_magic("nantrace") is None
    assert shell.find_line_magic("nanwatch") is None
    callbacks = shell.events.callbacks["post_run_cell"]
    assert not any(getattr(cb, "__self__", None).__class__.__name__ == "NanMagics" for cb in callbacks)
    shell.run_line_magic("load_ext", "nan_magic")
    assert shell.find_cell_magic("nantrace") is not None


def test_ops_mode_debug_opens_on_the_producing_line_with_its_locals(ip, ns) -> None:
    run(ip, "%%nantrace model --ops\n" + TRAIN)
    report = ns["_nan_report"]
    assert (report.module, report.op) == ("log", "aten.log.default")
    assert report.source.line == "return torch.log(h)"
    assert report.debug_frame.line == "return torch.log(h)"
    assert {name for name, _stats in report.debug_locals} == {"x", "h"}
    printed = debug_session(ip, "p float(h.min()) < 0\nq\n")
    assert "True" in printed  # h, the value log was given, is there to inspect
