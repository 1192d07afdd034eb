"""The demo notebooks, executed by nbclient in a real kernel.

Assertions read what a frontend would get: the cell's error, the display
bundle (widget view plus static fallbacks) and the stored widget state
(Tab titles, the Layers table HTML, the PNG in the Histograms Output).
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
from jupyter_support import NOTEBOOKS, execute_cells, execute_notebook, named_cell, widget_states

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
TAB_TITLES = ["Summary", "Layers", "Histograms", "Debug", "History"]


@pytest.fixture(scope="module")
def transformer() -> Any:
    return execute_notebook(NOTEBOOKS / "transformer_attention_blowup.ipynb")


@pytest.fixture(scope="module")
def cnn() -> Any:
    return execute_notebook(NOTEBOOKS / "cnn_log_zero.ipynb")


def nantrace_cells(nb: Any) -> list[Any]:
    return [
        cell for cell in nb.cells
        if cell.cell_type == "code" and cell.source.startswith("%%nantrace")
    ]


def report_output(cell: Any) -> dict[str, Any]:
    """The widget output of the report under a failing %%nantrace cell."""
    (output,) = [out for out in cell.outputs if WIDGET_MIME in out.get("data", {})]
    return dict(output["data"])


def static_output(cell: Any) -> dict[str, Any]:
    """The static report: an output of its own, before the widget's."""
    positions = [
        position for position, out in enumerate(cell.outputs)
        if "nan-magic-report nm-static" in out.get("data", {}).get("text/html", "")
    ]
    (static,) = positions
    (widget,) = [p for p, out in enumerate(cell.outputs) if WIDGET_MIME in out.get("data", {})]
    assert static < widget
    return dict(cell.outputs[static]["data"])


def report_widgets(nb: Any, cell: Any) -> dict[str, Any]:
    """The stored states of the report's widget tree: Tab, its tabs' contents."""
    states = widget_states(nb)
    tab = states[report_output(cell)[WIDGET_MIME]["model_id"]]
    assert tab["model_name"] == "TabModel"
    children = [states[ref.removeprefix("IPY_MODEL_")] for ref in tab["state"]["children"]]
    return {"tab": tab["state"], "children": children, "states": states}


def descendants(states: dict[str, Any], model: dict[str, Any]) -> list[dict[str, Any]]:
    """``model`` and every widget model below it, depth first."""
    found = [model]
    for ref in model["state"].get("children", []):
        found.extend(descendants(states, states[ref.removeprefix("IPY_MODEL_")]))
    return found


def pngs_in(models: list[dict[str, Any]]) -> list[bytes]:
    return [
        base64.b64decode(output["data"]["image/png"])
        for model in models
        if model["model_name"] == "OutputModel"
        for output in model["state"]["outputs"]
        if "image/png" in output.get("data", {})
    ]


def html_values(models: list[dict[str, Any]]) -> str:
    return "\n".join(m["state"]["value"] for m in models if m["model_name"] == "HTMLModel")


def test_committed_notebooks_show_the_static_report() -> None:
    """Committed with outputs (scripts/execute-notebooks): GitHub and nbviewer show the report."""
    import nbformat

    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    assert paths
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        (failing, _fixed) = nantrace_cells(nb)
        html = static_output(failing)["text/html"]
        assert 'class="nm-headline"' in html and "data:image/png;base64," in html, path
        # The stored widget state is whole: nbviewer can draw the widget from it.
        assert report_widgets(nb, failing)["tab"]["titles"] == TAB_TITLES, path


def report_bytes(nb: Any, cell: Any) -> tuple[int, int]:
    """What one report adds to a saved notebook: its outputs, and its widget models.

    JupyterLab saves the outputs (the static report and the widget's view
    reference); the widget models only with the jupyterlab-manager setting
    ``saveState``, or when nbclient stores them (scripts/execute-notebooks).
    """
    tree = report_widgets(nb, cell)
    root = tree["states"][report_output(cell)[WIDGET_MIME]["model_id"]]
    models = descendants(tree["states"], root)
    outputs = [out for out in cell.outputs if out.get("output_type") == "display_data"]
    return len(json.dumps(outputs)), len(json.dumps(models))


