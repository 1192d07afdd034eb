"""The review of session 34's user walk: what a person read that was wrong after its merge, asserted in-process.

xlogy's +inf was read as a log of zero whenever its log's operand held any zero, not where the +inf was. An entropy
``xlogy(p, p)`` and a Poisson likelihood ``k.xlogy(rate)`` hold zeros there on purpose (paired with x = 0), so a
float16 Poisson NLL whose ``20000 * log(3000)`` overflowed said "clamp to eps" (log-domain) instead of
half-precision-overflow. The op's run now counts the infinities where y is at the log's edge (localize/ops/log_edge.py,
a ``log-edge`` note) and only those are zeros; ``xlog1py`` (edge y = -1) and ``xlogy(x, 0.0)`` read the same count.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nan_magic import NonFiniteError, watch

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)

MODES = [{}, {"defer": True}, {"mode": "full"}, {"ops": True}]


def _rate_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 1), nn.ReLU()).half()
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1000.0, 0.0, 0.0]]))
        model[0].bias.zero_()
    return model


def _poisson_step(counts: list[float], low: float = -1.0, **options: object) -> torch.Tensor:
    """A float16 count model: NLL = rate - k·log(rate); the rate 0 (ReLU's) meets the count 0, which xlogy keeps 0."""
    model = _rate_model()
    x = torch.tensor([[3.0, 0, 0], [low, 0, 0], [0.5, 0, 0]]).half()  # rates 3000, 0 (ReLU of -1000), 500
    k = torch.tensor(counts).half().reshape(3, 1)
    with watch(model, fixes=False, **options):
        rate = model(x)
        (rate - k.xlogy(rate)).sum().float().backward()
    return model[0].weight.grad


@pytest.mark.parametrize("options", MODES, ids=["default", "defer", "full", "ops"])
def test_a_float16_poisson_overflow_beside_legitimate_zeros_is_an_overflow(options: dict) -> None:
    with pytest.raises(NonFiniteError) as caught:
        _poisson_step([20000.0, 0.0, 40.0], **options)  # 20000·log(3000) = 160000 > 65504
    report = caught.value.report
    assert report.op == "aten.xlogy.Tensor" and report.posinf == 1, report.where
    assert report.cause.label == "half-precision-overflow", report.cause.hint
    assert "clamp" not in report.cause.hint, report.cause.hint


def test_the_healthy_poisson_twin_is_silent_and_bit_identical() -> None:
    # 2000·log(3000) = 16000: finite in float16 (a rate of 10, not 0, beside the zero count: the derivative in the
    # rate of xlogy(0, 0), 0/0, is NaN whatever the watch)
    counts = [2000.0, 0.0, 40.0]
    watched = _poisson_step(counts, low=0.01)
    model = _rate_model()
    x = torch.tensor([[3.0, 0, 0], [0.01, 0, 0], [0.5, 0, 0]]).half()
    k = torch.tensor(counts).half().reshape(3, 1)
    rate = model(x)
    (rate - k.xlogy(rate)).sum().float().backward()
    assert torch.equal(watched, model[0].weight.grad)


class Entropy(nn.Module):
    """The entropy of a distribution with zeros, written with xlogy (xlogy(0, 0) = 0), inside the module."""

    def forward(self, p: torch.Tensor) -> torch.Tensor:
        return -torch.xlogy(p, p).sum(-1)


@pytest.mark.parametrize("options", MODES, ids=["default", "defer", "full", "ops"])
def test_an_entropy_with_zeros_that_overflows_elsewhere_is_not_a_log_of_zero(options: dict) -> None:
    """Another form: float32, the xlogy inside a watched module, x = y (its zeros are paired with x = 0)."""
    net = nn.Sequential(nn.Linear(4, 4), Entropy())
    with torch.no_grad():
        net[0].weight.zero_()
        net[0].bias.copy_(torch.tensor([0.0, 0.5, 0.0, 3e38]))  # 3e38·log(3e38) overflows float32
    with pytest.raises(NonFiniteError) as caught, watch(net, fixes=False, **options):
        net(torch.ones(2, 4)).sum().backward()
    report = caught.value.report
    assert report.op == "aten.xlogy.Tensor" and report.posinf == 2 and report.neginf == 0, report.where
    assert report.cause.label == "overflow", report.cause.hint


def test_the_zeros_counted_are_the_infinities_at_y_zero_only() -> None:
    """Both at once: one +inf of x < 0 at y = 0, one overflow: a log of zero of one zero, not two."""
    y = torch.tensor([0.0, 3e38, 0.0])
    model = nn.Linear(1, 3)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor([-1.0, 3e38, 0.0]))
    with pytest.raises(NonFiniteError) as caught, watch(model, fixes=False):
        torch.xlogy(model(torch.ones(1, 1)), y).sum().backward()
    report = caught.value.report
    assert report.posinf == 2 and report.cause.label == "log-domain", report.cause.hint
    assert report.cause.fact("zeros") == 1, report.cause.facts
    assert report.cause.hint.startswith("xlogy got 1 zero and 0 negatives in"), report.cause.hint
    assert "xlogy's output is infinite in 1 element where its y is 0, its log's edge" in report.notes, report.notes


