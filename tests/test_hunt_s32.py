"""hunt_s32: an inverse CDF at its domain's edge, and the log of a normal CDF that underflowed.

``torch.special.ndtri`` (a rank-gauss of the top rank, ``n / n``) and ``erfinv`` (``Normal.icdf`` of a CDF of 1) were
"unclassified: no rule of the checklist matches", with no fix tried; they are read like ``logit`` and ``atanh`` (an
infinity at the domain's edge, NaN past it), and the eps remedy clamps their operand into the domain, verified.

``log(special.ndtr(z))`` and ``log(Normal(0, 1).cdf(z))`` of a sample far in the tail (a Tobit or probit likelihood)
are -inf where the CDF underflowed to 0. The stable remedy fused only a softmax's or sigmoid's log and said "not tried:
it found nothing to change"; it now knows the normal CDF too, as ``special.ndtr`` (module code) or as the ops it is
computed by (``0.5 * (1 + erf(z / sqrt(2)))``: ``Normal.cdf``, and ndtr's recorded ops in loss code), and computes
``special.log_ndtr(z)``: verified, with the edit to the line.
"""

from __future__ import annotations

import re

import pytest
import torch
from contract import hunt_s32
from contract.hunt19 import CASES as HUNT19_CASES

import nan_magic
from nan_magic.render.fixes import fix_description, suggested_edit

MODES = {"default": {}, "full": {"mode": "full"}}


def _report(build, **options: object) -> nan_magic.Report:
    scenario = build()
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options):
        scenario.run()
    return caught.value.report


def _trial(report: nan_magic.Report, kind: str):
    trials = [trial for trial in report.fixes if trial.kind == kind]
    assert len(trials) == 1, [(trial.kind, trial.finite) for trial in report.fixes]
    return trials[0]


@pytest.mark.parametrize("mode", MODES)
def test_ndtri_of_the_top_rank_is_an_inverse_cdf_at_its_edge_and_the_clamp_is_verified(mode: str) -> None:
    report = _report(lambda: hunt_s32._ndtri(0.0), **MODES[mode])
    assert (report.phase, report.op, report.step) == ("forward", "aten.special_ndtri.default", 0)
    assert report.cause is not None and (report.cause.label, report.cause.reading) == ("log-domain", "icdf-edge")
    assert "-inf at 0, +inf at 1 and NaN beyond" in report.cause.hint and "(rank - 0.5) / n" in report.cause.hint
    trial = _trial(report, "eps")
    assert trial.finite is True
    edit = suggested_edit(trial)
    assert edit is not None and edit.endswith(
        "return torch.special.ndtri(((ranks - offset) / len(target)).clamp(1.2e-07, 0.99999988))")


def test_erfinv_of_a_cdf_of_1_is_an_inverse_cdf_at_its_edge_and_the_clamp_is_verified() -> None:
    case = next(case for case in HUNT19_CASES if case.name == "hunt19_rank_gauss_icdf_of_a_cdf_of_1")
    report = _report(case.build)
    assert report.op == "aten.erfinv.default" and report.cause is not None
    assert (report.cause.label, report.cause.reading) == ("log-domain", "icdf-edge")
    assert "±inf at ±1 and NaN beyond" in report.cause.hint
    assert _trial(report, "eps").finite is True


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("build", "edit"), [
    (lambda: hunt_s32._tobit("ndtr"), "below = torch.special.log_ndtr(z)"),
    (lambda: hunt_s32._tobit("normal"), None),  # (Normal(0, 1).cdf(z): no call on the line to rewrite)
    (lambda: hunt_s32._probit(False), None),
], ids=["special-ndtr-in-loss-code", "normal-cdf-in-loss-code", "normal-cdf-in-a-module"])
def test_the_log_of_an_underflowed_normal_cdf_is_fused_into_log_ndtr(mode: str, build, edit: str | None) -> None:
    report = _report(build, **MODES[mode])
    assert report.op == "aten.log.default" and report.step == 2
    trial = _trial(report, "stable")
    assert trial.finite is True and trial.fact("form") == "log_ndtr"
    assert fix_description(trial) == "the log of the normal CDF fused into log_ndtr"
    if edit is not None:
        assert suggested_edit(trial) is not None and suggested_edit(trial).endswith(edit)


def test_a_log_of_an_erf_that_is_not_a_normal_cdf_is_left_alone() -> None:
    """``log(0.5 * (2 + erf(x)))`` is no normal CDF: the stable remedy changes nothing there."""
    from nan_magic.fixes.remedies.stable import StableFix
    fix = StableFix("log")
    x = torch.randn(4)
    erf = torch.erf(x)
    fix.seen(torch.erf, (x,), {}, erf)
    shifted = erf + 2
    fix.seen(torch.Tensor.__add__, (erf, 2), {}, shifted)
    half = shifted * 0.5
    fix.seen(torch.Tensor.__mul__, (shifted, 0.5), {}, half)
    assert fix(torch.log, (half,), {}) is None
    one = erf + 1
    fix.seen(torch.Tensor.__add__, (erf, 1), {}, one)
    cdf = 0.5 * one
    fix.seen(torch.Tensor.__rmul__, (one, 0.5), {}, cdf)
    fused = fix(torch.log, (cdf,), {})
    assert fused is not None and torch.allclose(fused, torch.special.log_ndtr(x * 2**0.5))


@pytest.mark.xfail(strict=True, reason=(
    "log(expm1(y)) (an inverse softplus) whose expm1 overflowed: no remedy computes it as y + log(-expm1(-y)); the "
    "stable remedy is offered for an exp or a log only, and the report's hint speaks of a softmax's max"))
def test_an_inverse_softplus_whose_expm1_overflowed_has_its_stable_form_verified() -> None:
    report = _report(lambda: hunt_s32._rates(False))
    assert report.op == "aten.expm1.default"
    assert _trial(report, "stable").finite is True


@pytest.mark.xfail(strict=True, reason=(
    "a division inside torch.where's discarded branch (Box-Cox at lambda 0 guarded by one where): the backward's "
    "0 * (1 / 0) is read as a pole of a/b, and the hint says to add eps to the divisor, not that the discarded "
    "branch needs a safe divisor too (the double where)"))
def test_a_division_in_a_discarded_where_branch_says_so() -> None:
    report = _report(lambda: hunt_s32._boxcox("where"))
    assert (report.phase, report.module, report.op) == ("backward", "0", "aten.div.Tensor")
    assert report.cause is not None
    assert "where" in re.sub(r"`[^`]*`", "", report.cause.hint)  # (the quoted line aside)
