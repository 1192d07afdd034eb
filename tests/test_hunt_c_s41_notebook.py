"""A notebook session in a real kernel (nbclient): ``%%nantrace --full``, then ``%tb`` and ``%debug``; then
``%nanwatch on --warn`` over two cells of a run whose NaN reached the weights, then ``%nanwatch off``.

What the person saw before session 41's fixes (hunt-c-s41):
- the short error said ``producer: Cell In[1], line 10, in forward`` twice, the report listed ``forward`` twice under
  "Frames from your code to the producer", ``%tb`` showed two ``Net.forward`` frames and pdb's ``where`` too: a
  check inside the still-running forward raised, and the replay's frame of that same call was appended after it
  (errors/frames.py ``_one_call``);
- a ``%nanwatch on --warn`` cell ended with ``<frozen runpy>:198: NanMagicWarning: 2 more non-finite events ...``:
  the watch's summary, said from IPython's cell events where no frame of the user's runs, was placed at the
  kernel's first frame (errors/warning_lines.py ``warn_at_user``).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from jupyter_support import cell_text, execute_cells, named_cell, short_error

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

CELLS = {
    "setup": """%load_ext nan_magic
import torch
from torch import nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8); self.fc2 = nn.Linear(8, 1)
    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(torch.log(h.abs()))
torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)""",
    # step 1's batch all zeros and fc1's bias zeroed: h is exactly 0, log(0) = -inf on any kernel
    "train": """%%nantrace --full
for step in range(3):
    x = torch.randn(8, 4)
    if step == 1:
        x = torch.zeros(8, 4)
        with torch.no_grad(): model.fc1.bias.zero_()
    loss = (model(x) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()""",
    "tb": "%tb",
    "debug": """import unittest.mock as _m
get_ipython().InteractiveTB.pdb = None
with _m.patch('builtins.input', side_effect=['where', 'p h.abs().max()', 'q']):
    get_ipython().run_line_magic('debug', '')""",
    "on": "%nanwatch on --warn",
    # the weights went NaN at step 1 (the report above stopped there; its optimizer step was not run): a NaN step
    "poison": """with torch.no_grad(): model.fc1.weight[0, 0] = float('nan')
for step in range(3):
    loss = (model(torch.randn(8, 4)) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()""",
    "more": """for step in range(2):
    loss = (model(torch.randn(8, 4)) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()""",
    "off": "%nanwatch off",
}


@pytest.fixture(scope="module")
def nb(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return execute_cells(CELLS, {"train", "tb"}, tmp_path_factory.mktemp("hunt_c_s41") / "session.ipynb")


def test_the_full_modes_short_error_tb_and_debug_show_the_producers_forward_once(nb: Any) -> None:
    short = short_error(named_cell(nb, "train"))
    assert short[:2] == ["NonFiniteError: first non-finite value in forward step 1: Net (root)",
                         "  op aten.log.default at Cell In[1], line 10 (64 -inf of 64)"], short
    assert [line for line in short if line.startswith("producer: ")] == [
        "producer: Cell In[1], line 10, in forward"], short
    report = "\n".join(output.data["text/plain"] for output in named_cell(nb, "train").outputs
                       if output.output_type == "display_data" and "text/html" in output.data)
    frames = report[report.index("Frames from your code to the producer:"):]
    assert frames.count("in forward") == 1, frames
    tb = cell_text(named_cell(nb, "tb"))
    # IPython 9 writes `in Net.forward(self, x)`, IPython 7 `in forward()`
    assert len(re.findall(r"\bin (?:Net\.)?forward\(", tb)) == 1, tb
    debug = cell_text(named_cell(nb, "debug"))
    # pdb's `where` lists the cell, torch's module call, the forward: the forward once, where %debug opens
    assert debug.count("forward()") == 2, debug  # the frame %debug opens at, and the same in `where`'s list
    assert "---> 10         return self.fc2(torch.log(h.abs()))" in debug and "\ntensor(0.)\n" in debug, debug


def test_a_nanwatch_on_cells_warnings_name_no_frame_of_the_kernel(nb: Any) -> None:
    said = [cell_text(named_cell(nb, name)) for name in ("poison", "more")]
    for text in said:
        assert "<frozen" not in text and "runpy" not in text, text
    # each cell's repeated events, said once as the cell ends: with no place (no line of the user's runs then)
    summaries = [line for text in said for line in text.splitlines() if "more non-finite events" in line]
    assert len(summaries) == 2 and all(line.startswith("NanMagicWarning: ") for line in summaries), summaries
