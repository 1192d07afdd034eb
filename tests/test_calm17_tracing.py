"""Tracing a watched model inside the watch stays calm, bit-identical and silent in the five modes (issue 25;
harness: test_calm16.py's ``assert_calm``): ``torch.func.linearize`` (a jvp function traced by make_fx) between
training steps, ``make_fx`` of the trained model at the end of the cell, shapes inferred under a ``FakeTensorMode``,
a loss compiled by ``aot_function``.

Found by calm17: the watch's hooks read the traced call's values, and a read of a tracing tensor raises
("It appears that you're trying to get value out of a tracing tensor", from the user's ``make_fx`` line) in the
default, full and ops modes; the op tracer did the same in ops mode; the loop-code recorder looked at a fake
tensor's storage, and torch warned ("Accessing the data pointer of FakeTensor is deprecated"; also under a
``FakeTensorMode`` and ``aot_function``). Now, while make_fx's ``ProxyTorchDispatchMode`` or a ``FakeTensorMode``
is entered, the watch steps aside (lifecycle/users_modes._Traced), the op tracer passes
the ops on unread, and a mode entered again inside itself no longer takes its outer entry's undo as it is left
(patches/dispatch_modes.py: make_fx re-enters its proxy mode around every op it traces).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_calm16 import Loop, assert_calm
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn import functional as F
from watching import FIVE_MODES

import nan_magic

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def linearized() -> Loop:
    """Train a step, then the model's linearization at the batch (one jvp traced, applied to a tangent)."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(2)]

    def run() -> list[torch.Tensor]:
        out = []
        for x, y in data:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            value, jvp_fn = torch.func.linearize(model, x)
            out += [loss.detach(), value.detach(), jvp_fn(torch.ones_like(x)).detach()]
        return out

    return Loop((model, opt), (model, opt), run)


def traced_at_the_end() -> Loop:
    """Train, then ``make_fx`` of the model and a softmax (an export for inspection), the graph run once."""
    model = _net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

    def run() -> list[torch.Tensor]:
        out = []
        for _ in range(3):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        graph = make_fx(lambda t: model(t).softmax(-1))(x)
        return [*out, graph(x).detach(), torch.tensor(len(graph.graph.nodes))]

    return Loop((model, opt), (model, opt), run)


def fake_shapes() -> Loop:
    """After each step, the output shape of another batch size, inferred under a ``FakeTensorMode``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

    def run() -> list[torch.Tensor]:
        out = []
        for _ in range(2):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            with FakeTensorMode(allow_non_fake_inputs=True):
                shape = model(torch.empty(5, 4)).shape
            out += [loss.detach(), torch.tensor(shape)]
        return out

    return Loop((model, opt), (model, opt), run)


def aot_loss() -> Loop:
    """A loss function compiled by ``aot_function`` (traced with fake tensors at its first call)."""
    from functorch.compile import aot_function, nop

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    loss_fn = aot_function(lambda logits, target: F.cross_entropy(logits, target), fw_compiler=nop)

    def run() -> list[torch.Tensor]:
        out = []
        for _ in range(3):
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            out.append(loss.detach())
        return out

    return Loop((model, opt), (model, opt), run)


TRACED = {
    "linearize-between-steps": linearized,
    "make-fx-at-the-end": traced_at_the_end,
    "fake-tensor-mode-shapes": fake_shapes,
    "aot-function-loss": aot_loss,
}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", TRACED)
def test_make_fx_tracing_inside_the_watch_is_calm_and_identical(name: str, options: dict) -> None:
    assert_calm(TRACED[name], options)


def _warnings(run, *targets, **options) -> set[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if targets:
            with nan_magic.watch(*targets, **options):
                run()
        else:
            run()
    return {str(w.message).split(".")[0] for w in caught}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", ["make-fx-at-the-end", "fake-tensor-mode-shapes", "aot-function-loss"])
def test_tracing_inside_the_watch_warns_nothing_the_unwatched_cell_does_not(name: str, options: dict) -> None:
    torch.manual_seed(0)
    TRACED[name]().run()  # (torch's first-use warnings, once per process, out of the way)
    torch.manual_seed(0)
    unwatched = _warnings(TRACED[name]().run)
    torch.manual_seed(0)
    loop = TRACED[name]()
    assert _warnings(loop.run, *loop.targets, **options) <= unwatched


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", ["make-fx-at-the-end", "fake-tensor-mode-shapes", "aot-function-loss"])
def test_no_recorder_of_the_watch_measures_a_fake_tensor(name: str, options: dict, monkeypatch) -> None:
    """The loop-code recorders do not record the traced ops (torch warns once per process as a fake tensor's
    storage is measured, so the warning test above sees it only the first time: this one asks the recorders)."""
    from nan_magic.localize.outside import held

    measured = []
    real = held.storage_bytes

    def spy(tensor: torch.Tensor):
        measured.append(type(tensor).__name__)
        return real(tensor)

    monkeypatch.setattr(held, "storage_bytes", spy)
    torch.manual_seed(0)
    loop = TRACED[name]()
    with nan_magic.watch(*loop.targets, **options):
        loop.run()
    assert "FakeTensor" not in measured


def test_the_traced_graph_holds_no_probe_of_the_watch() -> None:
    """The graph make_fx records inside the watch is the one it records outside: no aminmax, no sum of ours."""
    torch.manual_seed(0)
    model, x = _net(), torch.randn(8, 4)
    plain = make_fx(lambda t: model(t).softmax(-1))(x)
    with nan_magic.watch(model):
        model(x).sum().backward()  # a step first: the watch has seen the model; its update-code recorder is on
        watched = make_fx(lambda t: model(t).softmax(-1))(x)
    assert [n.target for n in watched.graph.nodes] == [n.target for n in plain.graph.nodes]
