"""The fix trials audited as a demanding user would (fixes-s29): 17 incidents of different causes, each in the
default, deferred, per-call (``mode="full"``) and traced (``ops=True``) watch, each verdict checked against the
remedy applied by hand to a fresh copy of the same model and batch, and the user's state after the trials compared
bit for bit with a run that tried none (``fixes=False``).

Two causes got no fix a person would apply. A ``torch.logit`` of a probability that rounded to exactly 0 or 1 (a
saturated sigmoid) had no remedy at all: no "Fixes tried", where ``logit(p.clamp(eps, 1 - eps))`` trains on. And a
division in the backward of a user's ``torch.autograd.Function`` got a note that contradicted itself ("aten.div.Tensor
is not one a remedy changes ... the trials change a ... division"): its node's name (``RecipBackward``) was read as a
torch function, and the trial's remedy never ran in a backward. Both now are tried, and verified, as by hand.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from typing import Any

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nan_magic
from nan_magic.records import FixTrial, Report
from nan_magic.render.edits import suggested_edit

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"},
                                    "ops": {"ops": True}}
EPS = torch.finfo(torch.float32).eps
Built = tuple[nn.Module, torch.optim.Optimizer, Callable[[], None], dict[str, torch.Tensor]]


def _step(model: nn.Module, opt: torch.optim.Optimizer, loss_of: Callable[[], torch.Tensor]) -> tuple[float, bool]:
    """One step by hand: its loss, and whether its gradients and updated parameters are all finite."""
    opt.zero_grad()
    loss = loss_of()
    loss.backward()
    grads = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    opt.step()
    return float(loss.detach()), grads and all(bool(torch.isfinite(p).all()) for p in model.parameters())


def _fit(model: nn.Module, data: dict[str, torch.Tensor], lr: float = 0.1) -> Built:
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def run() -> None:
        for _ in range(3):
            opt.zero_grad()
            loss = F.mse_loss(model(data["x"]), data["y"])
            loss.backward()
            opt.step()

    return model, opt, run, data


# ---------------------------------------------------------------- a logit of a sigmoid that rounded to 1
class Logit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.lin(x))
        return torch.logit(p)  # producer: logit of exactly 1


def logit_of_one() -> Built:
    torch.manual_seed(0)
    model = Logit()
    with torch.no_grad():
        model.lin.weight.mul_(100)
    return _fit(model, {"x": torch.randn(8, 4), "y": torch.randn(8, 1)})


def logit_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = logit_of_one()
    return _step(model, opt, lambda: F.mse_loss(
        torch.logit(torch.sigmoid(model.lin(data["x"])).clamp(EPS, 1 - EPS)), data["y"]))


# ---------------------------------------------------------------- a division in a custom Function's backward
class Root(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.abs().sqrt()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * x.sign() / (2 * x.abs().sqrt())  # producer: 0/0 where x is 0


class Rooted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)
        self.register_buffer("keep", torch.tensor([1.0, 0.0, 1.0, 1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(Root.apply(self.lin(x) * self.keep))


def custom_backward() -> Built:
    torch.manual_seed(0)
    return _fit(Rooted(), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)})


def custom_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = custom_backward()

    class Clamped(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            return x.abs().sqrt()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return grad * x.sign() / (2 * x.abs().sqrt()).clamp_min(EPS)

    def loss() -> torch.Tensor:
        hidden = Clamped.apply(model.lin(data["x"]) * model.keep)
        return F.mse_loss(model.out(hidden), data["y"])

    return _step(model, opt, loss)


# ---------------------------------------------------------------- the incidents already tried as by hand
class HandNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lin((x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)))  # producer: std 0


def zero_std() -> Built:
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    x[2] = 1.5
    return _fit(HandNorm(), {"x": x, "y": torch.randn(8, 1)})


def zero_std_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = zero_std()
    x = data["x"]
    return _step(model, opt, lambda: F.mse_loss(model.out(model.lin(
        (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True).clamp_min(EPS))), data["y"]))


class Gamma(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lin(x) ** 0.5)  # producer: a negative base, a fractional exponent


def negative_pow() -> Built:
    torch.manual_seed(0)
    return _fit(Gamma(), {"x": torch.randn(8, 4), "y": torch.randn(8, 1)})


def negative_pow_by_hand() -> tuple[float, bool]:
    model, opt, _run, data = negative_pow()
    return _step(model, opt, lambda: F.mse_loss(model.out(model.lin(data["x"]).clamp_min(EPS) ** 0.5), data["y"]))


#: name -> (the incident, the remedy by hand, the remedy's kind, the trial's output_change: 0.0 where the remedy leaves
#: the outputs the unremedied replay had finite as they were, None where that replay had none finite to compare).
INCIDENTS: dict[str, tuple[Callable[[], Built], Callable[[], tuple[float, bool]], str, float | None]] = {
    "logit": (logit_of_one, logit_by_hand, "eps", 0.0),
    "custom-backward": (custom_backward, custom_by_hand, "eps", 0.0),
    "zero-std": (zero_std, zero_std_by_hand, "eps", 0.0),
    "negative-pow": (negative_pow, negative_pow_by_hand, "eps", None),  # (a negative in every sample's row)
}


def _state(model: nn.Module, opt: torch.optim.Optimizer, data: dict[str, torch.Tensor]) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name, parameter in model.named_parameters():
        state[f"param {name}"] = parameter.detach().clone()
        state[f"grad {name}"] = None if parameter.grad is None else parameter.grad.clone()
    state.update({f"buffer {name}": buffer.clone() for name, buffer in model.named_buffers()})
    for index, values in opt.state_dict()["state"].items():
        state.update({f"optimizer {index} {key}": value for key, value in values.items()})
    state["groups"] = repr(opt.state_dict()["param_groups"])
    state["torch rng"] = torch.get_rng_state()
    state["python rng"] = random.getstate()
    state["numpy rng"] = numpy.random.get_state()[1].copy()
    state.update({f"data {name}": tensor.clone() for name, tensor in data.items()})
    return state


def _run(build: Callable[[], Built], mode: str, **options: Any) -> tuple[Report, dict[str, Any]]:
    model, opt, run, data = build()
    random.seed(1)
    numpy.random.seed(1)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **MODES[mode], **options):
        run()
    return caught.value.report, _state(model, opt, data)


def _same(one: Any, other: Any) -> bool:
    if isinstance(one, torch.Tensor):
        return isinstance(other, torch.Tensor) and one.dtype == other.dtype and one.shape == other.shape and bool(
            (one.view(-1).view(torch.uint8) == other.view(-1).view(torch.uint8)).all())  # bit for bit, NaN too
    if isinstance(one, numpy.ndarray):
        return bool((one == other).all())
    return bool(one == other)


def _trial(report: Report, kind: str) -> FixTrial:
    return next(trial for trial in report.fixes if trial.kind == kind)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(INCIDENTS))
def test_the_verdict_is_the_remedy_by_hand_and_the_user_state_is_untouched(name: str, mode: str) -> None:
    build, by_hand, kind, change = INCIDENTS[name]
    report, state = _run(build, mode)
    trial = _trial(report, kind)
    loss, finite = by_hand()
    assert finite, f"{name}: the remedy by hand"
    assert trial.finite is True, (name, mode, trial, [note.text for note in report.note_facts])
    if trial.loss is not None:  # (a forward event's replay stops before the loss code in some modes: it says so)
        assert trial.loss == pytest.approx(loss, rel=1e-5)
    assert trial.output_change == (None if change is None else pytest.approx(change, abs=1e-3))
    assert "verified" in str(report) and "verified" in report.to_html()
    _untried, untried_state = _run(build, mode, fixes=False)
    assert untried_state.keys() == state.keys()
    assert [key for key in state if not _same(state[key], untried_state[key])] == []


@pytest.mark.parametrize("mode", ["default", "ops"])
def test_logit_of_exactly_one_gets_the_clamp_into_its_domain(mode: str) -> None:
    """Was: no fix tried at all (logit had no remedy). Now: the operand clamped into [eps, 1 - eps], verified."""
    report, _ = _run(logit_of_one, mode)
    # (its cause said "unclassified": now the logit's own domain, with the clamp said in words)
    assert report.cause is not None and (report.cause.label, report.cause.reading) == ("log-domain", "logit-edge")
    assert "logit(p) = log(p / (1 - p)) is -inf at 0, +inf at 1" in " ".join(str(report).split())
    trial = _trial(report, "eps")
    assert trial.finite is True and trial.fact("function") == "logit"
    assert trial.description == ("the operand of logit clamped into [eps, 1 - eps], eps = 1.19e-7 (the float32 "
                                 "machine eps)")
    assert "torch.logit(p.clamp(1.2e-07, 0.99999988))" in str(suggested_edit(trial))
    assert "eps: the operand of logit clamped into [eps, 1 - eps]" in str(report)


@pytest.mark.parametrize("mode", ["default", "full"])
def test_a_division_in_a_custom_functions_backward_is_remedied_there(mode: str) -> None:
    """Was: "no fix was tried: the producer's op (aten.div.Tensor) is not one a remedy changes at its line (the trials
    change ... division ...)". Now: the denominator clamped in the Function's backward as the trial runs it."""
    report, _ = _run(custom_backward, mode)
    assert report.autograd_node == "RootBackward" and report.source is not None
    assert report.source.lineno == Root.backward.__code__.co_firstlineno + 3
    trial = _trial(report, "eps")
    assert trial.finite is True and trial.fact("function") == "div" and trial.fact("eps") == EPS
    assert "is not one a remedy changes" not in str(report)
    edit = suggested_edit(trial)
    assert edit is not None and "(2 * x.abs().sqrt()).clamp_min(1.2e-07)" in edit


