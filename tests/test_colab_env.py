"""Colab's notebook stack (IPython 7.34, ipywidgets 7.7, ipykernel 5.5): install, report, magics.

Runs in .venv-colab (scripts/setup-colab-env creates it; scripts/test runs this
environment's tests after the main suite); skipped elsewhere. What a Colab user
sees is asserted where a kernel shows it: nbclient executes notebooks in a
kernel of this environment (the widget view and the stored widget state,
``Cell In[N]`` in tracebacks, the static twin before the widget).
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest

IPython = pytest.importorskip("IPython")
if IPython.version_info[0] != 7:
    pytest.skip("Colab's stack (IPython 7): runs in .venv-colab (scripts/setup-colab-env)", allow_module_level=True)

from jupyter_support import NOTEBOOKS, execute_notebook, widget_states  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
TAB_TITLES = ["Summary", "Layers", "Histograms", "Debug", "History"]
PINNED = ("ipython", "ipywidgets", "ipykernel", "jupyter-client", "traitlets")


def test_the_environment_has_colabs_pins() -> None:
    assert version("ipython") == "7.34.0"
    assert version("ipywidgets") == "7.7.1"
    assert version("ipykernel") == "5.5.6"
    assert int(version("jupyter-client").split(".")[0]) < 8
    assert tuple(int(part) for part in version("traitlets").split(".")[:2]) < (5, 10)


def test_installing_the_package_changes_nothing_installed(tmp_path: Path) -> None:
    """``pip install .`` here (as in Colab) would install nan_magic and nothing else that is installed."""
    report_path = tmp_path / "pip-report.json"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--disable-pip-version-check",
         "--no-build-isolation", "--report", str(report_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    would_install = {
        item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
        for item in json.loads(report_path.read_text())["install"]
    }
    assert "nan-magic" in would_install
    changed = {}
    for name, new in would_install.items():
        if name == "nan-magic":
            continue
        try:
            changed[name] = f"{version(name)} -> {new}"
        except Exception:  # not installed: a new package, nothing Colab imported changes
            continue
    assert changed == {}, f"installing nan_magic would change {changed}"
    assert not set(would_install) & set(PINNED)


def test_the_report_widget_uses_ipywidgets_7s_tab_titles() -> None:
    import ipywidgets
    from test_render import fault_report

    from nan_magic.render.widget import TAB_TITLES as titles
    from nan_magic.render.widget import build_widget

    assert ipywidgets.__version__.startswith("7.")
    tab = build_widget(fault_report("log_negative"))
    assert [tab.get_title(index) for index in range(len(titles))] == TAB_TITLES
    assert "1 (LogLayer)" in tab.children[0].value


# -- in a kernel of this environment ----------------------------------------------------------

MAGIC_CELLS = {
    "setup": """
%load_ext nan_magic
import torch
from torch import nn

class LogLayer(nn.Module):
    def forward(self, x):
        return torch.log(x * 1.0)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
        self.log = LogLayer()

    def forward(self, x):
        return self.log(self.encoder(x))

torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(5, 4)
""",
    "ipython_syntax": "%%nantrace model\n%time y = model.encoder(x)\n!echo shell-says-hi\ny.shape[1] + 1",
    "stops": "%%nantrace\nfor step in range(3):\n    loss = model(x).abs().mean()\n"
             "    opt.zero_grad(); loss.backward(); opt.step()",
    "report": "print(_nan_report.module, _nan_report.op)",
    "on": "%nanwatch on model",
    "watched": "loss = model(x).abs().mean()",
    "status": "%nanwatch status",
    "off": "%nanwatch off",
    "unwatched": "loss = model(x).abs().mean()\nprint('unwatched', bool(loss.isnan()))",
    # The producer at the cell's own top level, below a blank line and a loop: IPython 7 names that code
    # "<cell line: 0>" (Python 3.11; the statement's first line on 3.12), IPython 8+ "<module>".
    "top_level": "%%nantrace\nlin = nn.Linear(2, 2)\n\nfor i in range(1):\n    z = lin(torch.randn(2, 2))\n"
                 "w = torch.log(z - 9)\nq = lin(w)",
    "top_level_fields": "r = _nan_report\nprint(r.source, r.debug_frame, *r.frames, sep=' | ')",
}
RAISING = {"stops", "watched", "top_level"}


@pytest.fixture(scope="module")
def magics_nb(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import nbformat

    nb = nbformat.v4.new_notebook()
    for name, source in MAGIC_CELLS.items():
        cell = nbformat.v4.new_code_cell(source.strip("\n"), metadata={"name": name})
        if name in RAISING:
            cell.metadata["tags"] = ["raises-exception"]
        nb.cells.append(cell)
    path = tmp_path_factory.mktemp("colab") / "magics.ipynb"
    nbformat.write(nb, path)
    return execute_notebook(path)


@pytest.fixture(scope="module")
def quickstart() -> Any:
    return execute_notebook(NOTEBOOKS / "colab_quickstart.ipynb")


def named(nb: Any, name: str) -> Any:
    (cell,) = [cell for cell in nb.cells if cell.metadata.get("name") == name]
    return cell


def errors_of(cell: Any) -> list[Any]:
    return [out for out in cell.outputs if out.output_type == "error"]


def stream_text(cell: Any) -> str:
    return "".join(out["text"] for out in cell.outputs if out.output_type == "stream")


def the_report(nb: Any, cell: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The static twin, the widget output after it, and the Tab's stored state (ipywidgets 7)."""
    static = [p for p, out in enumerate(cell.outputs) if "nm-static" in out.get("data", {}).get("text/html", "")]
    widget = [p for p, out in enumerate(cell.outputs) if WIDGET_MIME in out.get("data", {})]
    assert len(static) == 1 and len(widget) == 1 and static[0] < widget[0], cell.outputs
    view = cell.outputs[widget[0]]["data"][WIDGET_MIME]
    states = widget_states(nb)
    tab = states[view["model_id"]]
    assert tab["model_name"] == "TabModel" and tab["model_module_version"].startswith("1.")
    return dict(cell.outputs[static[0]]["data"]), view, {"tab": tab["state"], "states": states}


