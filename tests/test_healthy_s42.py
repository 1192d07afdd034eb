"""Healthy programs a user leaves the watch on for (session 42): ``torch.func`` and ``torch.compile`` together,
compiled functions (not models) calling a model, and the usual training-script constructs, in every mode. Each row
runs unwatched and watched (tests/calm_s29.py ``check``: no exception, no warning of ours, nothing but benign
events, outputs, parameters, gradients and optimizer state bit-identical, nothing left on the model).

The compiled rows compile and call once before the watch, as a loop compiled in an earlier cell does, then call
again inside it: the watch must not break the graph dynamo makes there (inside a ``torch.func`` transform a graph
break is dynamo's ``AssertionError: False != True``) nor add one (``fullgraph=True`` raises on it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from calm_s29 import MODES, Row, check
from contract import MODE_OPTIONS
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import nan_magic

pytestmark = pytest.mark.usefixtures("one_torch_thread", "frozen_heap")  # (conftest.py: why)


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _once_then_watched(call: Callable[[], Any], times: int = 3) -> Callable[[Callable[..., Any]], list[Any]]:
    """A loop that calls ``call`` once unwatched (dynamo compiles there), then ``times`` times inside the watch."""

    def run(watching: Callable[..., Any]) -> list[Any]:
        outputs = [call()]
        with watching():
            outputs += [call() for _ in range(times)]
        return outputs

    return run


def _grads(out: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [out[name] for name in sorted(out)]


def grad_of_functional_call(backend: str) -> Callable[[], Row]:
    """``torch.compile(torch.func.grad(f))`` with ``f`` calling ``functional_call``: MAML's inner step, compiled."""

    def build() -> Row:
        torch._dynamo.reset()
        model, x = _mlp(), torch.randn(8, 4)
        params = {name: p.detach() for name, p in model.named_parameters()}

        def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(model, p, (x,)).pow(2).sum()

        grad = torch.compile(torch.func.grad(loss), backend=backend)
        return Row((model,), (model,), _once_then_watched(lambda: _grads(grad(params, x))))

    return build


def per_sample_grads_compiled() -> Row:
    """Per-sample gradients (``vmap(grad(...))`` over ``functional_call``), compiled: Opacus-style clipping."""
    torch._dynamo.reset()
    model, x, y = _mlp(), torch.randn(6, 4), torch.randn(6, 2)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(torch.func.functional_call(model, p, (xi[None],)), yi[None])

    per_sample = torch.compile(torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0)), backend="eager")
    return Row((model,), (model,), _once_then_watched(lambda: _grads(per_sample(params, x, y))))


def functional_call_fullgraph_first_inside() -> Row:
    """A ``fullgraph=True`` function over ``functional_call`` compiled for the first time inside the watch."""
    torch._dynamo.reset()
    model, x = _mlp(), torch.randn(8, 4)
    params = {name: p.detach() * 2 for name, p in model.named_parameters()}
    call = torch.compile(lambda p, x: torch.func.functional_call(model, p, (x,)).sum(), backend="eager",
                         fullgraph=True)

    def run(watching: Callable[..., Any]) -> list[torch.Tensor]:
        with watching():
            return [call(params, x) for _ in range(2)]

    return Row((model,), (model,), run)


def fullgraph_function_over_model() -> Row:
    """A ``fullgraph=True`` compiled loss over a plain model (under ``ops=True`` the op tracer makes dynamo compile
    no frame, which ``fullgraph=True`` raises on unless the stance says eager)."""
    torch._dynamo.reset()
    model, x = _mlp(), torch.randn(8, 4)
    call = torch.compile(lambda x: model(x).pow(2).mean(), backend="eager", fullgraph=True)
    return Row((model,), (model,), _once_then_watched(lambda: call(x)))


