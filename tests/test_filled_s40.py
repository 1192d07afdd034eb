"""The fill rule (hot/checks/backward/filled.py): a non-finite gradient into a model output is no event only where every
non-finite entry sits at the output's deliberate fill, made by a masked_fill or where that drops it.

The rule on its own (a record built as the forward builds it), then whole loops in the five modes: what a user's
hook or an in-place write does to a masked loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from watching import FIVE_MODES, raised

import nan_magic
from nan_magic.hot.checks.backward.filled import dropped_by_its_fill
from nan_magic.hot.kept.call_records import TensorRecord

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)

_LEGAL = torch.tensor([[True, True, False], [True, False, False]])
_NAN_AT_FILL = torch.tensor([[0.5, 1.0, float("nan")], [2.0, float("nan"), float("nan")]])


def _record(output: torch.Tensor, status: str = "benign") -> TensorRecord:
    record = TensorRecord("output", output, None, False)
    record.status = status  # type: ignore[assignment]  # (the forward's verdict on its infinities)
    return record


def _logits() -> torch.Tensor:
    return torch.randn(2, 3, requires_grad=True)


@pytest.mark.parametrize("fill", ["masked_fill", "where", "where_first", "double", "view", "neg"])
def test_a_nan_only_at_the_filled_entries_of_a_benign_output_is_dropped(fill: str) -> None:
    x = _logits()
    if fill == "masked_fill":
        out = x.masked_fill(~_LEGAL, float("-inf"))
    elif fill == "where":
        out = torch.where(_LEGAL, x, float("-inf"))
    elif fill == "where_first":
        out = torch.where(~_LEGAL, float("-inf"), x)
    elif fill == "double":
        out = x.masked_fill(~_LEGAL, float("-inf")).double()
    elif fill == "view":
        out = x.masked_fill(~_LEGAL, float("-inf")).view(2, 3)
    else:
        out = -x.masked_fill(~_LEGAL, float("-inf"))  # (+inf: still the fill's)
    assert dropped_by_its_fill(_NAN_AT_FILL.to(out.dtype), _record(out))


def test_what_the_rule_does_not_drop() -> None:
    x = _logits()
    out = x.masked_fill(~_LEGAL, float("-inf"))
    assert not dropped_by_its_fill(_NAN_AT_FILL, _record(out, "ok")), "the forward did not judge the -inf deliberate"
    at_legal = _NAN_AT_FILL.clone()
    at_legal[0, 0] = float("inf")
    assert not dropped_by_its_fill(at_legal, _record(out)), "a non-finite gradient at a legal (finite) entry"
    bias = torch.zeros(2, 3).masked_fill(~_LEGAL, float("-inf"))
    assert not dropped_by_its_fill(_NAN_AT_FILL, _record(x + bias)), "an add hands the NaN on to x"
    assert not dropped_by_its_fill(_NAN_AT_FILL, _record(x.masked_fill(~_LEGAL, float("-inf")) / 2.0)), (
        "a division's divisor is a saved tensor the rule does not read")
    other = torch.full((2, 3), float("-inf"), requires_grad=True)
    assert not dropped_by_its_fill(_NAN_AT_FILL, _record(torch.where(_LEGAL, x, other))), "both sides learn"
    record = _record(out)
    with torch.no_grad():
        out.add_(1.0)  # (written in place since the forward judged it)
    assert not dropped_by_its_fill(_NAN_AT_FILL, record)
    gone = _record(x.masked_fill(~_LEGAL, float("-inf")))  # (the temporary is freed at once)
    assert gone.ref() is None and not dropped_by_its_fill(_NAN_AT_FILL, gone)
    relu = torch.relu(x - 100.0)
    assert not dropped_by_its_fill(torch.full((2, 3), float("inf")), _record(relu)), "a dead ReLU's 0 is finite"


class _Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).masked_fill(~_LEGAL, float("-inf"))


def _masked_loop(user_hook=None):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = _Masked()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = [torch.randn(2, 6) for _ in range(3)]

    def run() -> list[torch.Tensor]:
        losses = []
        for x in xs:
            out = model(x)
            if user_hook is not None:
                out.register_hook(user_hook)
            loss = torch.where(_LEGAL, out ** 2, 0.0).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    return model, opt, run


@pytest.mark.parametrize("options", FIVE_MODES)
def test_the_healthy_masked_loop_is_silent_and_bit_identical(options: dict) -> None:
    expected = _masked_loop()[2]()
    model, opt, run = _masked_loop()
    with nan_magic.watch(model, opt, **options) as w:
        got = run()
    assert w.report is None
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_user_hook_that_spreads_the_nan_to_the_legal_entries_is_still_caught(options: dict) -> None:
    # The user's hook on the output runs after ours: the gradient the rule judged had NaN at the fill only, the
    # one the fill's backward gets has it everywhere, and the weights' gradients go NaN (session 38's check hid it).
    # Default and deferred name net.0.weight at the optimizer step, as they did before the rule (the step replay
    # takes the output's gradient for the fill's); full and ops name the gradient into net's output in backward.
    model, opt, run = _masked_loop(lambda g: g + g.sum())
    report = raised(run, model, opt, **options)
    assert report.step == 0
    expected = ("backward", "grad of net output") if options.get("ops") or options.get("mode") == "full" else (
        "optimizer", "parameter net.0.weight")
    assert (report.phase, str(report.tensor)) == expected, report.message


class _TwiceMasked(nn.Module):
    """An additive -inf bias over some entries, then a masked_fill over others: the fill's backward drops the NaN at
    its own entries and hands the bias's on to the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = torch.zeros(2, 3).masked_fill(_BIAS, float("-inf"))
        return (self.net(x) + bias).masked_fill(~_LEGAL & ~_BIAS, float("-inf"))


