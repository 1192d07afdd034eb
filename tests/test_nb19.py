"""What a user sees of ``%debug`` in a real kernel (round 19): one notebook, executed once by nbclient.

A backward producer (sqrt at 0, its gradient infinite): the report names the forward line that made the
node, whose frame had returned before backward ran. ``%debug`` itself runs in the kernel, given pdb commands
(``p h``, ``where``, ``q``) through ``input``: pdb stands at that forward line, in a replay of the step's call,
with the locals that line left (``h`` all zeros), and the report says it is a replay. The default and the
deferred watch replay the step, mode="full" the call from its gradient hook, ops=True the step's call it kept.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from jupyter_support import execute_cells, named_cell

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

#: ``%debug`` with pdb's commands given through ``input`` (a kernel asks the frontend; nbclient gives no stdin).
DEBUG = (
    "import builtins\n"
    "answers = iter(['p h.abs().max().item()', 'where', 'q'])\n"
    "builtins.input = lambda prompt='': next(answers)\n"
    "%debug"
)

SETUP = (
    "%load_ext nan_magic\nimport torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
    "class Sqrt(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.lin = nn.Linear(4, 4)\n"
    "    def forward(self, x):\n"
    "        h = self.lin(x)\n"
    "        r = h.abs().sqrt()  # the forward line\n"
    "        return r.sum(-1, keepdim=True)\n"
)


MODES = {"default": "", "defer": "--defer", "full": "--full", "ops": "--ops"}
CELLS: dict[str, str] = {"setup": SETUP}
for _mode, _options in MODES.items():
    CELLS[f"model_{_mode}"] = "model = Sqrt()\nopt = torch.optim.SGD(model.parameters(), lr=0.1)"
    CELLS[_mode] = (
        f"%%nantrace model, opt {_options}\n"
        "for step in range(3):\n"
        "    x = torch.randn(8, 4); y = torch.rand(8, 1)\n"
        "    if step == 1:\n"
        "        with torch.no_grad():\n"
        "            model.lin.weight.zero_(); model.lin.bias.zero_()\n"
        "    loss = ((model(x) - y) ** 2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()"
    )
    CELLS[f"{_mode}_debug"] = DEBUG
    CELLS[f"{_mode}_notes"] = "print(*_nan_report.notes, sep='\\n')"
RAISING = set(MODES)


@pytest.fixture(scope="module")
def nb(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return execute_cells(CELLS, RAISING, tmp_path_factory.mktemp("nb19") / "nb19.ipynb")


def stdout(cell: Any) -> str:
    text = "".join(out["text"] for out in cell.outputs if out.get("name") == "stdout")
    return re.sub(r"\x1b\[[0-9;]*m", "", text)  # (the kernel's pdb colours its lines)


@pytest.mark.parametrize("mode", list(MODES))
def test_debug_in_a_kernel_stands_at_the_forward_line_of_a_backward_producer(nb: Any, mode: str) -> None:
    (error,) = [out for out in named_cell(nb, mode).outputs if out.output_type == "error"]
    assert " in backward step 1: " in error.evalue, error.evalue
    printed = stdout(named_cell(nb, f"{mode}_debug"))
    lines = printed.splitlines()
    # ``p h``: the zeros the sqrt read (the weights were zeroed), not a later value
    assert "0.0" in lines, printed
    # ``where``: the frames from the cell's line (the model call, as the replay reached it; the per-call replay
    # from the gradient hook: loss.backward()) to the forward line, where pdb stands (its "> " entry, then "--->")
    current = max(index for index, line in enumerate(lines) if line.startswith("> "))
    assert lines[current].endswith("forward()"), printed
    arrows = [line for line in lines[current:] if re.match(r"\s*-+> ", line)]
    assert arrows and "r = h.abs().sqrt()  # the forward line" in arrows[0], printed
    caller = [line for line in lines[:current] if re.match(r"\s*-+> ", line)]
    called_by = "loss.backward()" if mode == "full" else "loss = ((model(x) - y) ** 2).mean()"
    assert caller and called_by in caller[-1], printed
    notes = stdout(named_cell(nb, f"{mode}_notes"))
    assert "%debug opens a replay of " in notes and "its locals are the replay's" in notes, notes
