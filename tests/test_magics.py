"""The magics through a real in-process IPython shell."""

from __future__ import annotations

import io
import sys
import warnings
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


def test_traceback_ends_in_the_frame_that_ran_the_producing_op(ip, ns) -> None:
    run(ip, "%%nantrace model\n" + TRAIN)
    tb = sys.last_traceback
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame
    # the replay found the op: the producer's own forward at that line, not its parent's call
    assert frame.f_code.co_name == "forward"
    assert frame.f_locals["self"].__class__.__name__ == "LogLayer"
    assert tb.tb_lineno == frame.f_code.co_firstlineno + 2  # return torch.log(h)
    report = ns["_nan_report"]
    assert report.debug_frame.line == "return torch.log(h)"
    assert {name for name, _stats in report.debug_locals} == {"x", "h"}
    assert report.frames[-1].line == "return torch.log(h)"


def test_debug_opens_in_the_producing_frame(ip, ns) -> None:
    run(ip, "%%nantrace model\n" + TRAIN)
    printed = debug_session(ip, "p type(self).__name__\np float(h.min()) < 0\np tuple(h.shape)\nq\n")
    assert "'LogLayer'" in printed
    assert "True" in printed  # h, the value log was given, is there to inspect
    assert "(5, 8)" in printed


ATTENTION = """
class Attention(nn.Module):
    def forward(self, x):
        q = x * 1e20
        att = q @ q.transpose(-2, -1)  # overflows: +inf scores
        att = att - att.amax(-1, keepdim=True)  # inf - inf: NaN
        out = att.softmax(-1)
        return out @ x

attention = Attention()
"""


@pytest.mark.parametrize("options", ["", "--ops", "--defer", "--full"])
def test_debug_and_tb_show_the_producing_line_with_the_state_it_left(ip, ns, options) -> None:
    ip.run_cell(ATTENTION)
    run(ip, f"%%nantrace attention {options}\ny = attention(torch.rand(2, 3, 4) + 1)")
    assert ns["_nan_report"].source.line == "att = q @ q.transpose(-2, -1)  # overflows: +inf scores"
    printed = debug_session(ip, "p bool(att.isinf().any()), bool(att.isnan().any())\np 'out' in dir()\nll\nwhere\nq\n")
    # att is the line's fresh +inf scores, not the NaN the next line made; out, defined later, is absent
    assert "(True, False)" in printed and "False" in printed.split("(True, False)")[1]
    # The arrow of the frame pdb opens, of ll and of where (after the cell's own line): the producing line
    arrows = [line for line in printed.splitlines() if "---->" in line]
    producing = [line for line in arrows if "att = q @ q.transpose(-2, -1)" in line]
    assert len(producing) == 3 and len(arrows) == 4 and "y = attention(" in arrows[2], printed
    with capture_output() as shown:
        ip.run_line_magic("tb", "")
    last = [line for line in shown.stdout.splitlines() if "---->" in line or "-->" in line][-1]
    assert "att = q @ q.transpose(-2, -1)" in last, shown.stdout


def test_output_option_names_the_variable(ip, ns) -> None:
    run(ip, "%%nantrace model opt -o rep\n" + TRAIN)
    assert ns["rep"].module == "log"
    assert "_nan_report" not in ns


def test_last_expression_is_displayed_and_healthy_cells_run_normally(ip, ns) -> None:
    result, _ = run(ip, "%%nantrace other\ny = other(torch.ones(1, 3))\ny.shape[1] + 1")
    assert result.error_in_exec is None
    assert result.result == 4
    assert "_nan_report" not in ns


def test_a_model_the_cell_rebuilds_is_watched_as_the_new_one(ip, ns) -> None:
    ip.run_cell("def build():\n    m = Net()\n    return m, torch.optim.SGD(m.parameters(), lr=0.1)")
    for magic_line in ("%%nantrace", "%%nantrace model opt"):
        old_model = ns["model"]
        run(ip, magic_line + "\nmodel, opt = build()\n" + TRAIN)
        report = ns["_nan_report"]
        assert ns["model"] is not old_model
        assert (report.model, report.module, report.module_type) == ("model", "log", "LogLayer"), magic_line