def test_a_saved_report_adds_at_most_about_100_kb(transformer: Any, cnn: Any) -> None:
    for nb in (transformer, cnn):
        failing, _fixed = nantrace_cells(nb)
        outputs, models = report_bytes(nb, failing)
        assert outputs <= 100 * 1024
        # With the widget state stored too: the Layers table (every module of the step, 24 rows in the transformer)
        # is in both, compacted (layers_html). 180 kB until round 21, when every mode's report gained the producer
        # module's input histogram beside the op's operands (about 10 kB in each copy: the transformer's went from
        # 83 + 97 kB to 93 + 106 kB).
        assert outputs + models <= 200 * 1024, (outputs, models)


def test_transformer_report_widget_and_fallbacks(transformer: Any) -> None:
    failing, fixed = nantrace_cells(transformer)
    (error,) = [out for out in failing.outputs if out.output_type == "error"]
    assert error.ename == "NonFiniteError"
    assert "forward step 3: blocks.0.attn (SelfAttention)" in error.evalue
    assert not [out for out in fixed.outputs if out.output_type == "error"]

    bundle = static_output(failing)
    assert "producer    blocks.0.attn (SelfAttention)" in bundle["text/plain"]
    static = bundle["text/html"]
    assert re.search(r'class="[^"]*nm-producer[^"]*"[^>]*>blocks\.0\.attn \(SelfAttention\)<', static)
    assert re.findall(r"data:image/png;base64,", static)

    tree = report_widgets(transformer, failing)
    assert tree["tab"]["titles"] == TAB_TITLES
    summary, layers, histograms, _debug, history = tree["children"]
    assert "blocks.0.attn (SelfAttention)" in summary["state"]["value"]
    assert "forward step 3" in summary["state"]["value"]
    assert '<p class="nm-summary">Likely cause: ' in summary["state"]["value"]
    table = html_values(descendants(tree["states"], layers))
    assert re.search(r'class="[^"]*nm-producer[^"]*"[^>]*>blocks\.0\.attn \(SelfAttention\)<', table)
    # Every module of the 2-block model, the ones after the producer too (the replay ran the step to its end).
    modules = ["Classifier (root)", "embed (Embedding)", "blocks (Sequential)", "head (Linear)"] + [
        f"blocks.{block}{part}" for block in (0, 1) for part in (
            " (Block)", ".attn (SelfAttention)", ".attn.qkv (Linear)", ".attn.proj (Linear)", ".norm1 (LayerNorm)",
            ".mlp (Sequential)", ".mlp.0 (Linear)", ".mlp.1 (GELU)", ".mlp.2 (Linear)", ".norm2 (LayerNorm)")]
    assert all(f">{module}<" in table for module in modules), [m for m in modules if f">{m}<" not in table]
    assert "24 calls measured" in table
    # The producer's parents: the path to it down the tree.
    marked = re.findall(r'<tr>\s*<td[^>]*>\d+</td>\s*<td class="[^"]*nm-contains[^"]*" >contains producer</td>'
                        r'\s*<td[^>]*>[^<]*</td>\s*<td[^>]*>([^<]*)</td>', table)
    assert set(marked) == {"Classifier (root)", "blocks (Sequential)", "blocks.0 (Block)"}, marked
    # History: what the per-module step measured inside the model, beside the model output.
    layers_history = html_values(descendants(tree["states"], history))
    assert "Step 1 measured every module" in layers_history
    assert re.search(r"The producer, blocks\.0\.attn, on the per-module steps: step 1: max \|output\| [\d.]+, "
                     r"headroom [\d,]+x \(float16\)", layers_history)
    pngs = pngs_in(descendants(tree["states"], histograms))
    assert pngs and all(png.startswith(PNG_MAGIC) for png in pngs)


