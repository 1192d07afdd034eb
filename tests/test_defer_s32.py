"""The deferred watch (what a GPU runs) names what the immediate one names: round 32.

- Every incident row of tests/contract/defer_s32.py: the deferred report names the module, op, line, phase, step
  and cause the immediate one names, and ``%debug`` opens at the same line (ops=True likewise with defer=True).
- A NaN reading in a jagged nested-tensor batch that the model's own code passes to its head (no op names it): the
  immediate watch raises in the forward and ``%debug`` opens there; the deferred one opened at the loop's model call
  (that forward had returned by the step's check). It now opens the replay's forward at the same line, and says so.
- A GAN's ``update(opt, loss)`` helper called for D then G, G's Adam at fault: judged at the next step's check in D's
  call of the same line, %debug opened there with a note that its locals are the next step's, not that they are the
  other optimizer's call (its ``loss`` is D's). It now says so; two optimizers stepped at different lines do not.
- ``%nanwatch on model`` with the model on a GPU defers its checks (hot/timing.py chooses, the user asked nothing):
  its confirmation line said nothing of it, so a GPU user did not know the report comes at the step's check. The
  device is faked at the one place each path reads it (``timing_for``'s parameters' device; the namespace's
  ``models_on_a_device`` for ``%nanwatch on`` with no target).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import numpy as np
import pytest
import torch
from contract import Case, Scenario, all_cases, defer_s32
from torch import nn

import nan_magic
from nan_magic import NonFiniteError, Phase
from nan_magic.hot import timing
from nan_magic.ipython import magics


def _line(pointer: Any) -> tuple[str, int] | None:
    return None if pointer is None else (os.path.basename(pointer.filename), pointer.lineno)


def _seen(case: Case, options: dict[str, Any]) -> dict[str, Any]:
    """What a user reads off the row's report: where, what, why, and where %debug opens."""
    torch.manual_seed(0)
    scenario = case.build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options, **scenario.options):
        scenario.run()
    report = caught.value.report
    return {"module": report.module, "op": report.op, "source": _line(report.source), "phase": report.phase,
            "step": report.step, "cause": None if report.cause is None else report.cause.label,
            "debug": _line(report.debug_frame)}


INCIDENTS = [pytest.param(case, id=case.name, marks=case.marks) for case in defer_s32.CASES
             if case.expect is not None]


@pytest.mark.parametrize("case", INCIDENTS)
@pytest.mark.parametrize("ops", [pytest.param(False, id="default"), pytest.param(True, id="ops")])
def test_deferred_report_and_debug_line_are_the_immediate_ones(case: Case, ops: bool) -> None:
    base = {"ops": True} if ops else {}
    now, late = _seen(case, base), _seen(case, {**base, "defer": True})
    assert now["op"] is not None and now["source"] is not None and now["debug"] is not None, now
    assert late == now


