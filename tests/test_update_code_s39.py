"""Update code between ``backward()`` and ``step()`` named with op and line in every mode: session 39's gaps.

Session 38 named ``p.grad /= p.grad.norm()``, ``.data``, foreach and library writes (test_update_code_s37.py). Left
over, where default/defer/full named the gradient's owner with no op while ops=True named the loop's code:

- the trust-ratio form of a LARS helper, ``p.grad.mul_(1.0 / p.grad.norm())``, over more parameters than the watched
  region's ring at a later step (the write was kept past the ring; the reciprocal that made its operand was not);
- ``g = p.grad; g.div_(g.norm() + 0)``;
- a write through a view, ``p.grad.view(-1).div_(0)`` (or a row's, ``p.grad[-1].div_(0)``);
- ``p.grad.data.copy_(p.grad / p.grad.norm())`` (a gradient replaced by a computed one) past the ring;
- ``clip_grad_norm_(params, max_norm=nan)`` (a max norm a config or a running statistic made NaN), also with
  ``foreach=False`` (each gradient scaled in turn, the first long out of the ring over 40 parameters).

Each is exact by construction: at the bad step the loss is multiplied by 0, so every gradient is exactly 0 and its
norm is 0 (0 / 0, 1 / 0), or the divisor or max norm given is 0 or NaN. Step 0 (the update region recorded in full)
and step 3 (watched, its ring of 16 ops long past the first parameter's ops), over 4 and 40 parameters.

The phase asserted is the one every mode gives, ops=True's too: "backward" (the gradient check's: "first non-finite
gradient of 0.weight in backward step N"), though the producer ran in the loop's update code, not in a gradient
formula; PRODUCT.md's phase is where the producer ran. Left as it is (report-update-s39): a change of every mode.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from contract import MODE_OPTIONS
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.records import Phase, TensorRef, TensorRole

_STEPS = 4


def _line(function: Callable[..., Any], marker: str) -> int:
    lines, first = inspect.getsourcelines(function)
    (index,) = [i for i, text in enumerate(lines) if f"# {marker}" in text]
    return first + index


def _trust_ratio(params: list[nn.Parameter], bad: bool) -> None:
    for p in params:
        p.grad.mul_(1.0 / p.grad.norm())  # the update


def _aliased(params: list[nn.Parameter], bad: bool) -> None:
    for p in params:
        g = p.grad
        g.div_(g.norm() + 0)  # the update


def _through_view(params: list[nn.Parameter], bad: bool) -> None:
    for p in params:
        p.grad.view(-1).div_(0.0 if bad else 2.0)  # the update


def _through_row(params: list[nn.Parameter], bad: bool) -> None:
    for p in params:
        p.grad[-1].div_(0.0 if bad else 2.0)  # the update


def _replaced(params: list[nn.Parameter], bad: bool) -> None:
    for p in params:
        p.grad.data.copy_(p.grad / p.grad.norm())  # the update


def _clip_nan(params: list[nn.Parameter], bad: bool) -> None:
    nn.utils.clip_grad_norm_(params, max_norm=float("nan") if bad else 1.0)  # the update


def _clip_nan_each(params: list[nn.Parameter], bad: bool) -> None:
    nn.utils.clip_grad_norm_(params, max_norm=float("nan") if bad else 1.0, foreach=False)  # the update


#: Each update, whether the loss is zeroed at the bad step (its norms 0), and the op ops=True names.
_UPDATES: dict[Callable[..., None], tuple[bool, str]] = {
    _trust_ratio: (True, "aten.reciprocal.default"),
    _aliased: (True, "aten.div_.Tensor"),
    _through_view: (False, "aten.div_.Tensor"),
    _through_row: (False, "aten.div_.Tensor"),
    _replaced: (True, "aten.div.Tensor"),
    _clip_nan: (False, "aten.mul.Tensor"),
    _clip_nan_each: (False, "aten.mul.Tensor"),
}
_IDS = {_trust_ratio: "trust-ratio", _aliased: "aliased", _through_view: "through-view",
        _through_row: "through-row", _replaced: "data-copy", _clip_nan: "clip-norm-nan",
        _clip_nan_each: "clip-norm-nan-each"}


def _loop(update: Callable[..., None], parameters: int, bad: int | None, options: dict[str, Any] | None
          ) -> tuple[Any, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(parameters // 2)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(5, 3) for _ in range(_STEPS)]
    zeroed = _UPDATES[update][0]
    params = list(model.parameters())
    watch = nan_magic.watch(model, opt, **options) if options is not None else contextlib.nullcontext()
    with watch as w:
        for step, x in enumerate(xs):
            loss = model(x).pow(2).mean() * (0.0 if zeroed and step == bad else 1.0)  # every gradient exactly 0
            opt.zero_grad()
            loss.backward()
            update(params, step == bad)
            opt.step()
    return w, [p.detach().clone() for p in model.parameters()]


_CASES = [pytest.param(update, id=_IDS[update]) for update in _UPDATES]


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
@pytest.mark.parametrize("parameters", [4, 40])
@pytest.mark.parametrize("bad", [0, 3])
@pytest.mark.parametrize("update", _CASES)
def test_the_loops_update_code_is_named_with_op_and_line(update: Any, bad: int, parameters: int, mode: str) -> None:
    with pytest.raises(NonFiniteError) as caught:
        _loop(update, parameters, bad, MODE_OPTIONS[mode])
    report = caught.value.report
    # (The phase is the gradient check's, "backward", in every mode, ops=True's too: the module docstring.)
    assert (report.module, report.phase, report.step, report.op) == (
        None, Phase.BACKWARD, bad, _UPDATES[update][1]), report.message
    assert report.tensor == TensorRef(TensorRole.PARAMETER_GRADIENT, "0.weight", ""), str(report.tensor)
    assert report.source is not None and report.source.lineno == _line(update, "the update"), report.message


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
@pytest.mark.parametrize("parameters", [4, 40])
@pytest.mark.parametrize("update", _CASES)
def test_the_healthy_twin_is_silent_and_bit_identical(update: Any, parameters: int, mode: str) -> None:
    _w, expected = _loop(update, parameters, None, None)
    w, got = _loop(update, parameters, None, MODE_OPTIONS[mode])
    assert w.report is None and not w.events, [event.message for event in w.events]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def _centered(params: list[nn.Parameter], bad: int) -> None:
    for i, p in enumerate(params):
        g = p.grad
        g.div_((g - g.mean()).pow(2).sum().sqrt() * (0.0 if i == bad else 1.0))  # the update


@pytest.mark.parametrize("mode", list(MODE_OPTIONS))
def test_a_later_write_after_gradient_sized_temporaries_is_named(mode: str) -> None:
    """Eight 512 x 512 layers (1 MiB gradients), ``g.div_((g - g.mean()).pow(2).sum().sqrt() * k)`` with k = 0 for
    5.weight only, at step 3. The ops before each write make gradient-sized temporaries: kept with every write, they
    filled the region's byte budget after a few parameters and 5.weight's write went unnamed in default, defer and
    full (review of update-s39). The write is then kept alone, with its operand, as before session 39."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    params, xs = list(model.parameters()), [torch.randn(4, 512) for _ in range(5)]
    with pytest.raises(NonFiniteError) as raised, nan_magic.watch(model, opt, **MODE_OPTIONS[mode]):
        for step in range(5):
            loss = model(xs[step]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            _centered(params, 10 if step == 3 else -1)
            opt.step()
    report = raised.value.report
    assert (report.module, report.op, report.step) == (None, "aten.div_.Tensor", 3)
    assert report.source is not None and report.source.lineno == _line(_centered, "the update")
    assert report.tensor == TensorRef(TensorRole.PARAMETER_GRADIENT, "5.weight")
