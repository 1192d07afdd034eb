"""A report says which norm layers' running statistics the failing step has already made non-finite.

A batch norm in training mode folds each batch into ``running_mean`` and ``running_var`` as its forward runs. Where
a NaN reached it before the watch stopped the step (a NaN batch, held for its step in the default and deferred
modes; any event the deferred check finds after the forward), the user's model keeps NaN statistics after the
report, and every evaluation-mode output is NaN: the report's notes name them and how to put them back.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

import nan_magic
from nan_magic.explain.norm_stats import nonfinite_norm_stats

MODES: dict[str, dict[str, Any]] = {"default": {}, "defer": {"defer": True}, "full": {"mode": "full"},
                                    "ops": {"ops": True}, "ops-defer": {"ops": True, "defer": True}}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))


def _fail(model: nn.Module, options: dict[str, Any], bad_step: int = 2) -> Any:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(model, opt, **options):
        for step in range(4):
            x = torch.randn(8, 4)
            if step == bad_step:
                x[3, 1] = math.nan
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return caught.value.report


def _norm_notes(report: Any) -> list[str]:
    return [note.text for note in report.note_facts if note.kind == "norm-stats-nonfinite"]


@pytest.mark.parametrize("mode", list(MODES))
def test_the_note_names_the_statistics_the_step_left_non_finite_in_every_mode(mode: str) -> None:
    model = _model()
    report = _fail(model, MODES[mode])
    bn = model[1]
    poisoned = not bool(bn.running_mean.isfinite().all() and bn.running_var.isfinite().all())
    notes = _norm_notes(report)
    # (the immediate full watch stops at the first module, before the norm ran; the held batch of the default mode
    # and the deferred check let the forward run through it)
    assert bool(notes) == poisoned
    if poisoned:
        assert notes == ["1.running_mean and 1.running_var in your model hold non-finite values now (a norm layer "
                         "folds each training batch into them as its forward runs, and normalises by them in "
                         "evaluation mode): put them back before going on (report.restore() with "
                         "keep_last_good=True, or a checkpoint)"]
        assert notes[0] in " ".join(report.to_text().split())  # (the report as printed, its lines joined)


@pytest.mark.parametrize("mode", ["default", "defer"])
def test_the_held_batch_leaves_the_statistics_non_finite_and_says_so(mode: str) -> None:
    model = _model()
    report = _fail(model, MODES[mode])
    assert report.phase == "data"
    assert not bool(model[1].running_mean.isfinite().all())
    assert len(_norm_notes(report)) == 1


def test_report_restore_puts_the_statistics_back() -> None:
    model = _model()
    report = _fail(model, {"keep_last_good": True})
    assert _norm_notes(report)
    report.restore()
    assert bool(model[1].running_mean.isfinite().all()) and bool(model[1].running_var.isfinite().all())


def test_no_note_without_a_norm_layer_or_in_evaluation_mode() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    assert _norm_notes(_fail(plain, {})) == []
    frozen = _model()
    frozen[1].eval()  # a frozen norm: its statistics are not updated
    assert _norm_notes(_fail(frozen, {})) == []
    assert bool(frozen[1].running_mean.isfinite().all())


def test_several_models_name_their_statistics_by_model() -> None:
    encoder, head = _model(), nn.Sequential(nn.BatchNorm1d(1))
    head[0].running_var.fill_(math.inf)  # (as a step would leave it)
    assert nonfinite_norm_stats([("encoder", encoder), ("head", head)]) == ("head.0.running_var",)
    assert nonfinite_norm_stats([(None, nn.BatchNorm1d(2))]) == ()
    lone = nn.BatchNorm1d(2)
    lone.running_mean[0] = math.nan
    assert nonfinite_norm_stats([("bn", lone)]) == ("running_mean",)


def test_a_buffer_that_cannot_be_read_is_no_finding() -> None:
    lazy = nn.LazyBatchNorm1d()  # (uninitialized buffers until its first call)
    on_meta = nn.BatchNorm1d(4, device="meta")
    assert nonfinite_norm_stats([("lazy", lazy), ("meta", on_meta)]) == ()