def test_kernel_runs_magics_shell_commands_and_the_last_value(magics_nb: Any) -> None:
    cell = named(magics_nb, "ipython_syntax")
    assert not errors_of(cell)
    assert "Wall time" in stream_text(cell) and "shell-says-hi" in stream_text(cell)
    (result,) = [out for out in cell.outputs if out.output_type == "execute_result"]
    assert result["data"]["text/plain"] == "9"


def test_kernel_stops_with_the_short_error_naming_the_cell(magics_nb: Any) -> None:
    cell = named(magics_nb, "stops")
    (error,) = errors_of(cell)
    assert error.ename == "NonFiniteError"
    lines = "\n".join(error.traceback).splitlines()
    assert lines[0].startswith("NonFiniteError: first non-finite value in forward step 0: log")
    assert f"Cell In[{cell.execution_count}], line 3" in lines
    assert any(line.strip() == "return torch.log(x * 1.0)" for line in lines)
    assert "ipython-input" not in "\n".join(lines)
    assert stream_text(named(magics_nb, "report")).split() == ["log", "aten.log.default"]


def test_kernel_shows_the_widget_report_with_its_static_twin(magics_nb: Any) -> None:
    cell = named(magics_nb, "stops")
    static, view, tree = the_report(magics_nb, cell)
    assert view["version_major"] == 2 and view["model_id"]
    assert "Cell In[" in static["text/plain"] and "ipython-input" not in static["text/html"]
    element = static["text/html"].split('nm-static" id="', 1)[1].split('"', 1)[0]
    tab, states = tree["tab"], tree["states"]
    assert [tab["_titles"][str(index)] for index in range(len(TAB_TITLES))] == TAB_TITLES
    summary, _layers, histograms, debug, _history = (
        states[ref.removeprefix("IPY_MODEL_")] for ref in tab["children"]
    )
    # The live widget hides its static twin (on Colab's page the element itself; in Lab its whole output,
    # prompt and margins); both name the producer.
    hidden = f"<style>#{element}, .jp-OutputArea-child:has(#{element}) {{ display: none; }}</style>"
    assert hidden in summary["state"]["value"]
    assert "log (LogLayer)" in summary["state"]["value"] and "log (LogLayer)" in static["text/html"]
    assert "%debug" in debug["state"]["value"] and "return torch.log(x * 1.0)" in debug["state"]["value"]
    output = states[histograms["state"]["children"][1].removeprefix("IPY_MODEL_")]
    assert any("image/png" in out.get("data", {}) for out in output["state"]["outputs"])


def test_kernel_nanwatch_on_watches_the_following_cells(magics_nb: Any) -> None:
    assert "watching every cell" in stream_text(named(magics_nb, "on"))
    (error,) = errors_of(named(magics_nb, "watched"))
    assert error.ename == "NonFiniteError"
    the_report(magics_nb, named(magics_nb, "watched"))
    assert "nan_magic: on for every cell (model)" in stream_text(named(magics_nb, "status"))
    assert "watch off" in stream_text(named(magics_nb, "off"))
    unwatched = named(magics_nb, "unwatched")
    assert "unwatched True" in stream_text(unwatched) and not errors_of(unwatched)


def test_the_colab_quickstart_runs_in_colabs_stack(quickstart: Any) -> None:
    failing, fixed = [c for c in quickstart.cells if c.cell_type == "code" and c.source.startswith("%%nantrace")]
    (error,) = errors_of(failing)
    assert error.ename == "NonFiniteError" and "norm (Standardize)" in error.evalue
    assert "Cell In[" in "\n".join(error.traceback)
    static, _view, tree = the_report(quickstart, failing)
    assert "norm (Standardize)" in static["text/plain"]
    assert [tree["tab"]["_titles"][str(index)] for index in range(len(TAB_TITLES))] == TAB_TITLES
    assert not errors_of(fixed) and "finished: loss" in stream_text(fixed)
    others = [c for c in quickstart.cells if c.cell_type == "code" and c is not failing]
    assert not [c for c in others if errors_of(c)]


def test_kernel_names_a_cells_top_level_line_as_ipython_8_does(magics_nb: Any) -> None:
    """IPython 7's "<cell line: 0>" made the report read "Cell In[9], line 6, in <cell line: 0>"."""
    cell = named(magics_nb, "top_level")
    n = cell.execution_count
    (error,) = errors_of(cell)
    lines = "\n".join(error.traceback).splitlines()
    assert f"  op aten.log.default at Cell In[{n}], line 6 (4 nan of 4)" in lines
    assert f"producer: Cell In[{n}], line 6" in lines and "    w = torch.log(z - 9)" in lines
    fields = stream_text(named(magics_nb, "top_level_fields")).strip().split(" | ")
    at = f"Cell In[{n}], line 6, in <module>"
    assert fields == [at, at, f"Cell In[{n}], line 7, in <module>", at]  # source, %debug's, frames (q = lin(w))
    static, _view, _tree = the_report(magics_nb, cell)
    assert f"Cell In[{n}], line 6, in &lt;module&gt;" in static["text/html"]
    assert "cell line" not in static["text/plain"] + static["text/html"]