def test_an_optimizer_the_cell_rebuilds_is_watched_when_named(ip, ns) -> None:
    ip.run_cell("lin = nn.Linear(4, 2)\nfast = torch.optim.SGD(lin.parameters(), lr=0.1)")
    cell = (
        "%%nantrace lin fast\n"
        "lin = nn.Linear(4, 2)\n"
        "fast = torch.optim.SGD(lin.parameters(), lr=1e38)\n"
        "for step in range(3):\n"
        "    loss = lin(x).pow(2).sum()\n"
        "    fast.zero_grad(); loss.backward(); fast.step()\n"
    )
    result, _ = run(ip, cell)
    assert isinstance(result.error_in_exec, FloatingPointError)
    report = ns["_nan_report"]
    assert (report.phase, report.model, report.step) == ("optimizer", "lin", 0)
    for name in ("lin", "fast"):
        ns.pop(name)


def test_with_targets_only_those_models_are_watched(ip, ns) -> None:
    result, _ = run(ip, "%%nantrace other\n" + TRAIN)
    assert result.error_in_exec is not None
    # model is not a target: the NaN is first seen where the watch can see it, not inside model
    assert ns["_nan_report"].model != "model"
    assert ns["_nan_report"].module != "log"


def test_a_compiled_model_is_watched_by_every_mode(ip, ns) -> None:
    from nan_magic import NanMagicWarning

    run(ip, "compiled = torch.compile(nn.Linear(4, 4), backend='aot_eager')")
    run(ip, "%%nantrace\n" + TRAIN)
    assert ns["_nan_report"].module == "log"
    result, _ = run(ip, "%%nantrace\ny = compiled(x)")
    assert result.error_in_exec is None  # the tiered default watches it from outside its graph
    for flag in ("--full", "--ops"):
        with pytest.warns(NanMagicWarning, match="compiled is compiled with torch.compile; under"):
            result, _ = run(ip, f"%%nantrace {flag}\ny = compiled(x)")
        assert result.error_in_exec is None  # run eagerly while the cell runs
    ns.pop("compiled")


def test_the_cell_is_run_by_ipython(ip, ns) -> None:
    cell = (
        "%%nantrace other\n"
        "%time y = other(torch.ones(1, 3))\n"
        "!echo shell-says-hi\n"
        "import asyncio\n"
        "await asyncio.sleep(0)\n"
        "y.shape[1] + 1\n"
    )
    with capture_output() as captured:
        result = ip.run_cell(cell, store_history=True)
    assert result.error_in_exec is None and result.error_before_exec is None
    assert "Wall time" in captured.stdout and "shell-says-hi" in captured.stdout
    # the last value is displayed and kept in the history like any cell's
    assert result.result == 4
    assert ns["Out"][result.execution_count] == 4 and ns["_"] == 4
    # a body that awaits is awaited by the cell, on the loop already running (a kernel's)
    awaited = "await __import__('nan_magic.ipython.magics').ipython.magics.awaiting_nantrace("
    assert ns["In"][result.execution_count].startswith(awaited)
    result = ip.run_cell("%%nantrace other\n%time y = other(torch.ones(1, 3))\ny.shape[1] + 2", store_history=True)
    assert result.result == 5 and ns["_"] == 5
    assert ns["In"][result.execution_count].startswith("get_ipython().run_cell_magic('nantrace', 'other', ")


def test_the_users_custom_exception_handler_survives(ip, ns) -> None:
    seen = []

    def handler(shell, etype, value, tb, tb_offset=None):
        seen.append(etype)

    ip.set_custom_exc((ZeroDivisionError,), handler)
    try:
        run(ip, "%%nantrace\n" + TRAIN)
        run(ip, "%nanwatch model\n" + TRAIN)
        run(ip, "1 / 0")
        assert seen == [ZeroDivisionError]
        assert ip.custom_exceptions == (ZeroDivisionError,)
    finally:
        ip.set_custom_exc((), None)


