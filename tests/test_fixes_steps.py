"""Fix trials that change the step rather than the producer's line (issue 28): ``scale``, ``lr`` after a divergence.

Also the float32 edit of a line that calls a module, and what a trial says of
the loss when the loss code is outside the model. As in test_fixes.py, every
verified fix is applied by hand and training must go on; every remedy that
does not work must not be marked verified.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch
from contract.scaler_collapse import collapsing
from test_fixes import LogOf, _train
from torch import nn

import nan_magic
from nan_magic.fixes.remedies.scale import lower_scales
from nan_magic.records import FixTrial, Report
from nan_magic.render.edits import suggested_edit
from nan_magic.scene.last_good import LastGood

sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
from train_blowup import TinyTransformer  # the demo's model


def _trial(report: Report, kind: str) -> FixTrial:
    return next(trial for trial in report.fixes if trial.kind == kind)


def _line(method: object, marker: str) -> str:
    """The source line of ``method`` that holds ``marker``, without its comment."""
    line = next(line for line in inspect.getsource(method).splitlines() if marker in line)  # type: ignore[arg-type]
    return line.split("  #")[0].strip()


# -- scale ----------------------------------------------------------------------------------------------------


class CastOut(nn.Module):
    """Run under float16 autocast; the cast of its output to float32 is inside the model (as many models do)."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fixed = nn.Linear(8, 16), nn.Linear(16, 4), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:
            with torch.autocast('cpu', enabled=False): return self.fc2(torch.relu(self.fc1(x.float()))).float()  # noqa: E701  # fixed
        return self.fc2(torch.relu(self.fc1(x))).float()  # cast


def _scaled_run(init_scale: float, fixed: bool = False, defer: bool = False, steps: int = 20,
                losses: list[float] | None = None) -> Report | None:
    """A GradScaler at ``init_scale``: from 2**40 it skips 15 steps in a row (the gradient into the float16
    output passes 65504 above about 2**22) and the watch raises grad-scaler-collapse at scale 2**26.
    ``losses`` gets each step's loss."""
    torch.manual_seed(0)
    model = CastOut(fixed)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    try:
        with nan_magic.watch(model, opt, defer=defer):
            for _ in range(steps):
                with torch.autocast("cpu", dtype=torch.float16):
                    out = model(x)
                loss = (out - y).pow(2).mean()
                if losses is not None:
                    losses.append(loss.item())
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    except nan_magic.NonFiniteError as error:
        return error.report
    return None


@pytest.mark.parametrize("defer", [False, True])
def test_a_scaler_whose_scale_overflows_is_verified_lower_and_that_scale_trains_on(defer: bool) -> None:
    losses: list[float] = []
    report = _scaled_run(2.0**40, defer=defer, losses=losses)
    assert report is not None and report.cause is not None and report.cause.label == "grad-scaler-collapse"
    trial = _trial(report, "scale")
    assert trial.finite is True and trial.fact("scale") == 2.0**26 and trial.fact("new_scale") == 2.0**18
    # The loss without the scaler's scale (scaler.scale(loss) is left out), as the step computed it.
    assert trial.fact("loss_from") == "loss code" and trial.loss == pytest.approx(losses[-1], rel=1e-5)
    assert trial.fact("tried") == (2.0**18,) and trial.fact("stepped") is True
    # The edit is at the line that built the scaler (before the watch: found where scale() first saw it).
    built = _line(_scaled_run, "GradScaler(")
    assert trial.fact("scaler_line") == built and trial.fact("scaler_file") == __file__
    assert (suggested_edit(trial) or "").endswith(
        f"test_fixes_steps.py:{trial.fact('scaler_lineno')}: scaler = torch.amp.GradScaler('cpu', init_scale=2.0**18)")
    assert "scale: the GradScaler's scale 6.71e7 lowered (tried 262144) -> verified" in report.to_text()
    assert _scaled_run(2.0**18, defer=defer) is None  # the edit by hand: training continues


