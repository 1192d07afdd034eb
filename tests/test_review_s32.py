"""The review of hunt-s32: a fused log verified where it computed another value, and edits that were not the trial.

1. The stable remedy fused ``log(p)`` into ``log_ndtr(z)`` (``log_softmax``, ``logsigmoid``) from the CDF's input,
   though the code had written p in place since (``p.masked_fill_(~censored, 1.0)``, ``p[:, -1] = 1.0``,
   ``sig.mul_(0.5)``): "verified ... the model's finite outputs unchanged", with another loss. A fused form is now
   tried only where neither the tensor nor its input was written in place since it was made, and where it is the
   line's own value wherever that is finite; else the trial says it was not tried, and why.
2. ``log(0.5 * erf(z / sqrt(2)).add(1, alpha=-1))`` was read as a normal CDF (alpha ignored) and "verified".
3. Edits: a user's ``ndtr(x, loc, scale)`` helper got ``torch.special.log_ndtr(x, loc, scale)`` (a TypeError); a
   float64 ndtri's clamp was written ``.clamp(2.2e-16, 1.0)`` (still inf by hand); ``u.erfinv_()`` got
   ``u.clamp(...).erfinv_()``, which writes into a temporary and leaves u at the edge.
4. The hint named ``special_ndtri`` (aten's name) where the user wrote ``torch.special.ndtri``.
"""

from __future__ import annotations

import math

import pytest
import torch
from contract.loops import batches, sgd_loop
from torch import nn
from torch.distributions import Normal
from torch.nn import functional as F

import nan_magic
from nan_magic.render.edits import suggested_edit
from nan_magic.render.fixes import fixes_text

WRITTEN = "was written in place after it was computed"


def _report(scenario, **options: object) -> nan_magic.Report:
    with pytest.raises(nan_magic.NonFiniteError) as caught, nan_magic.watch(*scenario.targets, **options):
        scenario.run()
    return caught.value.report


def _trial(report: nan_magic.Report, kind: str):
    trials = [trial for trial in report.fixes if trial.kind == kind]
    assert len(trials) == 1, [(trial.kind, trial.finite) for trial in report.fixes]
    return trials[0]


# ------------------------------------------------------------------------------------- a Tobit loss (loss code)
def _tobit(form: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 2))
    xs, ys = batches(6, 3), [torch.randn(6) * 0.5 for _ in range(4)]
    censored = torch.tensor([False, True, False, False, True, False])
    ys[2][4] = -60.0

    def below(z: torch.Tensor) -> torch.Tensor:
        if form == "plain":
            return torch.log(torch.special.ndtr(z))
        p = torch.special.ndtr(z)
        p.masked_fill_(~censored, 1.0)  # P(censored) on censored rows, 1 (log 0) elsewhere
        return torch.log(p)

    def loss(out: torch.Tensor, step: int) -> torch.Tensor:
        mu, log_sigma = out.unbind(-1)
        z = (ys[step] - mu) / log_sigma.exp()
        term = below(z)
        return -torch.where(censored, term, -0.5 * z**2 - log_sigma).mean() - term.mean()
    return sgd_loop(model, lambda step: (xs[step],), loss)


@pytest.mark.parametrize("mode", [{}, {"mode": "full"}], ids=["default", "full"])
def test_a_cdf_written_in_place_before_its_log_is_not_verified_as_log_ndtr(mode: dict) -> None:
    report = _report(_tobit("masked"), **mode)
    assert (report.op, report.step) == ("aten.log.default", 2)
    trial = _trial(report, "stable")
    assert trial.finite is None and WRITTEN in (trial.untried or "")
    line = next(line for line in fixes_text(report).splitlines() if line.strip().startswith("stable:"))
    assert "not tried" in line and "would change what the line computes" in line and "verified" not in line
    assert suggested_edit(trial) is None


def test_the_same_cdf_not_written_is_still_fused_and_verified() -> None:
    trial = _trial(_report(_tobit("plain")), "stable")
    assert trial.finite is True and trial.fact("form") == "log_ndtr"
    assert (suggested_edit(trial) or "").endswith("return torch.special.log_ndtr(z)")