def test_the_short_error_comes_first_and_names_cells(ip, ns) -> None:
    _, captured = run(ip, "%%nantrace\n" + TRAIN)
    # the short error is printed while the cell stops, the report displayed after it
    error_part = captured.stdout
    assert any("log (LogLayer)" in out.data.get("text/plain", "") for out in captured.outputs)
    lines = error_part.strip().splitlines()
    # the headline broken between its clauses, never mid-word by the frontend: what and where, then the op
    assert lines[0] == "NonFiniteError: first non-finite value in forward step 0: log (LogLayer)"
    assert lines[1].startswith("  op aten.log.default at Cell In[")
    assert len(lines) <= 15
    # the cell's line (line 5 of the cell as typed, magic line included) and the producer's line
    assert "Cell In[" in lines[2] and lines[2].endswith(", line 5")
    assert lines[3].strip() == "loss = model(x).abs().mean()"
    assert any(line.strip() == "return torch.log(h)" for line in lines)
    assert "run_cell_magic" not in error_part and "module.py" not in error_part
    report_text = ns["_nan_report"].to_text()
    assert "Cell In[" in report_text and "ipython-input" not in report_text and "/tmp/" not in report_text
    # the report below it names the source as the user knows it
    assert str(ns["_nan_report"].source).startswith("Cell In[")


def test_tb_shows_the_full_traceback(ip, ns) -> None:
    run(ip, "%%nantrace\n" + TRAIN)
    with capture_output() as captured:
        ip.run_line_magic("tb", "")
    # The tiered watch raises once the model's call returned, after its replay: the traceback runs
    # from the cell's line to the producer's frame (the per-module watch raises inside the forward).
    assert "Traceback (most recent call last)" in captured.stdout
    assert "loss = model(x).abs().mean()" in captured.stdout
    assert "return torch.log(h)" in captured.stdout  # the producer's frame, from the replay
    engine = ("hot", "localize", "lifecycle", "explain", "errors", "scene", "patches", "distributed")
    assert not [part for part in engine if f"nan_magic/{part}/" in captured.stdout]  # our hook's frames were cut


def test_bare_nanwatch_watches_the_rest_of_the_cell_with_every_target(ip, ns) -> None:
    before = global_hook_counts()
    result, _ = run(ip, "y = model(x)\n%nanwatch\n" + TRAIN)
    assert isinstance(result.error_in_exec, FloatingPointError)
    assert (ns["_nan_report"].model, ns["_nan_report"].module) == ("model", "log")
    assert global_hook_counts() == before
    _, status = run(ip, "%nanwatch status")
    assert "nan_magic: off" in status.stdout and "last report" in status.stdout


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
        # Both ways to go on: the last one won in silence (the cell logged, though --warn was asked for).
        ("%%nantrace model --warn --log\nsteps_run = 99", "argument --log: not allowed with --warn"),
        ("%nanwatch on --log --warn", "argument --warn: not allowed with --log"),
        ("%%nantrace -o 1bad\nsteps_run = 99", "-o needs a Python identifier"),
        ("%%nantrace model\n   \n", "the cell is empty"),
        ("%nanwatch on modle", "cannot evaluate target 'modle'"),
        ("%nanwatch off now", "%nanwatch off takes no arguments"),
        ("%nanwatch of\nsteps_run = 99", "'of' is not on, off or status, nor a name defined here"),
        ("%nanwatch model\n%nanwatch model\nsteps_run = 99", "a watch is already armed for this cell"),
        ("%nanreplay scene.pt -o 1bad\nsteps_run = 99", "%nanreplay: -o needs a Python identifier"),
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


def test_a_nantrace_cell_takes_over_from_nanwatch_on(ip, ns) -> None:
    before = global_hook_counts()
    run(ip, "%nanwatch on other")
    result, _ = run(ip, "%%nantrace model\n" + TRAIN)
    assert isinstance(result.error_in_exec, FloatingPointError)
    assert (ns["_nan_report"].model, ns["_nan_report"].module) == ("model", "log")
    run(ip, "%nanwatch off")
    assert global_hook_counts() == before


def test_run_cell_magic_called_directly_runs_the_body_through_the_shell(ip, ns) -> None:
    before = global_hook_counts()
    with capture_output():
        ip.run_cell_magic("nantrace", "model", "%time " + TRAIN.strip().splitlines()[2].strip() + "\n" + TRAIN)
    assert (ns["_nan_report"].model, ns["_nan_report"].module) == ("model", "log")
    assert global_hook_counts() == before


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


