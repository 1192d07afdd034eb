"""Post-mortem in a plain script: the traceback's last entry is the producer's line, with its locals.

``python -i train.py`` then ``pdb.pm()``, or a ``sys.excepthook`` that opens a debugger, open the last entry of
the traceback the script died with. In a notebook the cell's frame is never that traceback's first entry
(IPython's frames come first), but in a script whose training loop runs at the top level it is: the watch's exit
then replaces that first entry too (errors/frames.end_at_producer's ``holder``), so the script's post-mortem opens
where the producer ran, as ``%debug`` does in a cell. Each script runs in a fresh interpreter; its excepthook
prints the last entry's function, line and a local.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

HOOK = """
import sys
def _last_entry(kind, value, tb):
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame
    shown = frame.f_locals.get("p")
    print("LAST", frame.f_code.co_name, tb.tb_lineno, None if shown is None else float(shown.sum()))
    print("ERROR", kind.__name__)
sys.excepthook = _last_entry
"""

SETUP = """
import torch, nan_magic
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sigmoid())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8, 4)
defer = len(sys.argv) > 1
"""

TOP_LEVEL_LOOP = """
with nan_magic.watch(model, opt, defer=defer):
    for step in range(3):
        p = model(x) * (0 if step == 2 else 1)
        loss = -torch.log(p).mean()  # producer
        opt.zero_grad()
        loss.backward()
        opt.step()
"""

TOP_LEVEL_HELPER = """
def loss_of(p):
    return -torch.log(p).mean()  # producer

with nan_magic.watch(model, opt, defer=defer):
    for step in range(3):
        p = model(x) * (0 if step == 2 else 1)
        loss = loss_of(p)  # the call
        opt.zero_grad()
        loss.backward()
        opt.step()
"""

LOOP_IN_A_FUNCTION = """
def train():
    with nan_magic.watch(model, opt, defer=defer):
        for step in range(3):
            p = model(x) * (0 if step == 2 else 1)
            loss = -torch.log(p).mean()  # producer
            opt.zero_grad()
            loss.backward()
            opt.step()

train()
"""

# The last iteration's backward has no optimizer step after it: the deferred check judges it as the watch is left.
TOP_LEVEL_TAIL = """
with nan_magic.watch(model, opt, defer=defer):
    for step in range(3):
        p = model(x) * (0 if step == 2 else 1)
        loss = -torch.log(p).mean()  # producer
        opt.zero_grad()
        loss.backward()
        if step < 2:
            opt.step()
"""

HELPER_TAIL = """
def loss_of(p):
    return -torch.log(p).mean()  # producer

with nan_magic.watch(model, opt, defer=defer):
    for step in range(3):
        p = model(x) * (0 if step == 2 else 1)
        loss = loss_of(p)  # the call
        opt.zero_grad()
        loss.backward()
        if step < 2:
            opt.step()
"""

# A backward producer in a loss helper that returned before backward ran: sqrt's gradient at a distance of 0 (the
# targets are the outputs at the last step). The helper's frame is kept while its tensors are small.
BACKWARD_IN_A_HELPER = """
def rmse(out, y):
    p = ((out - y) ** 2).mean()
    return p.sqrt()  # producer

with nan_magic.watch(model, opt, defer=defer):
    for step in range(3):
        out = model(x)
        y = out.detach() if step == 2 else torch.rand(8, 4)
        loss = rmse(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
"""

TIMINGS = [pytest.param([], id="immediate"), pytest.param(["defer"], id="deferred")]


def _run(tmp_path: Path, body: str, argv: list[str]) -> tuple[str, int, str]:
    source = HOOK + SETUP + body
    script = tmp_path / "train.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    last = [line for line in done.stdout.splitlines() if line.startswith("LAST ")]
    assert "ERROR NonFiniteError" in done.stdout, done.stdout + done.stderr
    assert len(last) == 1, done.stdout + done.stderr
    _tag, function, line, shown = last[0].split(" ")
    return function, int(line), shown


def _line_of(body: str, marker: str) -> int:
    source = HOOK + SETUP + body
    return next(number for number, text in enumerate(source.splitlines(), 1) if f"# {marker}" in text)


@pytest.mark.parametrize("argv", TIMINGS)
def test_a_top_level_loop_s_post_mortem_opens_on_the_producing_line_with_its_locals(tmp_path, argv) -> None:
    function, line, shown = _run(tmp_path, TOP_LEVEL_LOOP, argv)
    assert (function, line) == ("<module>", _line_of(TOP_LEVEL_LOOP, "producer"))
    assert shown == "0.0"  # p at that line: the zeros the log read


@pytest.mark.parametrize("argv", TIMINGS)
def test_a_top_level_loop_s_post_mortem_opens_in_the_loss_helper_it_called(tmp_path, argv) -> None:
    function, line, shown = _run(tmp_path, TOP_LEVEL_HELPER, argv)
    assert (function, line) == ("loss_of", _line_of(TOP_LEVEL_HELPER, "producer"))
    assert shown == "0.0"


@pytest.mark.parametrize("argv", TIMINGS)
def test_a_loop_in_a_function_s_post_mortem_opens_on_the_producing_line(tmp_path, argv) -> None:
    function, line, _shown = _run(tmp_path, LOOP_IN_A_FUNCTION, argv)
    assert (function, line) == ("train", _line_of(LOOP_IN_A_FUNCTION, "producer"))


@pytest.mark.parametrize("argv", TIMINGS)
def test_an_event_judged_as_the_watch_is_left_opens_on_the_producing_line(tmp_path, argv) -> None:
    """The deferred check's last step, judged at the exit: the traceback it was raised with ended in nan_magic's own
    check (``raise_agreed``), where a script's post-mortem opened; the with statement's entry now holds it."""
    function, line, shown = _run(tmp_path, TOP_LEVEL_TAIL, argv)
    assert (function, line) == ("<module>", _line_of(TOP_LEVEL_TAIL, "producer"))
    assert shown == "0.0"


@pytest.mark.parametrize("argv", TIMINGS)
def test_an_event_judged_as_the_watch_is_left_opens_in_the_returned_helper(tmp_path, argv) -> None:
    function, line, shown = _run(tmp_path, HELPER_TAIL, argv)
    assert (function, line) == ("loss_of", _line_of(HELPER_TAIL, "producer"))
    assert shown == "0.0"


@pytest.mark.parametrize("argv", TIMINGS)
def test_a_backward_producer_in_a_returned_loss_helper_opens_there(tmp_path, argv) -> None:
    """It opened at ``loss.backward()`` (the helper had returned, its frame let go as backward started), where its
    local ``p``, the zero distance whose root's gradient is infinite, was no longer to be seen."""
    function, line, shown = _run(tmp_path, BACKWARD_IN_A_HELPER, argv)
    assert (function, line) == ("rmse", _line_of(BACKWARD_IN_A_HELPER, "producer"))
    assert shown == "0.0"
