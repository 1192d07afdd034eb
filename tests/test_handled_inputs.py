"""A model that handles the NaN in its own input is not stopped; one whose step goes non-finite is, as a data event.

PRODUCT.md: a non-finite value entering a watched model is an event, *benign* when the program handles it: the
step's outputs, loss, gradients and parameters stay finite (a tabular model imputing its NaN-coded missing values
in its forward). The watch holds the batch's finding for the step (nan_magic/hot/kept/held_batch.py); anything of
the step going non-finite makes it the report, exactly today's for a NaN batch (phase data, the batch field, the
step, the data code's op and line, %debug where it opened). Every case runs in the five modes; the healthy twins
are bit-identical to an unwatched run and record one benign event, ``handled-input``, counting the steps.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from watching import FIVE_MODES

import nan_magic
from nan_magic import NonFiniteError
from nan_magic.records import Phase, TensorRef, TensorRole

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)

NAN = float("nan")
STEPS = 4


def _missing(seed: int, rows: int = 6, features: int = 5) -> torch.Tensor:
    """A batch with about a fifth of its values missing, coded as NaN."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, features, generator=generator)
    x[torch.rand(rows, features, generator=generator) < 0.2] = NAN  # missing values written
    return x


class WhereImputer(nn.Module):
    """``torch.where(isnan(x), fill, x)`` before any arithmetic: the column means held as a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("fill", torch.zeros(5))
        self.head = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.where(torch.isnan(x), self.fill, x))


class NanToNum(nn.Module):
    """``torch.nan_to_num(x)`` and a missing-value flag per feature, then the head."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(10, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([torch.nan_to_num(x), torch.isnan(x).float()], -1))


class LearnedFill(nn.Module):
    """A learned fill value per feature, on a copy imputed in place (``x.clone().nan_to_num_()`` for the flags)."""

    def __init__(self) -> None:
        super().__init__()
        self.fill = nn.Parameter(torch.zeros(5))
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        missing = torch.isnan(x)
        filled = x.clone().nan_to_num_()
        return self.head(torch.where(missing, self.fill.expand_as(x), filled))


class CausalMask(nn.Module):
    """Returns a float causal mask for its input's rows: -inf on purpose (a deliberate infinity, benign)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.full((h.shape[0], h.shape[0]), float("-inf")).triu(1)


class ImputingAttention(nn.Module):
    """Imputes its rows' missing values, then causal self-attention over them with a mask a submodule makes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(5, 5)
        self.mask = CausalMask()
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(torch.nan_to_num(x))
        scores = h @ h.T / 5**0.5 + self.mask(h)
        return self.head(scores.softmax(-1) @ h)


class DictBatch(nn.Module):
    """A dict batch: the model reads ``features`` only; ``notes`` (NaN) comes along unread."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(5, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(batch["features"])


class Autoencoder(nn.Module):
    """Imputes its input, reconstructs it: the loss against the raw batch reads its NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(torch.nan_to_num(x))


class MaskedProduct(nn.Module):
    """The trap: ``where(isnan(x), 0, x * w)``: the outputs are finite, but ``w``'s gradient is 0 * NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(5))
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.where(torch.isnan(x), 0.0, x * self.w))


class ImputeThenNormalise(nn.Module):
    """Imputes, then divides by the row's absolute sum: 0 / 0 on a row of zeros (a real forward NaN)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nan_to_num(x)
        return self.head(x / x.abs().sum(-1, keepdim=True))  # producer: row norm


class Unhandled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


Batch = Callable[[int], Any]
Loss = Callable[[torch.Tensor, Any, int], torch.Tensor]


def _targets(step: int) -> torch.Tensor:
    return torch.randn(6, 1, generator=torch.Generator().manual_seed(100 + step))


def _regression(out: torch.Tensor, _batch: Any, step: int) -> torch.Tensor:
    return F.mse_loss(out, _targets(step))


