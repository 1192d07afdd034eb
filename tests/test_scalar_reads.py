"""A 0-d boundary tensor read at once is read by its value, not probed (hot18, issue 25).

The loss is a 0-d tensor read at every healthy step. Its value is its minimum and its maximum, so the immediate
timing reads it with one ``.item()``: no ``aminmax`` runs for it and no tensor is made (a reduction and two host
reads less a step). These pin that, and that what the watch says of the loss is what the probe said: the
history's loss bit for bit, a NaN, ``+inf`` or ``-inf`` loss counted as such and named at its op and line in both
timings (the deferred timing holds the loss's probe for its check, as before), a bfloat16 loss, a loss that
requires grad read without a warning, and a forward-mode dual loss read as its primal.
"""

from __future__ import annotations

import sys
import warnings

import faults
import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.hot.kept import call_records

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]


def _marked(key: str) -> int:
    return faults.marked_line(key, where=sys.modules[__name__])


def test_the_loss_is_read_without_a_probe_in_the_immediate_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    probed: list[tuple[int, ...]] = []
    original = call_records.probe

    def counting(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probed.append(tuple(tensor.shape))
        return original(tensor)

    monkeypatch.setattr(call_records, "probe", counting)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    losses = []
    with nan_magic.watch(model, opt) as w:
        for _ in range(4):
            loss = nn.functional.cross_entropy(model(x), y)
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert w.report is None and [row.loss for row in w.history] == losses
    assert probed and () not in probed  # the batch and the output probed; the loss read by its value


def _loss_code(kind: str, loss: torch.Tensor, step: int) -> torch.Tensor:
    shift = 0.0 if step < 2 else 1.0
    if kind == "nan":
        return torch.log(loss - 1e6 * shift)  # producer: nan loss
    if kind == "posinf":
        return torch.exp(loss + 1e3 * shift)  # producer: posinf loss
    return torch.log(loss * (1.0 - shift))  # producer: neginf loss


@pytest.mark.parametrize("options", TIMINGS)
@pytest.mark.parametrize(
    ("kind", "op", "counts"),
    [
        ("nan", "aten.log.default", (1, 0, 0)),
        ("posinf", "aten.exp.default", (0, 1, 0)),
        ("neginf", "aten.log.default", (0, 0, 1)),
    ],
)
def test_a_non_finite_loss_is_counted_and_named_as_the_probe_did(
    options: dict, kind: str, op: str, counts: tuple[int, int, int]
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(3):
            loss = _loss_code(kind, model(x).pow(2).mean() + 1.0, step)
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 2, op)
    assert report.source is not None and report.source.lineno == _marked(f"{kind} loss")
    assert (report.nan, report.posinf, report.neginf) == counts


@pytest.mark.parametrize("options", TIMINGS)
def test_a_bfloat16_loss_is_read_as_its_value_without_a_warning(options: dict) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(5, 4, dtype=torch.bfloat16), torch.randint(0, 2, (5,))
    losses = []
    with warnings.catch_warnings(), nan_magic.watch(model, opt, **options) as w:
        warnings.simplefilter("error")  # float() of a tensor that requires grad warns; the read must not
        for _ in range(3):
            loss = nn.functional.cross_entropy(model(x), y)
            losses.append(float(loss.detach()))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert w.report is None and [row.loss for row in w.history] == losses


def test_a_forward_mode_dual_loss_is_read_as_its_primal() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    primal = torch.randn(6, 4)
    losses = []
    with nan_magic.watch(model, opt) as w, fwAD.dual_level():
        for _ in range(3):
            x = fwAD.make_dual(primal, torch.full_like(primal, 1e30))  # a tangent no read may take for the value
            loss = model(x).pow(2).mean()
            losses.append(float(fwAD.unpack_dual(loss).primal.detach()))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert w.report is None and [row.loss for row in w.history] == losses