def test_a_scaler_built_inside_the_watch_is_named_at_the_line_that_built_it() -> None:
    torch.manual_seed(0)
    model = CastOut()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    with pytest.raises(nan_magic.NonFiniteError) as raised, nan_magic.watch(model, opt):
        amp = torch.amp.GradScaler("cpu", 2.0**40)  # built
        for _ in range(20):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            opt.zero_grad()
            amp.scale((out - y).pow(2).mean()).backward()
            amp.step(opt)
            amp.update()
    trial = _trial(raised.value.report, "scale")
    assert trial.finite is True and trial.fact("scaler_line").split("  #")[0] == _line(
        test_a_scaler_built_inside_the_watch_is_named_at_the_line_that_built_it, "# built")
    assert (suggested_edit(trial) or "").endswith("amp = torch.amp.GradScaler('cpu', 2.0**18)")


def test_the_same_collapse_is_also_fixed_by_the_float32_edit_of_the_line_that_calls_the_modules() -> None:
    report = _scaled_run(2.0**40)
    assert report is not None
    trial = _trial(report, "float32")
    assert trial.finite is True and trial.fact("autocast") == ("cpu",)
    edit = suggested_edit(trial)
    assert edit is not None and edit.endswith(_line(CastOut.forward, "# noqa: E701")), edit
    assert _scaled_run(2.0**40, fixed=True) is None  # the autocast-off form, by hand: no step overflows


def test_gradients_that_overflow_at_any_scale_never_get_scale_verified() -> None:
    scenario = collapsing(1.0)  # the contract case: the head's backward overflows float16 unscaled
    with pytest.raises(nan_magic.NonFiniteError) as raised, nan_magic.watch(*scenario.targets):
        scenario.run()
    report = raised.value.report
    trial = _trial(report, "scale")
    assert trial.finite is False and trial.failed == "backward" and trial.fact("scale") == 4.0
    assert trial.fact("tried") == (1.0,) and trial.fact("new_scale") is None
    assert suggested_edit(trial) is None
    assert "scale: the GradScaler's scale 4 lowered (tried 1) -> still non-finite (backward)" in report.to_text()
    model, opt = scenario.targets
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)  # by hand: the lowest scale still overflows
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    opt.zero_grad()
    scaler.scale((out.float() - y).pow(2).mean()).backward()
    assert not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())


def test_the_scales_tried_fall_by_2_to_the_8_down_to_1() -> None:
    assert lower_scales(2.0**26) == [2.0**18, 2.0**10, 4.0, 1.0]
    assert lower_scales(1.0) == []


# -- lr after a divergence seen in the forward ----------------------------------------------------------------


