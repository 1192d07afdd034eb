"""Fix trials in ``mode="full"`` and ``ops=True``: the same remedies as the default watch, tried on the failing step.

Those watches (``mode="full"`` and ``ops=True``, each in both timings) name the
producer without a replay of the step; they keep the step's top-level model
calls all the same (localize/modes.py ``kept``), and the trials replay the
failing one (fixes/kept.py). For each phase (a forward op in a module, the loss
code, a backward op, the optimizer step, a bad batch, a collapsing GradScaler)
a case checks which remedies the report says it tried and what each did, in
each mode, and that the trials left the user's model, optimizer state,
gradients and generators bit-identical: the same loop under a watch with
``fixes=False`` ends in the same state.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_fixes import LogOf, SqrtOf, _batch, _make
from test_fixes_steps import CastOut
from torch import nn

import nan_magic
from nan_magic.records import FixTrial, Phase, Report

MODES = [{"mode": "full"}, {"mode": "full", "defer": True}, {"ops": True}, {"ops": True, "defer": True}]
MODE_IDS = ["full", "full-deferred", "ops", "ops-deferred"]

#: Why no remedy is tried where the watch did not name the producer's op (note_words.py ``fixes-no-op``).
NO_OP = ("no fix was tried: the remedies fit the producer's op, which was not named; watch with ops=True "
         "(%%nantrace --ops) for the op and line")

#: Why a trial cannot run the loss code again under ops=True (fixes/loss.py).
OPS_LOSS = ("ops mode traces the loss code as it runs, and keeps no record of it to run again (a watch without the "
            "op tracer records it, so that its trials can run it again)")


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Everything of the user's a trial could change: parameters, buffers, .grad, optimizer state, generators."""
    return {
        "model": {name: value.clone() for name, value in model.state_dict().items()},
        "grads": {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()},
        "opt": {key: {name: value.clone() if isinstance(value, torch.Tensor) else value
                      for name, value in entry.items()} for key, entry in opt.state_dict()["state"].items()},
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
    }


def _same(first: Any, second: Any) -> bool:
    if isinstance(first, torch.Tensor):
        # Bit for bit (a NaN parameter of the failing step is equal to itself here).
        return (isinstance(second, torch.Tensor) and first.dtype == second.dtype and first.shape == second.shape
                and torch.equal(first.reshape(-1).view(torch.uint8), second.reshape(-1).view(torch.uint8)))
    if isinstance(first, dict):
        return first.keys() == second.keys() and all(_same(first[key], second[key]) for key in first)
    return bool(first == second)


def _run(make: Callable[[], tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]], steps: int,
         **options: Any) -> tuple[Report | None, dict[str, Any]]:
    """The report a loop stopped with, and the user's state after it (a step draws from the generators)."""
    torch.manual_seed(0)
    random.seed(0)
    model, opt, step = make()
    report = None
    try:
        with nan_magic.watch(model, opt, **options):
            for _ in range(steps):
                torch.rand(1)  # the loop draws: a trial that drew too would move what comes next
                step()
    except nan_magic.NonFiniteError as error:
        report = error.report
    return report, _state(model, opt)


def _checked(make: Callable[[], tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]], steps: int = 3,
             **options: Any) -> Report:
    """The report with trials, after checking that the trials left the user's state as a watch without them."""
    report, after = _run(make, steps, **options)
    untried, untouched = _run(make, steps, fixes=False, **options)
    assert report is not None and untried is not None and untried.fixes == ()
    assert _same(after, untouched), "the trials changed the user's model, optimizer, gradients or generators"
    return report


def _trial(report: Report, kind: str) -> FixTrial:
    return next(trial for trial in report.fixes if trial.kind == kind)


def _kinds(report: Report) -> dict[str, bool | None]:
    return {trial.kind: trial.finite for trial in report.fixes}