def test_transformer_report_in_namespace(transformer: Any) -> None:
    (table_cell,) = [c for c in transformer.cells if c.source.startswith("_nan_report.table")]
    (result,) = [out for out in table_cell.outputs if out.output_type == "execute_result"]
    html = result["data"]["text/html"]
    assert "blocks.0.attn" in html and "producer" in html


def test_transformer_table_marks_the_producer(transformer: Any) -> None:
    failing, _fixed = nantrace_cells(transformer)
    static = static_output(failing)["text/html"]
    assert re.search(r'class="[^"]*nm-producer[^"]*"[^>]*>blocks\.0\.attn \(SelfAttention\)<', static)


def test_cnn_report_names_the_loss_code(cnn: Any) -> None:
    failing, fixed = nantrace_cells(cnn)
    (error,) = [out for out in failing.outputs if out.output_type == "error"]
    assert error.ename == "NonFiniteError" and "forward step 1" in error.evalue
    assert not [out for out in fixed.outputs if out.output_type == "error"]

    bundle = static_output(failing)
    assert "code outside any watched module" in bundle["text/plain"]
    # The loss the check saw: its one non-zero count, not three.
    assert "f32[] 1 +inf" in bundle["text/html"] and "0 nan, 1 +inf, 0 -inf" not in bundle["text/html"]

    tree = report_widgets(cnn, failing)
    assert tree["tab"]["titles"] == TAB_TITLES
    summary, layers, _histograms, _debug, _history = tree["children"]
    assert "code outside any watched module" in summary["state"]["value"]
    table = html_values(descendants(tree["states"], layers))
    assert ">8 (Softmax)<" in table
    producer_cells = re.findall(r'class="[^"]*nm-producer[^"]*" >([^<]*)<', table)
    # (since session 46 the producer's row is the log's own output, the loss it reached a propagated row after it)
    assert "code outside any watched module" in producer_cells and "output of aten.log.default" in producer_cells
    assert ">loss<" in table



# -- the magics in a real kernel: one notebook, executed once, asserted per cell ----------

KERNEL_SETUP = """
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
        h = self.encoder(x)
        return self.log(h)

def build():
    torch.manual_seed(0)
    net = Net()
    return net, torch.optim.SGD(net.parameters(), lr=0.1)

model, opt = build()
other = nn.Linear(3, 3)
x = torch.randn(5, 4)
"""

KERNEL_TRAIN = """for step in range(3):
    loss = model(x).abs().mean()
    opt.zero_grad(); loss.backward(); opt.step()"""

