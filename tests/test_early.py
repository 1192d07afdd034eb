"""Early warnings: they fire before the first non-finite value, and stay silent over healthy runs."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_healthy import TinyCNN, TinyTransformer
from torch import nn
from torch.nn import functional as F
from watching import amp_training, sgd_regression

import nan_magic
from nan_magic import NanMagicWarning, NonFiniteError
from nan_magic.hot.checks.early import BATCH_RULE_EVERY, HEADROOM_LIMIT, SCALE_FALLS, WARMUP, WARN_EVERY, EarlyWarnings
from nan_magic.plain import to_pairs
from nan_magic.records import StepSummary, TensorRef


def kinds(found) -> list[str]:
    return [warning.kind for warning in found]


# -- through the watch: before the first non-finite value ----------------------------------


def test_a_geometrically_growing_loss_warns_long_before_it_overflows() -> None:
    w = sgd_regression(lr=1.0, on_detect="log")
    report = w.report
    assert report is not None
    spikes = [warning for warning in report.warnings if warning.kind == "loss-spike"]
    assert spikes and spikes[0].step < report.step - 30  # dozens of steps of notice
    assert spikes[0] in w.warnings
    assert "grad-norm-spike" in kinds(report.warnings)
    assert "running median" in spikes[0].message


def test_warn_mode_shows_each_warning_as_it_happens_before_the_event() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        w = sgd_regression(lr=1.0, on_detect="warn")
    shown = [(item.category, str(item.message)) for item in caught]
    first_early = next(i for i, (category, _m) in enumerate(shown) if category is NanMagicWarning)
    first_event = next(i for i, (category, _m) in enumerate(shown) if category is RuntimeWarning)
    assert first_early < first_event
    assert shown[first_early][1] == w.warnings[0].message


class Rollout(nn.Module):
    """A float16 recurrent cell whose gain is above 1 in a float32 model: the state drifts towards 65504."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(16, 16, bias=False).half()
        with torch.no_grad():
            orthogonal, _ = torch.linalg.qr(torch.randn(16, 16))
            self.cell.weight.copy_(1.25 * orthogonal)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return self.cell(state.half()).float()


def test_float16_activations_drifting_towards_the_limit_warn_before_they_overflow() -> None:
    torch.manual_seed(0)
    model = Rollout()
    state = torch.randn(4, 16)

    def roll() -> None:
        nonlocal state
        with torch.no_grad():
            for _ in range(100):
                state = model(state)

    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, mode="full") as w:
        roll()
    report = caught.value.report
    (risk,) = [warning for warning in report.warnings if warning.kind == "overflow-risk"]
    assert risk.step < report.step - 3
    assert (risk.module, risk.value is not None and risk.value < HEADROOM_LIMIT) == ("cell", True)
    assert "float16" in risk.message and "65504" in risk.message
    assert report.cause.label == "half-precision-overflow" and "cell (Linear)" in report.cause.hint
    assert list(w.warnings) == list(report.warnings)


def test_a_grad_scaler_scale_that_keeps_falling_warns_before_it_collapses() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))

    def train() -> None:
        for iteration in range(200):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            if iteration % 2:
                loss = loss * 1e8  # every other step, a gradient that overflows at any scale above 1
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, scaler, mode="full"):
        train()
    report = caught.value.report
    assert report.cause.label == "grad-scaler-collapse"
    (falling,) = [warning for warning in report.warnings if warning.kind == "scale-falling"]
    assert falling.step == SCALE_FALLS and falling.step < report.step
    assert falling.value == 2.0**16 / 2**SCALE_FALLS


def test_extreme_and_constant_inputs_warn_without_raising() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 1))
    batch = torch.randn(16, 5)
    batch[:, 2] = 3.0  # a constant feature
    batch[0, 0] = 5e7  # an extreme value
    with nan_magic.watch(model, mode="full") as w:
        model(batch)
    assert w.report is None
    assert sorted(kinds(w.warnings)) == ["constant-feature", "extreme-input"]
    constant = next(warning for warning in w.warnings if warning.kind == "constant-feature")
    assert "input[0]" in constant.message and "feature 2 (= 3)" in constant.message