# ---------------------------------------------------------------- a trial that raises
class HalfOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            hidden = torch.exp(self.lin(x))  # producer: overflows float16
        if hidden.dtype != torch.float16:
            raise TypeError("this block expects float16")
        return self.out(hidden.float())


def raising_trial() -> Built:
    torch.manual_seed(0)
    model = HalfOnly()
    with torch.no_grad():
        model.lin.weight.mul_(20)
    return _fit(model, {"x": torch.randn(8, 8), "y": torch.randn(8, 1)})


@pytest.mark.parametrize("mode", list(MODES))
def test_a_trial_that_raises_is_not_finite_and_leaves_the_user_state_as_it_was(mode: str) -> None:
    report, state = _run(raising_trial, mode)
    upcast = _trial(report, "float32")
    assert (upcast.finite, upcast.failed) == (False, "raised")
    assert upcast.error == ("TypeError", "this block expects float16")
    stable = _trial(report, "stable")  # (exp(x - max) changes this line's value: no max cancels; said, not verified)
    assert stable.finite is None and stable.fact("changes_value") is True
    _untried, untried_state = _run(raising_trial, mode, fixes=False)
    assert [key for key in state if not _same(state[key], untried_state[key])] == []


# ---------------------------------------------------------------- what the trials cannot do yet
def adam_without_eps() -> Built:
    """Adam(eps=0): an embedding row no sample uses gets a zero gradient, 0 / sqrt(0) at the first step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0)
    data = {"index": torch.randint(0, 9, (3, 8)), "y": torch.randn(3, 8, 1)}

    def run() -> None:
        for step in range(3):
            opt.zero_grad()
            F.mse_loss(model(data["index"][step]), data["y"][step]).backward()
            opt.step()

    return model, opt, run, data


@pytest.mark.xfail(strict=True, reason=(
    "Adam with eps=0 fails at its first step (a parameter with a zero gradient divides 0 by sqrt(0)); the eps "
    "remedy redoes the step from the last good state (remedies/optimizer_step.py), and none is kept before the "
    "first step, even with keep_last_good=True: the trial says 'it is the first optimizer step' and is not run, "
    "where Adam(eps=1e-8) by hand trains on. Keeping the state at the watch's start is not done."))
def test_adams_eps_is_verified_at_the_first_step() -> None:
    model, opt, run, _data = adam_without_eps()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, keep_last_good=True):
        run()
    assert _trial(caught.value.report, "eps").finite is True


def diverging() -> Built:
    """SGD at lr 3 on a small regression: the loss grows ~1000x a step from step 1, and overflows at step 14."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=3.0)
    x, y = torch.randn(32, 4) * 3, torch.randn(32, 1) * 10

    def run() -> None:
        for _ in range(200):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()

    return model, opt, run, {"x": x, "y": y}


