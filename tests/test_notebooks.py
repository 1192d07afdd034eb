"""The demo notebooks, executed by nbclient in a real kernel.

Assertions read what a frontend would get: the cell's error, the display
bundle (widget view plus static fallbacks) and the stored widget state
(Tab titles, the Layers table HTML, the PNG in the Histograms Output).
"""

from __future__ import annotations

import base64
import re
from typing import Any

import pytest
from jupyter_support import NOTEBOOKS, execute_notebook, widget_states

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
    """The display output of the report under a failing %%nantrace cell."""
    (output,) = [out for out in cell.outputs if WIDGET_MIME in out.get("data", {})]
    return dict(output["data"])


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


def test_notebooks_are_committed_without_outputs() -> None:
    import nbformat

    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        assert all(not cell.outputs and cell.execution_count is None for cell in code), path
        assert "widgets" not in nb.metadata, path


def test_transformer_report_widget_and_fallbacks(transformer: Any) -> None:
    failing, fixed = nantrace_cells(transformer)
    (error,) = [out for out in failing.outputs if out.output_type == "error"]
    assert error.ename == "NonFiniteError"
    assert "forward step 3: blocks.0.attn (SelfAttention)" in error.evalue
    assert not [out for out in fixed.outputs if out.output_type == "error"]

    bundle = report_output(failing)
    assert "producer    blocks.0.attn (SelfAttention)" in bundle["text/plain"]
    static = bundle["text/html"]
    assert re.search(r'class="[^"]*nm-producer[^"]*"[^>]*>blocks\.0\.attn<', static)
    assert re.findall(r"data:image/png;base64,", static)

    tree = report_widgets(transformer, failing)
    assert tree["tab"]["titles"] == TAB_TITLES
    summary, layers, histograms, _debug, _history = tree["children"]
    assert "blocks.0.attn (SelfAttention)" in summary["state"]["value"]
    assert "during the forward phase of step 3" in summary["state"]["value"]
    table = html_values(descendants(tree["states"], layers))
    assert re.search(r'class="[^"]*nm-producer[^"]*"[^>]*>blocks\.0\.attn<', table)
    pngs = pngs_in(descendants(tree["states"], histograms))
    assert pngs and all(png.startswith(PNG_MAGIC) for png in pngs)


def test_transformer_report_in_namespace(transformer: Any) -> None:
    (table_cell,) = [c for c in transformer.cells if c.source.startswith("_nan_report.table")]
    (result,) = [out for out in table_cell.outputs if out.output_type == "execute_result"]
    html = result["data"]["text/html"]
    assert "blocks.0.attn" in html and "producer" in html


def test_cnn_report_names_the_loss_code(cnn: Any) -> None:
    failing, fixed = nantrace_cells(cnn)
    (error,) = [out for out in failing.outputs if out.output_type == "error"]
    assert error.ename == "NonFiniteError" and "forward step 1" in error.evalue
    assert not [out for out in fixed.outputs if out.output_type == "error"]

    bundle = report_output(failing)
    assert "code outside any watched module" in bundle["text/plain"]
    assert "0 nan, 1 +inf, 0 -inf" in bundle["text/html"]

    tree = report_widgets(cnn, failing)
    assert tree["tab"]["titles"] == TAB_TITLES
    summary, layers, _histograms, _debug, _history = tree["children"]
    assert "code outside any watched module" in summary["state"]["value"]
    table = html_values(descendants(tree["states"], layers))
    assert ">Softmax<" in table
    producer_cells = re.findall(r'class="[^"]*nm-producer[^"]*" >([^<]*)<', table)
    assert "(outside modules)" in producer_cells and "loss" in producer_cells

