"""A user's notebook split over cells, then the kernel restarted (round 20): two notebooks, each run once by nbclient.

Before the restart: the model in one cell, a loss helper in the next, ``%%nantrace`` training in a third whose NaN
the helper makes (the report and ``%debug`` at ``Cell In[3], line 4``, pdb with that line's locals); ``%nanwatch on``
over three cells, the NaN in the third one's model (the step counted across cells), a scene dumped; the status,
``%nanwatch off`` twice, a ``%%nantrace`` cell of comments alone. The report is pickled, as ``%store`` does.

After the restart (a fresh kernel): the pickled report still names the cell, not the dead kernel's temporary file;
``%nanreplay`` with no model yet says what it needs and what it loaded; the scene's report's ``restore()`` points at
the scene's own state; with the model built again, ``%nanreplay`` reproduces the NaN.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from jupyter_support import execute_cells, named_cell, widget_states

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

DEBUG = "import builtins\nanswers = iter({commands!r})\nbuiltins.input = lambda prompt='': next(answers)\n%debug"
MODEL = (
    "class Normed(nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.lin = nn.Linear(4, 4)\n"
    "    def forward(self, x):\n"
    "        h = self.lin(x)\n"
    "        return h / h.norm(dim=-1, keepdim=True)\n"
    "torch.manual_seed(0)\n"
    "net = nn.Sequential(nn.Linear(4, 4), Normed(), nn.Linear(4, 1))\n"
    "opt = torch.optim.SGD(net.parameters(), lr=0.01)"
)
ITERATIONS = (
    "for _ in range({n}):\n"
    "    loss = loss_fn(net(torch.randn(8, 4)), torch.randn(8, 1))\n"
    "    opt.zero_grad(); loss.backward(); opt.step()"
)


def before_restart(scenes: Path, pickled: Path) -> dict[str, str]:
    return {
        "setup": "%load_ext nan_magic\nimport pickle\nimport torch\nfrom torch import nn",
        "model": MODEL,  # Cell In[2]
        "helper": (  # Cell In[3]
            "def loss_fn(out, y):\n"
            "    err = (out - y) ** 2\n"
            "    total = err.sum(dim=0, keepdim=True)\n"
            "    share = err / total  # 0/0 when every error is zero\n"
            "    return err.mean() + share.max()"
        ),
        "train": (
            "%%nantrace\n"
            "for step in range(5):\n"
            "    x = torch.randn(8, 4)\n"
            "    y = net(x).detach() if step == 3 else torch.randn(8, 1)\n"
            "    loss = loss_fn(net(x), y)\n"
            "    opt.zero_grad(); loss.backward(); opt.step()"
        ),
        "debug": DEBUG.format(commands=["p float(total.abs().max())", "p err.shape", "q"]),
        "pickle": (
            f"pickle.dump(_nan_report, open({str(pickled)!r}, 'wb'))\n"
            f"open({str(pickled.with_suffix('.json'))!r}, 'w').write(_nan_report.to_json())"
        ),
        "on": f"%nanwatch on --dump {scenes} --keep-last-good",
        "cell_a": ITERATIONS.format(n=2),
        "cell_b": ITERATIONS.format(n=3),
        "cell_c": (
            "with torch.no_grad():\n    net[1].lin.weight.zero_(); net[1].lin.bias.zero_()\n" + ITERATIONS.format(n=1)
        ),
        "fields": "r = _nan_report\nprint(r.phase, r.module, r.op, r.step, r.source.lineno)",
        "healthy": "print('a healthy cell')",
        "status": "%nanwatch status",
        "off": "%nanwatch off",
        "off_again": "%nanwatch off",
        "comments_only": "%%nantrace\n# the loop goes here\n",
    }


def after_restart(scenes: Path, pickled: Path) -> dict[str, str]:
    return {
        "setup": (
            "%load_ext nan_magic\nimport glob, pickle\nimport torch\nfrom torch import nn\n"
            f"path, = glob.glob({str(scenes / '*.pt')!r})\nreport = pickle.load(open({str(pickled)!r}, 'rb'))\n"
            f"import json\nsaved = json.load(open({str(pickled.with_suffix('.json'))!r}))"
        ),
        "pickled": "print(report.message)\nreport",
        "json": "from nan_magic.locations import name_location\nprint(name_location(saved['source']['filename'], 4))",
        "replay_no_model": "%nanreplay $path",
        "scene_loaded": "print(_nan_scene.report.message)",
        "scene_restore": "_nan_scene.report.restore()",
        "model_again": MODEL,
        "replay": "%nanreplay $path net",
    }


#: The cells that raise (a usage error shows as one stderr line, no error output: comments_only, replay_no_model).
RAISING_BEFORE = {"train", "cell_c"}
RAISING_AFTER = {"scene_restore"}
#: Every cell may fail, so that one failing check does not take the others with it; each test says which failed.
MAY_FAIL = set(before_restart(Path("s"), Path("r.pkl"))) | set(after_restart(Path("s"), Path("r.pkl")))


@pytest.fixture(scope="module")
def nbs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    folder = tmp_path_factory.mktemp("nb20")
    scenes, pickled = folder / "scenes", folder / "report.pkl"
    before = execute_cells(before_restart(scenes, pickled), MAY_FAIL, folder / "before.ipynb")
    after = execute_cells(after_restart(scenes, pickled), MAY_FAIL, folder / "after.ipynb")
    return before, after


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)  # (pdb and IPython 7 colour their lines)


def stream(cell: Any, name: str = "stdout") -> str:
    return plain("".join(out["text"] for out in cell.outputs if out.get("name") == name))


def error(cell: Any) -> Any:
    (found,) = [out for out in cell.outputs if out.output_type == "error"]
    return found


def test_only_the_cells_that_should_fail_fail(nbs: tuple[Any, Any]) -> None:
    for nb, raising in zip(nbs, (RAISING_BEFORE, RAISING_AFTER)):
        failed = {cell.metadata["name"] for cell in nb.cells if any(out.output_type == "error" for out in cell.outputs)}
        assert failed == raising, failed


def test_the_helpers_nan_is_named_at_its_cell_and_line_and_debug_stands_there(nbs: tuple[Any, Any]) -> None:
    before, _ = nbs
    assert error(named_cell(before, "train")).evalue == (
        "first non-finite value in forward step 3: code outside any watched module, "
        "op aten.div.Tensor at Cell In[3], line 4 (8 nan of 8)"
    )
    printed = stream(named_cell(before, "debug")).splitlines()
    current = max(index for index, line in enumerate(printed) if line.startswith("> "))
    assert printed[current].endswith("loss_fn()"), printed
    assert any(line.startswith("----> 4 ") and "share = err / total" in line for line in printed[current:]), printed
    assert "0.0" in printed and "torch.Size([8, 1])" in printed, printed  # the line's locals: the zero it divided by


def test_nanwatch_on_counts_the_step_over_three_cells(nbs: tuple[Any, Any]) -> None:
    before, _ = nbs
    assert error(named_cell(before, "cell_c")).evalue.startswith(
        "first non-finite value in forward step 5: 1 (Normed), op aten.div.Tensor at Cell In[2], line 7"
    )
    assert stream(named_cell(before, "fields")) == "forward 1 aten.div.Tensor 5 7\n"


def test_the_status_and_off_say_what_is_true(nbs: tuple[Any, Any]) -> None:
    before, _ = nbs
    # The last report past a healthy cell after it (it was forgotten); off, then off with nothing on.
    status = stream(named_cell(before, "status")).splitlines()
    assert status[0].startswith("nan_magic: on for every cell (--dump ") and len(status) == 2, status
    assert status[1] == "last report: " + error(named_cell(before, "cell_c")).evalue
    assert stream(named_cell(before, "off")) == "nan_magic: watch off\n"
    assert stream(named_cell(before, "off_again")) == "nan_magic: no watch is on (nothing to turn off)\n"
    cell = named_cell(before, "comments_only")
    assert stream(cell, "stderr").strip() == (
        "UsageError: %%nantrace: the cell is empty; put the code to watch below the magic line"
    )
    assert [out for out in cell.outputs if out.output_type != "stream"] == []


def test_a_pickled_report_still_names_the_cell_after_a_restart(nbs: tuple[Any, Any]) -> None:
    _, after = nbs
    cell = named_cell(after, "pickled")
    where = "op aten.div.Tensor at Cell In[3], line 4 (8 nan of 8)"
    assert stream(cell).splitlines() == [
        f"first non-finite value in forward step 3: code outside any watched module, {where}"
    ]
    (static,) = [out["data"]["text/plain"] for out in cell.outputs if "text/html" in out.get("data", {})]
    assert "  source      Cell In[3], line 4, in loss_fn" in static.splitlines(), static
    assert "ipykernel_" not in static and "ipython-input" not in static
    # its JSON too (to_json, the --log-file lines): the cell, not the dead kernel's file
    assert stream(named_cell(after, "json")) == "Cell In[3], line 4\n"


def test_nanreplay_without_the_model_says_what_it_needs_and_loads_the_scene(nbs: tuple[Any, Any]) -> None:
    _, after = nbs
    assert stream(named_cell(after, "replay_no_model"), "stderr").strip() == (
        "UsageError: %nanreplay: no model here to replay the scene on (it was saved from net): build it, then "
        "%nanreplay PATH net; the scene is loaded as _nan_scene, and _nan_scene.report is its report"
    )
    assert stream(named_cell(after, "scene_loaded")).startswith(
        "first non-finite value in forward step 5: 1 (Normed), op aten.div.Tensor at Cell In[2], line 7"
    )
    restore = error(named_cell(after, "scene_restore"))
    assert restore.ename == "RuntimeError"
    assert ".restore_into(model, optimizer, state='last_good')" in restore.evalue, restore.evalue
    assert "watch with keep_last_good" not in restore.evalue  # the user had: the state is in the scene
    assert stream(named_cell(after, "replay")).startswith(
        "nan_magic: replay of 1 reproduced 32 nan in aten.div.Tensor at "
        f"Cell In[{named_cell(after, 'model_again').execution_count}], line 7"
    )


def test_the_histograms_are_the_failing_ops_in_text_html_and_the_widget(nbs: tuple[Any, Any]) -> None:
    """The division's operands and output, named by the line's own words, in all three forms (the widget live: its
    Output's stored figure; the HTML static: its embedded image; the text: its rows)."""
    before, _ = nbs
    cell = named_cell(before, "train")
    drawn = "err (self of aten.div.Tensor), total (other of aten.div.Tensor), output of aten.div.Tensor"
    (static,) = [out["data"] for out in cell.outputs if "text/html" in out.get("data", {})]
    assert f'alt="histograms of {drawn}, loss of code outside any watched module"' in static["text/html"]
    text = static["text/plain"].splitlines()
    start = text.index("Histograms of the producer's values (finite values in 24 bins, log scale; non-finite apart):")
    assert text[start + 1 : start + 7 : 2] == [f"  {label}" for label in drawn.split(", ")]
    assert text[start + 6] == "      no finite value   float32, 0 finite of 8; 8 nan"
    states = widget_states(before)
    figures = [
        out["data"]["text/plain"]
        for model in states.values()
        if model["model_name"] == "OutputModel"
        for out in model["state"].get("outputs", [])
        if "image/png" in out.get("data", {})
    ]
    assert f"<histograms of {drawn}, loss of code outside any watched module>" in figures, figures