def _diverged_by_hand() -> tuple[int, float, float]:
    """The unwatched truth: the first step whose loss is non-finite, the loss of the step before it, and that step's
    loss again after the previous update redone at a tenth of the learning rate (what the lr trial does)."""
    model, opt, _run, data = diverging()
    losses, states = [], []
    while not losses or math.isfinite(losses[-1]):
        states.append(copy.deepcopy(model.state_dict()))
        opt.zero_grad()
        loss = F.mse_loss(model(data["x"]), data["y"])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    failing = len(losses) - 1
    model.load_state_dict(states[failing - 1])
    model.zero_grad()
    F.mse_loss(model(data["x"]), data["y"]).backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= 0.3 * parameter.grad
        redone = F.mse_loss(model(data["x"]), data["y"]).item()
    return failing, losses[failing - 1], redone


def test_a_divergence_over_many_steps_gets_a_lower_learning_rate_tried_honestly() -> None:
    """The lr trial redoes the previous update at a tenth: the loss grows ~1000x a step, so by hand that leaves the
    failing step's loss about 1e36 to 1e39, finite or inf by the CPU's last bits (2.0e36 and 2.1e36 under ATen's
    default and avx2 kernels of an AMD EPYC, inf where the suite first ran). Either way the trial must never be
    verified: inf is not finite; a finite loss is no fix, the state it was redone from having diverged."""
    failing, before, redone = _diverged_by_hand()
    model, opt, run, _data = diverging()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, keep_last_good=True):
        run()
    report = caught.value.report
    trial = _trial(report, "lr")
    assert report.step == failing, (report.step, failing)
    if math.isinf(redone):
        assert trial.finite is False and trial.loss == float("inf"), trial
        assert "not finite" in str(report) or "non-finite" in str(report)
    else:
        assert trial.finite is None and trial.loss == pytest.approx(redone, rel=1e-5), (trial, redone)
        step, loss = trial.fact("diverged_before")[:2]
        assert step == failing - 1 and loss == pytest.approx(before, rel=1e-5), trial
        assert "not a fix, though the step came out finite" in str(report) and "had already diverged" in str(report)


@pytest.mark.xfail(strict=True, reason=(
    "A run that diverged over many steps (SGD lr 3: the loss x1000 a step from step 1) needs its learning rate "
    "lowered from the start; the lr trial redoes only the previous update at a tenth (remedies/diverged.py), which "
    "cannot undo thirteen steps of growth, so no lower learning rate is ever verified for it. Replaying the run "
    "from an earlier kept state is not done."))
def test_a_divergence_over_many_steps_gets_a_verified_lower_learning_rate() -> None:
    model, opt, run, _data = diverging()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, keep_last_good=True):
        run()
    assert _trial(caught.value.report, "lr").finite is True
