"""A solve that overflows is an overflow, not a singular matrix (review of hunt-s35's solve-singular reading)."""

from __future__ import annotations

import pytest
import torch
from contract import MODE_OPTIONS
from torch import nn

import nan_magic


def _solve_a_huge_right_hand_side(mode: str) -> nan_magic.Report:
    """A well-conditioned solve (0.25 I) of a right-hand side of 1e38 at step 2: float32 overflows, nothing is singular
    (tests/contract/hunt_s35.py's MultivariateNormal rows hold the singular reading)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nan_magic.watch(model, opt, **MODE_OPTIONS[mode]) as w, pytest.raises(nan_magic.NonFiniteError):
        for step in range(4):
            out = model(torch.randn(3, 4))
            b = torch.full((3, 4, 1), 1e38 if step == 2 else 1.0)
            z = torch.linalg.solve(torch.eye(4) * 0.25, b)
            loss = z.pow(2).mean() * 0 + out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert w.report is not None
    return w.report


@pytest.mark.parametrize("mode", ["default", "ops", "defer"])
def test_a_solve_of_a_right_hand_side_near_the_max_reads_overflow(mode: str) -> None:
    report = _solve_a_huge_right_hand_side(mode)
    assert report.step == 2 and report.op is not None and "solve" in report.op
    assert report.cause is not None and report.cause.label == "overflow", report.message
    assert report.cause.reading != "solve-singular"