KERNEL_CELLS = {
    "setup": KERNEL_SETUP,
    "ipython_syntax": (
        "%%nantrace other\n%matplotlib inline\n%time y = other(torch.ones(1, 3))\n!echo shell-says-hi\n"
        "import asyncio\nawait asyncio.sleep(0)\ny.shape[1] + 1"
    ),
    "handler": (
        "def handler(shell, etype, value, tb, tb_offset=None):\n"
        "    print('my handler saw', etype.__name__)\n"
        "get_ipython().set_custom_exc((ZeroDivisionError,), handler)"
    ),
    "stops": "%%nantrace\n" + KERNEL_TRAIN,
    "handler_kept": "1 / 0",
    "rebuilt": "%%nantrace model opt\nmodel, opt = build()\n" + KERNEL_TRAIN,
    "rebuilt_report": "print(_nan_report.model, _nan_report.module)",
    "bare_nanwatch": "model, opt = build()\n%nanwatch\n" + KERNEL_TRAIN,
    "bare_report": "print(_nan_report.model, _nan_report.module)\n%nanwatch status",
    "split_setup": (
        "class Shifted(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin, self.log = nn.Linear(4, 4), LogLayer()\n"
        "    def forward(self, x):\n"
        "        return self.log(self.lin(x).abs() + x[:, :1])\n"
        "torch.manual_seed(0)\n"
        "shifted = Shifted()\n"
        "sgd = torch.optim.SGD(shifted.parameters(), lr=0.01)\n"
        "batches = [torch.rand(3, 4) for _ in range(6)]\n"
        "batches[5] = torch.full((3, 4), -100.0)  # log of negatives in the 6th iteration\n"
        "i = 0\n"
        "%nanwatch on"
    ),
    # %nanwatch on, forward and backward in one cell, the optimizer step in the next: six iterations.
    **{
        name: source
        for iteration in range(6)
        for name, source in (
            (f"split_forward_{iteration}", "loss = shifted(batches[i]).mean(); sgd.zero_grad(); loss.backward()"),
            (f"split_step_{iteration}", "sgd.step(); i += 1"),
        )
        if name != "split_step_5"
    },
    "split_report": "print(_nan_report.step, [entry.step for entry in _nan_report.history])\n%nanwatch off",
    "attention_setup": (
        "class Attention(nn.Module):\n"
        "    def forward(self, x):\n"
        "        q = x * 1e20\n"
        "        att = q @ q.transpose(-2, -1)  # overflows: +inf scores\n"
        "        att = att - att.amax(-1, keepdim=True)  # inf - inf: NaN\n"
        "        out = att.softmax(-1)\n"
        "        return out @ x\n"
        "attention = Attention()"
    ),
    "attention_fails": "%%nantrace attention\ny = attention(torch.rand(2, 3, 4) + 1)",
    # %debug with its commands piped in (the kernel's stdin is the notebook's, which nbclient does not serve).
    "attention_debug": (
        "from unittest import mock\n"
        "commands = ['p bool(att.isinf().any()), bool(att.isnan().any())', \"p 'out' in dir()\", 'll', 'where', 'q']\n"
        "with mock.patch('builtins.input', side_effect=commands):\n"
        "    %debug"
    ),
    "attention_tb": "%tb",
}
RAISING = {"stops", "handler_kept", "rebuilt", "bare_nanwatch", "split_forward_5", "attention_fails", "attention_tb"}


