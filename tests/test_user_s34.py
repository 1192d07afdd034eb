"""Session 34's walk (tests/notebooks/user_s34/): what a person read that was wrong, asserted in-process.

A Beta regression whose fraction target held a 1.0 (``-Beta(a, b).log_prob(y)``, b < 1) made +inf in
``aten.xlogy`` (x·log(0) with x = b - 1 < 0), and the report said "Likely cause: unclassified ... no rule of the
checklist matches": the log-domain rule counted only -inf (x > 0) as a zero. xlogy's +inf is now a zero of its log's
operand too, and the hint says that the zeros made +inf or -inf by x's sign.

A per-batch standardisation ``(x - x.mean(0)) / x.std(0)`` named its divisor by the op's schema ("divided by zero
(`other` (6,) held 1 zero of 6)"): ``std`` was not among the calls known to run one op and no division inside, so the
line was taken to be ambiguous. ``std``, ``var``, ``std_mean``, ``var_mean``, ``logsumexp`` and ``median`` (one aten op
each, no ``aten.div`` under them) now leave the line's ``/`` the one division: "(`x.std(0)` (6,) held 1 zero of 6)".

The same standardisation said which column was constant ("feature 5 (= 0); standardising it divides by a zero std")
only when the failing step was a watch's first (or an 8th): the replay of the failing step now keeps that reading.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import Beta

from nan_magic import NonFiniteError, watch

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)


class BetaHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 2)
        with torch.no_grad():
            self.body.bias.fill_(-1.0)  # softplus(-1) ~ 0.31: both concentrations below 1 (a U-shaped Beta)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = F.softplus(self.body(x)).unbind(-1)
        return a + 1e-3, b + 1e-3


def _beta_step(y: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    net = BetaHead()
    x = torch.randn(len(y), 4) * 0.1
    with watch(net, fixes=False):
        a, b = net(x)
        loss = -Beta(a, b).log_prob(y).mean()
        loss.backward()
    return net.body.weight.grad


def test_a_beta_log_prob_at_its_support_edge_is_a_log_of_zero_not_unclassified() -> None:
    y = torch.linspace(0.1, 0.9, 10)
    y[4] = 1.0  # log(1 - y) = log(0) times b - 1 < 0: +inf
    with pytest.raises(NonFiniteError) as caught:
        _beta_step(y)
    report = caught.value.report
    assert report.op == "aten.xlogy.Tensor" and report.posinf == 1 and report.neginf == 0
    assert report.cause.label == "log-domain", report.cause.hint
    hint = report.cause.hint
    assert hint.startswith("xlogy got 1 zero and 0 negatives in `other` of aten.xlogy.Tensor"), hint
    assert "xlogy(x, y) is x * log(y): ±inf where y is 0 (+inf where x < 0)" in hint, hint


def test_the_healthy_beta_twin_is_silent_and_bit_identical() -> None:
    y = torch.linspace(0.1, 0.9, 10)
    watched = _beta_step(y)
    torch.manual_seed(0)
    net = BetaHead()
    x = torch.randn(len(y), 4) * 0.1
    a, b = net(x)
    (-Beta(a, b).log_prob(y).mean()).backward()
    assert torch.equal(watched, net.body.weight.grad)


def test_a_hand_written_xlogy_with_a_negative_weight_says_the_same() -> None:
    """Another form: a weighted log-likelihood written with torch.xlogy directly, a weight below 0 on a zero."""
    model = nn.Linear(3, 4)
    weights = torch.tensor([1.0, -0.5, 1.0, 1.0])
    with pytest.raises(NonFiniteError) as caught, watch(model, fixes=False):
        p = model(torch.ones(2, 3)).relu()  # relu's zeros: the log's operand
        torch.xlogy(weights, p).sum().backward()
    report = caught.value.report
    assert report.cause.label == "log-domain", report.cause.hint
    assert report.cause.hint.startswith("xlogy got "), report.cause.hint
    assert "±inf where y is 0 (+inf where x < 0)" in report.cause.hint, report.cause.hint


def test_an_xlogy_of_zeros_with_positive_weights_keeps_its_minus_inf_words() -> None:
    model = nn.Linear(3, 4)
    with pytest.raises(NonFiniteError) as caught, watch(model, fixes=False):
        p = model(torch.ones(2, 3)).relu()
        torch.xlogy(torch.ones(4), p).sum().backward()
    hint = caught.value.report.cause.hint
    assert caught.value.report.cause.label == "log-domain", hint
    report = caught.value.report
    # (x = 1 > 0: every zero of p is a -inf, and every -inf one of its zeros)
    assert report.posinf == 0 and report.cause.fact("zeros") == report.neginf > 0, report.cause.facts
    assert "negatives in `p`" in hint and "±inf where y is 0" in hint, hint


def test_an_xlogy_that_overflows_without_a_zero_is_no_log_of_zero() -> None:
    """Its +inf is a log of zero only where the log's operand held zeros: 1e38·log(1e38) overflows float32."""
    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(0.0)
        model.bias.fill_(1e38)
    with pytest.raises(NonFiniteError) as caught, watch(model, fixes=False):
        y = model(torch.ones(1, 1))
        torch.xlogy(y, y).sum().backward()
    report = caught.value.report
    assert report.op == "aten.xlogy.Tensor" and report.posinf == 1
    assert report.cause.label == "overflow", report.cause.hint


class BatchStandardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / x.std(0)


def test_a_standardisation_names_its_std_as_the_line_writes_it() -> None:
    x = torch.randn(8, 3)
    x[:, 1] = 0.0  # a column constant over the batch
    model = BatchStandardize()
    with pytest.raises(NonFiniteError) as caught, watch(model, fixes=False):
        model(x)
    hint = caught.value.report.cause.hint
    assert "divided by zero (`x.std(0)` (3,) held 1 zero of 3), giving 8 NaN (0/0)" in hint, hint
    assert "`other`" not in hint


def test_a_loss_divided_by_the_targets_variance_names_it() -> None:
    """Another form: a normalised MSE ``mse / y.var()`` in a function, over a batch whose targets are all equal."""
    model = nn.Linear(2, 1)

    def nmse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((pred - y) ** 2).mean() / y.var()

    with pytest.raises(NonFiniteError) as caught, watch(model, fixes=False):
        nmse(model(torch.randn(5, 2)), torch.full((5, 1), 3.0)).backward()
    hint = caught.value.report.cause.hint
    assert "divided by a variance of 0 (`y.var()`, a single number, was 0), giving 1 inf (x/0)" in hint, hint


def test_the_healthy_standardisation_twin_is_silent_and_bit_identical() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, 3)
    model = nn.Sequential(BatchStandardize(), nn.Linear(3, 1))
    with watch(model):
        watched = model(x)
    assert torch.equal(watched, model(x))


def test_the_step_that_divides_by_a_constant_column_says_which_column() -> None:
    """Was: the constant-feature warning is read at a watch's first step and every 8th only (hot/checks/early.py), so
    the per-batch standardisation said "feature 5 (= 0); standardising it divides by a zero std" when its forward ran
    alone in a cell (step 0) and not at step 3 of the loop. The replay of the failing step reads its batch."""
    torch.manual_seed(0)
    x = torch.randn(128, 6)
    x[96:128, 5] = 0.0
    model = nn.Sequential(BatchStandardize(), nn.Linear(6, 1))
    with pytest.raises(NonFiniteError) as caught, watch(model, fixes=False):
        for i in range(0, 128, 32):
            model(x[i:i + 32]).sum().backward()
    report = caught.value.report
    assert report.step == 3
    (warning,) = [warning for warning in report.warnings if warning.kind == "constant-feature"]
    assert warning.step == 3 and dict(warning.facts)["constant"] == ((5, 0.0),)
    assert "warning     step 3: input[0]: 1 of 6 features is constant over the batch of 32 rows: feature 5 (= 0); " \
        "standardising it divides by a zero std" in str(report)


class ChannelNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean((0, 2, 3), keepdim=True)) / x.std((0, 2, 3), keepdim=True)


def test_a_deferred_watch_of_images_with_a_blank_channel_says_it_at_the_failing_step() -> None:
    """Another form: images (a 4-D batch, a channel all 0 in batch 5) normalised per channel, under defer=True."""
    torch.manual_seed(0)
    images = torch.randn(48, 3, 4, 4)
    images[40:48, 2] = 0.0
    model = nn.Sequential(ChannelNorm(), nn.Conv2d(3, 2, 1))
    with pytest.raises(NonFiniteError) as caught, watch(model, defer=True, fixes=False):
        for i in range(0, 48, 8):
            model(images[i:i + 8]).sum().backward()
    report = caught.value.report
    assert report.step == 5 and report.op == "aten.div.Tensor"
    (warning,) = [warning for warning in report.warnings if warning.kind == "constant-feature"]
    assert warning.step == 5 and dict(warning.facts)["constant"] == ((2, 0.0),)


def test_a_healthy_loop_with_a_constant_column_warns_only_where_the_watch_reads_it() -> None:
    """No event, no replay: a constant column gets the watch's own warning (step 0; once per 100 steps), no more."""
    torch.manual_seed(0)
    x = torch.randn(320, 6)
    x[:, 5] = 1.0
    model = nn.Linear(6, 1)
    with watch(model) as w:
        for i in range(0, 320, 32):
            model(x[i:i + 32]).sum().backward()
    assert w.report is None
    assert [warning.step for warning in w.warnings if warning.kind == "constant-feature"] == [0]