def func_transforms() -> Row:
    """``torch.func`` eagerly: grad with ``has_aux``, ``vmap`` of the model, jacrev, jacfwd, hessian and
    ``torch.autograd.functional.jacobian``."""
    model, xs, x = _mlp(), torch.randn(5, 3, 4), torch.randn(4)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.func.functional_call(model, p, (x,))
        return out.pow(2).sum(), out

    def run(watching: Callable[..., Any]) -> list[Any]:
        with watching():
            grads, aux = torch.func.grad(loss, has_aux=True)(params)
            return [_grads(grads), aux, torch.func.vmap(model)(xs), torch.func.jacrev(model)(x),
                    torch.func.jacfwd(model)(x), torch.func.hessian(lambda z: model(z).sum())(x),
                    torch.autograd.functional.jacobian(model, xs[0])]

    return Row((model,), (model,), run)


def checkpointed_training(reentrant: bool) -> Callable[[], Row]:
    def build() -> Row:
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        xs, ys = torch.randn(3, 8, 4), torch.randn(3, 8, 2)

        def run(watching: Callable[..., Any]) -> list[torch.Tensor]:
            losses = []
            with watching():
                for x, y in zip(xs, ys, strict=True):
                    opt.zero_grad()
                    loss = F.mse_loss(checkpoint(model, x.requires_grad_(), use_reentrant=reentrant), y)
                    loss.backward()
                    opt.step()
                    losses.append(loss.detach())
            return losses

        return Row((model,), (model, opt), run)

    return build


def evaluation_and_odd_outputs() -> Row:
    """``no_grad`` and ``inference_mode`` evaluation, integer and bool outputs, a complex-valued model's step."""

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 3)
            self.mix = nn.Parameter(torch.randn(3, 3, dtype=torch.cfloat))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = self.linear(x)
            return out.argmax(-1), out > 0, (out.to(torch.cfloat) @ self.mix).abs()

    model, xs = Heads(), torch.randn(3, 5, 4)

    def run(watching: Callable[..., Any]) -> list[Any]:
        with watching():
            with torch.no_grad():
                evaluated = [model(x) for x in xs]
            with torch.inference_mode():
                inferred = [model(x)[:2] for x in xs]
            loss = model(xs[0])[2].sum()
            loss.backward()
        return [evaluated, inferred, loss.detach(), model.mix.grad, model.linear.weight.grad]

    return Row((model,), (model,), run)


ROWS: dict[str, Callable[[], Row]] = {
    "grad_of_functional_call_eager": grad_of_functional_call("eager"),
    "grad_of_functional_call_aot_eager": grad_of_functional_call("aot_eager"),
    "per_sample_grads_compiled": per_sample_grads_compiled,
    "functional_call_fullgraph_first_inside": functional_call_fullgraph_first_inside,
    "fullgraph_function_over_model": fullgraph_function_over_model,
    "func_transforms": func_transforms,
    "checkpoint_reentrant": checkpointed_training(True),
    "checkpoint_non_reentrant": checkpointed_training(False),
    "evaluation_and_odd_outputs": evaluation_and_odd_outputs,
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("row", list(ROWS))
def test_healthy_row_is_calm_and_identical(row: str, mode: str) -> None:
    check(ROWS[row], mode)


@pytest.mark.parametrize("mode", ["default", "full"])
def test_compiled_grad_of_functional_call_keeps_its_one_graph(mode: str) -> None:
    """The watch adds no graph break to ``torch.compile(torch.func.grad(f))`` over ``functional_call``: its hooks are
    off while dynamo traces, and dynamo traces torch's own swap in place of the watch's. One recompile as the watch
    arrives (the swap's function is the watch's while it is active: dynamo guards its code), none as it goes."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, x = _mlp(), torch.randn(8, 4)
    params = {name: p.detach() for name, p in model.named_parameters()}
    grad = torch.compile(torch.func.grad(lambda p, x: torch.func.functional_call(model, p, (x,)).sum()),
                         backend="eager")
    grad(params, x)
    with nan_magic.watch(model, **MODE_OPTIONS[mode]):
        for _ in range(3):
            grad(params, x)
    grad(params, x)
    with nan_magic.watch(model, **MODE_OPTIONS[mode]):
        grad(params, x)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_compiled_grad_of_functional_call_with_inductor() -> None:
    """The default backend too (one row: inductor compiles slowly on a small machine)."""
    check(grad_of_functional_call("inductor"), "default")