# -- through the watch: silent over healthy runs ----------------------------------------------


def _train(model: nn.Module, batches, steps: int) -> nan_magic.Watch:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with nan_magic.watch(model, opt, mode="full") as w:
        for step in range(steps):
            x, y = batches(step)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return w


def test_a_healthy_transformer_gets_no_warning_in_300_steps() -> None:
    torch.manual_seed(0)

    def batches(step: int):
        tokens = torch.randint(1, 50, (8, 12))
        lengths = torch.randint(3, 12, (8,))
        tokens[torch.arange(12) >= lengths[:, None]] = 0
        return tokens, tokens[:, 0] % 2

    w = _train(TinyTransformer(), batches, 300)
    assert w.report is None and w.step == 300
    assert list(w.warnings) == []


def test_a_healthy_cnn_gets_no_warning_in_300_steps() -> None:
    torch.manual_seed(0)
    w = _train(TinyCNN(), lambda step: (torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,))), 300)
    assert w.report is None and w.step == 300
    assert list(w.warnings) == []


def test_healthy_mixed_precision_with_a_grad_scaler_gets_no_warning() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    # The first steps overflow while the scaler finds its scale.
    opt, scaler, train = amp_training(
        model, 200, init_scale=2.0**24, lr=0.05, batch=lambda: (torch.randn(32, 16), torch.randint(0, 4, (32,)))
    )
    with nan_magic.watch(model, opt, scaler, mode="full") as w:
        train()
    assert w.report is None and w.events  # benign skips happened
    assert list(w.warnings) == []


# -- the rules alone ----------------------------------------------------------------------------


def summary(step: int, **fields) -> StepSummary:
    return StepSummary(step=step, loss=fields.pop("loss", 1.0), absmax=1.0, **fields)


def test_overflow_risk_only_for_half_precision_within_the_limit() -> None:
    rules = EarlyWarnings()
    close = {"headroom": 5.0, "headroom_module": "encoder.3", "headroom_dtype": "bfloat16"}
    (warning,) = rules.observe_step(summary(0, **close))
    assert (warning.kind, warning.module, warning.value) == ("overflow-risk", "encoder.3", 5.0)
    assert "bfloat16" in warning.message and "encoder.3" in warning.message
    assert EarlyWarnings().observe_step(summary(0, **{**close, "headroom_dtype": "float32"})) == []
    assert EarlyWarnings().observe_step(summary(0, **{**close, "headroom": HEADROOM_LIMIT + 1})) == []


def test_each_kind_warns_at_most_once_per_period() -> None:
    rules = EarlyWarnings()
    close = {"headroom": 2.0, "headroom_module": "fc", "headroom_dtype": "float16"}
    found = [warning for step in range(2 * WARN_EVERY + 1) for warning in rules.observe_step(summary(step, **close))]
    assert [warning.step for warning in found] == [0, WARN_EVERY, 2 * WARN_EVERY]


def _losses(rules: EarlyWarnings, values: list[float]) -> list[str]:
    return [kind for step, value in enumerate(values) for kind in kinds(rules.observe_step(summary(step, loss=value)))]


def test_a_loss_spike_after_the_warm_up() -> None:
    assert _losses(EarlyWarnings(), [1.0, 0.9, 1.1, 0.95, 1.05, 1.0, 0.9, 15.0]) == ["loss-spike"]
    assert _losses(EarlyWarnings(), [1.0, 50.0, 0.9, 1.0]) == []  # within the warm-up: nothing to compare with
    assert _losses(EarlyWarnings(), [1.0] * WARMUP + [float("nan"), float("inf"), 1.0]) == []


def test_noise_around_a_converged_loss_is_not_a_spike() -> None:
    converged = [2.0, 1.5, 1.0, 0.5, 0.2] + [0.01] * 40 + [0.3, 0.01]  # 30x the median, below the start
    assert _losses(EarlyWarnings(), converged) == []


