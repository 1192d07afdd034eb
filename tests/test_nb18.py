"""What a user sees in a real kernel (round 18): one notebook, executed once by nbclient.

A batch normalised in the loop by a zero std and a NaN label read by the loss: the frame ``%debug`` opens
(``sys.last_traceback``'s last entry) is the report's line, and pdb, run on it, stands there. A misspelled
``--include`` / ``types``: one warning line in the cell's stderr, the cell runs on. A producer at a cell's top
level is named ``<module>``. Runs on the current stack and on Colab's (scripts/test runs it in .venv-colab).
"""

from __future__ import annotations

from typing import Any

import pytest
from jupyter_support import execute_cells, named_cell

from nan_magic.locations import function_name

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

#: Prints what %debug would open: its frame's function and line, the report's, and pdb's current line.
DEBUG_AT = (
    "import io, sys\n"
    "from IPython.core.debugger import Pdb\n"
    "tb = sys.last_traceback\n"
    "while tb.tb_next is not None:\n"
    "    tb = tb.tb_next\n"
    "r = _nan_report\n"
    "print(r.phase, tb.tb_frame.f_code.co_name, tb.tb_lineno, r.source.function, r.source.lineno, sep=' | ')\n"
    "out = io.StringIO()\n"
    "pdb = Pdb(stdin=io.StringIO('where\\nq\\n'), stdout=out)\n"
    "pdb.use_rawinput = False\n"
    "pdb.reset(); pdb.interaction(None, sys.last_traceback)\n"
    "import re\n"
    "shown = re.sub(r'\\x1b\\[[0-9;]*m', '', out.getvalue())  # (the kernel's pdb colours its lines)\n"
    "print([line for line in shown.splitlines() if '---->' in line or line.startswith('> ')][-1])"
)

CELLS = {
    "setup": (
        "%load_ext nan_magic\nimport warnings\nimport torch\nfrom torch import nn\nimport nan_magic\n"
        "torch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)"
    ),
    "normalised": (
        "%%nantrace model, opt\n"
        "for step in range(3):\n"
        "    x = torch.randn(8, 4); y = torch.randn(8, 1)\n"
        "    if step == 1:\n"
        "        x[:, 2] = 1.0  # a constant feature: its std is 0\n"
        "    x = (x - x.mean(0)) / x.std(0)\n"
        "    loss = ((model(x) - y) ** 2).mean()\n"
        "    opt.zero_grad(); loss.backward(); opt.step()"
    ),
    "normalised_debug": DEBUG_AT,
    "label": (
        "%%nantrace model, opt --defer\n"
        "for step in range(3):\n"
        "    x = torch.randn(8, 4); y = torch.randn(8, 1)\n"
        "    if step == 1:\n"
        "        y[0] = float('nan')\n"
        "    out = model(x)\n"
        "    loss = nn.functional.mse_loss(out, y)\n"
        "    opt.zero_grad(); loss.backward(); opt.step()"
    ),
    "label_debug": DEBUG_AT,
    "include_typo": "%%nantrace model --include 'O.*'\nran = model(torch.randn(2, 4))\nprint('ran', ran.shape)",
    "types_typo": (
        "with nan_magic.watch(model, types=['Linaer']):\n    ran = model(torch.randn(2, 4))\nprint('ran', ran.shape)"
    ),
    # As tests/test_colab_env.py's on IPython 7: a cell's top level is named "<module>" on both stacks.
    "top_level": (
        "%%nantrace\nlin = nn.Linear(2, 2)\n\nfor i in range(1):\n    z = lin(torch.randn(2, 2))\n"
        "w = torch.log(z - 9)\nq = lin(w)"
    ),
    "top_level_fields": "r = _nan_report\nprint(r.source, r.debug_frame, *r.frames, sep=' | ')",
}
RAISING = {"normalised", "label", "top_level"}


@pytest.fixture(scope="module")
def nb(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return execute_cells(CELLS, RAISING, tmp_path_factory.mktemp("nb18") / "nb18.ipynb")


def stdout(cell: Any) -> list[str]:
    return "".join(out["text"] for out in cell.outputs if out.get("name") == "stdout").splitlines()


def stderr(cell: Any) -> str:
    return "".join(out["text"] for out in cell.outputs if out.get("name") == "stderr")


@pytest.mark.parametrize(
    ("cell", "function", "line", "text"),
    [
        ("normalised", "<module>", 6, "x = (x - x.mean(0)) / x.std(0)"),
        ("label", "<module>", 7, "loss = nn.functional.mse_loss(out, y)"),
    ],
)
def test_debug_opens_at_the_line_the_report_names_for_data_the_loop_made(
    nb: Any, cell: str, function: str, line: int, text: str
) -> None:
    (error,) = [out for out in named_cell(nb, cell).outputs if out.output_type == "error"]
    assert " in data step 1: " in error.evalue and f", line {line} (" in error.evalue
    printed = stdout(named_cell(nb, cell + "_debug"))
    # (IPython 7's pdb says "[... skipping 1 hidden frame(s)]" on the kernel's own stdout, between the two)
    where, pdb_line = printed[0], printed[-1]
    phase, frame_function, frame_line, report_function, report_line = where.split(" | ")
    assert phase == "data"
    assert (int(frame_line), int(report_line)) == (line, line)
    # (IPython 7 names the cell's code "<cell line: 0>"; the report, as IPython 8+, "<module>")
    assert function_name(frame_function) == report_function == function
    assert text in pdb_line  # pdb's current line: the producing line, not the model call or backward()


def test_an_unmatched_include_pattern_warns_in_one_line_and_the_cell_runs(nb: Any) -> None:
    cell = named_cell(nb, "include_typo")
    assert not [out for out in cell.outputs if out.output_type == "error"]
    assert stdout(cell) == ["ran torch.Size([2, 1])"]
    warned = [line for line in stderr(cell).splitlines() if "NanMagicWarning" in line]
    assert len(warned) == 1, stderr(cell)
    assert "include pattern 'O.*' matches no module of the watched models" in warned[0]
    assert "(their module names: 0, 1, 2)" in warned[0]


def test_an_unmatched_type_given_to_watch_warns_in_one_line_and_the_cell_runs(nb: Any) -> None:
    cell = named_cell(nb, "types_typo")
    assert not [out for out in cell.outputs if out.output_type == "error"]
    assert stdout(cell) == ["ran torch.Size([2, 1])"]
    warned = [line for line in stderr(cell).splitlines() if "NanMagicWarning" in line]
    assert len(warned) == 1, stderr(cell)
    assert "types entry 'Linaer' matches no module of the watched models" in warned[0]
    assert "(their module types: Linear, ReLU)" in warned[0]


def test_a_cells_top_level_line_is_named_as_on_colabs_stack(nb: Any) -> None:
    n = named_cell(nb, "top_level").execution_count
    fields = "\n".join(stdout(named_cell(nb, "top_level_fields"))).split(" | ")
    at = f"Cell In[{n}], line 6, in <module>"
    assert fields == [at, at, f"Cell In[{n}], line 7, in <module>", at]
