"""hunt_s31: soft-DTW's infinite border, and an exp beside a mask.

Soft-DTW's table of cumulative costs has a +inf border. Filled by ``torch.full((), inf)`` it is deliberate
(PRODUCT.md, "benign": an op given an infinite scalar) in every mode, and a ``log(0)`` or an ``exp`` overflow later
in the code is named. Written with a literal (``inf = torch.tensor(float("inf"))``) the default, deferred and full
modes name that border as bad input data at the line that stacked it (:data:`LITERAL`, strict xfails): a rule taking
every lifted infinity for deliberate was built and taken back in session 31, as it also took a label, a reward or a
model's offset lifted from data (``torch.tensor(value)``) for deliberate and named the wrong module, op and cause.

An ``exp`` whose input's only non-finite values are -inf (a mask, that border) and which made +inf was "unclassified:
made +inf from inputs already non-finite"; ``exp(-inf)`` is 0, so the +inf is a finite element's overflow: the cause
is exp-overflow (explain/forward.py), with its hint and the max subtraction verified.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nan_magic

MODES = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"}, "ops": {"ops": True},
         "ops-defer": {"ops": True, "defer": True}}


def _border_loop(border: str, overflow: bool, **options: object) -> nan_magic.Report:
    """A loss over ``stack([value, border])``; at step 2 ``exp`` of it underflows to 0 (``log(0)``), or overflows."""
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(2, 3) for _ in range(3)]
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(3):
            out = model(xs[step])
            inf = torch.tensor(float("inf")) if border == "literal" else torch.full((), float("inf"))
            value = -(out.sum() ** 2 + 1) if overflow else out.sum() ** 2 + 1
            prev = torch.stack([value, inf])
            terms = torch.exp(-prev * (1.0 if step < 2 else 1e4))  # overflow: the producer at step 2
            loss = terms.sum() + out.sum() if overflow else -torch.log(terms.sum())  # log(0): the producer at step 2
            opt.zero_grad()
            loss.backward()
            opt.step()
    return caught.value.report


#: Why the literal border's rows fail (the module docstring).
LITERAL = pytest.mark.xfail(strict=True, reason=(
    "an infinity lifted from a literal (torch.tensor(float('inf'))) cannot be told from one lifted from data "
    "(torch.tensor(label)): both are data, so soft-DTW's literal border is named bad input data where it was stacked"))


@pytest.mark.parametrize(("mode", "border"), [
    pytest.param(mode, border, marks=LITERAL if border == "literal" and mode in ("default", "defer", "full") else ())
    for border in ("literal", "full") for mode in MODES])  # (the traced modes name the log: ops traces the code)
def test_a_log_of_0_beside_a_lifted_infinite_border_is_named(mode: str, border: str) -> None:
    report = _border_loop(border, False, **MODES[mode])
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 2, "aten.log.default")
    assert report.source is not None and report.source.line.startswith("loss = terms.sum() + out.sum() if overflow")
    assert report.cause is not None and report.cause.label == "log-domain"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("border", [pytest.param("literal", marks=LITERAL), "full"])
def test_an_exp_overflow_beside_a_lifted_infinite_border_is_named(mode: str, border: str) -> None:
    report = _border_loop(border, True, **MODES[mode])
    assert (report.phase, report.module, report.step, report.op) == ("forward", None, 2, "aten.exp.default")
    assert report.source is not None and report.source.line.startswith("terms = torch.exp(")
    # (Its cause was "unclassified: made +inf from inputs already non-finite" with either border: the -inf.)
    assert report.cause is not None and report.cause.label == "exp-overflow"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fill", [float("-inf"), -1e9])
def test_a_hand_written_masked_softmax_whose_exp_overflows_is_an_exp_overflow(mode: str, fill: float) -> None:
    """``exp(scores.masked_fill(mask, -inf))`` overflowing in an unmasked position: the mask's -inf gives 0, the +inf
    is the finite scores' overflow; its cause is exp-overflow, as without the mask (-1e9), and max subtraction is the
    fix verified on a replay."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    keep = torch.tensor([True, True, True, False])
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODES[mode]):
        for step in range(3):
            scores = model(torch.randn(2, 4) * (1 if step < 2 else -1000)).masked_fill(~keep, fill)
            e = torch.exp(scores)
            loss = -(e[:, 0] / e.sum(-1) + 1e-3).log().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.step, report.op) == ("forward", 2, "aten.exp.default")
    assert report.cause is not None and report.cause.label == "exp-overflow"
    if not MODES[mode].get("ops"):  # (ops=True tries no fix on this step: the same with -1e9, unmasked)
        assert [fix.kind for fix in report.fixes if fix.finite] == ["stable"]


@pytest.mark.parametrize("mode", MODES)
def test_an_infinity_the_loop_writes_into_the_batch_is_still_named_at_its_line(mode: str) -> None:
    """The lifted +inf is deliberate as lifted, but a batch it was written into is data at the model's input, named
    at the writing line as a NaN is (test_gaps25)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODES[mode]):
        for step in range(4):
            x, y = torch.randn(16, 4), torch.randn(16, 4)
            if step == 2:
                x[3, 2] = float("inf")
            loss = (model(x) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.step, report.posinf, report.op) == ("data", 2, 1, "aten.lift_fresh.default")
    assert report.source is not None and report.source.line == 'x[3, 2] = float("inf")'


@pytest.mark.parametrize("mode", MODES)
def test_a_lifted_nan_the_loss_reads_stays_data(mode: str) -> None:
    """A NaN is never deliberate: a NaN-coded target the loss code made from a literal is still data."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODES[mode]):
        for step in range(3):
            out = model(torch.randn(2, 4))
            target = torch.tensor(float("nan")) if step == 2 else torch.tensor(0.5)
            loss = (out - target).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = caught.value.report
    assert (report.phase, report.step, report.nan) == ("data", 2, 1)