def test_a_gradient_norm_spike() -> None:
    rules = EarlyWarnings()
    norms = [1.0, 1.2, 0.8, 1.1, 0.9, 1.0, 30.0]
    found = [w for step, norm in enumerate(norms) for w in rules.observe_step(summary(step, grad_norm=norm))]
    assert kinds(found) == ["grad-norm-spike"] and found[0].value == 30.0


def test_a_scale_falling_between_consecutive_steps() -> None:
    def falls(scales: list[float | None]) -> list[int]:
        rules = EarlyWarnings()
        return [w.step for step, scale in enumerate(scales) for w in rules.observe_step(summary(step, scale=scale))]

    assert falls([2.0**16 / 2**k for k in range(6)]) == [SCALE_FALLS]
    assert falls([2.0**16, 2.0**15, 2.0**15, 2.0**14, 2.0**14, 2.0**13]) == []  # it settles between falls
    assert falls([2.0**16, 2.0**15, None, 2.0**14, 2.0**13]) == []


def test_batch_rules() -> None:
    rules = EarlyWarnings()
    table = torch.randn(8, 4)
    assert rules.observe_batch(0, "input[0]", table) == []
    assert kinds(EarlyWarnings().observe_batch(0, "input[0]", table * 1e7)) == ["extreme-input"]
    with_inf = table.clone()
    with_inf[0, 0] = float("inf")  # a non-finite batch is an event, not a warning
    assert EarlyWarnings().observe_batch(0, "input[0]", with_inf) == []
    images = torch.randn(4, 3, 5, 5)
    images[:, 1] = 0.5
    (channel,) = EarlyWarnings().observe_batch(16, "input[0]", images)
    assert channel.kind == "constant-feature" and "channel 1 (= 0.5)" in channel.message and channel.step == 16
    one_row = torch.ones(1, 4)  # nothing varies over a single row
    assert EarlyWarnings().observe_batch(0, "input[0]", one_row) == []
    sequence = torch.ones(4, 6, 8)  # 3-D: which axis is a feature is ambiguous, no constant check
    assert EarlyWarnings().observe_batch(0, "input[0]", sequence) == []
    with_nan = table.clone()
    with_nan[:, 1] = float("nan")
    assert EarlyWarnings().observe_batch(0, "input[0]", with_nan) == []


def test_an_extreme_batch_warns_in_deferred_mode_from_the_step_summary() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nan_magic.watch(model, opt, defer=True, mode="full") as w:
        for scale in (1.0, 1e7):
            opt.zero_grad()
            model(torch.randn(8, 4) * scale).mean().backward()
            opt.step()
    (warning,) = w.warnings
    assert (warning.kind, warning.step) == ("extreme-input", 1)
    assert "the batch entering the model" in warning.message


