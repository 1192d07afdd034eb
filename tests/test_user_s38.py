"""Session 38's walk, in-process: what the notebooks of tests/notebooks/user_s38/ showed a user was wrong, pinned
where it is decided (the notebooks themselves run in tests/test_user_s38_notebooks.py).

A hand-written binary cross-entropy ``-(y * log(p) + (1 - y) * log(1 - p))`` with ``p = sigmoid(logits)`` is -inf in
``log(1 - p)`` where the sigmoid rounded to exactly 1 (a logit above 17 in float32, above about 6 in bfloat16 under
autocast). The stable remedy fused only ``log(sigmoid(z))`` into ``logsigmoid(z)``, which was finite already, and said
"still non-finite": the one form that fixes the line, ``log(1 - sigmoid(z)) = logsigmoid(-z)`` (what
``F.binary_cross_entropy_with_logits`` computes), was never tried.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic.records import Report
from nan_magic.render.edits import suggested_edit


def bce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(logits)
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()


def _report(autocast: bool) -> Report:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():  # a prior bias with the sign flipped: every logit near +40 (+9 under bfloat16 autocast)
        model.bias.fill_(9.0 if autocast else 40.0)
        model.weight.mul_(0.01)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 4), torch.zeros(8, 3)
    y[2, 1] = 1.0
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = bce(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return caught.value.report


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bfloat16-autocast"])
def test_the_log_of_one_minus_a_sigmoid_that_rounded_to_one_is_fused_into_logsigmoid_of_minus_z(
        autocast: bool) -> None:
    report = _report(autocast)
    assert report.op == "aten.log.default" and report.module is None and report.step == 0
    (stable,) = [trial for trial in report.fixes if trial.kind == "stable"]
    # Was: "the log of the sigmoid fused into logsigmoid -> still non-finite (loss)"
    assert stable.finite is True, stable
    assert stable.fact("form") == "logsigmoid(-x)"
    text = report.to_text()
    assert "stable: log(1 - sigmoid(x)) computed as F.logsigmoid(-x)" in text, text


def bce_one_line(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -(y * torch.log(torch.sigmoid(logits)) + (1 - y) * torch.log(1 - torch.sigmoid(logits))).mean()


@pytest.mark.parametrize("loss_fn", [bce, bce_one_line], ids=["two-lines", "one-line"])
def test_a_sigmoid_that_rounded_to_zero_is_still_the_log_of_the_sigmoid_fused(
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
    """The other direction: logits near -120 for positive labels, the sigmoid 0, log(p) the -inf and log(1 - p)
    finite. Both logs are fused in the trial; the form said, and the edit, are the -inf's (review of user-s38: it
    read 'log(1 - sigmoid(x)) ... where the sigmoid rounded to 1' and the one-line BCE lost its edit)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with torch.no_grad():
        model.bias.fill_(-120.0)
        model.weight.mul_(0.01)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 4), torch.ones(8, 3)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt):
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    report = caught.value.report
    (stable,) = [trial for trial in report.fixes if trial.kind == "stable"]
    assert stable.finite is True and stable.fact("form") == "logsigmoid", stable
    text = report.to_text()
    assert "stable: the log of the sigmoid fused into logsigmoid -> verified" in text, text
    assert "rounded to 1" not in text
    edit = suggested_edit(stable)
    if loss_fn is bce_one_line:  # (the sigmoid called on the log's line: the edit rewrites it there)
        assert edit is not None and "torch.nn.functional.logsigmoid(logits)" in edit, edit
    else:
        assert edit is None, edit


def test_the_log_domain_cause_says_how_a_sigmoid_s_log_is_computed_from_logits() -> None:
    # Was "... or use log_softmax / logsumexp / log_ndtr for log-probabilities (logdet for a determinant)": nothing
    # for the log of a sigmoid's probability, the commonest hand-written log of a probability
    cause = _report(autocast=True).to_text().split("\n\n")[1]
    assert "or use log_softmax / logsumexp / log_ndtr / logsigmoid(z) / logsigmoid(-z) for log-probabilities " \
        "(logdet for a determinant)" in cause, cause


@pytest.mark.xfail(strict=True, reason=(
    "A gradient already NaN when the watch begins (left by an earlier backward that was never zeroed: a second "
    "scene.rerun_step(step, model, opt) whose step() has no opt.zero_grad()) is reported as 'first non-finite "
    "gradient of weight in backward step 0: Linear (root)', cause 'unclassified: ... the backward that computed it "
    "was not watched': the watch reads parameter gradients only before the optimizer step, not as it begins, so it "
    "cannot tell an accumulated stale NaN from one this step's backward made"))
def test_a_gradient_already_nan_when_the_watch_begins_is_not_blamed_on_the_backward() -> None:
    from nan_magic.records import Phase

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.weight.grad = torch.full_like(model.weight, float("nan"))  # left by an earlier backward, never zeroed
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    assert caught.value.report.phase is Phase.DATA
