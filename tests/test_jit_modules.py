"""TorchScript inside a watch: scripted and traced modules called at top level, and tracing a watched model."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic.patches import registry as patches

MODES = [{}, {"mode": "full"}, {"defer": True}, {"ops": True}]


@pytest.mark.parametrize("options", MODES, ids=["default", "full", "defer", "ops"])
def test_a_scripted_and_a_traced_module_called_at_top_level_run_under_the_watch(options) -> None:
    # A top-level call of a module no watched model holds asks whether it is a compiled wrapper of one: a
    # ScriptModule's ``_modules`` (no ``get``) raised AttributeError in the user's call.
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    traced = torch.jit.trace(nn.Linear(4, 4), torch.ones(1, 4))
    x = torch.randn(3, 4)
    expected = model(traced(scripted(x)))
    with nan_magic.watch(model, opt, **options) as w:
        out = model(traced(scripted(x)))
        out.sum().backward()
    assert w.report is None and torch.equal(out, expected)


class _WarnsWhileTraced(nn.Module):
    """A model whose own code raises a TracerWarning when traced (a Python bool of a traced tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.sum() > 0):  # the user's own: the trace records one branch
            return self.layer(x)
        return -self.layer(x)


@pytest.mark.parametrize("defer", [False, True])
def test_torch_jit_trace_inside_a_watch_shows_the_users_tracer_warnings_only(defer: bool) -> None:
    # Our boundary reads ask the traced sizes questions (``0 in value.shape``): each raised a TracerWarning
    # pointing into nan_magic, about 30 for one trace, none about the user's graph.
    torch.manual_seed(0)
    model, x = _WarnsWhileTraced(), torch.ones(3, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    traces = torch.jit.trace, torch.jit.trace_module, torch.jit._get_trace_graph
    with warnings.catch_warnings(record=True) as seen, nan_magic.watch(model, opt, defer=defer) as w:
        warnings.simplefilter("always")
        model(x).sum().backward()
        opt.step()
        traced = torch.jit.trace(model, x)
        torch.jit.trace_module(model, {"forward": x})
        torch.jit._get_trace_graph(model, (x,))  # (the TorchScript ONNX exporter's trace)
    tracer = [(warning.filename, str(warning.message)) for warning in seen
              if issubclass(warning.category, torch.jit.TracerWarning)]
    assert tracer and all(filename == __file__ for filename, _ in tracer)  # the user's, from both traces
    assert not any("nan_magic" in filename for filename, _ in tracer)
    assert w.report is None and torch.equal(traced(x), model(x))
    assert (torch.jit.trace, torch.jit.trace_module, torch.jit._get_trace_graph) == traces
    assert patches.installed() == []