@pytest.mark.parametrize("extreme", [5e7, -5e7])
def test_an_extreme_batch_warns_at_its_step_where_the_feature_rule_does_not_run(extreme: float) -> None:
    """The default watch (immediate) passes over a batch's early warnings where nothing can be said (a finite batch
    within the limit, on a step the per-feature rule skips: hot/checks/forward.py's record_data): a batch of |x| = 1e6
    at step 1 says nothing (the limit is exclusive), one beyond it at step 3, either sign, is told at step 3."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nan_magic.watch(model, opt) as w:
        for step in range(5):
            batch = torch.randn(8, 4)
            batch[0, 0] = {1: -1e6, 3: extreme}.get(step, 0.5)
            opt.zero_grad()
            model(batch).mean().backward()
            opt.step()
    assert w.report is None and 3 % BATCH_RULE_EVERY
    (warning,) = w.warnings
    assert (warning.kind, warning.step, warning.value) == ("extreme-input", 3, abs(extreme))


def test_gradients_near_the_half_precision_limit_warn_before_they_overflow() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)).half()
    with torch.no_grad():
        model[1].weight.fill_(1.0)  # the gradient into layer 1's input is the output's: 20000
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.full((1, 4), 0.5).half()
    with nan_magic.watch(model, opt, mode="full") as w:
        for _ in range(2):
            opt.zero_grad()
            (model(x).sum() * 20000.0).backward()
            opt.step()
    assert w.report is None  # 20000 still fits in float16
    grads = [warning for warning in w.warnings if warning.kind == "overflow-risk" and "gradient" in warning.message]
    assert grads and grads[0].step == 0
    assert "float16 gradient of" in grads[0].message and "65504" in grads[0].message
    assert w.history[0].grad_headroom is not None and w.history[0].grad_headroom < 4


def test_no_gradient_overflow_warning_under_a_grad_scaler() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**15)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with nan_magic.watch(model, opt, scaler, mode="full") as w:
        for _ in range(5):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert all(summary.grad_headroom is None for summary in w.history)
    assert not [warning for warning in w.warnings if "gradient" in warning.message]


def test_the_per_feature_batch_rule_runs_at_the_first_step_then_every_few() -> None:
    table = torch.randn(8, 4)
    table[:, 3] = 1.0  # a constant feature

    def warns(step: int) -> bool:
        return bool(EarlyWarnings().observe_batch(step, "input[0]", table))

    assert [warns(step) for step in range(BATCH_RULE_EVERY + 1)] == [True] + [False] * (BATCH_RULE_EVERY - 1) + [True]
    assert warns(2 * BATCH_RULE_EVERY)
    # The extreme-input rule reads the probe the watch already has, every step.
    probe = (float(table.min()), 2e7)
    assert kinds(EarlyWarnings().observe_batch(BATCH_RULE_EVERY + 1, "input[0]", table, probe)) == ["extreme-input"]


@pytest.mark.parametrize("defer", [False, True])
def test_a_step_summary_holds_the_largest_values_and_where_the_headroom_is_least(defer: bool) -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[3.0, 0.0], [0.0, -5.0]]))  # outputs 3 and -10
        model[0].bias.zero_()
        model[1].weight.fill_(1.0)  # output -7
        model[1].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nan_magic.watch(model, opt, defer=defer, mode="full") as w:
        opt.zero_grad()
        model(torch.tensor([[1.0, 2.0]])).sum().backward()
        opt.step()
    (summary,) = w.history
    assert (summary.absmax, summary.input_absmax) == (10.0, 2.0)
    assert summary.headroom == pytest.approx(torch.finfo(torch.float32).max / 10.0)
    assert (summary.headroom_module, summary.headroom_dtype) == ("0", "float32")
    if defer:
        # Deferred gradients get a range (every gradient here is 1), read with the step's one transfer.
        assert summary.grad_headroom == pytest.approx(torch.finfo(torch.float32).max)
        assert summary.grad_headroom_dtype == "float32"
    else:
        assert summary.grad_headroom is None  # float32 CPU gradients: finiteness only, by a sum


def test_a_warning_keeps_its_numbers_and_render_writes_its_sentence() -> None:
    # The watch keeps a warning's kind and facts; its sentence is render/words/warning_words.py's, from them.
    batch = torch.randn(8, 4)
    batch[:, 2] = 3.0
    batch[0, 0] = 1e7
    found = EarlyWarnings().observe_batch(0, "x", batch)
    extreme, constant = sorted(found, key=lambda warning: warning.kind, reverse=True)
    # The batch tensor is a typed reference (the model call's argument), stored as plain pairs.
    assert dict(extreme.facts)["tensor"] == dict(constant.facts)["tensor"] == to_pairs(TensorRef.argument("x"))
    assert (extreme.kind, dict(extreme.facts)["absmax"]) == ("extreme-input", 1e7)
    assert extreme.message == ("x of the batch holds |x| = 1e+07 (> 1e+06): normalise or clip the inputs before "
                               "they overflow a layer")
    assert dict(constant.facts)["constant"] == ((2, 3.0),)
    assert constant.message == ("x: 1 of 4 features is constant over the batch of 8 rows: feature 2 (= 3); "
                                "standardising it divides by a zero std")
    assert all(isinstance(value, (str, int, float, tuple, type(None))) for _name, value in constant.facts)
