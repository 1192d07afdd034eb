"""The watch under torch's anomaly mode (``set_detect_anomaly(True)``), which people turn on to hunt NaNs.

Anomaly mode stops a backward with a RuntimeError as soon as an autograd node
returns NaN, before any boundary of the watch reads the gradient. The watch
explains that error with its report (the producer's module, op and line,
raised from torch's error), and runs its own replays and fix trials with
anomaly mode off, so that they do not stop where the user's backward did.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic import NonFiniteError
from tests.faults import marked_line

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]
OPS = [pytest.param({"ops": True}, id="ops"), pytest.param({"ops": True, "defer": True}, id="ops-deferred"),
       pytest.param({"ops": True, "mode": "full"}, id="ops-full")]
#: The per-module watch without ops: the calls whose backward was running are replayed (CallReplay.replay_anomaly).
FULL = [pytest.param({"mode": "full"}, id="full"), pytest.param({"mode": "full", "defer": True}, id="full-deferred")]


def _line(marker: str) -> int:
    return marked_line(marker, where=sys.modules[__name__])


class _WhereSqrt(nn.Module):
    """The sqrt of the positive part, by torch.where: finite forward, 0 * NaN in the backward of the discarded side."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))  # producer: where sqrt


def _train(model: nn.Module, loss_of: object, options: dict[str, bool], steps: int = 3) -> list[float]:
    """``steps`` SGD steps under anomaly mode and the watch; the losses."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    with torch.autograd.set_detect_anomaly(True), nan_magic.watch(model, opt, **options):
        for step in range(steps):
            loss = loss_of(model, step)  # type: ignore[operator]
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("options", [*TIMINGS, *OPS, *FULL])
def test_a_nan_the_anomaly_mode_stops_in_a_modules_backward_is_named_at_its_op_and_line(options) -> None:
    # Replayed by the default watch; under ops the live tracer saw the op start it, before any boundary claimed it;
    # the per-module watch replays the call whose output's gradient arrived last (the where's), which reproduces it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _WhereSqrt(), nn.Linear(4, 1))
    with pytest.raises(NonFiniteError) as caught:
        _train(model, lambda m, step: m(torch.randn(8, 4)).mean(), options)
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("backward", "1", 0, "aten.mul.Scalar")
    assert report.autograd_node == "SqrtBackward0"
    assert report.source is not None and report.source.lineno == _line("where sqrt")
    assert report.reproduced is (None if options.get("ops") or options.get("mode") == "full" else True)
    assert report.ops is bool(options.get("ops"))
    assert "torch's anomaly detection stopped the backward (Function 'SqrtBackward0' returned nan values" in (
        report.to_text())
    # torch's own error stays the cause, and anomaly mode is as the user set it once the watch is gone
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert "returned nan values" in str(caught.value.__cause__)
    assert not torch.is_anomaly_enabled()


def _distance_loss(model: nn.Module, step: int) -> torch.Tensor:
    out = model(torch.randn(3, 4))
    target = out.detach() if step == 1 else torch.randn(3, 2)  # step 1: the distance is exactly 0
    return torch.sqrt(((out - target) ** 2).sum())  # producer: distance


@pytest.mark.parametrize("options", [*TIMINGS, *OPS, *FULL])
def test_a_nan_the_anomaly_mode_stops_in_the_loss_codes_backward_is_named_there(options) -> None:
    # sqrt's gradient at 0 is inf (no NaN: anomaly mode lets it pass); PowBackward0 turns it into NaN and is the
    # node torch's error names. The value was born at the sqrt's gradient (under ops, the op tracer's first origin).
    with pytest.raises(NonFiniteError) as caught:
        _train(nn.Linear(4, 2), _distance_loss, options)
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("backward", None, 1, "aten.div.Tensor")
    assert report.autograd_node == "SqrtBackward0"
    assert report.source is not None and report.source.lineno == _line("distance")
    assert "torch's anomaly detection stopped the backward (Function 'PowBackward0' returned nan values" in (
        report.to_text())


class _SqrtBetween(nn.Module):
    """A container whose own code, between its two submodules, takes the where-sqrt (not a submodule's)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner, self.outer = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(x)
        h = torch.where(h > 0, torch.sqrt(h), torch.zeros_like(h))  # producer: container sqrt
        return self.outer(h)


@pytest.mark.parametrize("options", [*TIMINGS, *OPS, *FULL])
def test_a_nan_the_anomaly_mode_stops_in_a_containers_own_code_is_named_as_the_container(options) -> None:
    # The last gradient that arrived finite is the outer Linear's output's: its replay stays finite, the container's
    # (its parent) makes the NaN in its own code.
    torch.manual_seed(0)
    model = nn.Sequential(_SqrtBetween())
    with pytest.raises(NonFiniteError) as caught:
        _train(model, lambda m, step: m(torch.randn(8, 4)).mean(), options)
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("backward", "0", 0, "aten.mul.Scalar")
    assert report.module_type == "_SqrtBetween"
    assert report.autograd_node == "SqrtBackward0"
    assert report.source is not None and report.source.lineno == _line("container sqrt")
    assert "torch's anomaly detection stopped the backward (Function 'SqrtBackward0' returned nan values" in (
        report.to_text())


class _FirstCallSqrt(nn.Module):
    """The where-sqrt on its first call only: a replay runs after the counter moved, and takes the other path."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))  # producer: first call sqrt
        return x * 1


@pytest.mark.parametrize("options", [*TIMINGS, *OPS, *FULL])
def test_a_nan_the_anomaly_mode_stops_at_that_no_replay_makes_again_claims_no_producer(options) -> None:
    # No check saw the gradient (torch stopped the backward first) and no replay made it again: no module, op,
    # tensor or counts are claimed; the notes say torch stopped the backward, and to watch with ops=True. The live
    # op tracer (ops) saw the op itself.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _FirstCallSqrt(), nn.Linear(4, 1))
    with pytest.raises(NonFiniteError) as caught:
        _train(model, lambda m, step: m(torch.randn(8, 4)).mean(), options)
    report = caught.value.report
    if options.get("ops"):
        assert (report.phase, report.module, report.op) == ("backward", "1", "aten.mul.Scalar")
        assert report.source is not None and report.source.lineno == _line("first call sqrt")
        return
    assert (report.phase, report.module, report.step, report.op, report.source) == ("backward", None, 0, None, None)
    assert report.message == "first non-finite value in backward step 0: producer unknown"
    text = report.to_text()
    summary = text.split("Layers of step")[0]  # (the layer table lists the loss as code outside the modules)
    assert "outside any watched module" not in summary and " of 0" not in summary and "grad of model" not in summary
    assert "torch's anomaly detection stopped the backward (Function 'SqrtBackward0' returned nan values" in text
    assert "ops=True" in text
    assert "\n  producer  unknown\n" in summary and 'mode="full"' not in summary  # (no check saw it; full would not)
    if options.get("mode") == "full":
        # The gradient of 1's output arrived last, finite: its backward, or an enclosing one's, was running.
        assert "the backward was running in 1 or a module enclosing it" in text
    else:
        assert report.reproduced is False


class _ExpAct(nn.Module):
    """A softmax by hand: its max-subtracted exp is the same computation (a bare exp's is not: remedies/stable.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x)  # producer: exp
        return e / e.sum(-1, keepdim=True)


@pytest.mark.parametrize("options", TIMINGS)
def test_under_anomaly_mode_a_forward_events_fix_is_still_verified(options) -> None:
    # The trials replay the step's backward: under the user's anomaly mode that replay would stop at the NaN too.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _ExpAct(), nn.Linear(4, 1))
    with pytest.raises(NonFiniteError) as caught:
        _train(model, lambda m, step: m(torch.randn(2, 4) * (1000 if step == 2 else 1)).mean(), options)
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("forward", "1", 2, "aten.exp.default")
    assert report.source is not None and report.source.lineno == _line("exp")
    assert next(trial for trial in report.fixes if trial.kind == "stable").finite is True


@pytest.mark.parametrize("options", [*TIMINGS, pytest.param({"ops": True}, id="ops"), *FULL])
def test_a_healthy_run_under_anomaly_mode_is_silent_and_identical(options) -> None:
    def loss_of(model: nn.Module, step: int) -> torch.Tensor:
        return model(torch.randn(8, 4)).pow(2).mean()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    expected = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    expected.load_state_dict(model.state_dict())
    watched = _train(model, loss_of, options, steps=4)
    torch.manual_seed(0)
    opt = torch.optim.SGD(expected.parameters(), lr=0.01)
    unwatched = []
    with torch.autograd.set_detect_anomaly(True):
        for _step in range(4):
            loss = loss_of(expected, 0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            unwatched.append(loss.item())
    assert watched == unwatched


ALL = [*TIMINGS, *OPS, *FULL]


class _Residual(nn.Module):
    """x + block(x), the where-sqrt inside the block: its backward makes the NaN, the skip path's stays finite."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), _WhereSqrt())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


@pytest.mark.parametrize("options", ALL)
def test_a_nan_the_anomaly_mode_stops_inside_a_residual_branch_is_named_in_the_block(options) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _Residual(), nn.Linear(4, 1))
    with pytest.raises(NonFiniteError) as caught:
        _train(model, lambda m, step: m(torch.randn(8, 4)).mean(), options)
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("backward", "1.block.1", 0, "aten.mul.Scalar")
    assert report.module_type == "_WhereSqrt"
    assert report.autograd_node == "SqrtBackward0"
    assert report.source is not None and report.source.lineno == _line("where sqrt")
    assert "torch's anomaly detection stopped the backward (Function 'SqrtBackward0' returned nan values" in (
        report.to_text())


class _TwiceSqrt(nn.Module):
    """One where-sqrt module called twice: the first call's input is positive (a finite backward), the second's not."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.act, self.second = nn.Linear(4, 4), _WhereSqrt(), nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.first(x).abs() + 1)
        return self.head(self.act(self.second(h) - 2))


@pytest.mark.parametrize("options", ALL)
def test_a_nan_the_anomaly_mode_stops_in_the_second_call_of_a_module_is_named_at_that_call(options) -> None:
    torch.manual_seed(0)
    model = _TwiceSqrt()
    with pytest.raises(NonFiniteError) as caught:
        _train(model, lambda m, step: m(torch.randn(8, 4)).mean(), options)
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("backward", "act", 0, "aten.mul.Scalar")
    assert report.autograd_node == "SqrtBackward0"
    assert report.source is not None and report.source.lineno == _line("where sqrt")
    # The counts are the second call's: every element of its input (second(h) - 2) is below 0; the first call's
    # (all >= 1) make none. The gradient of second's output, which the root's own code passed on, is not the producer.
    assert (report.nan, report.posinf, report.neginf) == (32, 0, 0)
    assert "producer    act (_WhereSqrt)" in report.to_text()
    assert not any(layer.status == "producer" and layer.module == "" for layer in report.layers)


class _Pair(nn.Module):
    """A tuple output: the where-sqrt of x and 2 * x; only the first element's backward makes the NaN."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x)), x * 2  # producer: pair sqrt


class _PairModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.pair, self.out = nn.Linear(4, 4), _Pair(), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        root, double = self.pair(self.inp(x))
        return self.out(root) + self.out(double)


@pytest.mark.parametrize("options", ALL)
def test_a_nan_the_anomaly_mode_stops_in_one_element_of_a_tuple_output_is_named_in_its_module(options) -> None:
    torch.manual_seed(0)
    model = _PairModel()
    with pytest.raises(NonFiniteError) as caught:
        _train(model, lambda m, step: m(torch.randn(8, 4)).mean(), options)
    report = caught.value.report
    assert (report.phase, report.module, report.step, report.op) == ("backward", "pair", 0, "aten.mul.Scalar")
    assert report.autograd_node == "SqrtBackward0"
    assert report.source is not None and report.source.lineno == _line("pair sqrt")


class _SqrtRelu(nn.Module):
    """sqrt(relu(x)): at x <= 0 the sqrt's backward divides the upstream gradient by 0: NaN where it is 0, else inf
    (which relu's backward zeroes: no error). The gain makes the call's own backward reach a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(torch.relu(x * self.gain))  # producer: sqrt relu


def _zero_gradient_model(zero_columns: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _SqrtRelu(), nn.Linear(4, 1))
    if zero_columns:
        with torch.no_grad():
            model[2].weight[:, :2] = 0  # no gradient flows into the first two features of the sqrt's output
    return model


@pytest.mark.parametrize("options", ALL)
def test_a_nan_that_only_the_real_output_gradient_makes_is_named_with_its_counts(options) -> None:
    # The gradient into the sqrt's output is 0 in two features: 0 / 0 there (NaN, which anomaly mode stops at);
    # a replay of that call with a gradient of ones makes 1 / 0 (inf) instead. The default watch's step replay sends
    # the real gradient; the full watch holds none (its hook's gradient is freed as torch stops), so its replay of
    # the sqrt's call does not stop at a NaN under anomaly mode and is passed over, and the root's replay (ones into
    # its output, zero through the head's zero columns) does, with the real counts.
    model = _zero_gradient_model(zero_columns=True)
    x = torch.randn(8, 4)
    with torch.no_grad():
        at_zero = model[0](x) <= 0
    expected_nan, expected_inf = int(at_zero[:, :2].sum()), int(at_zero[:, 2:].sum())  # 0 / 0, and g / 0
    with pytest.raises(NonFiniteError) as caught:
        _train(model, lambda m, step: m(x).mean(), options)
    report = caught.value.report
    assert (report.phase, report.step) == ("backward", 0)
    assert "torch's anomaly detection stopped the backward (Function 'SqrtBackward0' returned nan values" in (
        report.to_text())
    if report.op is None:  # producer unknown, never a wrong one
        assert report.module is None
        pytest.fail(report.to_text())
    assert (report.module, report.op, report.autograd_node) == ("1", "aten.div.Tensor", "SqrtBackward0")
    assert report.source is not None and report.source.lineno == _line("sqrt relu")
    assert (report.nan, report.posinf + report.neginf) == (expected_nan, expected_inf), report.to_text()


@pytest.mark.parametrize("options", ALL)
def test_the_same_layout_with_a_nonzero_output_gradient_is_healthy(options) -> None:
    # The same sqrt at 0 with a gradient that is not 0 there: inf, zeroed by relu's backward; nothing is reported.
    model = _zero_gradient_model(zero_columns=False)
    x = torch.randn(8, 4)
    losses = _train(model, lambda m, step: m(x).mean(), options)
    assert len(losses) == 3


@pytest.mark.parametrize("options", ALL)
def test_a_nan_that_only_the_loss_codes_zero_gradient_makes_is_named_or_left_unknown(options) -> None:
    # The loss masks out rows: the gradient into the model's output is 0 there, and the sqrt's backward makes 0 / 0
    # in those rows. The default watch's step replay sends the captured gradient, and the live tracer (ops) sees the
    # op: both name it. The per-module watch's own replays send ones (1 / 0: inf, relu's backward zeroes it), which
    # do not stop where the user's backward did; the step replay of its kept calls, from the captured gradient,
    # names it as the default watch does (gaps23: the producer was left unknown, replay/per_call.py).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _SqrtRelu(), nn.Linear(4, 2))
    x, mask = torch.randn(8, 4), torch.tensor([1.0, 0.0] * 4).unsqueeze(1)
    with pytest.raises(NonFiniteError) as caught:
        _train(model, lambda m, step: (m(x) * mask).sum(), options)
    report = caught.value.report
    assert (report.phase, report.step) == ("backward", 0)
    assert (report.module, report.op, report.autograd_node) == ("1", "aten.div.Tensor", "SqrtBackward0")
    assert report.source is not None and report.source.lineno == _line("sqrt relu")
    with torch.no_grad():
        at_zero = model[0](x) <= 0
    assert report.nan == int(at_zero[1::2].sum())  # (the masked rows: 0 / 0)