@pytest.fixture(scope="module")
def kernel_nb(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return execute_cells(KERNEL_CELLS, RAISING, tmp_path_factory.mktemp("kernel") / "magics.ipynb")


named = named_cell


def stream_text(cell: Any) -> str:
    return "".join(out["text"] for out in cell.outputs if out.output_type == "stream")


def errors_of(cell: Any) -> list[Any]:
    return [out for out in cell.outputs if out.output_type == "error"]


def test_kernel_runs_the_nantrace_cell_as_ipython_does(kernel_nb: Any) -> None:
    cell = named(kernel_nb, "ipython_syntax")
    assert not errors_of(cell)
    text = stream_text(cell)
    assert "Wall time" in text and "shell-says-hi" in text
    (result,) = [out for out in cell.outputs if out.output_type == "execute_result"]
    assert result["data"]["text/plain"] == "4" and result["execution_count"] == cell.execution_count


def test_kernel_short_error_first_then_the_report(kernel_nb: Any) -> None:
    cell = named(kernel_nb, "stops")
    (error,) = errors_of(cell)
    assert error.ename == "NonFiniteError"
    lines = "\n".join(error.traceback).splitlines()
    assert len(lines) <= 15, lines
    assert lines[0].startswith("NonFiniteError: first non-finite value in forward step 0: log")
    # the cell's own line, numbered as the user sees the cell (the magic is line 1)
    assert f"Cell In[{cell.execution_count}], line 3" in lines
    assert "    loss = model(x).abs().mean()" in lines
    assert any(line.strip() == "return torch.log(x * 1.0)" for line in lines)
    joined = "\n".join(lines)
    assert "run_cell_magic" not in joined and "module.py" not in joined and "ipykernel_" not in joined
    # the report is displayed under the error
    kinds = [out.output_type for out in cell.outputs]
    assert kinds.index("error") < kinds.index("display_data")
    report = static_output(cell)  # the static report, then the widget
    assert "Cell In[" in report["text/plain"] and "ipykernel_" not in report["text/plain"]
    assert "Cell In[" in report["text/html"] and "ipykernel_" not in report["text/html"]


def test_kernel_debug_tab_shows_the_producers_frame_and_locals(kernel_nb: Any) -> None:
    tree = report_widgets(kernel_nb, named(kernel_nb, "stops"))
    debug = html_values(descendants(tree["states"], tree["children"][TAB_TITLES.index("Debug")]))
    # the replayed producer's own frame (LogLayer.forward), named as a cell, with its tensor local x
    assert re.search(r"%debug opens in <code>Cell In\[\d+\], line \d+, in forward</code>", debug), debug
    assert "return torch.log(x * 1.0)" in debug
    assert "<code>x</code>: " in debug


def test_kernel_keeps_the_users_exception_handler(kernel_nb: Any) -> None:
    assert "my handler saw ZeroDivisionError" in stream_text(named(kernel_nb, "handler_kept"))


def test_kernel_watches_the_model_the_cell_rebuilds(kernel_nb: Any) -> None:
    (error,) = errors_of(named(kernel_nb, "rebuilt"))
    assert error.ename == "NonFiniteError"
    assert stream_text(named(kernel_nb, "rebuilt_report")).split() == ["model", "log"]


def test_kernel_bare_nanwatch_watches_the_rest_of_the_cell(kernel_nb: Any) -> None:
    (error,) = errors_of(named(kernel_nb, "bare_nanwatch"))
    assert error.ename == "NonFiniteError"
    text = stream_text(named(kernel_nb, "bare_report"))
    assert text.split("\n")[0].split() == ["model", "log"]
    assert "nan_magic: off" in text and "last report" in text


def test_kernel_nanwatch_on_counts_a_loop_split_over_cells_as_one_run(kernel_nb: Any) -> None:
    for iteration in range(5):
        assert not errors_of(named(kernel_nb, f"split_forward_{iteration}"))
    failing = named(kernel_nb, "split_forward_5")
    (error,) = errors_of(failing)
    assert error.evalue.startswith("first non-finite value in forward step 5: log (LogLayer)"), error.evalue
    assert stream_text(named(kernel_nb, "split_report")).splitlines()[0] == "5 [0, 1, 2, 3, 4]"
    # The report's History holds the five steps before the event, in the static report and in the widget.
    assert "History (5 steps kept)" in static_output(failing)["text/html"]
    tree = report_widgets(kernel_nb, failing)
    history = html_values(descendants(tree["states"], tree["children"][TAB_TITLES.index("History")]))
    assert [f"<tr><td>{step}</td>" in history for step in range(6)] == [True] * 5 + [False]  # steps 0-4, a row each
    assert "No history" not in history


def test_kernel_debug_and_tb_open_at_the_producing_line_with_the_state_it_left(kernel_nb: Any) -> None:
    failing = named(kernel_nb, "attention_fails")
    assert errors_of(failing)[0].ename == "NonFiniteError"
    printed = stream_text(named(kernel_nb, "attention_debug"))
    # att is the line's fresh +inf scores, not the NaN of the next line; out, assigned later, is absent
    assert "(True, False)\n" in printed and "\nFalse\n" in printed.split("(True, False)")[1], printed
    arrows = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in printed.splitlines() if "---->" in line]
    producing = [line for line in arrows if "att = q @ q.transpose(-2, -1)" in line]
    assert len(producing) == 3 and len(producing) == len(arrows) - 1, printed  # pdb's stop, ll, where
    (tb,) = errors_of(named(kernel_nb, "attention_tb"))
    shown = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in "\n".join(tb.traceback).splitlines()]
    assert "att = q @ q.transpose(-2, -1)" in [line for line in shown if "---->" in line][-1], shown
