"""Models compiled with torch.compile, under the tiered default watch.

The boundary checks run around the compiled module (nothing inside its graph:
no graph break, no recompile); a failing step is replayed eagerly on
``_orig_mod``, which names module, op and line as for an eager model.
"""

from __future__ import annotations

import shutil
import sys

import faults
import pytest
import torch
from torch import nn
from watching import train_steps

import nan_magic
from nan_magic import NonFiniteError

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402 - after the skip


def _marked(key: str) -> int:
    return faults.marked_line(key, where=sys.modules[__name__])


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.exp(x)  # producer: compiled exp


class RootOfZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(x - x.detach())  # producer: compiled sqrt


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Gate(), nn.Linear(8, 1))


def _batches(n: int) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(4, 8) for _ in range(n)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    counters.clear()
    yield
    dynamo.reset()


def test_a_healthy_compiled_run_is_silent_identical_and_never_recompiled() -> None:
    """Counted by a backend that records every graph dynamo hands it: a break or a recompile adds one."""
    graphs: list[object] = []

    def counting(graph, inputs):  # type: ignore[no-untyped-def]
        graphs.append(graph)
        return dynamo.lookup_backend("aot_eager")(graph, inputs)

    batches = _batches(12)
    plain = _model()
    opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    expected = train_steps(torch.compile(plain, backend=counting), opt, batches)
    unwatched_graphs = len(graphs)
    dynamo.reset()
    graphs.clear()
    watched = _model()
    compiled = torch.compile(watched, backend=counting)
    opt_w = torch.optim.SGD(watched.parameters(), lr=0.01)
    with nan_magic.watch(compiled, opt_w) as w:
        got = train_steps(compiled, opt_w, batches[:6])
    with nan_magic.watch(compiled, opt_w):  # a second entry: no recompile either
        got += train_steps(compiled, opt_w, batches[6:])
    train_steps(compiled, opt_w, [batches[0]])  # and none after the watch
    assert w.report is None and w.events == []
    assert got == expected
    assert len(graphs) == unwatched_graphs  # the graphs of the unwatched run: no break, no recompile
    assert not compiled._forward_hooks and not compiled._forward_pre_hooks
    assert not torch.nn.modules.module._has_any_global_hook()


def test_a_forward_fault_in_a_compiled_model_is_named_through_the_eager_replay() -> None:
    model = _model()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = _batches(3)
    batches[2] = batches[2] * 200.0  # exp(x) of the 200x batch overflows
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(compiled, opt):
        train_steps(compiled, opt, batches)
    report = caught.value.report
    assert (report.phase, report.module, report.module_type, report.step) == ("forward", "1", "Gate", 2)
    assert report.op == "aten.exp.default"
    assert report.source is not None and report.source.lineno == _marked("compiled exp")
    assert report.reproduced is True
    assert counters["graph_break"] == {}


def test_a_backward_fault_in_a_compiled_model_is_named_through_the_eager_replay() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), RootOfZero(), nn.Linear(4, 1))
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(compiled, opt):
        train_steps(compiled, opt, [torch.randn(3, 4)])
    report = caught.value.report
    assert (report.phase, report.module, report.module_type) == ("backward", "1", "RootOfZero")
    assert report.op is not None and report.op.startswith("aten.")
    assert report.source is not None and report.source.lineno == _marked("compiled sqrt")
    assert report.reproduced is True


def test_the_discovering_watch_watches_a_compiled_model_called_in_the_cell() -> None:
    compiled = torch.compile(_model(), backend="aot_eager")
    batch = _batches(1)[0] * 200.0
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch():
        compiled(batch)
    assert (caught.value.report.module, caught.value.report.op) == ("1", "aten.exp.default")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="inductor needs a C compiler")
def test_the_default_backend_is_watched_and_named_through_the_eager_replay() -> None:
    """torch.compile's default backend (inductor: generated C++ on the CPU); about 20 s of compiling."""
    model = _model()
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = _batches(3)
    batches[2] = batches[2] * 200.0
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(compiled, opt):
        train_steps(compiled, opt, batches)
    report = caught.value.report
    assert (report.phase, report.module, report.op, report.step) == ("forward", "1", "aten.exp.default", 2)
    assert report.source is not None and report.source.lineno == _marked("compiled exp")
    assert report.reproduced is True
