"""What a user debugging a NaN in a notebook saw go wrong (session 23's walk), each through a real IPython shell.

The walk's notebooks are in tests/notebooks/user23/ (split training cells, ``%nanwatch on``, NaNs in forward,
loss code, backward, the optimizer step and the data, interrupts); each defect found there has its test here,
in the cheap in-process shell of the ``ip`` fixture (conftest.py).
"""

from __future__ import annotations

import re
import sys
from typing import Any
from unittest import mock

import pytest
from IPython.utils.capture import capture_output

SETUP = """
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
"""

LOOP = """
for step in range(3):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

#: Where a real interrupt landed in the walk (kernel interrupts at random points of a watched step): below a
#: hook's entry, in the checks it calls, whose frames are not marked hidden (only the entry is).
DEEP_IN_A_HOOK = [
    "nan_magic.hot.checks.early.EarlyWarnings.observe_batch",  # forward pre-hook > record_data > _judge_data > here
    # optimizer pre-hook > on_step_pre > here:
    "nan_magic.hot.checks.optimizer.step_checks.OptimizerChecks._gradient_norms",
]


def traceback_shown(ip: Any, cell: str) -> str:
    """The traceback IPython shows for the cell's KeyboardInterrupt, without colours."""
    with capture_output():
        result = ip.run_cell(cell)
    assert isinstance(result.error_in_exec, KeyboardInterrupt), result.error_in_exec
    lines = ip.InteractiveTB.structured_traceback(sys.last_type, sys.last_value, sys.last_traceback)
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(lines))


@pytest.mark.parametrize(("inside", "armed"), [
    (inside, armed) for inside in DEEP_IN_A_HOOK
    for armed in ("%%nantrace\n", "%%nantrace --defer\n", "%%nantrace --full\n", "%nanwatch on\n")
    if not (armed.endswith("--defer\n") and inside.endswith("observe_batch"))  # (--defer does not call it here)
])
def test_an_interrupt_deep_in_a_hook_shows_no_frame_of_ours(ip: Any, inside: str, armed: str) -> None:
    """The user pressed stop during a watched step; the traceback named nan_magic's files (early.py:255 in
    _constant_feature, step_checks.py:198 in _gradient_norms) as if nan_magic had failed. Now it ends at the user's
    line and torch's call of the hook."""
    ip.run_cell(SETUP)
    held = armed.startswith("%nanwatch")
    if held:
        ip.run_cell("%nanwatch on")
    try:
        with mock.patch(inside, side_effect=KeyboardInterrupt):
            text = traceback_shown(ip, ("" if held else armed) + LOOP)
    finally:
        ip.run_line_magic("nanwatch", "off")
    ours = [line for line in text.splitlines() if "nan_magic" in line and line.startswith("File ")]
    assert not ours, text
    assert "loss = nn.functional.cross_entropy(model(x), y)" in text or "opt.step()" in text, text
    # What it stopped in stays the same model: nothing of the watch is left on it.
    assert not ip.user_ns["model"][0]._forward_pre_hooks and not ip.user_ns["model"]._forward_hooks


DATA = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(4)
rows = torch.randn(200, 7)
rows[137, 4] = float("nan")  # a missing value in the csv
loader = DataLoader(TensorDataset(rows, (rows[:, 0] > 0).long()), batch_size=25)
clf = nn.Sequential(nn.Linear(7, 16), nn.ReLU(), nn.Linear(16, 2))
clf_opt = torch.optim.SGD(clf.parameters(), lr=0.1)
"""

DATA_LOOP = """%%nantrace
for xb, yb in loader:
    loss = nn.functional.cross_entropy(clf(xb), yb)
    clf_opt.zero_grad(); loss.backward(); clf_opt.step()
