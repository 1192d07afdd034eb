"""A ``LinAlgError`` raised on a matrix the user's code had already made non-finite is explained (hunt-s33).

``may_follow_nonfinite`` left every ``LinAlgError`` to the user (e45ef17: linalg's verdict on a singular matrix, whose
``_ex`` kernel's NaN never reached the user's code, must stay catchable). But where the matrix handed to linalg
already held a NaN or a +inf (a GP kernel of a lengthscale that underflowed to 0), the first non-finite value came
before the error: ``ops=True`` stopped at it, while the default, deferred and per-module watches let the bare
``LinAlgError`` out with no report. Now each replays the forward and names the same producer. A finite singular
matrix's error is still the user's to catch (tests/test_tiered.py's linalg row).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import nan_magic

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]  # (conftest.py: small models, torch on one thread)

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"},
                                    "ops": {"ops": True}, "ops-defer": {"ops": True, "defer": True}}


class Procrustes(nn.Module):
    """Aligns two views' features by the orthogonal Procrustes solution of their standardised cross-covariance."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fa, fb = self.a(x), self.b(x)
        za = (fa - fa.mean(0)) / fa.std(0)  # a dead feature: its std is 0
        u, _s, vh = torch.linalg.svd(za.T @ fb)
        return fa @ (u @ vh) - fb


@pytest.mark.parametrize("mode", list(MODES))
def test_an_svd_of_a_matrix_a_division_made_nan_names_the_division(mode: str) -> None:
    torch.manual_seed(0)
    model = Procrustes()
    with torch.no_grad():
        model.a.weight[1] = 0.0  # feature 1 of view a is constant: std 0, (x - mean) / 0 is 0 / 0
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODES[mode]):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", "", 0, "aten.div.Tensor"), \
        report.message
    assert report.source is not None and "fa.std(0)" in report.source.line
    assert isinstance(caught.value.__context__, torch.linalg.LinAlgError) or mode.startswith("ops")


@pytest.mark.parametrize("mode", ["default", "full"])
def test_a_finite_singular_matrix_is_still_the_users_to_catch(mode: str) -> None:
    """A GP whose duplicated points make ``K`` singular (no NaN anywhere): ``except LinAlgError`` adds jitter."""
    torch.manual_seed(0)
    model = nn.Linear(2, 2)
    x = torch.randn(5, 2)
    x[3] = x[1]
    with nan_magic.watch(model, **MODES[mode]) as w:
        h = model(x)
        k = h @ h.T  # rank 2 of 5: singular
        try:
            chol = torch.linalg.cholesky(k)
        except torch.linalg.LinAlgError:
            chol = torch.linalg.cholesky(k + 1e-3 * torch.eye(5))
    assert w.report is None and bool(torch.isfinite(chol).all())