SPLIT_SETUP = """
class Shifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log = LogLayer()

    def forward(self, x):
        return self.log(self.lin(x).abs() + x[:, :1])

torch.manual_seed(0)
shifted = Shifted()
sgd = torch.optim.SGD(shifted.parameters(), lr=0.01)
batches = [torch.rand(3, 4) for _ in range(8)]
batches[5] = torch.full((3, 4), -100.0)  # log of negatives in the 6th iteration
i = 0
"""
SPLIT_FORWARD = "loss = shifted(batches[i]).mean(); sgd.zero_grad(); loss.backward()"
SPLIT_STEP = "sgd.step(); i += 1"


def test_nanwatch_on_counts_a_loop_split_over_cells_as_one_run(ip, ns) -> None:
    before = global_hook_counts()
    ip.run_cell(SPLIT_SETUP)
    run(ip, "%nanwatch on")
    failed = None
    for iteration in range(8):
        result, _ = run(ip, SPLIT_FORWARD)
        assert global_hook_counts() == before  # paused between cells: nothing attached
        if result.error_in_exec is not None:
            failed = iteration
            break
        run(ip, SPLIT_STEP)
    assert failed == 5
    report = ns["_nan_report"]
    assert (report.module, report.step) == ("log", 5)  # the user's iteration, as one cell would count it
    assert report.message.startswith("first non-finite value in forward step 5: log (LogLayer)")
    assert [entry.step for entry in report.history] == [0, 1, 2, 3, 4]
    # The run raised: the next cell starts a new one, counted from step 0.
    ns["i"] = 5
    result, _ = run(ip, SPLIT_FORWARD)
    assert ns["_nan_report"].step == 0 and not ns["_nan_report"].history
    run(ip, "%nanwatch off")
    assert global_hook_counts() == before


def test_an_error_of_the_users_own_leaves_the_run_going_on(ip, ns) -> None:
    ip.run_cell(SPLIT_SETUP)
    run(ip, "%nanwatch on shifted")
    for _ in range(2):
        run(ip, SPLIT_FORWARD)
        run(ip, SPLIT_STEP)
    result, _ = run(ip, "undefined_name")  # a typo: the run is not over
    assert isinstance(result.error_in_exec, NameError)
    for _ in range(3):
        run(ip, SPLIT_FORWARD)
        run(ip, SPLIT_STEP)
    result, _ = run(ip, SPLIT_FORWARD)
    assert result.error_in_exec is not None
    assert ns["_nan_report"].step == 5
    run(ip, "%nanwatch off")


def test_a_terminal_nantrace_cell_still_ends_at_a_blank_line(ip) -> None:
    # check_complete decides when terminal IPython runs what was typed; a cell magic ends at a blank line
    check = ip.input_transformer_manager.check_complete
    assert check("%%nantrace model\ny = model(x)\n")[0] == "incomplete"
    assert check("%%nantrace model\ny = model(x)\n\n")[0] == "complete"


def test_help_is_real_help_with_an_example(ip) -> None:
    magic = ip.find_cell_magic("nantrace")
    doc = magic.__doc__
    assert "Example" in doc and "%%nantrace model opt" in doc
    for option in ("--include", "--exclude", "--types", "--warn", "--ops", "-o"):
        assert option in doc
    from nan_magic.options import WATCH_OPTIONS

    for magic_doc in (doc, ip.find_line_magic("nanwatch").__doc__):  # every watch option, with its help
        words = " ".join(magic_doc.split())
        for flags, spec in WATCH_OPTIONS:
            assert flags[0] in words and " ".join(spec["help"].split()) in words, flags
    assert "%nanwatch on" in ip.find_line_magic("nanwatch").__doc__


@pytest.mark.parametrize(
    ("query", "expected"), [("%%nantrace?", "%%nantrace model opt"), ("%nanwatch?", "%nanwatch on")]
)
def test_help_is_reachable_the_ipython_way(ip, query, expected) -> None:
    # IPython turns "%%nantrace?" into its pinfo magic, which pages the docstring
    pages = []
    with mock.patch("IPython.core.page.page", lambda strng, *args, **kwargs: pages.append(strng)):
        result, _ = run(ip, query)
    assert result.error_before_exec is None and result.error_in_exec is None
    text = str(pages)
    assert expected in text and "Example" in text