def _demo(lr: float, steps: int = 40, lowered_at: int | None = None, keep: bool = True,
          defer: bool = False, losses: list[float] | None = None) -> Report | None:
    """The demo's training loop (examples/train_blowup.py); step ``lowered_at`` runs at a tenth of ``lr``;
    ``losses`` gets each step's loss."""
    torch.manual_seed(0)
    model = TinyTransformer()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    tokens = torch.randint(0, 64, (8, 16))
    try:
        with nan_magic.watch(model, opt, keep_last_good=keep, defer=defer):
            for step in range(steps):
                opt.param_groups[0]["lr"] = lr / 10 if step == lowered_at else lr
                logits = model(tokens[:, :-1])
                loss = loss_fn(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
                if losses is not None:
                    losses.append(loss.item())
                opt.zero_grad()
                loss.backward()
                opt.step()
    except nan_magic.NonFiniteError as error:
        return error.report
    return None


@pytest.mark.parametrize("defer", [False, True])
def test_a_divergence_seen_in_the_forward_is_verified_by_redoing_the_previous_update_at_a_tenth(defer: bool) -> None:
    report = _demo(2.0, defer=defer)
    assert report is not None and report.phase == "forward" and report.step == 9
    assert report.cause is not None and report.cause.label == "learning-rate-too-high"
    trial = _trial(report, "lr")
    assert trial.finite is True and trial.fact("new_lr") == 0.2 and trial.fact("from_step") == 7
    assert report.fixes[0] is trial and "lr=0.2" in (suggested_edit(trial) or "")
    assert "the previous update (from the state after step 7) redone at a tenth" in report.to_text()
    assert _demo(2.0, steps=10, lowered_at=8, defer=defer) is None  # by hand: step 8 at a tenth, step 9 finite
    assert _demo(0.2, defer=defer) is None  # the suggested edit: training at a tenth goes on


def test_a_previous_update_at_a_tenth_that_is_not_enough_is_not_verified() -> None:
    report = _demo(3.0)
    assert report is not None and report.step == 7
    trial = _trial(report, "lr")
    assert trial.finite is False and trial.failed == "forward" and trial.fact("from_step") == 5
    again = _demo(3.0, steps=8, lowered_at=6)  # by hand, the same: step 7 still overflows
    assert again is not None and again.step == 7


def test_lr_after_a_divergence_says_why_it_could_not_be_tried() -> None:
    report = _demo(2.0, keep=False)
    assert report is not None
    trial = _trial(report, "lr")
    assert trial.finite is None and "keep_last_good" in (trial.untried or "")
    assert ("lr: the previous update redone at a tenth of the learning rate, then this step -> not tried: "
            "no last good state was kept") in report.to_text()


def test_the_demo_verifies_lr_and_its_loss_is_the_one_the_lowered_update_gives_by_hand() -> None:
    import train_blowup

    report = train_blowup.train(steps=20).report
    assert report is not None and report.phase == "forward" and report.step == 9
    trial = _trial(report, "lr")
    # The forward failed before step 9's loss code ran: step 8's, with its targets (the same tokens), gives the loss.
    assert trial.finite is True and trial.fact("loss_from") == "last loss code"
    assert trial.fact("backward_from") == "loss" and trial.fact("loss_not_computed") is None
    losses: list[float] = []
    assert _demo(2.0, steps=10, lowered_at=8, losses=losses) is None  # step 8 at a tenth, by hand
    assert trial.loss == pytest.approx(losses[9], rel=1e-4)
    assert "1 of 2 verified" in report.to_text()
    assert (f"loss {trial.loss:.3g} (the last step's loss code and targets on this step's outputs)"
            in report.to_text())
    assert train_blowup.train(steps=40, lr=0.2).report is None  # the demo at a tenth, by hand


# -- float32 of a line that calls a half-precision module ----------------------------------------------------


class HalfProj(nn.Module):
    """A float16 Linear whose output passes 65504 (weights of 30000); the line that calls it is the producer's."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.proj, self.fixed = nn.Linear(4, 4).half(), fixed
        with torch.no_grad():
            self.proj.weight.fill_(30000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:  # noqa: SIM108  # the fixed line stands alone, as the edit writes it
            h = self.proj.float()(x.float())  # fixed
        else:
            h = self.proj(x)
        return h / 1000


def test_a_half_module_call_is_verified_in_float32_and_its_edit_upcasts_the_module() -> None:
    report = _train(HalfProj())
    assert report is not None and report.module == "proj"
    assert report.cause is not None and report.cause.label == "half-precision-overflow"
    trial = _trial(report, "float32")
    assert trial.finite is True and trial.fact("autocast") == ()
    edit = suggested_edit(trial)
    assert edit is not None and edit.endswith(_line(HalfProj.forward, "# fixed")), edit
    assert _train(HalfProj(fixed=True), steps=5) is None  # the edit by hand: training continues


# -- the loss --------------------------------------------------------------------------------------------------


class LossOfLog(LogOf):
    """A model that returns its own loss (as Hugging Face models given labels do): the trial reads it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).mean()


def test_a_model_that_returns_its_loss_gives_the_trials_loss_and_no_loss_note() -> None:
    torch.manual_seed(0)
    model, x = LossOfLog(), torch.randn(3, 4)
    with pytest.raises(nan_magic.NonFiniteError) as raised, nan_magic.watch(model):
        model(x).backward()
    trial = _trial(raised.value.report, "eps")
    assert trial.finite is True and trial.fact("loss_not_computed") is None
    fixed = LossOfLog(fixed=True)
    fixed.load_state_dict(model.state_dict())
    # The fixed line by hand gives the loss the trial reported (its eps, 1.19e-07, is written rounded to 1.2e-07).
    assert trial.loss == pytest.approx(float(fixed(x).detach()), abs=0.01)
    assert f"loss {trial.loss:.3g}" in raised.value.report.to_text()