def _in_model(cls: type[nn.Module]) -> Callable[[], tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]]:
    def make() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
        inner = _make(cls)
        # A BatchNorm whose running statistics the replay must not move, and a draw in the model: the replay draws
        # the same mask from the call's generators, and puts the user's back.
        model = nn.Sequential(nn.BatchNorm1d(4), inner, nn.Dropout(0.1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x = _batch(inner)

        def step() -> None:
            opt.zero_grad()
            model(x).float().sum().backward()
            opt.step()

        return model, opt, step

    return make


@pytest.mark.parametrize("options", MODES, ids=MODE_IDS)
def test_a_forward_producer_in_a_module_gets_its_eps_verified(options: dict[str, Any]) -> None:
    report = _checked(_in_model(LogOf), **options)
    assert (report.phase, report.module, report.op) == (Phase.FORWARD, "1", "aten.log.default")
    assert _kinds(report) == {"eps": True, "stable": None}
    eps = _trial(report, "eps")
    assert eps.fact("function") == "log" and eps.seconds > 0
    assert _trial(report, "stable").untried == "it found nothing to change at the producer's line"
    assert not any(note.kind.startswith("fixes-") for note in report.note_facts)
    text = report.to_text()
    assert "verified" in text and "no fix was tried" not in text


@pytest.mark.parametrize("options", MODES, ids=MODE_IDS)
def test_a_backward_producer_in_a_module_gets_its_eps_verified(options: dict[str, Any]) -> None:
    report = _checked(_in_model(SqrtOf), **options)
    # (full-deferred: the per-call watch's deferred check named the module, not its op, and no remedy was tried,
    # until gaps20: the step's top-level call it keeps for the trials is replayed from the real output gradient.)
    assert (report.phase, report.module, report.op) == (Phase.BACKWARD, "1", "aten.div.Tensor")
    assert _kinds(report) == {"eps": True}
    assert _trial(report, "eps").fact("backward_from") in ("loss", "output-gradient")


def _loss_code() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """A hand-written log-likelihood: sigmoid underflows to 0 (test_fixes_outside_code.LogSigmoid)."""
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4)

    def step() -> None:
        opt.zero_grad()
        loss = -torch.log(torch.sigmoid(model(x) - 200)).mean()
        loss.backward()
        opt.step()

    return model, opt, step


@pytest.mark.parametrize("options", MODES, ids=MODE_IDS)
def test_a_producer_in_the_loss_code_is_remedied_where_its_code_can_run_again(options: dict[str, Any]) -> None:
    report = _checked(_loss_code, **options)
    assert (report.phase, report.module, report.op) == (Phase.FORWARD, None, "aten.log.default")
    if not options.get("ops"):
        # The per-call watch records the loss code as the default watch does: both remedies run in it.
        assert _kinds(report) == {"eps": True, "stable": True}
        assert _trial(report, "eps").fact("loss_from") == "loss code"
        return
    # The op tracer keeps no record of the loss code to run again: the report says no remedy was tried, and why.
    assert report.fixes == ()
    assert [note.text for note in report.note_facts if note.kind.startswith("fixes-")] == [
        f"no fix was tried: the producer ran in the loss code, which the trials could not run again: {OPS_LOSS}"]
    assert OPS_LOSS in report.to_text()


def _unfrozen() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """Adam's eps 1e-8 rounds to 0 in float16 (test_fixes._unfrozen_embedding): 0 / 0 at step 1."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1)).half()
    opt = torch.optim.Adam(model.parameters(), eps=1e-8)
    steps = iter(range(100))

    def step() -> None:
        model[0].weight.requires_grad_(next(steps) > 0)
        opt.zero_grad()
        model(torch.tensor([1, 2])).float().sum().backward()
        opt.step()

    return model, opt, step


@pytest.mark.parametrize("options", MODES, ids=MODE_IDS)
def test_an_optimizer_event_gets_its_eps_verified_on_copies(options: dict[str, Any]) -> None:
    report = _checked(_unfrozen, keep_last_good=True, **options)
    assert (report.phase, report.optimizer) == (Phase.OPTIMIZER, "Adam")
    assert _kinds(report) == {"eps": True}
    assert _trial(report, "eps").fact("new_eps") == torch.finfo(torch.float16).eps


def _bad_rows() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    x[2, 1], x[4, 0] = float("nan"), float("inf")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    return model, opt, step


@pytest.mark.parametrize("options", MODES, ids=MODE_IDS)
def test_a_batch_with_bad_samples_is_verified_without_them(options: dict[str, Any]) -> None:
    report = _checked(_bad_rows, **options)
    assert report.phase == Phase.DATA
    assert _kinds(report) == {"skip-batch": True}
    trial = _trial(report, "skip-batch")
    assert trial.fact("dropped") == (2, 4) and trial.fact("batch") == 6


@pytest.mark.parametrize("traced", [False, True], ids=["full", "ops"])
def test_replay_false_tries_no_model_call_and_says_so(traced: bool) -> None:
    options: dict[str, Any] = {"ops": True} if traced else {"mode": "full"}
    report, _after = _run(_in_model(LogOf), 3, replay=False, **options)
    assert report is not None and report.fixes == ()
    assert [note.kind for note in report.note_facts if note.kind.startswith("fixes-")] == [
        "fixes-traced" if traced else "fixes-per-call"]


class SecondCallOnly(nn.Module):
    """log of a negative value on its second call only (a counter in the module): a replay does not go non-finite."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.calls = nn.Linear(4, 4), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.fc(x)
        return torch.log(h - 100) if self.calls == 2 else h


@pytest.mark.parametrize("options", MODES, ids=MODE_IDS)
def test_a_step_whose_replay_comes_out_finite_gets_no_verdict_and_says_why(options: dict[str, Any]) -> None:
    def make() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
        model = SecondCallOnly()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(3, 4)

        def step() -> None:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()

        return model, opt, step

    report = _checked(make, **options)
    if not options.get("ops"):
        # The per-call watch's replay of the producer's call does not go non-finite either: no op, no remedy fits.
        assert (report.phase, report.op, report.fixes) == (Phase.FORWARD, None, ())
        assert [note.text for note in report.note_facts if note.kind.startswith("fixes-")] == [NO_OP]
        return
    assert (report.phase, report.op) == (Phase.FORWARD, "aten.log.default")
    assert report.fixes == ()  # eps and stable fit the log, but a replay that never fails cannot judge them
    assert [note.text for note in report.note_facts if note.kind.startswith("fixes-")] == [
        "no fix was tried: the failing step, run again on copies as it ran, came out finite, so no remedy could be "
        "judged on it"]


class ShiftedLog(nn.Module):
    """log of a Linear's output shifted by a keyword argument (``model(x, shift=10.0)``), in a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, shift: float) -> torch.Tensor:
        return torch.log(self.fc(x) - shift)


class KeywordModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = ShiftedLog()

    def forward(self, x: torch.Tensor, *, shift: float) -> torch.Tensor:
        return self.head(x, shift)


@pytest.mark.parametrize("options", MODES, ids=MODE_IDS)
def test_a_call_stopped_by_its_event_is_replayed_with_its_keyword_arguments(options: dict[str, Any]) -> None:
    # Immediately, the event stops the model call before it returns: its keyword arguments, which a global pre-hook
    # never sees, are read from its running frame (fixes/kept.py); without them the replay would raise.
    def make() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
        model = KeywordModel()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(3, 4)

        def step() -> None:
            opt.zero_grad()
            model(x, shift=10.0).sum().backward()
            opt.step()

        return model, opt, step

    report = _checked(make, **options)
    assert (report.phase, report.module, report.op) == (Phase.FORWARD, "head", "aten.log.default")
    assert _kinds(report) == {"eps": True, "stable": None}
    assert not any(note.kind.startswith("fixes-") for note in report.note_facts)



def _two_models(**options: Any) -> tuple[Report | None, dict[str, Any]]:
    """``head(body(x))``, both watched: the producer is the body's sqrt backward."""
    torch.manual_seed(0)
    random.seed(0)
    body, head = _make(SqrtOf), nn.Linear(4, 1)
    both = nn.ModuleList([body, head])
    opt = torch.optim.SGD(both.parameters(), lr=1e-3)
    x = _batch(body)
    report = None
    try:
        with nan_magic.watch(body, head, opt, **options):
            for _ in range(3):
                torch.rand(1)
                opt.zero_grad()
                head(body(x)).sum().backward()
                opt.step()
    except nan_magic.NonFiniteError as error:
        report = error.report
    return report, _state(both, opt)


# (Not mode="full" deferred: it names no backward op to choose a remedy by, test_a_backward_producer_in_a_module_...)
@pytest.mark.parametrize("options", [MODES[0], *MODES[2:]], ids=[MODE_IDS[0], *MODE_IDS[2:]])
def test_a_backward_producer_in_the_first_of_two_models_is_remedied_on_that_models_call(
        options: dict[str, Any]) -> None:
    # Backward reaches the head's call first, but the producer is the body's: its call is the one replayed.
    report, after = _two_models(**options)
    untried, untouched = _two_models(fixes=False, **options)
    assert report is not None and untried is not None and _same(after, untouched)
    assert (report.phase, report.op) == (Phase.BACKWARD, "aten.div.Tensor")
    assert _kinds(report) == {"eps": True}
    assert _trial(report, "eps").fact("backward_from") == "output-gradient"  # the head's gradient into the body
    assert not any(note.kind.startswith("fixes-") for note in report.note_facts)


def _collapsing_scaler() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """A GradScaler from 2**40 whose scale collapses (test_fixes_steps._scaled_run): raised at scale 2**26."""
    model = CastOut(False)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    x, y = torch.randn(32, 8), torch.randn(32, 4)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = (out - y).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return model, opt, step


@pytest.mark.parametrize("options", MODES, ids=MODE_IDS)
def test_a_collapsing_scaler_gets_float32_and_a_lower_scale_verified(options: dict[str, Any]) -> None:
    report = _checked(_collapsing_scaler, steps=20, **options)
    assert report.cause is not None and report.cause.label == "grad-scaler-collapse"
    assert _kinds(report) == {"float32": True, "scale": True}
    scale = _trial(report, "scale")
    assert (scale.fact("scale"), scale.fact("new_scale")) == (2.0**26, 2.0**18)