_BIAS = torch.tensor([[False, False, True], [False, False, False]])


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_nan_at_an_entry_the_fill_did_not_fill_but_that_was_minus_inf_before_is_still_caught(options: dict) -> None:
    # The rule cannot tell (without reading the fill's saved mask) an entry the fill filled from one that was -inf
    # already; the boundary lets it by, and the NaN weight gradient is caught further on: in full and ops at the
    # gradient into net's output, in default and deferred at the optimizer step (where they said it before). (ops
    # does not take this output's -inf for deliberate: it names the gradient into the model output, as before.)
    torch.manual_seed(0)
    model = _TwiceMasked()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(2, 6)

    def run() -> None:
        for _ in range(2):
            loss = torch.where(_LEGAL, model(x) ** 2, 0.0).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(run, model, opt, **options)
    assert report.step == 0
    expected = ("backward", "grad of model output") if options.get("ops") else ("backward", "grad of net output") if (
        options.get("mode") == "full") else ("optimizer", "parameter net.0.weight")
    assert (report.phase, str(report.tensor)) == expected, report.message


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_user_hook_that_zeroes_the_nan_is_silent(options: dict) -> None:
    model, opt, run = _masked_loop(lambda g: g.nan_to_num(0.0))
    with nan_magic.watch(model, opt, **options) as w:
        run()
    assert w.report is None


class _ViewedAfterTheFill(nn.Module):
    """The filled scores returned through a view the loss code then reads entry by entry (review of masks-s40:
    ``.t()``, ``.unsqueeze()`` and a slice after the fill stopped full, ops and ops-defer)."""

    def __init__(self, view: str) -> None:
        super().__init__()
        self.view = view
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.view == "slice":
            wide = torch.cat([self.net(x), self.net(x)], -1)
            return wide.masked_fill(~torch.cat([_LEGAL, _LEGAL], -1), float("-inf"))[:, :3]
        filled = self.net(x).masked_fill(~_LEGAL, float("-inf"))
        return filled.t() if self.view == "t" else filled.unsqueeze(1)


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("view", ["t", "unsqueeze", "slice"])
def test_a_healthy_masked_loop_viewed_after_the_fill_is_silent_and_bit_identical(view: str, options: dict) -> None:
    def loop() -> tuple[nn.Module, torch.optim.Optimizer, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = _ViewedAfterTheFill(view)
        return model, torch.optim.SGD(model.parameters(), lr=0.01), [torch.randn(2, 6) for _ in range(3)]

    def run(model: nn.Module, opt: torch.optim.Optimizer, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        losses = []
        for x in xs:
            out = model(x)
            legal = _LEGAL.t() if view == "t" else _LEGAL.unsqueeze(1) if view == "unsqueeze" else _LEGAL
            loss = torch.where(legal, out ** 2, 0.0).mean()  # NaN gradient at the filled entries only
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return losses

    expected = run(*loop())
    model, opt, xs = loop()
    with nan_magic.watch(model, opt, **options) as w:
        got = run(model, opt, xs)
    assert w.report is None
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
