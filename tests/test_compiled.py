"""Models compiled with torch.compile, under the tiered default watch.

The boundary checks run around the compiled module (nothing inside its graph:
no graph break, no recompile); a failing step is replayed eagerly on
``_orig_mod``, which names module, op and line as for an eager model.
"""

from __future__ import annotations

import shutil
import sys
import warnings

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


# -- ops=True and mode="full": the compiled model runs eagerly while the watch is active ----------------


class LogGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.log(x)  # producer: eager log


def _log_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(LogGate(), nn.Linear(8, 1))


def _positive_batches(n: int) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.rand(4, 8) + 0.1 for _ in range(n)]


def _eager_notices(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, nan_magic.NanMagicWarning)
            and "compiled with torch.compile" in str(w.message)]


def _counting_backend(graphs: list[object]):  # type: ignore[no-untyped-def]
    def counting(graph, inputs):  # type: ignore[no-untyped-def]
        graphs.append(graph)
        return dynamo.lookup_backend("aot_eager")(graph, inputs)

    return counting


def test_ops_true_runs_a_compiled_model_eagerly_and_names_module_op_line_and_step() -> None:
    batches = _positive_batches(4)
    batches[2] = -batches[2]  # log of a negative batch: NaN at step 2
    reports = {}
    for kind in ("eager", "compiled"):
        model = _log_model()
        called = torch.compile(model, backend="aot_eager") if kind == "compiled" else model
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(NonFiniteError) as error, nan_magic.watch(called, opt, ops=True):
                train_steps(called, opt, batches)
        reports[kind] = error.value.report
        notices = _eager_notices(caught)
        if kind == "compiled":
            assert len(notices) == 1, notices  # one notice for three steps
            assert "under ops=True it runs eagerly" in notices[0]
            notice = next(w for w in caught if str(w.message) == notices[0])
            assert notice.filename == train_steps.__code__.co_filename  # it points at the model's call
        else:
            assert notices == []
    report = reports["compiled"]
    assert (report.phase, report.module, report.module_type, report.step) == ("forward", "0", "LogGate", 2)
    assert report.op == "aten.log.default"
    assert report.source is not None and report.source.lineno == _marked("eager log")
    eager = reports["eager"]
    assert (eager.phase, eager.module, eager.module_type, eager.step, eager.op, eager.source.lineno) == (
        report.phase, report.module, report.module_type, report.step, report.op, report.source.lineno)
    assert (report.nan, report.posinf, report.neginf) == (eager.nan, eager.posinf, eager.neginf)
    assert torch._dynamo.eval_frame._stance.stance == "default"


def test_a_healthy_compiled_run_under_ops_true_matches_eager_and_leaves_the_compiled_model_as_it_was() -> None:
    """Bit-identical to an unwatched eager run; the compiled code, guards and hooks untouched (no recompile)."""
    graphs: list[object] = []
    batches = _positive_batches(5)
    plain = _log_model()
    opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    plain(batches[0])  # the compiled model's first call below, unwatched: it compiles
    expected = train_steps(plain, opt, batches[:3])
    model = _log_model()
    compiled = torch.compile(model, backend=_counting_backend(graphs))
    opt_w = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled(batches[0])
    compiled_graphs = len(graphs)
    assert compiled_graphs > 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nan_magic.watch(compiled, opt_w, ops=True) as w:
            got = train_steps(compiled, opt_w, batches[:3])
    assert len(_eager_notices(caught)) == 1
    assert w.report is None and w.events == []
    assert got == expected  # floats of the same eager ops, in the same order
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters()))
    assert len(graphs) == compiled_graphs  # nothing compiled while watched
    train_steps(compiled, opt_w, batches[3:])
    assert len(graphs) == compiled_graphs  # its guards still hold after the watch: no recompile
    assert not compiled._forward_hooks and not compiled._forward_pre_hooks
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not torch.nn.modules.module._has_any_global_hook()
    assert torch._dynamo.eval_frame._stance.stance == "default"
    assert counters["graph_break"] == {}


def test_the_full_mode_runs_a_compiled_model_eagerly_and_names_the_module() -> None:
    batches = _positive_batches(3)
    batches[1] = -batches[1]
    model = _log_model()
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(NonFiniteError) as error, nan_magic.watch(compiled, opt, mode="full"):
            train_steps(compiled, opt, batches)
    report = error.value.report
    assert (report.phase, report.module, report.module_type, report.step) == ("forward", "0", "LogGate", 1)
    assert report.op == "aten.log.default"  # the full mode's replay of the producer module names it
    notices = _eager_notices(caught)
    assert len(notices) == 1 and 'under mode="full" it runs eagerly' in notices[0]


def test_a_compiled_submodule_and_a_discovered_compiled_model_run_eagerly_under_ops_true() -> None:
    batch = -_positive_batches(1)[0]
    gate = LogGate()
    outer = nn.Sequential(torch.compile(gate, backend="aot_eager"), nn.Linear(8, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(NonFiniteError) as error, nan_magic.watch(outer, ops=True):
            outer(batch)
    report = error.value.report
    assert (report.module, report.module_type, report.op) == ("0", "LogGate", "aten.log.default")
    assert report.source is not None and report.source.lineno == _marked("eager log")
    assert len(_eager_notices(caught)) == 1
    compiled = torch.compile(_log_model(), backend="aot_eager")
    notice = pytest.warns(nan_magic.NanMagicWarning, match="compiled is compiled")  # the user's name, discovered
    with notice, pytest.raises(NonFiniteError) as error, nan_magic.watch(ops=True):
        compiled(batch)
    assert (error.value.report.module, error.value.report.op) == ("0", "aten.log.default")
    assert counters["graph_break"] == {}


def test_the_default_watch_replays_a_compiled_submodule_eagerly() -> None:
    """The replay's own watch is a full one: the compiled submodule runs eagerly in it, without a notice."""
    torch.manual_seed(0)
    outer = nn.Sequential(torch.compile(LogGate(), backend="aot_eager"), nn.Linear(8, 1))
    opt = torch.optim.SGD(outer.parameters(), lr=0.01)
    batches = _positive_batches(3)
    batches[2] = -batches[2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(NonFiniteError) as error, nan_magic.watch(outer, opt):
            train_steps(outer, opt, batches)
    report = error.value.report
    assert (report.phase, report.module, report.module_type, report.step) == ("forward", "0", "LogGate", 2)
    assert report.op == "aten.log.default"
    assert report.source is not None and report.source.lineno == _marked("eager log")
    assert report.reproduced is True
    assert _eager_notices(caught) == []
    assert torch._dynamo.eval_frame._stance.stance == "default"