# ------------------------------------------------------------------------------------- a probit head (module code)
class _Head(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.net, self.cuts, self.form = nn.Linear(4, 1), nn.Parameter(torch.tensor([-1.0, 0.0, 1.0])), form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.cuts - self.net(x)
        if self.form == "normal_inplace":  # the top cut's CDF forced to 1 (an open last interval), in place
            p = Normal(0.0, 1.0).cdf(z)
            p[:, -1] = 1.0
            return torch.log(p)
        if self.form == "data_written":  # written through .data: no version moves, the value does
            p = torch.special.ndtr(z)
            p.data[:, -1] = 1.0
            return torch.log(p)
        if self.form == "sigmoid_input_inplace":  # the older fused form, its input clamped in place after
            h = z * 4
            s = torch.sigmoid(h)
            h.clamp_(min=-10.0)
            return torch.log(s)
        if self.form == "alpha_minus":  # 0.5 * (erf - 1): negative, its log NaN; no CDF
            return torch.log(0.5 * torch.erf(z / math.sqrt(2)).add(1, alpha=-1))
        if self.form == "helper":
            return torch.log(ndtr(self.cuts, self.net(x), 2.0))
        if self.form == "one_argument_helper":
            return _log_of_a_helper(z)
        raise ValueError(self.form)


def ndtr(x: torch.Tensor, loc: torch.Tensor, scale: float) -> torch.Tensor:
    """A user's own normal CDF with a location and scale, named as torch's."""
    return 0.5 * (1 + torch.erf((x - loc) / (scale * math.sqrt(2))))


def _half_ndtr(z: torch.Tensor) -> torch.Tensor:
    return torch.special.ndtr(z / 2)


def _log_of_a_helper(z: torch.Tensor) -> torch.Tensor:
    ndtr = _half_ndtr  # a one-argument ndtr of z / 2 (calling torch's), named as torch's
    return torch.log(ndtr(z))


def _probit(form: str):
    torch.manual_seed(0)
    model = _Head(form)
    xs, ys = batches(5, 4), [torch.randint(0, 3, (5,)) for _ in range(4)]
    xs[2][1] = (1000.0 if form == "helper" else 500.0) * model.net.weight.detach()[0].sign()
    return sgd_loop(model, lambda step: (xs[step],), lambda out, step: -out.gather(1, ys[step][:, None]).mean())


@pytest.mark.parametrize(("form", "why"), [
    ("normal_inplace", WRITTEN),
    ("sigmoid_input_inplace", "the sigmoid the line takes the log of (or its input) " + WRITTEN),
    ("data_written", "log_ndtr of the normal CDF's input is not the line's own value where that is finite"),
])
def test_a_fused_log_of_a_tensor_changed_since_it_was_made_says_it_was_not_tried(form: str, why: str) -> None:
    report = _report(_probit(form))
    assert report.op == "aten.log.default" and report.module == ""
    trial = _trial(report, "stable")
    assert trial.finite is None and why in (trial.untried or "")
    line = next(line for line in fixes_text(report).splitlines() if line.strip().startswith("stable:"))
    assert "-> not tried: " in line and why in line and "would change what the line computes" in line


def test_an_erf_given_alpha_minus_1_is_no_normal_cdf() -> None:
    trial = _trial(_report(_probit("alpha_minus")), "stable")
    assert trial.finite is None and trial.fact("form") is None


@pytest.mark.parametrize("form", ["helper", "one_argument_helper"])
def test_a_users_ndtr_helper_gets_no_edit_calling_log_ndtr_with_its_arguments(form: str) -> None:
    """The trial fused the CDF the helper computed (right); ``torch.special.log_ndtr(<its arguments>)`` is not it."""
    trial = _trial(_report(_probit(form)), "stable")
    assert trial.finite is True and trial.fact("form") == "log_ndtr"  # (the value fused is right: its erf's)
    assert suggested_edit(trial) is None


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(F.softmax(self.fc(x), -1))


def test_a_log_of_f_softmax_unwritten_is_still_fused_and_verified() -> None:
    """F.softmax reaches the trial with its own keywords (``_stacklevel``, ``dtype=None``): still a softmax."""
    torch.manual_seed(0)
    model = _Classifier()
    xs = batches(5, 4)
    xs[2][1] = 500.0 * model.fc.weight.detach()[0].sign()
    report = _report(sgd_loop(model, lambda step: (xs[step],), lambda out, step: -out[:, 0].mean()))
    trial = _trial(report, "stable")
    assert trial.finite is True and trial.fact("form") == "log_softmax"
    assert (suggested_edit(trial) or "").endswith("return torch.log_softmax(self.fc(x), -1)")


# ------------------------------------------------------------------------------------- inverse CDFs: exact edits
def _rank_gauss(form: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    xs, prices = batches(8, 4), [torch.rand(8) for _ in range(4)]

    def target(p: torch.Tensor) -> torch.Tensor:
        if form == "ndtri_f64":
            return torch.special.ndtri(p.double()).float()
        u = 2 * p - 1
        u.erfinv_()
        return math.sqrt(2) * u

    def loss(out: torch.Tensor, step: int) -> torch.Tensor:
        ranks = prices[step].argsort().argsort().float() + 1.0
        return F.mse_loss(out.squeeze(-1), target(ranks / 8))
    return sgd_loop(model, lambda step: (xs[step],), loss)


def test_a_float64_ndtri_edit_clamps_to_the_trials_exact_bounds() -> None:
    report = _report(_rank_gauss("ndtri_f64"))
    assert report.op == "aten.special_ndtri.default"
    assert report.cause is not None and report.cause.hint.startswith("ndtri in ")  # (not aten's special_ndtri)
    trial = _trial(report, "eps")
    assert trial.finite is True
    edit = suggested_edit(trial) or ""
    assert edit.endswith("return torch.special.ndtri(p.double().clamp(2.220446049250313e-16, 0.9999999999999998))"
                         ".float()")
    p = torch.tensor([0.125, 1.0], dtype=torch.float64)  # by hand, as the edit writes it: finite
    assert torch.isfinite(torch.special.ndtri(p.clamp(2.220446049250313e-16, 0.9999999999999998))).all()


def test_an_in_place_erfinv_edit_clamps_u_in_place() -> None:
    trial = _trial(_report(_rank_gauss("erfinv_")), "eps")
    assert trial.finite is True
    edit = suggested_edit(trial) or ""
    assert "u.clamp_(-0.99999988, 0.99999988).erfinv_()" in edit
    u = 2 * torch.tensor([0.125, 1.0]) - 1  # by hand: u itself is clamped, then its erfinv is finite
    u.clamp_(-0.99999988, 0.99999988).erfinv_()
    assert torch.isfinite(u).all()
