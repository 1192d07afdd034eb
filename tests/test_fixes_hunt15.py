"""The fix trials of hunt15's incidents (tests/contract/hunt15.py, hunt14.py): what each remedy says.

A max-subtracted exp is a fix only where the max cancels (a softmax): a PPO probability ratio, a CLIP logit
scale, a log-softmax by hand without the max added back and an exp activation come out finite by computing
something else, and say so (finite None, not verified). SwAV's Sinkhorn under ``no_grad`` is replayed under
``no_grad`` (no autograd in-place error). A float16 attention's float32 trial whose result the later code refuses
(``attn @ v`` in half) says why, rather than that the replay raised.
"""

from __future__ import annotations

import pytest
import torch
from contract import hunt14, hunt15
from torch import nn
from watching import raised

from nan_magic.records import FixTrial, Report

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py: small models, torch on one thread)

TIMINGS = [pytest.param({}, id="immediate"), pytest.param({"defer": True}, id="deferred")]


def _report(module, name: str, options: dict) -> Report:
    case = next(case for case in module.CASES if case.name == name)
    scenario = case.build()
    return raised(scenario.run, *scenario.targets, **options)


def _only(report: Report, kind: str) -> FixTrial:
    assert [trial.kind for trial in report.fixes] == [kind], report.fixes
    return report.fixes[0]


#: (module, case, what the stable trial's moved value is: the loss, or the model's output)
NOT_A_SOFTMAX = [
    pytest.param(hunt15, "hunt15_ppo_ratio_exp_overflow_behind_the_clip", "loss", id="ppo-ratio"),
    pytest.param(hunt15, "hunt15_log_softmax_by_hand_of_large_logits", "loss", id="hand-log-softmax"),
    pytest.param(hunt15, "hunt15_clip_logit_scale_unclamped", "model's output", id="clip-logit-scale"),
    pytest.param(hunt15, "hunt15_swav_sinkhorn_exp_under_no_grad", "loss", id="swav-sinkhorn"),
    pytest.param(hunt14, "hunt14_second_micro_batch_overflows", "model's output", id="exp-activation"),
    pytest.param(hunt14, "hunt14_encoder_shared_by_two_models", "model's output", id="shared-exp"),
]


@pytest.mark.parametrize("options", TIMINGS)
@pytest.mark.parametrize(("module", "name", "moved"), NOT_A_SOFTMAX)
def test_a_max_subtracted_exp_that_changes_the_value_is_no_fix(module, name: str, moved: str, options: dict) -> None:
    """The step came out finite with the max subtracted, but moving the max moved the loss or the output: the
    trial is not verified, and says it changes what the line computes. (SwAV's 3 Sinkhorn iterations are not
    invariant to a per-sample scale either: its loss moves too.)"""
    report = _report(module, name, options)
    trial = _only(report, "stable")
    assert trial.finite is None and trial.error is None and trial.failed is None
    assert trial.fact("form") == "max-subtracted exp" and trial.fact("changes_value") is True
    assert trial.untried is not None and trial.untried.startswith("it changes what the line computes")
    assert f"the {moved} moved by" in trial.untried
    text = report.to_text()
    assert "0 of 1 verified" in text
    assert "-> not a fix, though the step came out finite: it changes what the line computes" in text
    assert "suggested edit" not in text


@pytest.mark.parametrize("options", TIMINGS)
def test_the_ppo_ratios_hint_clamps_the_exponent_before_any_max(options: dict) -> None:
    """A probability ratio has no max to subtract: the backward's hint leads with the clamp."""
    text = _report(hunt15, "hunt15_ppo_ratio_exp_overflow_behind_the_clip", options).to_text()
    assert "; clamp its input (x.clamp(max=20): a probability ratio exp(logp - old_logp), a scale); only where" in text
    assert "subtract the max first (logsumexp) or clamp the input" not in text


@pytest.mark.parametrize("options", TIMINGS)
def test_swavs_sinkhorn_under_no_grad_is_replayed_under_no_grad(options: dict) -> None:
    """The trial ran the loss code's ``no_grad`` block without a graph, as the user's code did: no autograd
    in-place error from the normalisations ``q /= q.sum()`` of the exp's saved output; the step came out finite."""
    trial = _only(_report(hunt15, "hunt15_swav_sinkhorn_exp_under_no_grad", options), "stable")
    assert trial.error is None and trial.loss is not None
    assert "moved by" in (trial.untried or "")


@pytest.mark.parametrize("options", TIMINGS)
def test_a_float32_line_whose_result_the_half_code_after_it_refuses_says_why(options: dict) -> None:
    """``padding.to(half) * -1e9`` in float32 gives a float32 bias, and ``softmax(scores + bias) @ v`` with v in
    float16 refuses it: the float32 trial is not tried, and says the line cannot be computed in float32 alone."""
    report = _report(hunt15, "hunt15_fp16_attention_masked_with_minus_1e9", options)
    trial = _only(report, "float32")
    assert trial.finite is None and trial.error is None and trial.failed is None
    assert trial.untried == (
        "the code after the producer's line refused its float32 result (RuntimeError: expected scalar type Float "
        "but found Half): it meets tensors still in float16 there, so the line cannot be computed in float32 "
        "alone; that code would need float32 too (or autocast over the region)")
    assert "float32: the producer's line computed in float32 (it ran in float16) -> not tried: the code after" in (
        report.to_text())


class _HandSoftmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.fc(x)
        e = torch.exp(s)
        return e / e.sum(-1, keepdim=True)


@pytest.mark.parametrize("options", TIMINGS)
def test_a_softmax_by_hands_max_subtracted_exp_is_still_verified(options: dict) -> None:
    """Where the exp is normalised by its own sum the max cancels: moving it moves nothing, the trial is verified
    (with the suggested edit)."""
    torch.manual_seed(0)
    model = nn.Sequential(_HandSoftmax(), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        for step in range(3):
            loss = model(torch.randn(4, 4) * (1000 if step == 2 else 1)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(run, model, **options)
    trial = next(trial for trial in report.fixes if trial.kind == "stable")
    assert trial.finite is True and trial.fact("changes_value") is None and trial.untried is None
    assert "stable: the exp max-subtracted (exp(x - x.amax(-1, keepdim=True))) -> verified" in report.to_text()


@pytest.mark.parametrize("options", TIMINGS)
def test_a_no_grad_target_softmax_by_hand_in_the_loss_code_is_verified(options: dict) -> None:
    """Soft targets made in the loss code under ``no_grad``, ``t = exp(s); t /= t.sum(-1)`` (in place, as SwAV's
    codes): the trial replays the block without a graph, so the in-place division raises nothing, and the max
    cancels in the normalisation: the max-subtracted exp is verified."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        for step in range(3):
            scores = model(torch.randn(5, 4) * (1000 if step == 2 else 1))
            with torch.no_grad():
                targets = torch.exp(scores / 0.1)
                targets /= targets.sum(-1, keepdim=True)
            loss = -(targets * torch.log_softmax(scores, -1)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    report = raised(run, model, **options)
    assert report.op == "aten.exp.default" and report.module is None
    trial = _only(report, "stable")
    assert trial.finite is True and trial.error is None and trial.fact("changes_value") is None, trial