def test_unload_disarms_unregisters_events_and_leaves_ipython_alone(ip) -> None:
    import warnings

    from IPython.core.error import UsageError

    shell = ip
    before = global_hook_counts()
    magics_before = {kind: dict(names) for kind, names in shell.magics_manager.magics.items()}
    from nan_magic.patches import registry as patches

    assert (warnings, "formatwarning") in patches.installed()  # the cell-named printer, ours while loaded
    pythons = warnings.formatwarning.__wrapped__
    shell.run_cell(SETUP)
    shell.run_line_magic("nanwatch", "on model")
    shell.run_line_magic("unload_ext", "nan_magic")
    for event in ("pre_run_cell", "post_run_cell"):  # the events the extension registers
        callbacks = shell.events.callbacks[event]
        assert not any(getattr(cb, "__self__", None).__class__.__name__ == "NanMagics" for cb in callbacks)
    # IPython has no public way to remove a magic: ours stay, answer in one line, and arm nothing.
    assert shell.magics_manager.magics == magics_before
    result = shell.run_cell("%%nantrace model\ny = model(x)")
    assert isinstance(result.error_in_exec, UsageError) and "nan_magic is unloaded" in str(result.error_in_exec)
    result = shell.run_cell("y = model(torch.full((1, 4), float('nan')))")
    assert result.error_in_exec is None  # "%nanwatch on" ended with the extension
    assert global_hook_counts() == before
    # The cell-named warnings' patch (warning_lines.py) went with the extension: Python's own printer is back.
    assert warnings.formatwarning is pythons and (warnings, "formatwarning") not in patches.installed()
    shell.run_line_magic("load_ext", "nan_magic")
    result = shell.run_cell("%%nantrace model\ny = model(torch.full((1, 4), float('nan')))")
    assert isinstance(result.error_in_exec, FloatingPointError)


def test_ops_mode_debug_opens_on_the_producing_line_with_its_locals(ip, ns) -> None:
    run(ip, "%%nantrace model --ops\n" + TRAIN)
    report = ns["_nan_report"]
    assert (report.module, report.op) == ("log", "aten.log.default")
    assert report.source.line == "return torch.log(h)"
    assert report.debug_frame.line == "return torch.log(h)"
    assert {name for name, _stats in report.debug_locals} == {"x", "h"}
    printed = debug_session(ip, "p float(h.min()) < 0\nq\n")
    assert "True" in printed  # h, the value log was given, is there to inspect