@pytest.mark.parametrize("options", [{}, {"ops": True}], ids=["default", "ops"])
def test_an_xlog1py_at_minus_one_is_a_log_of_zero_of_its_y(options: dict) -> None:
    m = nn.Linear(2, 3)
    with torch.no_grad():
        m.weight.zero_()
        m.bias.copy_(torch.tensor([-1.0, 0.5, 0.2]))
    with pytest.raises(NonFiniteError) as caught, watch(m, fixes=False, **options):
        torch.special.xlog1py(torch.ones(3), m(torch.ones(1, 2))).sum().backward()  # log1p(-1) = -inf
    report = caught.value.report
    assert report.op == "aten.special_xlog1py.default" and report.neginf == 1
    assert report.cause.label == "log-domain", report.cause.hint
    hint = report.cause.hint
    assert hint.startswith("xlog1py got 1 value at -1 and 0 values below -1 in `other`"), hint
    assert "y.clamp_min(-0.99999988)" in hint, hint  # -1 + 1e-12 is -1 in float32: the bound log1p's remedy verifies


def test_an_xlogy_of_a_python_zero_is_a_log_of_zero() -> None:
    """``torch.xlogy(x, 0.0)`` (aten.xlogy.Scalar_Other): its y is a number, at the edge everywhere x != 0."""
    model = nn.Linear(2, 4)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.copy_(torch.tensor([-1.0, 0.0, 2.0, 0.0]))
    with pytest.raises(NonFiniteError) as caught, watch(model, fixes=False):
        torch.xlogy(model(torch.ones(1, 2)), 0.0).sum().backward()
    report = caught.value.report
    assert report.op == "aten.xlogy.Scalar_Other" and (report.posinf, report.neginf) == (1, 1)
    assert report.cause.label == "log-domain" and report.cause.fact("zeros") == 2, report.cause.hint


def test_a_healthy_entropy_with_zeros_is_silent_and_bit_identical() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Softmax(-1), Entropy())
    x = torch.randn(3, 4)
    with watch(net, fixes=False):
        net(x).sum().backward()
    watched = net[0].weight.grad.clone()
    net.zero_grad()
    net(x).sum().backward()
    assert torch.equal(watched, net[0].weight.grad)


# -- the failing step's constant-feature warning: only where the cause is a division the batch can make ----------


class OneHotAmount(nn.Module):
    """One-hot categories beside an amount whose log1p is taken: nothing standardises anything."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.cat([x, x[:, 3:4].log1p()], 1))


def _one_hot_batches(absent_at: tuple[int, ...]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    batches = []
    for i in range(5):
        category = torch.randint(0, 3, (16,))
        if i in absent_at:
            category[category == 2] = 0  # category 2 absent: its one-hot column constant (= 0) over the batch
        amount = torch.rand(16, 1) * 10
        if i == 3:
            amount[5] = -3.0  # a corrupt record: log1p(-3) is NaN
        batches.append(torch.cat([nn.functional.one_hot(category, 3).float(), amount, torch.randn(16, 1)], 1))
    return batches


def test_a_log_of_a_negative_at_a_step_with_a_constant_one_hot_column_has_no_std_warning() -> None:
    """Was: "feature 2 (= 0); standardising it divides by a zero std" on a log1p's NaN that no std made."""
    model = OneHotAmount()
    with pytest.raises(NonFiniteError) as caught, watch(model, fixes=False):
        for batch in _one_hot_batches(absent_at=(3,)):
            model(batch).pow(2).mean().backward()
    report = caught.value.report
    assert report.step == 3 and report.op == "aten.log1p.default" and report.cause.label == "log-domain"
    assert [warning for warning in report.warnings if warning.kind == "constant-feature"] == []
    assert "divides by a zero std" not in str(report)


class PaddedPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = (self.emb(ids) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.out(h).exp().log()  # exp(-200) underflows to 0: log(0) = -inf


def test_a_log_of_zero_beside_an_all_ones_padding_mask_has_no_std_warning() -> None:
    """Another form: a 0/1 padding mask all ones at the failing step (constant columns of 1), a log(0) event."""
    torch.manual_seed(0)
    model = PaddedPool()
    ids = [torch.randint(0, 50, (8, 6)) for _ in range(4)]
    masks = [torch.ones(8, 6) for _ in range(4)]
    for mask in masks[:3]:
        mask[0, 4:] = 0
    with pytest.raises(NonFiniteError) as caught, watch(model, fixes=False):
        for i, (t, m) in enumerate(zip(ids, masks)):
            if i == 3:
                with torch.no_grad():
                    model.out.bias.fill_(-200.0)
            model(t, m).sum().backward()
    report = caught.value.report
    assert report.step == 3 and report.op == "aten.log.default" and report.cause.label == "log-domain"
    assert [warning.step for warning in report.warnings if warning.kind == "constant-feature"] == [0], \
        report.warnings  # (step 0's is the watch's own reading: its mask has columns of 1 there too)


class RowStandardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)


def test_a_division_at_a_step_whose_constant_column_was_warned_already_warns_once() -> None:
    """Was: the step-0 warning and the replay's step-3 one, the same words twice; the watch's repeat limit keeps one.
    A row standardisation divides by a blank row's zero std at step 3; column 5 (an unused one-hot) is 0 throughout."""
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    x[:, 5] = 0.0
    x[48 + 7] = 0.0  # a blank record in batch 3
    model = nn.Sequential(RowStandardize(), nn.Linear(6, 1))
    with pytest.raises(NonFiniteError) as caught, watch(model, fixes=False):
        for i in range(0, 64, 16):
            model(x[i:i + 16]).sum().backward()
    report = caught.value.report
    assert report.step == 3 and report.op == "aten.div.Tensor" and report.cause.label == "division-by-zero"
    warned = [warning for warning in report.warnings if warning.kind == "constant-feature"]
    assert [warning.step for warning in warned] == [0], warned
    assert dict(warned[0].facts)["constant"] == ((5, 0.0),)
    assert str(report).count("standardising it divides by a zero std") == 1