"""


def test_a_missing_value_stored_in_the_dataset_is_named_by_its_index(ip: Any) -> None:
    """The walk's data notebook: the report said the refetched samples "made no non-finite value: it is stored in
    the dataset itself, or drawn at random", and the user was left to find which of 200 rows. Now it names the
    dataset index, 137 (row 12 of step 5's batch), and no longer offers "drawn at random" where it is stored."""
    ip.run_cell(DATA)
    with capture_output():
        ip.run_cell(DATA_LOOP)
    report = ip.user_ns["_nan_report"]
    assert (report.phase, report.step) == ("data", 5)
    (said,) = [note for note in report.notes if "from TensorDataset again" in note]
    assert "it is stored in the dataset itself, at index 137 (dataset[137] shows it)" in said, said
    assert "drawn at random" not in said
    assert ("refetch-stored", (("count", 25), ("dataset", "TensorDataset"), ("indices", (137,)),
                               ("holding", 1))) in [(note.kind, note.facts) for note in report.note_facts]


def test_one_exact_zero_is_said_in_the_singular() -> None:
    """The walk's RMS norm without eps: the divisor's histogram said "1 exact zeros"."""
    from nan_magic.records import Sample
    from nan_magic.render.plots import histogram_figure

    figure = histogram_figure([Sample(dtype="float32", values=(0.0, 0.2, 0.4), numel=3, zeros=1)], zeros=True)
    (axes,) = [axes for axes in figure.axes if axes.get_legend() is not None]
    assert "1 exact zero" in [text.get_text() for text in axes.get_legend().get_texts()]


ADAM_EPS_ZERO = """
import torch
from torch import nn

torch.manual_seed(3)
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
adam = torch.optim.Adam(net.parameters(), lr=1e-3, eps=0.0)  # "eps only hurts"
x4, y4 = torch.randn(16, 4), torch.randn(16, 1)
x4[:, 3] = 0.0  # a dead feature: its weights' gradient is exactly 0, and Adam's 0 / (sqrt(0) + 0) is NaN
"""

ADAM_LOOP = """%%nantrace
for step in range(5):
    loss = nn.functional.mse_loss(net(x4), y4)
    adam.zero_grad()
    loss.backward()
    adam.step()
"""


@pytest.mark.parametrize("keep", ["", " --keep-last-good"])
def test_the_untried_optimizer_fix_at_the_first_step_says_why_and_sends_nowhere(ip: Any, keep: str) -> None:
    """The walk's Adam with eps=0, in a notebook, fails at its first step: the eps trial said 'not tried: no last
    good state was kept (watch(..., keep_last_good=True) keeps ...)', and with --keep-last-good the cell failed the
    same, the trial then 'no optimizer step ended finite before this one'. The first step has no state before it,
    kept or not: that is what it says, whatever is kept."""
    ip.run_cell(ADAM_EPS_ZERO)
    with capture_output():
        ip.run_cell(ADAM_LOOP.replace("%%nantrace", "%%nantrace" + keep))
    report = ip.user_ns["_nan_report"]
    assert (report.phase, report.module, report.cause.label, report.step) == (
        "optimizer", "0", "optimizer-eps-underflow", 0)
    (trial,) = [fix for fix in report.fixes if fix.kind == "eps"]
    assert trial.finite is None and trial.reason is not None and trial.reason.kind == "first-optimizer-step"
    assert trial.untried == "it is the first optimizer step: no state before it is kept to redo it from"
    assert "--keep-last-good" not in report.to_text() and "keep_last_good=True" not in report.to_text()  # no advice


def test_the_untried_optimizer_fix_after_the_first_step_says_the_magics_option(ip: Any) -> None:
    """A learning rate raised to 3e38 at step 2 overflows the update: the redo at a tenth needs a kept state, and
    the trial says how to keep one in a notebook (%%nantrace --keep-last-good), not only watch(...)."""
    ip.run_cell(ADAM_EPS_ZERO + "sgd = torch.optim.SGD(net.parameters(), lr=1e-3)\ny100 = 100 * y4\n")
    with capture_output():
        ip.run_cell("""%%nantrace
for step in range(5):
    if step == 2:
        sgd.param_groups[0]["lr"] = 3e38
    loss = nn.functional.mse_loss(net(x4), y100)
    sgd.zero_grad()
    loss.backward()
    sgd.step()
""")
    report = ip.user_ns["_nan_report"]
    assert (report.phase, report.step, report.cause.label) == ("optimizer", 2, "learning-rate-too-high")
    (trial,) = [fix for fix in report.fixes if fix.kind == "lr"]
    assert trial.finite is None and "%%nantrace --keep-last-good" in trial.untried, trial.untried


RMS_NORM = """
import torch
from torch import nn

class Scale(nn.Module):
    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        normed = x / var.sqrt()  # RMS norm without eps
        return normed

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.act, self.norm, self.out = nn.Linear(6, 16), nn.ReLU(), Scale(), nn.Linear(16, 3)

    def forward(self, x):
        h = self.act(self.inp(x))
        h = self.norm(h)
        return self.out(h)

torch.manual_seed(0)
net = Net()
net_opt = torch.optim.SGD(net.parameters(), lr=0.05)
with torch.no_grad():
    net.inp.bias.fill_(-0.5)
xs, ys = torch.randn(8, 6), torch.randint(0, 3, (8,))
xs[5] = 0.0  # a padding row: after the ReLU its RMS is 0
"""

NET_LOOP = """%%nantrace
for step in range(3):
    loss = nn.functional.cross_entropy(net(xs), ys)
    net_opt.zero_grad()
    loss.backward()
    net_opt.step()
"""


def test_tb_in_a_kernel_shows_the_calling_line_of_each_frame(ip: Any) -> None:
    """The walk's forward notebook: %tb read 'Cell In[2], line 22, in Net.forward ... ---> 22 return self.out(h)'
    where the short error and %debug say line 21, h = self.norm(h). IPython 9 formats a frame whose file is not on
    disk (ipykernel's cells) at frame.f_lineno; round 25 formats the full traceback with those files counted from
    linecache, so IPython reads each entry's tb_lineno (errors/exceptions.py, test_nb25.py)."""
    kernel_like = mock.patch.object(type(ip.compile), "get_code_name",
                                    lambda self, raw, code, number: f"/tmp/nan-magic-no-such-dir/{abs(hash(code))}.py")
    with kernel_like:
        ip.run_cell(RMS_NORM)
        with capture_output():
            ip.run_cell(NET_LOOP)
        assert ip.user_ns["_nan_report"].module == "norm"
        with capture_output() as shown:
            ip.run_line_magic("tb", "")
    text = re.sub(r"\x1b\[[0-9;]*m", "", shown.stdout + shown.stderr)
    calling = [line for line in text.splitlines() if line.lstrip().startswith(("--->", "---->", "->"))]
    assert any("h = self.norm(h)" in line for line in calling), text
    assert not any("return self.out(h)" in line for line in calling), text


@pytest.mark.parametrize("inside", ["nan_magic.fixes.runner.try_fixes", "nan_magic.fixes.runner._remedy_trial"])
def test_stop_pressed_during_the_fix_trials_keeps_the_report(ip: Any, inside: str) -> None:
    """The trials of a larger model take seconds after the producer is found; the user pressed stop then and got a
    bare KeyboardInterrupt: no report, no _nan_report, the producer already found lost. Now the trials alone end,
    and the cell stops with the report, a note saying so; the model and torch's random state as before."""
    import torch

    ip.run_cell(RMS_NORM)
    ip.user_ns.pop("_nan_report", None)
    before = {name: value.clone() for name, value in ip.user_ns["net"].state_dict().items()}
    rng = torch.get_rng_state()
    with mock.patch(inside, side_effect=KeyboardInterrupt), capture_output() as shown:
        result = ip.run_cell(NET_LOOP)
    from nan_magic import NonFiniteError

    assert isinstance(result.error_in_exec, NonFiniteError), result.error_in_exec
    report = ip.user_ns["_nan_report"]
    assert (report.module, report.op, report.fixes) == ("norm", "aten.div.Tensor", ())
    assert any("the fix trials were interrupted (the stop button, Ctrl-C): no remedy was tried" in note
               for note in report.notes), report.notes
    assert any("text/html" in output.data for output in shown.outputs)
    after = ip.user_ns["net"].state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert torch.equal(rng, torch.get_rng_state())


def test_stop_pressed_during_the_fix_trials_of_a_warn_run_stops_it(ip: Any) -> None:
    """--warn goes on after the event: an interrupt during its trials is the user's stop, and stops the run."""
    ip.run_cell(RMS_NORM)
    with mock.patch("nan_magic.fixes.runner.try_fixes", side_effect=KeyboardInterrupt), capture_output():
        result = ip.run_cell(NET_LOOP.replace("%%nantrace", "%%nantrace --warn"))
    assert isinstance(result.error_in_exec, KeyboardInterrupt), result.error_in_exec


def test_stop_pressed_during_the_step_replay_keeps_what_the_check_saw(ip: Any) -> None:
    """The op-level replay that names the producer takes seconds on a large model; stop pressed then gave a bare
    KeyboardInterrupt and no report. Now the cell stops with what the step's boundary check saw, a note saying
    that the producer is not named; the model as before, no hook of the watch left on it."""
    import torch

    ip.run_cell(RMS_NORM)
    ip.user_ns.pop("_nan_report", None)
    before = {name: value.clone() for name, value in ip.user_ns["net"].state_dict().items()}
    replay = "nan_magic.localize.replay.tiered.step.StepReplays.localize"
    with mock.patch(replay, side_effect=KeyboardInterrupt), capture_output() as shown:
        result = ip.run_cell(NET_LOOP)
    from nan_magic import NonFiniteError

    assert isinstance(result.error_in_exec, NonFiniteError), result.error_in_exec
    report = ip.user_ns["_nan_report"]
    assert (report.phase, report.step, report.fixes) == ("forward", 0, ())
    assert any(note.startswith("the replay that names the producer was interrupted") for note in report.notes)
    assert any("text/html" in output.data for output in shown.outputs)
    after = ip.user_ns["net"].state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert not ip.user_ns["net"]._forward_hooks and not ip.user_ns["net"].norm._forward_pre_hooks
    with mock.patch(replay, side_effect=KeyboardInterrupt), capture_output():
        result = ip.run_cell(NET_LOOP.replace("%%nantrace", "%%nantrace --warn"))
    assert isinstance(result.error_in_exec, KeyboardInterrupt), result.error_in_exec  # (warn goes on: it stops)
