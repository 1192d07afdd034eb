"""What a user met in a real kernel in round 21, run once by nbclient: each cell's own output.

``%nanwatch on`` with a mistyped ``--include``: the warning came one cell late (at ``%nanwatch off``) and named
``asyncio/events.py:80``, the kernel's event loop. A shape mismatch in a watched cell showed nan_magic's
``__torch_dispatch__`` frame under the user's line (and ``%debug`` opened there). An abbreviated option
(``--ful``) was taken for another.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from jupyter_support import execute_cells, named_cell

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

DEBUG = "import builtins\nanswers = iter(['p y.shape', 'q'])\nbuiltins.input = lambda prompt='': next(answers)\n%debug"
CELLS = {
    "setup": (
        "%load_ext nan_magic\nimport torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
        "net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.01)"
    ),
    # (No targets: the models are known as the cell ends, where the filters are judged, from IPython's cell events.)
    "on_typo": "%nanwatch on --include nosuch\nprint(net(torch.randn(2, 4)).shape)",
    "watched": "print(net(torch.randn(2, 4)).shape)",
    "mistake": "x = torch.randn(2, 4)\ny = net(x)\nz = y @ torch.randn(3, 3)",
    "mistake_debug": DEBUG,
    "off": "%nanwatch off",
    "abbreviated": "%%nantrace net opt --ful\nprint('ran')",
}
RAISING = {"mistake", "abbreviated"}


@pytest.fixture(scope="module")
def nb(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return execute_cells(CELLS, RAISING, tmp_path_factory.mktemp("nb21") / "nb21.ipynb")


def stream(cell: Any, name: str = "stdout") -> str:
    return "".join(out["text"] for out in cell.outputs if out.output_type == "stream" and out["name"] == name)


def test_an_unmatched_include_under_nanwatch_on_warns_in_the_cell_that_ran_without_a_false_place(nb: Any) -> None:
    # The cell of %nanwatch on is watched from that line (it ran the model): said there, once.
    warned = stream(named_cell(nb, "on_typo"), "stderr")
    assert "include pattern 'nosuch' matches no module of the watched models" in warned, warned
    # Not at asyncio/events.py:80 or traitlets' app.start(): no user line is the place of a cell's end.
    assert warned.startswith("NanMagicWarning: nan_magic: include pattern"), warned
    for other in ("watched", "mistake", "off"):  # not again at the next cells or at the off
        assert "matches no module" not in stream(named_cell(nb, other), "stderr"), other


def test_a_shape_mismatch_under_nanwatch_on_is_the_users_own_traceback_and_debug(nb: Any) -> None:
    (error,) = [out for out in named_cell(nb, "mistake").outputs if out.output_type == "error"]
    shown = "\n".join(error["traceback"])
    assert error["ename"] == "RuntimeError" and "cannot be multiplied" in error["evalue"]
    assert "nan_magic" not in shown and "__torch_dispatch__" not in shown and "skipping hidden" not in shown, shown
    printed = re.sub(r"\x1b\[[0-9;]*m", "", stream(named_cell(nb, "mistake_debug")))  # (pdb's colours)
    assert "z = y @ torch.randn(3, 3)" in printed and "torch.Size([2, 1])" in printed, printed  # the cell's line


def test_an_abbreviated_option_is_refused_in_one_line(nb: Any) -> None:
    cell = named_cell(nb, "abbreviated")
    said = stream(cell, "stderr")  # (IPython shows a UsageError as one line on stderr)
    assert said.startswith("UsageError: %%nantrace: unrecognized arguments: --ful (did you mean --full?); the "), said
    assert said.count("\n") == 1 and "ran" not in stream(cell), said
