"""The "x / 0 may be hidden" warning of a verified eps, however the division is spelled.

Was (fixes-s37's warning saw ``x / v`` only): ``x * v ** -1`` and ``x * v.rsqrt()`` of a v that is exactly 0 in one
column read "eps: ... -> verified: the step came out finite" with no warning, though the clamped column's value is
x * 8e6 (x * 2.9e3 for the rsqrt) and outweighs the rest of the loss, as ``x / v``'s does; ``x * torch.reciprocal(v)``
was judged by 1 / eps alone, so a row of zeros times it (0 * 1 / eps = 0, F.normalize's 0 / 0) read "may be hidden"
too. And the every-use retry of a Gaussian NLL whose division reads sigma through a view (``sigma.expand(...)``) did
not see that use of sigma: "eps: ... -> still non-finite (loss)". Now a negative power's clamp (``pow`` with a
negative exponent, ``rsqrt``, ``reciprocal``, at the aten level in the loss code and as torch functions in a forward)
is judged by its product at the line, and a view of the clamped operand is a use of it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_fixes_s37 import LOSS_CODE_MODES, MODES, Loop, watched
from torch import nn

import nan_magic
from nan_magic.fix_records import FixTrial
from nan_magic.records import Report
from nan_magic.render.edits import suggested_edit
from nan_magic.render.fixes import fixes_text

pytestmark = [pytest.mark.usefixtures("one_torch_thread")]

HIDDEN = "a non-zero value over 0 has no eps that fixes it"

#: The division by v, spelled four ways (v is exactly 0 in one column).
SPELLINGS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "div": lambda x, v: x / v,
    "pow": lambda x, v: x * v ** -1,
    "rsqrt": lambda x, v: x * v.rsqrt(),
    "reciprocal": lambda x, v: x * torch.reciprocal(v),
    # the power read through a view of it (the product sees the view, not the power's output)
    "pow-view": lambda x, v: x * (v ** -1).unsqueeze(0),
    "rsqrt-view": lambda x, v: x * v.rsqrt().unsqueeze(0),
}
OPS = {"div": "aten.div.Tensor", "pow": "aten.pow.Tensor_Scalar", "rsqrt": "aten.rsqrt.default",
       "reciprocal": "aten.reciprocal.default", "pow-view": "aten.pow.Tensor_Scalar",
       "rsqrt-view": "aten.rsqrt.default", "scaled-pow": "aten.pow.Tensor_Scalar"}
#: 0 / 0 spelled as above, and with the power scaled first: the product with h's zero rows is 0 however it is read.
ZERO_ROW_SPELLINGS = {**SPELLINGS, "scaled-pow": lambda x, v: x * (2 * v ** -1)}


def eps_trial(report: Report) -> FixTrial:
    (trial,) = [trial for trial in report.fixes if trial.kind == "eps"]
    return trial


def eps_line(report: Report) -> str:
    (line,) = [line for line in fixes_text(report).splitlines() if line.lstrip().startswith("eps:")]
    return line


def edit_code(trial: FixTrial) -> str:
    edit = suggested_edit(trial)
    assert edit is not None, trial
    return edit.split(": ", 1)[1]


# ------------------------------------------------------------------ x / 0 in one column, in the loss code
def columns(spelling: str, constant: bool = True) -> tuple[nn.Module, torch.optim.Optimizer, Loop]:
    """``divide(err.mean(0), y.var(0)).mean()``: the targets' 2nd column is constant, its variance exactly 0."""
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 3), torch.randn(8, 3)
    if constant:
        y[:, 1] = 0.5
    divide = SPELLINGS[spelling]

    def loop() -> None:
        for _step in range(2):
            opt.zero_grad()
            err = (model(x) - y) ** 2
            divide(err.mean(0), y.var(0)).mean().backward()
            opt.step()
    return model, opt, loop


