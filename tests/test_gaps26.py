"""Known wrong answers left by session 25 (its closing note's "Not done, plainly"), each as a test that failed before
its fix."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import nan_magic
from tests.test_gaps25 import _write_a_nan_at_step_2


def _adam_eps_0_report(**options: object) -> nan_magic.Report:
    """Adam with eps=0 over embedding rows no batch used: 0/0 in step 0's update (test_nb25's notebook, as a script)."""
    torch.manual_seed(0)
    emb = nn.Embedding(20, 4)
    opt = torch.optim.Adam(emb.parameters(), lr=1e-2, eps=0.0)
    with pytest.raises(nan_magic.NonFiniteError) as raised, nan_magic.watch(emb, opt, **options):
        for _step in range(3):
            ids = torch.randint(0, 10, (8,))
            loss = (emb(ids).sum(-1) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = raised.value.report
    assert (report.phase, report.step, report.op) == ("optimizer", 0, "aten.addcdiv_.default")
    return report


@pytest.mark.parametrize("defer", [False, True])
def test_an_optimizer_replays_operands_say_whose_numbers_they_are(defer: bool) -> None:
    """The op of an optimizer step is named by a replay from what the step left (its state already advanced), so the
    report's inputs and histograms (Adam's averages) are the replay's numbers. Deferred, the step's gradient is gone
    by the check (step 1's backward replaced it) and the replay applied step 1's: the report said the replay ran on
    "its gradient" under numbers that were neither step 0's nor the immediate report's (nb25). The note now says
    which gradient the replay applied and that the numbers are not the step's."""
    report = _adam_eps_0_report(defer=defer)
    (said,) = [note for note in report.notes if "named by a replay of the Adam step" in note]
    if defer:
        assert said == ("aten.addcdiv_.default named by a replay of the Adam step on copies of the parameter and its "
                        "state as step 0 left them and of step 1's gradient (step 0's was replaced before it was "
                        "judged): its inputs and histograms are the replay's numbers, not step 0's"), said
    else:
        assert said == ("aten.addcdiv_.default named by a replay of the Adam step on copies of the parameter, its "
                        "gradient and its state as the step left them (non-finite elements as 0): its inputs and "
                        "histograms are the replay's numbers, not the step's own"), said
    assert report.operand("tensor2") is not None and report.operand("tensor2").zeros == 64


@pytest.mark.parametrize("options", [{"ops": True}, {"ops": True, "defer": True}])
def test_ops_mode_names_a_nan_the_loop_writes_into_the_batch(options: dict) -> None:
    """``x[3, 2] = float("nan")`` before the model call: ops=True reported the batch as data with op None at the model
    call (its live tracer kept no lifted number, since a lift made the tracer's finding had stopped its checks behind
    a handled batch's benign event: test_handled_inputs). It names the lift and the writing line now, as the other
    modes do, and %debug opens at that line."""
    with pytest.raises(nan_magic.NonFiniteError) as caught:
        _write_a_nan_at_step_2(**options)
    report = caught.value.report
    assert (report.phase, report.step, report.op) == ("data", 2, "aten.lift_fresh.default")
    assert report.source is not None and report.source.line == 'x[3, 2] = float("nan")'
    assert report.debug_frame is not None and report.debug_frame.line == 'x[3, 2] = float("nan")'


FIVE_MODES = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"}, "ops": {"ops": True},
              "ops+defer": {"ops": True, "defer": True}}