def test_the_last_good_state_keeps_the_models_state_one_capture_earlier_in_two_swapped_buffers() -> None:
    model, kept = nn.Linear(2, 2), LastGood("cpu")
    buffers = set()
    for step in range(1, 6):
        with torch.no_grad():
            model.weight.fill_(step)
        kept.capture([(None, model)], [], step, right_after=True)
        buffers.add(kept.state_of(model)["weight"].data_ptr())  # type: ignore[index]
    assert (kept.step, kept.before_step) == (4, 3)
    assert float(kept.state_of(model)["weight"][0, 0]) == 5 and float(kept.before(model)["weight"][0, 0]) == 4
    assert len(buffers) == 2  # one copy a step, into the buffers of two captures ago
    kept.hand_over()
    assert kept.before(model) is None and kept.before_step is None


def _optimizer_event(optimizer: str, scale: float = 1.0, **settings: float) -> Report:
    """Step 2 of a two-layer model whose input's first feature is always 0; ``settings`` set on the optimizer there."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = getattr(torch.optim, optimizer)(model.parameters(), lr=1e-3)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt):
        for step in range(4):
            x = torch.randn(8, 4)
            x[:, 0] = 0  # column 0 of the first weight never gets a gradient
            loss = model(x).mean() * scale
            opt.zero_grad()
            loss.backward()
            if step == 2:
                opt.param_groups[0].update(settings)
            opt.step()
    return caught.value.report


@pytest.mark.parametrize("lr", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_learning_rate_is_not_tried_at_a_tenth_and_its_cause_says_every_update(lr: float) -> None:
    # Its cause is the number (nonfinite-number), not a rate too high; a tenth of it is no trial but a note.
    report = _optimizer_event("SGD", lr=lr)
    assert (report.phase, report.module, report.step, report.optimizer) == ("optimizer", "0", 2, "SGD")
    assert report.fixes == () and report.cause is not None and report.cause.label == "nonfinite-number"
    text = report.to_text()
    assert (f"no fix was tried: the learning rate is {lr}, and a lower one (a tenth of it) is {lr} too; the remedy "
            "is a finite rate where it is set") in text
    kind = "not a number" if lr != lr else "infinite"
    assert f"its learning rate lr = {lr} is {kind}, not a rate too high, so every update lr · g is non-finite" in text
    assert "learning-rate-too-high" not in text and "usual range" not in text


def test_an_eps_that_could_not_be_tried_says_what_it_would_change() -> None:
    # Adam with eps 0: a weight column that never gets a gradient divides 0 by 0. No last good state: not tried,
    # and the line still says which step and which eps (it read "the operand of None ... the  machine eps").
    report = _optimizer_event("Adam", eps=0.0)
    assert report.cause is not None and report.cause.label == "optimizer-eps-underflow"
    trial = _trial(report, "eps")
    assert trial.finite is None and "keep_last_good" in (trial.untried or "")
    assert ("eps: the Adam step redone with eps 0 -> 1.19e-7 (the parameters' dtype holds it) -> not tried: no last "
            "good state was kept") in report.to_text()


def test_an_lr_that_could_not_be_tried_says_from_which_rate_to_which() -> None:
    report = _optimizer_event("SGD", scale=100.0, lr=3e38)  # near the float32 max: lr * g overflows
    assert report.cause is not None and report.cause.label == "learning-rate-too-high"
    trial = _trial(report, "lr")
    assert trial.finite is None and "keep_last_good" in (trial.untried or "")
    assert ("lr: the SGD step redone at a tenth of its learning rate (3e38 -> 3e37) -> not tried: no last good "
            "state was kept") in report.to_text()