@pytest.mark.parametrize("mode", LOSS_CODE_MODES)
@pytest.mark.parametrize("spelling", list(SPELLINGS))
def test_x_over_zero_in_the_loss_code_reads_hidden_however_spelled(spelling: str, mode: str) -> None:
    report = watched(*columns(spelling), mode)
    assert (report.op, report.module, report.step) == (OPS[spelling], None, 0)
    trial = eps_trial(report)
    assert trial.finite is True and trial.fact("moved_all") is None, fixes_text(report)
    at, rest = trial.fact("over_eps")
    # the numerator (err.mean(0)[1], about 0.5) times 1 / eps (8.4e6), or 1 / sqrt(eps) (2.9e3) for the rsqrt
    assert at > (1e3 if spelling.startswith("rsqrt") else 1e6) and rest < 10, (at, rest)
    line = eps_line(report)
    assert "-> verified: the step came out finite" in line and "the quotient is up to" in line, line
    assert HIDDEN in line and "the inf may be hidden, not fixed" in line, line


# ------------------------------------------------------------------ 0 / 0 (F.normalize's), spelled as a power
def zero_rows(spelling: str) -> tuple[nn.Module, torch.optim.Optimizer, Loop]:
    """A row of zeros times 1 / its norm of 0: the clamp gives 0 * 1 / eps = 0, which outweighs nothing."""
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, mask = torch.randn(6, 3), torch.ones(6, 3)
    mask[4] = 0.0
    divide = ZERO_ROW_SPELLINGS[spelling]

    def loop() -> None:
        for _step in range(2):
            opt.zero_grad()
            h = model(x) * mask
            divide(h, h.abs().sum(1, keepdim=True)).pow(2).sum().backward()
            opt.step()
    return model, opt, loop


@pytest.mark.parametrize("spelling", list(ZERO_ROW_SPELLINGS))
def test_zero_over_zero_spelled_as_a_power_is_no_x_over_zero(spelling: str) -> None:
    report = watched(*zero_rows(spelling), "default")
    assert report.op == OPS[spelling], report.op
    trial = eps_trial(report)
    assert trial.finite is True and trial.fact("over_eps") is None, fixes_text(report)
    assert HIDDEN not in fixes_text(report)


# ------------------------------------------------------------------ the same, in a forward (every mode tries it)
class NormalizedMse(nn.Module):
    """A forward that returns the loss: the squared error of each column over the targets' variance (0 in one)."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.divide = SPELLINGS[spelling]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.divide(((self.lin(x) - y) ** 2).mean(0), y.var(0)).mean()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("spelling", ["pow", "rsqrt"])
def test_x_over_zero_in_a_forward_reads_hidden_however_spelled(spelling: str, mode: str) -> None:
    torch.manual_seed(0)
    model = NormalizedMse(spelling)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 3), torch.randn(8, 3)
    y[:, 1] = 0.5

    def loop() -> None:
        for _step in range(2):
            opt.zero_grad()
            model(x, y).backward()
            opt.step()
    report = watched(model, opt, loop, mode)
    assert (report.op, report.step) == (OPS[spelling], 0) and report.module is not None, (report.op, report.module)
    trial = eps_trial(report)
    assert trial.finite is True and trial.fact("over_eps") is not None, fixes_text(report)
    assert HIDDEN in eps_line(report), eps_line(report)


# ------------------------------------------------------------------ the every-use retry through a view
def nll_through_a_view() -> tuple[nn.Module, torch.optim.Optimizer, Loop]:
    """A Gaussian NLL whose division reads sigma through ``sigma.expand(...)``: sigma is a per-column scale that is
    exactly 0 in one column (a constant target), so the log of it and the division by it both go non-finite."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 3), torch.randn(8, 2) + 3.0
    y[:, 1] = 0.5

    def loop() -> None:
        for _step in range(2):
            opt.zero_grad()
            mu = model(x)
            sigma = y.std(0)
            (torch.log(sigma) + 0.5 * ((y - mu) / sigma.expand(8, 2)) ** 2).mean().backward()
            opt.step()
    return model, opt, loop


