"""The review of fixes-s34: a verified float32 edit is the line as the remedy changed it, and it runs.

Was: ``torch.exp(h * (1 / 3))`` in float16 printed the user's own line unchanged as its "suggested edit" (the trial
saw 0.333 given to mul, and ``h``, a name beside a computed number, was taken for it), which still overflows; and
``F.leaky_relu(h, self.p)``, ``F.dropout(h, self.p, self.training)``, ``torch.mul(h, self.cfg["scale"])``,
``torch.mul(h, self.w[0])``, ``torch.div(h, temperature)`` (``temperature = 1.0``, a literal 1 elsewhere on the
line), ``torch.mul(h, scale + 1.0)`` and ``h / math.sqrt(d)`` had ``.float()`` written on a Python number or bool
(or inside ``math.sqrt``), which raises on the user's line. Each form here runs the float32 trial for real, then
evaluates its edit on the model's own values: float32, finite, and never the line unchanged.
"""

# ruff: noqa: RUF059  (each form unpacks every name a line may read, as a forward holds its locals)

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_fixes_s33 import _trial
from test_fixes_s34 import _same
from torch import nn

import nan_magic
from nan_magic.render.edits import suggested_edit

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]


class _Base(nn.Module):
    """A float16 layer; ``hidden`` gives the names each form's line reads (``h`` scaled so its exp overflows)."""

    gain, shift = 36.0, 0.0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2).half()
        self.p, self.cfg, self.w = 0.2, {"scale": 0.5}, [0.5, 1.0]

    def hidden(self, x: torch.Tensor) -> tuple[Any, ...]:
        h = self.lin(x) * self.gain + self.shift
        return h, torch.full_like(h, 1 / 3), 1.0, 0.5, 4


class Third(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w, temperature, scale, d = self.hidden(x)
        return torch.exp(h * (1 / 3)).mean(-1, keepdim=True) / 2e5


class Over255(_Base):
    gain, shift = 3060.0, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w, temperature, scale, d = self.hidden(x)
        return torch.exp(h * (1.0 / 255)).mean(-1, keepdim=True) / 2e5


class RootTwo(_Base):
    gain, shift = 17.0, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w, temperature, scale, d = self.hidden(x)
        return torch.exp(h / 2 ** 0.5).mean(-1, keepdim=True) / 2e5


class TensorThenThird(_Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w, temperature, scale, d = self.hidden(x)
        return (torch.exp(h * w) * (1 / 3)).mean(-1, keepdim=True) / 2e5


class LeakySlope(_Base):
    gain, shift = 1.0, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w, temperature, scale, d = self.hidden(x)
        return torch.exp(F.leaky_relu(h, self.p) + 12.0).mean(-1, keepdim=True) / 2e5


class DropoutFlag(_Base):
    gain, shift = 1.0, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w, temperature, scale, d = self.hidden(x)
        return torch.exp(F.dropout(h, self.p, self.training) + 12.0).mean(-1, keepdim=True) / 2e5


class DictScale(_Base):
    gain, shift = 1.0, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w, temperature, scale, d = self.hidden(x)
        return torch.exp(torch.mul(h, self.cfg["scale"]) + 12.0).mean(-1, keepdim=True) / 2e5


class ListScale(_Base):
    gain, shift = 1.0, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w, temperature, scale, d = self.hidden(x)
        return torch.exp(torch.mul(h, self.w[0]) + 12.0).mean(-1, keepdim=True) / 2e5


class TemperatureOne(_Base):
    gain, shift = 1.0, 13.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w, temperature, scale, d = self.hidden(x)
        return torch.exp(torch.div(h, temperature) - 1).mean(-1, keepdim=True) / 2e5


class ScalePlusOne(_Base):
    gain, shift = 1.0, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w, temperature, scale, d = self.hidden(x)
        return torch.exp(torch.mul(h, scale + 1.0) + 12.0).mean(-1, keepdim=True) / 2e5


class SqrtDim(_Base):
    gain, shift = 24.0, 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w, temperature, scale, d = self.hidden(x)
        return torch.exp(h / math.sqrt(d)).mean(-1, keepdim=True) / 2e5


FORMS = (Third, Over255, RootTwo, TensorThenThird, LeakySlope, DropoutFlag, DictScale, ListScale, TemperatureOne,
         ScalePlusOne, SqrtDim)


def _report(cls: type[_Base], **options: Any) -> nan_magic.Report:
    torch.manual_seed(0)
    model = cls()
    x, y = torch.randn(8, 4).half(), torch.randn(8, 1).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        with nan_magic.watch(model, opt, **options):
            for _ in range(3):
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
    except nan_magic.NonFiniteError as error:
        return error.report
    raise AssertionError(f"{cls.__name__}: no event")


@pytest.mark.parametrize("options", [{}, {"ops": True}], ids=["default", "ops"])
@pytest.mark.parametrize("cls", FORMS, ids=[cls.__name__ for cls in FORMS])
def test_a_verified_float32_edit_runs_on_the_users_line_in_float32(cls: type[_Base], options: dict[str, Any]) -> None:
    report = _report(cls, **options)
    trial = _trial(report, "float32")
    assert trial.finite is True, trial
    edit = suggested_edit(trial)
    assert edit is not None and f"suggested edit (not applied): {edit}" in report.to_text()
    code = edit.split(": ", 1)[1].strip().removeprefix("return ")
    line = trial.source.line.strip().removeprefix("return ")
    assert code != line and "h.float()" in code, edit  # (the tensor upcast; never the line as the user wrote it)
    torch.manual_seed(0)
    model = cls()
    h, w, temperature, scale, d = model.hidden(torch.randn(8, 4).half())
    names = {"h": h, "w": w, "temperature": temperature, "scale": scale, "d": d, "self": model}
    out = eval(code, {"torch": torch, "F": F, "math": math}, names)  # (raises where .float() is on a number)
    assert out.dtype == torch.float32 and bool(torch.isfinite(out).all()), edit
    line_out = eval(line, {"torch": torch, "F": F, "math": math}, names)
    assert not bool(torch.isfinite(line_out).all())  # (the line itself overflows: the edit is what fixes it)


@pytest.mark.parametrize("cls", [Third, LeakySlope, SqrtDim], ids=["Third", "LeakySlope", "SqrtDim"])
def test_the_healthy_twins_of_the_forms_stay_silent_and_bit_identical(cls: type[_Base]) -> None:
    """The same lines with small values (``h`` at a tenth, no shift): no event, and the run is the unwatched one."""
    twin = type(f"Healthy{cls.__name__}", (cls,), {"gain": 0.1, "shift": 0.0})
    if cls in (LeakySlope,):  # (its + 12.0 is on the line: exp(12) overflows float16 whatever h is)
        twin.forward = lambda self, x: torch.exp(F.leaky_relu(self.hidden(x)[0], self.p) + 1.0).mean(-1) / 2e5

    def train() -> tuple[list[torch.Tensor], list[float]]:
        torch.manual_seed(0)
        model = twin()
        x, y = torch.randn(8, 4).half(), torch.randn(8).half()
        opt, losses = torch.optim.SGD(model.parameters(), lr=0.01), []
        for _ in range(3):
            opt.zero_grad()
            loss = F.mse_loss(model(x).reshape(8), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return [p.detach().clone() for p in model.parameters()], losses

    with nan_magic.watch() as watch:
        watched = train()
    assert watch.report is None and not watch.events
    unwatched = train()
    assert watched[1] == unwatched[1] and all(_same(a, b) for a, b in zip(watched[0], unwatched[0]))