SCRIPT_CELL = """%%nantrace
import torch
from torch import nn
model = nn.Linear(3, 3)
x = torch.ones(2, 3)
x[0, 0] = float("inf")
y = model(x)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["script.ipy", "-c"])
def test_terminal_ipython_prints_the_short_error_and_the_text_report(tmp_path, how) -> None:
    import os
    import subprocess
    from pathlib import Path

    (tmp_path / "cell.ipy").write_text(SCRIPT_CELL)
    # No terminal title: under an xterm TERM, IPython writes its escape sequence before any output.
    command = [sys.executable, "-m", "IPython", "--no-banner", "--TerminalInteractiveShell.term_title=False",
               "--ext", "nan_magic"]
    command += ["cell.ipy"] if how == "script.ipy" else ["-c", SCRIPT_CELL]
    env = {**os.environ, "IPYTHONDIR": str(tmp_path / "ipython"),
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    out = done.stdout
    assert out.startswith("NonFiniteError: first non-finite input[0] in data step 0: Linear (root)"), out
    assert "Cell In[1], line 7\n    y = model(x)" in out
    # then the text report, after the error
    assert out.index("\n  producer    Linear (root)") > out.index("Cell In[1], line 7")
    assert "bad-input-data" in out


@pytest.mark.parametrize("magic", ["%%nantrace other", "%nanwatch on other"])
def test_an_interrupted_cell_leaves_the_watch_and_the_model_clean(ip, ns, magic) -> None:
    from nan_magic.patches import registry as patches

    before = global_hook_counts()
    cell = "y = other(torch.ones(1, 3))\nraise KeyboardInterrupt\n"
    if magic.startswith("%%"):
        result, _ = run(ip, magic + "\n" + cell)
    else:
        run(ip, magic)
        result, _ = run(ip, cell)
        run(ip, "%nanwatch off")
    assert isinstance(result.error_in_exec, KeyboardInterrupt)  # the cell's own outcome, as IPython saw it
    assert global_hook_counts() == before
    assert patches.installed() == [(warnings, "formatwarning")]  # (the loaded extension's printer only)
    assert not ns["other"]._forward_hooks and not ns["other"]._forward_pre_hooks
    result, _ = run(ip, "y = other(torch.full((1, 3), float('nan')))")
    assert result.error_in_exec is None  # nothing watches the next cell


def test_an_event_found_as_the_watch_is_left_is_the_cells_error_and_the_report_follows(ip, ns) -> None:
    # The deferred check runs once per step: an inference step's runs as the watch is left, after the body.
    result, captured = run(ip, "%%nantrace model --defer\ny = model(torch.full((2, 4), float('nan')))\n")
    from nan_magic import NonFiniteError

    assert isinstance(result.error_in_exec, NonFiniteError)
    assert captured.stdout.lstrip().startswith("NonFiniteError: first non-finite")
    assert ns["_nan_report"].phase == "data"
    assert any("text/html" in out.data for out in captured.outputs)  # displayed after the error


def test_the_body_is_named_after_the_cell_that_runs_it(ip, ns) -> None:
    with capture_output() as captured:
        result = ip.run_cell("%%nantrace model\n\ny = model(x)\n" + TRAIN, store_history=True)
    assert isinstance(result.error_in_exec, FloatingPointError)
    assert f"Cell In[{result.execution_count}], line 3" in captured.stdout  # as typed, blank line included
    assert ns["Out"].get(result.execution_count) is None and ip.execution_count == result.execution_count + 1
    result = ip.run_cell("%%nantrace other\n1 + 1", store_history=True)
    assert ns["Out"][result.execution_count] == 2


def test_nanwatch_off_turns_the_watch_off_for_the_rest_of_its_own_cell(ip, ns) -> None:
    # "%nanwatch off" then "%nanwatch status" in one cell said "armed for this cell", and the rest of the cell
    # stayed watched: the model's NaN below the off line raised NonFiniteError.
    before = global_hook_counts()
    run(ip, "%nanwatch on model")
    result, captured = run(ip, "%nanwatch off\n%nanwatch status\ny = model(x)\nprint('ran', bool(y.isnan().any()))")
    assert result.error_in_exec is None
    # (the status also names the last report of the earlier tests' cells, kept since round 20: test_magics_said.py)
    said = [line for line in captured.stdout.splitlines() if not line.startswith("last report: ")]
    assert said == ["nan_magic: watch off", "nan_magic: off", "ran True"]
    assert global_hook_counts() == before


def test_targets_separated_by_commas_are_the_same_targets(ip, ns) -> None:
    # "%%nantrace model, opt" was a usage error: "cannot watch model, (builtins.tuple)".
    result, _ = run(ip, "%%nantrace model, opt\n" + TRAIN)
    assert isinstance(result.error_in_exec, FloatingPointError)
    report = ns["_nan_report"]
    assert (report.model, report.module, report.op) == ("model", "log", "aten.log.default")
    # A subscript keeps its own comma: it is one expression, evaluated as written.
    ns["grid"] = {(0, 1): ns["model"]}
    result, _ = run(ip, "%%nantrace grid[0,1] opt\nsteps_run = 5")
    assert result.error_in_exec is None and ns["steps_run"] == 5


def test_nanwatch_on_again_while_on_says_it_starts_a_new_run(ip, ns) -> None:
    """A setup cell holding ``%nanwatch on`` run again (its model made anew, maybe): a new run, whose steps count
    from 0, as after off and on; the line says so, so a step number is not read against the old count."""
    ip.run_cell(SPLIT_SETUP)
    _, first = run(ip, "%nanwatch on")
    assert "it was on" not in first.stdout
    for _ in range(3):
        run(ip, SPLIT_FORWARD)
        run(ip, SPLIT_STEP)
    _, again = run(ip, "%nanwatch on")
    said = again.stdout.strip()
    assert said.endswith("until %nanwatch off; it was on: a new run, its steps counted from 0"), said
    ns["i"] = 5  # (the forward's NaN iteration)
    result, _ = run(ip, SPLIT_FORWARD)
    assert result.error_in_exec is not None and ns["_nan_report"].step == 0
    run(ip, "%nanwatch off")
    _, after_off = run(ip, "%nanwatch on")
    assert "it was on" not in after_off.stdout
    run(ip, "%nanwatch off")