class _WithSpare(nn.Module):
    """Two layers, and a third the optimizer updates but forward never calls (test_phases' WithSpare)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.spare = nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


@pytest.mark.parametrize("mode", FIVE_MODES)
def test_a_parameter_the_data_region_rebinds_is_named_at_the_next_step(mode: str) -> None:
    """``model.spare.bias.data = torch.full(..., nan)`` after step 3's ``opt.step()``, a parameter no forward reads:
    the default, deferred and full watches found it at the next full check (step 16, phase data, no op or line),
    since the data region's rebinding check learned the parameters' memory at its first recorded end, which was this
    one (the loop's data region before ran no op). It is learned at the first backward now: the rebinding is named
    at the next step, by the op that made the new memory and its line, as ops=True and an in-place write named it."""
    torch.manual_seed(0)
    model = _WithSpare()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **FIVE_MODES[mode]):
        for step in range(20):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            if step == 3:
                model.spare.bias.data = torch.full((4,), float("nan"))
    report = caught.value.report
    assert (report.phase, report.step, report.module, report.op) == ("optimizer", 4, "spare", "aten.full.default")
    assert report.tensor.name == "spare.bias"
    assert report.source is not None and report.source.line == 'model.spare.bias.data = torch.full((4,), float("nan"))'


def _chunked_accumulation(eps: float, **options: object) -> tuple[nan_magic.Watch | None, list[torch.Tensor]]:
    """Four micro-batches a step, chunked from a batch the loop normalised row by row; a per-position loss over 40
    outputs (161 recorded ops a micro-batch, more than GOES_ON_MAX). Step 1's batch has a blank row in its third
    micro-batch: 0 / 0 there, unless ``eps``. Returns the watch (None where it raised) and the parameters after."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 40))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = [torch.randn(16, 4) for _ in range(3)], [torch.randn(16, 40) for _ in range(3)]
    xs[1][10] = 0.0
    watch = nan_magic.watch(model, opt, **options) if options.get("watched", True) else None
    with watch if watch is not None else contextlib.nullcontext():
        for step in range(3):
            x = xs[step] / (xs[step].norm(dim=1, keepdim=True) + eps)  # the loop normalises the whole batch
            opt.zero_grad()
            for xb, yb in zip(x.chunk(4), ys[step].chunk(4)):
                out = model(xb)
                loss = torch.zeros(())
                for t in range(40):  # a per-position loss
                    loss = loss + F.mse_loss(out[:, t], yb[:, t])
                (loss / 160).backward()
            opt.step()
    return watch, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", FIVE_MODES)
def test_an_accumulating_step_s_batch_the_data_code_made_is_named_past_a_long_loss_region(mode: str) -> None:
    """Deferred, an accumulating step's check runs as the next micro-batch's call starts, and the batch it judged
    was made by the data code before the first micro-batch; the records held for it were replaced by the loss code's
    at each call once a loss region ran more than GOES_ON_MAX ops (fewer go on across the call, and stay held):
    ``defer=True`` reported the batch with op and line None. The data code's records stay held now."""
    options = FIVE_MODES[mode]
    with pytest.raises(nan_magic.NonFiniteError) as caught:
        _chunked_accumulation(0.0, **options)
    report = caught.value.report
    assert (report.phase, report.step, report.module, report.op) == ("data", 1, "", "aten.div.Tensor")
    assert report.source is not None and "the loop normalises the whole batch" in report.source.line
    watch, watched = _chunked_accumulation(1e-6, **options)  # the twin: calm, and the same parameters as unwatched
    assert watch is not None and watch.report is None and not watch.events
    _none, unwatched = _chunked_accumulation(1e-6, watched=False)
    assert all(torch.equal(a, b) for a, b in zip(watched, unwatched))


#: A module attribute rebound to a new Parameter: the recorded modes never read it.
@pytest.mark.parametrize("mode", FIVE_MODES)
def test_a_parameter_the_data_region_replaces_is_named_at_the_next_step(mode: str) -> None:
    """``model.spare.bias = nn.Parameter(torch.full(..., nan))`` after step 3's ``opt.step()``: the model now holds a
    NaN parameter (its state_dict saves it), which the optimizer does not step and no forward reads. A parameter is a
    boundary (PRODUCT.md's event), so it is an event: the recorded modes saw none (Rebound compares the old
    parameters' memory, which the old spare.bias keeps). torch's parameter registration hook notes the replacement
    now, judged as the data region ends, named by the op that made its memory (LoopWrites.on_registered)."""
    torch.manual_seed(0)
    model = _WithSpare()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **FIVE_MODES[mode]):
        for step in range(20):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            if step == 3:
                model.spare.bias = nn.Parameter(torch.full((4,), float("nan")))
    report = caught.value.report
    assert (report.step, report.module, report.op) == (4, "spare", "aten.full.default")
    assert report.source is not None and "nn.Parameter(torch.full((4,)" in report.source.line