@pytest.mark.parametrize("mode", LOSS_CODE_MODES)
def test_the_every_use_retry_sees_the_operand_through_a_view(mode: str) -> None:
    report = watched(*nll_through_a_view(), mode)
    assert (report.op, report.module, report.step) == ("aten.log.default", None, 0)
    trial = eps_trial(report)
    assert trial.finite is True and trial.fact("every_use") == 1, fixes_text(report)
    assert edit_code(trial) == ("(torch.log(sigma.clamp_min(1.2e-07)) + 0.5 * ((y - mu) / "
                                "sigma.clamp_min(1.2e-07).expand(8, 2)) ** 2).mean().backward()")
    # the residual of the constant column over eps outweighs the rest: said, not only "verified"
    assert trial.fact("over_eps") is not None and HIDDEN in eps_line(report), eps_line(report)


@pytest.mark.parametrize("spelling", ["pow", "rsqrt"])
def test_the_healthy_twin_stays_silent_and_bit_identical(spelling: str) -> None:
    model, opt, loop = columns(spelling, constant=False)
    twin, _twin_opt, twin_loop = columns(spelling, constant=False)
    with nan_magic.watch(model, opt, keep_last_good=True):
        loop()
    twin_loop()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


# ------------------------------------------------------------------ the loop's update code (between backward and step)
#: What the report says of a division in the update code: no trial runs it, and the eps is named as not verified.
UPDATE_NOTE = ("no fix was tried: the producer ({op}) ran in the loop's code between backward() and the step, which "
               "the trials do not run again (they replay the step's forward, loss and backward only); an eps in its "
               "divisor at that line (norm.clamp_min(eps), or norm + eps) is the likely remedy, not verified")


def _lars(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad /= p.grad.norm()  # (a gradient of zeros: 0 / 0)


def _clip_by_hand(model: nn.Module) -> None:
    total = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
    for p in model.parameters():
        p.grad *= 1.0 / total  # (a total norm of 0: 1 / 0, then 0 * inf)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(("update", "op", "line"), [
    pytest.param(_lars, "aten.div_.Tensor", "p.grad /= p.grad.norm()", id="lars"),
    pytest.param(_clip_by_hand, "aten.reciprocal.default", "p.grad *= 1.0 / total", id="clip-by-hand"),
])
def test_update_code_says_no_trial_runs_it_and_names_the_eps_unverified(update: Callable[[nn.Module], None],
                                                                         op: str, line: str, mode: str) -> None:
    """Was: default, defer and full said "the failing step, run again on copies as it ran, came out finite" (the
    replay never runs the update code, so of course it did), ops and ops-defer "the producer ran in the loss code"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [torch.randn(6, 4) for _ in range(4)]

    def loop() -> None:
        for step, x in enumerate(xs):
            opt.zero_grad()
            (model(x).pow(2).mean() * (0.0 if step == 2 else 1.0)).backward()  # (step 2: every gradient 0)
            update(model)
            opt.step()
    report = watched(model, opt, loop, mode)
    assert (report.module, report.step, report.op) == (None, 2, op), (report.module, report.step, report.op)
    assert report.source is not None and report.source.line.strip().startswith(line), report.source
    assert report.fixes == ()
    notes = [note.text for note in report.note_facts if note.kind.startswith("fixes-")]
    assert notes == [UPDATE_NOTE.format(op=op)], notes
    assert UPDATE_NOTE.format(op=op) in report.to_text()


# ------------------------------------------------------------------ a loss-code producer under ops=True
@pytest.mark.parametrize("mode", list(MODES))
def test_a_loss_code_producer_under_ops_says_where_its_trials_run(mode: str) -> None:
    """ops=True keeps no record of the loss code (its op tracer names the op as it runs; the default watch's recorder
    is off), so no trial can run it again: the report says so, and that the watch without ops=True records it."""
    report = watched(*columns("div"), mode)
    assert (report.op, report.module) == ("aten.div.Tensor", None)
    if not mode.startswith("ops"):
        assert eps_trial(report).finite is True, fixes_text(report)
        return
    assert report.fixes == ()
    (note,) = [note.text for note in report.note_facts if note.kind.startswith("fixes-")]
    assert note.startswith("no fix was tried: the producer ran in the loss code, which the trials could not run "
                           "again: ops mode traces the loss code as it runs"), note
    assert note.endswith("(a watch without the op tracer records it, so that its trials can run it again)"), note