# ---------------------------------------------------------------- a value no op names: %debug in the forward
class _NumpyMadeWeight(nn.Module):
    """A forward whose weight numpy makes (``np.log`` of 0 at the third step: -inf no torch op made), passed on to a
    submodule: the root's own code made the head's non-finite input, and no op names it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head, self.table, self.calls = nn.Linear(4, 4), nn.Linear(4, 1), np.ones(4), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        w = torch.from_numpy(np.log(self.table - 1.0 * (self.calls > 1))).float()
        return self.head(h * w)  # the line %debug opens at


_MADE_LINE = inspect.getsourcelines(_NumpyMadeWeight.forward)[1] + 3


def _numpy_made(options: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    model = _NumpyMadeWeight()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(4):
            model.calls = step
            loss = model(torch.randn(8, 4)).pow(2).mean()  # the loop's model call
            opt.zero_grad()
            loss.backward()
            opt.step()
    return caught.value.report


_CALL_LINE = inspect.getsourcelines(_numpy_made)[1] + 7


@pytest.mark.parametrize("options", [{}, {"defer": True}, {"mode": "full"}, {"ops": True}, pytest.param(
    {"ops": True, "defer": True}, marks=pytest.mark.xfail(strict=True, reason=(
        "ops+defer runs no replay for a value no op names: it names head, whose input is the non-finite one, "
        "'inputs finite'")))], ids=["default", "defer", "full", "ops", "ops-defer"])
def test_a_submodules_input_no_op_names_is_the_forward_that_made_it(options: dict[str, Any]) -> None:
    """The root's forward made the head's input (numpy's -inf, no op names it): every mode names the root, and
    %debug opens where its frame is live: in the forward for the per-call modes (full, ops), at the loop's model
    call for the boundary modes, deferred as immediate. (A replay's frame is not offered: defer-s32 offered the
    innermost user frame met while the replay ran, which was the running loop's ``opt.step()`` line for a library
    parent or a backward event, and the replay ran past the line it named, so its locals were not that line's.)"""
    report = _numpy_made(options)
    assert (report.module, report.phase, report.step) == ("", Phase.FORWARD, 2)
    live = options.get("mode") == "full" or options.get("ops")
    assert _line(report.debug_frame) == (os.path.basename(__file__), _MADE_LINE if live else _CALL_LINE)
    if not live:
        assert "opens a replay" not in report.to_text()


def test_a_value_an_op_names_keeps_debug_where_the_immediate_watch_opens_it() -> None:
    """The replay's frame is taken only where no op names the value: a masked max pool's ``amax`` over a fully
    padded row (an op named, its frame not kept) opens %debug at the loop's model call, as the immediate watch."""
    case = next(case for case in all_cases() if case.name == "hunt14_max_pool_over_a_fully_padded_sequence")
    now, late = _seen(case, {}), _seen(case, {"defer": True})
    assert now["op"] == "aten.amax.default" and late == now, (now, late)


# ---------------------------------------------------------------- a shared update helper: whose call %debug opens
_OTHER_CALL = "and those of this line's step() call for another optimizer (its loss, not this optimizer's)"


def _text(build: Any, options: dict[str, Any]) -> str:
    torch.manual_seed(0)
    scenario = build()
    with pytest.raises(NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options):
        scenario.run()
    return caught.value.report.to_text()


@pytest.mark.parametrize("ops", [False, True])
def test_a_gan_shared_update_helper_says_debug_opens_in_the_other_optimizers_call(ops: bool) -> None:
    late = _text(lambda: defer_s32._gan_shared_update(0.0), {"defer": True, "ops": ops})
    assert "judged at step 3's deferred check" in late and _OTHER_CALL in late, late
    assert "judged at step" not in _text(lambda: defer_s32._gan_shared_update(0.0), {"ops": ops})


def _two_optimizers_two_lines():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    body, head = nn.Linear(4, 4), nn.Linear(4, 1)
    body_opt = torch.optim.Adam(body.parameters(), lr=1e-3, eps=0.0, foreach=False)
    head_opt = torch.optim.SGD(head.parameters(), lr=0.01)
    xs = [torch.randn(5, 4) for _ in range(4)]
    model = nn.Sequential(body, head)

    def run() -> None:
        for step in range(4):
            loss = model(xs[step]).pow(2).mean() * (0.0 if step == 0 else 1.0)
            body_opt.zero_grad()
            head_opt.zero_grad()
            loss.backward()
            head_opt.step()
            body_opt.step()
    return Scenario((model, body_opt, head_opt), run)


def test_two_optimizers_at_two_lines_say_nothing_of_another_call() -> None:
    late = _text(_two_optimizers_two_lines, {"defer": True})
    assert "judged at step 1's deferred check" in late and "another optimizer" not in late, late


# ---------------------------------------------------------------- %nanwatch on a GPU model says it defers

@pytest.fixture
def gpu_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every model reads as living on a GPU where the watch chooses its timing."""
    chosen = timing.timing_for

    def on_a_gpu(config: Any, roots: Any) -> Any:
        return chosen(config, roots) if config.defer is not None else timing.Deferred()

    monkeypatch.setattr("nan_magic.lifecycle.watch.timing_for", on_a_gpu)
    monkeypatch.setattr(magics, "models_on_a_device", lambda namespace: True)


@pytest.mark.parametrize(("line", "said"), [
    ("on model", "nan_magic: watching every cell (model; deferred: checked once a step, as a model is on a GPU) "
                 "until %nanwatch off"),
    ("on", "nan_magic: watching every cell (every module called; deferred: checked once a step, as a model is on "
           "a GPU) until %nanwatch off"),
    ("on model --defer", "nan_magic: watching every cell (model; deferred: checked once a step) until %nanwatch off"),
])
def test_nanwatch_on_a_gpu_model_says_it_defers(ip, gpu_models: None, line: str, said: str) -> None:
    from IPython.utils.capture import capture_output

    ip.user_ns["model"] = nn.Linear(2, 2)
    try:
        with capture_output() as captured:
            ip.run_line_magic("nanwatch", line)
        assert captured.stdout.strip() == said
    finally:
        with capture_output():
            ip.run_line_magic("nanwatch", "off")
        ip.user_ns.pop("model", None)


def test_nanwatch_on_a_cpu_model_says_nothing_of_defer(ip) -> None:
    from IPython.utils.capture import capture_output

    ip.user_ns["model"] = nn.Linear(2, 2)
    try:
        with capture_output() as captured:
            ip.run_line_magic("nanwatch", "on model")
        assert captured.stdout.strip() == "nan_magic: watching every cell (model) until %nanwatch off"
    finally:
        with capture_output():
            ip.run_line_magic("nanwatch", "off")
        ip.user_ns.pop("model", None)