def _train(model: nn.Module, batch: Batch, loss_of: Loss = _regression) -> tuple[nn.Module, Callable[[], list]]:
    """Adam on ``loss_of(model(batch(step)), batch, step)`` for :data:`STEPS` steps; outputs: losses and outputs."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def run() -> list[torch.Tensor]:
        outputs = []
        for step in range(STEPS):
            x = batch(step)
            out = model(x)  # the model call
            loss = loss_of(out, x, step)
            opt.zero_grad()
            loss.backward()
            opt.step()  # the optimizer step
            outputs += [out.detach(), loss.detach()]
        return outputs + [p.detach().clone() for p in model.parameters()]

    return model, run


def _line(marker: str) -> int:
    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()  # type: ignore[arg-type]
    found = [n for n, text in enumerate(lines, 1) if text.rstrip().endswith(f"# {marker}")]
    assert len(found) == 1, marker
    return found[0]


HANDLED: dict[str, Callable[[], tuple[nn.Module, Callable[[], list]]]] = {
    "where-fill": lambda: _train(WhereImputer(), _missing),
    "nan-to-num-and-flag": lambda: _train(NanToNum(), _missing),
    "learned-fill-on-a-copy": lambda: _train(LearnedFill(), _missing),
    "imputes-then-a-submodule-makes-a-causal-mask": lambda: _train(ImputingAttention(), _missing),
    "unread-feature-of-a-dict-batch": lambda: _train(
        DictBatch(),
        lambda step: {
            "features": torch.randn(6, 5, generator=torch.Generator().manual_seed(step)),
            "notes": torch.full((6, 2), NAN),
        },
    ),
}


@pytest.mark.parametrize("options", FIVE_MODES)
@pytest.mark.parametrize("name", HANDLED)
def test_a_model_that_handles_the_nan_in_its_input_is_calm_and_identical(name: str, options: dict) -> None:
    torch.manual_seed(0)
    _model, run = HANDLED[name]()
    expected = run()
    torch.manual_seed(0)
    model, run = HANDLED[name]()
    with nan_magic.watch(model, **options) as w:
        got = run()
    assert w.report is None, w.report.message if w.report else ""
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert not model._forward_hooks and not model._forward_pre_hooks
    # One benign event for the run, not one a step: the first, counting the steps whose batch it handled (and the
    # causal mask's own benign event, once, where a submodule makes one).
    assert all(event.benign for event in w.events), [event.message for event in w.events]
    handled = [event for event in w.events if event.cause is not None and event.cause.label == "handled-input"]
    assert len(handled) == 1 and len(w.events) == 1 + ("mask" in name), [event.message for event in w.events]
    event = handled[0]
    assert event.benign and event.phase == Phase.DATA and event.step == 0 and event.nan > 0
    assert event.cause is not None and event.cause.label == "handled-input"
    assert event.cause.fact("steps") == STEPS and event.cause.fact("last_step") == STEPS - 1
    assert "handled" in event.cause.hint and "the batch carried" in event.cause.hint


def _raw_target(out: torch.Tensor, x: torch.Tensor, _step: int) -> torch.Tensor:
    return F.mse_loss(out, x)  # the loss reads the raw batch


def _zeros_at_3(step: int) -> torch.Tensor:
    return torch.zeros(6, 5) if step == 3 else _missing(step) if step == 0 else torch.randn(6, 5)


def _nan_at_2(step: int) -> torch.Tensor:
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(step))
    if step == 2:
        x[1, 3] = NAN  # one NaN written
    return x


def _made_at_2(step: int) -> torch.Tensor:
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(step)) - (3.0 if step == 2 else 0.0)
    return x.sqrt() if step == 2 else x.abs().sqrt()  # the data code's sqrt


def _reported(build: Callable[[], tuple[nn.Module, Callable[[], list]]], options: dict) -> nan_magic.Report:
    torch.manual_seed(0)
    model, run = build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, **options):
        run()
    return caught.value.report


DEFERRED = ({"defer": True}, {"ops": True, "defer": True})


def _is_data_report(report: nan_magic.Report, step: int, model: str, options: dict, written: str) -> None:
    """``written``: the marker of the line that wrote the NaN into the batch (``x[...] = NAN``)."""
    assert report.phase == Phase.DATA and not report.benign, report.message
    assert report.step == step and report.module == "" and report.module_type == model
    assert report.tensor == TensorRef(TensorRole.INPUT, path="input[0]")
    # The lift of the NaN the loop wrote into the batch is named (the data code's records; ops=True: the live op
    # tracer's), and %debug opens at that line.
    assert report.op == "aten.lift_fresh.default" and report.source is not None
    assert report.source.lineno == _line(written)
    assert report.debug_frame is not None and report.debug_frame.lineno == _line(written), report.debug_frame


@pytest.mark.parametrize("options", FIVE_MODES)
def test_an_autoencoder_whose_loss_reads_the_raw_nan_target_is_a_data_event(options: dict) -> None:
    report = _reported(lambda: _train(Autoencoder(), _missing, _raw_target), options)
    _is_data_report(report, 0, "Autoencoder", options, "missing values written")


@pytest.mark.parametrize("options", FIVE_MODES)
def test_finite_outputs_but_a_nan_weight_gradient_is_a_data_event_at_that_step(options: dict) -> None:
    # where(isnan(x), 0, x * w): the outputs, the loss and the output gradient are finite; w's gradient is NaN.
    report = _reported(
        lambda: _train(MaskedProduct(), lambda step: _missing(step) if step == 2 else torch.randn(6, 5)), options
    )
    _is_data_report(report, 2, "MaskedProduct", options, "missing values written")


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_handled_nan_at_step_0_then_a_forward_nan_at_step_3_is_that_forward_event(options: dict) -> None:
    torch.manual_seed(0)
    model, run = _train(ImputeThenNormalise(), _zeros_at_3)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, **options) as w:
        run()
    report = caught.value.report
    assert report.phase == Phase.FORWARD and report.step == 3 and report.module == "", report.message
    assert report.op == "aten.div.Tensor" and report.source is not None
    assert report.source.lineno == _line("producer: row norm")
    handled = [event for event in w.events if event.benign]
    assert len(handled) == 1 and handled[0].step == 0 and handled[0].cause is not None
    assert handled[0].cause.label == "handled-input" and handled[0].cause.fact("steps") == 1


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_nan_batch_the_model_does_not_handle_is_the_data_report_of_before(options: dict) -> None:
    report = _reported(lambda: _train(Unhandled(), _nan_at_2), options)
    _is_data_report(report, 2, "Unhandled", options, "one NaN written")
    assert report.nan == 1
    assert not any(event.benign for event in [report])


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_nan_batch_the_loop_made_is_named_at_the_data_codes_op_and_line(options: dict) -> None:
    report = _reported(lambda: _train(Unhandled(), _made_at_2), options)
    assert report.phase == Phase.DATA and report.step == 2 and report.module == "", report.message
    assert report.op == "aten.sqrt.default" and report.source is not None
    assert report.source.lineno == _line("the data code's sqrt")
    assert report.debug_frame is not None and report.debug_frame.lineno == _line("the data code's sqrt")


class HalfImputer(nn.Module):
    """float16 throughout, imputing its input; a dead unit's zero gradient meets Adam's eps of 1e-8, 0 in float16."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 1))
        with torch.no_grad():
            self.seq[0].bias[2] = -100.0
            self.seq[0].weight[2] = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(torch.nan_to_num(x))


@pytest.mark.parametrize("options", FIVE_MODES)
def test_a_step_whose_optimizer_makes_a_parameter_nan_after_a_handled_batch_is_a_data_event(options: dict) -> None:
    # The step's parameters are part of the step: the optimizer's 0 / 0 on step 0, whose batch held NaN, makes that
    # batch the event in every mode (the deferred check reads the step's parameters with the next step's).
    def build() -> tuple[nn.Module, Callable[[], list]]:
        model = HalfImputer().half()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)

        def run() -> list[torch.Tensor]:
            losses = []
            for step in range(STEPS):
                x = _missing(step).half() if step == 0 else torch.randn(6, 5).half()
                loss = F.mse_loss(model(x), _targets(step).half())
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.detach())
            return losses

        return model, run

    report = _reported(build, options)
    assert report.phase == Phase.DATA and report.step == 0 and report.module == "", report.message
    assert report.module_type == "HalfImputer" and report.tensor == TensorRef(TensorRole.INPUT, path="input[0]")
